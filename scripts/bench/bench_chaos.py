"""A seeded chaos run of the torchft sync backend: faults of five kinds, each hitting one worker
of the main job, or part of it, while the others train; does every run end with one model and
the right exit code?

    python scripts/bench/bench_chaos.py [--seed 0] [--events 50] [--per-run 5] [--workers 2] [--ranks 2]

Each run is the main job (``scripts/train_gpt_edit.py --local-sgd-sync-backend torchft``: the
supervisor, its Lighthouse and one torchrun job per worker) with --per-run events, drawn with
--seed (kind and worker), one at a time: the next comes once the last one's worker has synced
again (it healed) and --gap seconds have passed, and none in the run's last sixth. Kinds:

* ``job``: every process of the worker's job SIGKILLed (its node died);
* ``launcher``: only the job's launcher SIGKILLed (a node agent, an OOM killer): its ranks must
  end within seconds and the supervisor relaunch the job;
* ``exchange``: one rank of the worker SIGKILLed inside its next exchange;
* ``heal``: the worker's job SIGKILLed and its relaunch's rank 1's heal transfer fails once (its
  rank 0's succeeds): a partial heal;
* ``sigstop``: every process of the worker's job stopped for --sync-timeout + 10 s, then continued
  (a hung node, a long GC pause, a live migration).

The in-process triggers (``exchange``, ``heal``) and each rank's digest of the model it ends with
come from ``scripts/bench/chaos_hooks/sitecustomize.py`` (on PYTHONPATH of the run only).
A run's outcome: ``one model`` (exit 0, every worker's ranks recorded the same digests),
``said`` (exit non-zero, the supervisor's last lines name why), ``SILENT`` (exit 0 and the
digests differ or are missing: a silent divergence) or ``WRONG CODE`` (exit non-zero with one
model). Goodput: worker-steps in the anchor per second, over a run without faults of the same
flags; time to heal: from the event to the worker's first sync after it (both from the run's
per-sync record, ``--local-sgd-sync-record``: its committed syncs and the time its sync ended).

Prints a Markdown table with the load average; writes it to scripts/bench/results/chaos.md (--out).
"""

from __future__ import annotations

import argparse
import os
import random
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "scripts" / "bench" / "chaos_hooks"
RESULTS = ROOT / "scripts" / "bench" / "results"
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
sys.path.insert(0, str(ROOT / "scripts"))
import bench_common as bc  # noqa: E402  (the per-sync record's reader)
from bench_ft import Run, anchored_steps, first_sync_after  # noqa: E402  (one start of the main job; its record's figures)
from fault_matrix import marked_processes  # noqa: E402  (a run's processes, by its mark)

KINDS = ("job", "launcher", "exchange", "heal", "sigstop")
CHAOS_ENV = "MEGATRON_EDIT_CHAOS_DIR"


def _processes(mark: str, worker: int):
    """(pid, is_rank) of every live process of worker ``worker``'s job in the run ``mark``."""
    tag = f"--local-sgd-replica-id\0{worker}\0".encode()
    return [(pid, any(v.startswith(b"LOCAL_RANK=") for v in env)) for pid, env in marked_processes(mark, tag)]


def _signal(pids, sig) -> int:
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, sig)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


def inject(kind: str, run: Run, worker: int, chaos: Path, args) -> bool:
    """Start event ``kind`` on ``worker``; False where it found nothing to hit (no job up)."""
    procs = _processes(run.mark, worker)
    ranks = [p for p, is_rank in procs if is_rank]
    if len(ranks) < args.ranks:  # its job is (re)starting: nothing to hit yet
        return False
    if kind == "job":
        return _signal([p for p, _ in procs], signal.SIGKILL) > 0
    if kind == "launcher":
        return _signal([p for p, is_rank in procs if not is_rank], signal.SIGKILL) > 0
    if kind == "exchange":
        (chaos / f"exchange-{worker}").touch()
        return True
    if kind == "heal":
        (chaos / f"heal-{worker}").touch()
        return _signal([p for p, _ in procs], signal.SIGKILL) > 0
    if kind == "sigstop":
        stopped = [p for p, _ in procs]
        _signal(stopped, signal.SIGSTOP)
        time.sleep(args.sync_timeout + 10)
        _signal(stopped, signal.SIGCONT)
        return True
    raise ValueError(kind)


def _happened(event: dict, chaos: Path) -> bool:
    """Whether ``event`` has hit its worker: an in-process trigger once a process took it (its
    ``end`` then becomes that moment), the others at once."""
    if event["kind"] not in ("exchange", "heal"):
        return True
    taken = list(chaos.glob(f"{event['kind']}-{event['worker']}.taken-*"))
    if taken and "taken" not in event:  # it hit then: the time to heal counts from there
        event["taken"] = True
        event["at"] = event["end"] = max(event["end"], taken[0].stat().st_mtime)
    return bool(taken)


def _sync_times(run: Run, worker: int):
    return [t for t, line in run.lines if re.match(rf"worker {worker} sync \d+ after", line)]


def _last_step(run: Run) -> int:
    steps = [int(m.group(1)) for _, line in run.lines for m in [re.match(r"step\s+(\d+) \| worker \d+ loss", line)] if m]
    return max(steps, default=0)


def one_run(args, folder: Path, name: str, plan) -> dict:
    """The main job with the events of ``plan`` ([(kind, worker)]); its outcome."""
    chaos = folder / f"{name}-chaos"
    chaos.mkdir()
    env = {CHAOS_ENV: str(chaos), "PYTHONPATH": os.pathsep.join(filter(None, [str(HOOKS), os.environ.get("PYTHONPATH")]))}
    os.environ.update(env)  # (inherited by the run: Run passes os.environ)
    try:
        run = Run(_flags(args), folder, name)
    finally:
        for key in env:
            os.environ.pop(key, None)
    events, pending = [], list(plan)
    deadline, next_at, first_sync = time.monotonic() + args.limit, None, None
    try:
        while run.poll():
            if time.monotonic() > deadline:
                raise SystemExit(f"bench_chaos: {name} did not end within {args.limit} s: {run.log}")
            now = time.time()
            if first_sync is None:
                first_sync = next((t for t, line in run.lines if re.match(r"worker 0 sync 1 after", line)), None)
                next_at = None if first_sync is None else first_sync + args.gap
            elif pending and now >= next_at and _last_step(run) < args.steps * 5 // 6:
                last = events[-1] if events else None
                healed = last is None or (_happened(last, chaos) and
                                          any(t > last["end"] for t in _sync_times(run, last["worker"])))
                if healed:
                    kind, worker = pending[0]
                    start = time.time()
                    if inject(kind, run, worker, chaos, args):
                        pending.pop(0)
                        events.append(dict(kind=kind, worker=worker, at=start, end=time.time()))
                        next_at = time.time() + args.gap
            time.sleep(0.2)
    finally:
        run.stop()
    run.poll()
    # A run that ended before its first sync wrote no record (its outcome says why).
    records = bc.read_records(str(run.record)) if run.record.exists() else []
    for e in events:
        _happened(e, chaos)
        heal = first_sync_after(records, e["worker"], e["end"])  # (the record's time of that sync)
        e["heal"] = None if heal is None else heal + e["end"] - e["at"]
    digests = {}
    for path in chaos.iterdir():
        m = re.fullmatch(r"end-w(\d+)-r(\d+)-\d+", path.name)
        if m:
            digests.setdefault((int(m.group(1)), int(m.group(2))), []).append((path.stat().st_mtime, path.read_text()))
    last = {key: max(values)[1] for key, values in digests.items()}
    complete = all((w, r) in last for w in range(args.workers) for r in range(args.ranks))
    one = complete and all(len({last[(w, r)] for w in range(args.workers)}) == 1 for r in range(args.ranks))
    code = run.proc.returncode
    outcome = ("one model" if one else "SILENT") if code == 0 else ("WRONG CODE" if one else "said")
    tail = [line for _, line in run.lines if line.startswith("train_gpt_edit.py:")][-2:]
    return dict(name=name, code=code, outcome=outcome, events=events, seconds=time.time() - run.started,
                worker_steps=anchored_steps(records), said=tail, unfired=len(pending), log=str(run.log))


def _flags(args):
    return ["--workers", str(args.workers), "--nproc-per-node", str(args.workers * args.ranks),
            "--steps", str(args.steps), "--eval-interval", str(args.steps), "--lr-warmup-steps", "2",
            "--local-sgd-sync-interval", str(args.h), "--log-interval", str(args.h),
            "--local-sgd-sync-backend", "torchft", "--local-sgd-sync-timeout", f"{args.sync_timeout:g}",
            "--data-dir", str(args.data_dir), "--compute-sleep-ms", f"{args.compute_ms:g}"]


def plans(args):
    """Per run, its events [(kind, worker)]: every kind as often as the others (the order and the
    workers drawn with --seed)."""
    rng = random.Random(args.seed)
    kinds = [KINDS[i % len(KINDS)] for i in range(args.events)]
    rng.shuffle(kinds)
    events = [(kind, rng.randrange(args.workers)) for kind in kinds]
    return [events[i:i + args.per_run] for i in range(0, len(events), args.per_run)]


def table(args, baseline, runs, load0, load1) -> str:
    rate = lambda r: r["worker_steps"] / r["seconds"]  # noqa: E731
    lines = [
        f"`python scripts/bench/bench_chaos.py --seed {args.seed} --events {args.events} --per-run {args.per_run} "
        f"--workers {args.workers} --ranks {args.ranks} --steps {args.steps} --h {args.h} --sync-timeout "
        f"{args.sync_timeout:g} --compute-ms {args.compute_ms:g}` (load average {load0[0]:.1f} before, "
        f"{load1[0]:.1f} after; {os.cpu_count()} cores)", "",
        "| run | events (kind:worker) | exit | outcome | goodput vs no fault | time to heal, s |",
        "|---|---|---|---|---|---|",
        f"| no fault | - | {baseline['code']} | {baseline['outcome']} | 1.00 | - |",
    ]
    for r in runs:
        heal = ", ".join("-" if e["heal"] is None else f"{e['heal']:.0f}" for e in r["events"]) or "-"
        kinds = ", ".join(f"{e['kind']}:{e['worker']}" for e in r["events"])
        if r["unfired"]:
            kinds += f" ({r['unfired']} not fired: the run ended first)"
        lines.append(f"| {r['name']} | {kinds} | {r['code']} | {r['outcome']} | {rate(r) / rate(baseline):.2f} | {heal} |")
    lines += ["", "| kind | events | median time to heal, s | in runs ending with one model |", "|---|---|---|---|"]
    for kind in KINDS:
        evs = [(e, r) for r in runs for e in r["events"] if e["kind"] == kind]
        heals = [e["heal"] for e, _ in evs if e["heal"] is not None]
        ok = sum(r["outcome"] == "one model" for _, r in evs)
        lines.append(f"| {kind} | {len(evs)} | {statistics.median(heals):.1f} | {ok} |" if heals
                     else f"| {kind} | {len(evs)} | - | {ok} |")
    fired = sum(len(r["events"]) for r in runs)
    silent = sum(r["outcome"] == "SILENT" for r in runs)
    lines += ["", f"{fired} events fired in {len(runs)} runs; silent divergences: {silent}; wrong exit codes: "
                  f"{sum(r['outcome'] == 'WRONG CODE' for r in runs)}; runs that said why they failed: "
                  f"{sum(r['outcome'] == 'said' for r in runs)}."]
    for r in runs:
        if r["outcome"] != "one model":
            lines.append(f"- {r['name']}: {' / '.join(r['said']) or '(no supervisor line)'} ({r['log']})")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--events", type=int, default=50)
    p.add_argument("--per-run", type=int, default=5, help="events per run of the main job")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--ranks", type=int, default=2, help="ranks per worker")
    p.add_argument("--steps", type=int, default=6000)
    p.add_argument("--h", type=int, default=8, help="--local-sgd-sync-interval")
    p.add_argument("--sync-timeout", type=float, default=10.0, help="--local-sgd-sync-timeout, seconds")
    p.add_argument("--gap", type=float, default=8.0, help="seconds between a worker's heal and the next event")
    p.add_argument("--compute-ms", type=float, default=40.0,
                   help="the main job's --compute-sleep-ms (a device per worker: see bench_ft.py)")
    p.add_argument("--limit", type=float, default=1500.0, help="seconds a run may take")
    p.add_argument("--runs", type=int, default=None, help="only the first RUNS runs of the plan")
    p.add_argument("--data-dir", default=os.environ.get("MEGATRON_EDIT_DATA", "data-cache"))
    p.add_argument("--out", default=str(RESULTS / "chaos.md"))
    args = p.parse_args(argv)
    if args.workers < 2 or args.ranks < 2 or args.per_run < 1 or args.events < 1:
        p.error("--workers >= 2, --ranks >= 2 (a heal fails on rank 1), --per-run and --events >= 1")
    folder = Path(tempfile.mkdtemp(prefix="bench_chaos_"))
    load0 = os.getloadavg()
    print(f"bench_chaos: logs in {folder}; no fault ...", flush=True)
    baseline = one_run(args, folder, "no-fault", [])
    print(f"bench_chaos: no fault: {baseline['outcome']} in {baseline['seconds']:.0f} s", flush=True)
    runs = []
    for i, plan in enumerate(plans(args)[:args.runs]):
        r = one_run(args, folder, f"run-{i}", plan)
        runs.append(r)
        print(f"bench_chaos: run {i}: {[(e['kind'], e['worker']) for e in r['events']]} -> exit {r['code']}, "
              f"{r['outcome']} in {r['seconds']:.0f} s", flush=True)
    text = table(args, baseline, runs, load0, os.getloadavg())
    print("\n" + text, flush=True)
    Path(args.out).write_text(text + "\n")
    return 1 if any(r["outcome"] in ("SILENT", "WRONG CODE") for r in runs) else 0


if __name__ == "__main__":
    sys.exit(main())
