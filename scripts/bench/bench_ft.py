"""Goodput under faults: the torchft sync backend (a dead worker's job is relaunched and heals from
the others, who go on) against today's torch backend (one world: a dead rank stops the run, which
restarts from its last checkpoint), on the same fault schedule.

    python scripts/bench/bench_ft.py [--workers 3] [--ranks 2] [--fault-every 60] [--steps 1600]

Each run is the main job (``scripts/train_gpt_edit.py``, EDiT H = --local-sgd-sync-interval, no
warmup) on this machine, --workers x --ranks processes:

* ``torchft, no fault``: ``--local-sgd-sync-backend torchft`` (a Lighthouse and one job per
  worker, megatron_edit.supervise);
* ``torchft, faults``: the same, and every --fault-every seconds after the first sync the job of
  worker 1, 2, ... in turn (never worker 0) is SIGKILLed, every process of it (its node died);
  the supervisor relaunches it and it heals from the others at their next sync;
* ``torch, no fault`` and ``torch, faults (restart)``: one world; at the same moments the whole
  job is SIGKILLed (one dead rank stops every worker) and started again for the steps left after
  the last checkpoint, taken every --save-interval steps. The restart is a fresh start: its
  imports, data and model, without a checkpoint's load (so the baseline's cost is a lower bound).

Goodput: worker-steps trained into the anchor (torchft: each committed sync adds the steps of the
workers that trained since the last, as the run's per-sync record says, ``--local-sgd-sync-record``;
torch: the steps kept at the checkpoints and the end) x tokens per worker-step, per second of the
run, over the no-fault run of the same backend. Also: the survivors' stall at a fault (the longest
gap between worker 0's logged steps around it, over the no-fault median gap x log interval: the
record has no steps between syncs), a relaunched worker's time from its kill to its first sync
(the ``time`` of its first record after the kill; and Python's imports of that alone, measured
apart), and the steps lost by the survivors (worker 0's logged steps: each once, none repeated).

On this CPU machine every worker shares the same cores: a dead worker's CPU time goes to the
survivors, and a relaunched job's start takes it from them, so both backends pay about a job's
start per fault. --compute-ms T stands for a device per worker: each step also sleeps T ms (the
main job's --compute-sleep-ms), so a worker's step time is mostly its own device's and the
survivors train at their own pace whatever the others do, as on a cluster.

Prints a Markdown table with the load average; writes it to scripts/bench/results/ft.md (--out).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAIN_JOB = ROOT / "scripts" / "train_gpt_edit.py"
RESULTS = ROOT / "scripts" / "bench" / "results"
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
from fault_matrix import RUN_MARK as MARK, kill_marked as _kill  # noqa: E402  (the run's processes, by mark)
import bench_common as bc  # noqa: E402  (the per-sync record's reader)


class Run:
    """One start of the main job; its output lines with the time each was first seen, and its
    per-sync record (:attr:`record`)."""

    def __init__(self, argv, folder: Path, name: str):
        self.log = folder / f"{name}.log"
        self.record = folder / f"{name}.syncs.jsonl"
        self.mark = f"{os.getpid()}-{time.monotonic_ns()}"
        self.sink = open(self.log, "w")
        self.started = time.time()
        argv = [*argv, "--local-sgd-sync-record", str(self.record)]
        self.proc = subprocess.Popen([sys.executable, str(MAIN_JOB), *argv], cwd=ROOT, stdout=self.sink,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env=dict(os.environ, **{MARK: self.mark}))
        self.lines = []
        """(time first seen, line) of every output line so far."""
        self._read = 0

    def poll(self) -> bool:
        """Record new lines; True while the job runs."""
        with open(self.log) as f:
            f.seek(self._read)
            chunk = f.read()
        complete = chunk[:chunk.rfind("\n") + 1]
        self._read += len(complete.encode())
        now = time.time()
        for line in complete.splitlines():
            self.lines.append((now, line.strip()))
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)  # a torchft supervisor stops its jobs
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        _kill(self.mark)
        self.proc.wait()
        self.sink.close()


def torchft_run(args, folder: Path, faults: bool) -> dict:
    flags = _flags(args) + ["--local-sgd-sync-backend", "torchft"]
    run = Run(flags, folder, "torchft-faults" if faults else "torchft")
    kills, victim, first_sync = [], 0, None
    deadline = time.monotonic() + args.limit
    try:
        while run.poll():
            if time.monotonic() > deadline:
                raise SystemExit(f"bench_ft: the torchft run did not end within {args.limit} s: {run.log}")
            if first_sync is None:
                first_sync = next((t for t, line in run.lines if re.match(r"worker 0 sync 1 after", line)), None)
            elif (faults and time.time() >= first_sync + args.fault_every * (len(kills) + 1)
                  and not any(f"validation after step {args.steps}:" in line for _, line in run.lines)):
                victim = victim % (args.workers - 1) + 1
                needle = f"--local-sgd-replica-id\0{victim}\0".encode()
                if _kill(run.mark, needle):
                    kills.append((time.time(), victim))
            time.sleep(0.1)
    finally:
        run.stop()
    run.poll()
    end = time.time()
    if run.proc.returncode != 0:
        raise SystemExit(f"bench_ft: the torchft run failed (exit {run.proc.returncode}); its output: {run.log}")
    records = bc.read_records(str(run.record))
    return dict(seconds=end - run.started, worker_steps=anchored_steps(records), kills=kills,
                stall=_stall(run, kills), rejoin=_rejoin(records, kills),
                survivor_steps_ok=_survivor_steps(run.log.read_text()) == list(range(args.log_interval, args.steps + 1,
                                                                     args.log_interval)))


def anchored_steps(records) -> int:
    """Worker-steps in the anchor, from a run's sync records: over its committed syncs (each
    once, whichever worker's record: a killed worker's last ones are lost, the others' are not),
    (workers that trained since the last) x (steps since the last committed sync: an uncommitted
    sync's steps count at the next)."""
    total, last = 0, 0
    for step, r in sorted({r["step"]: r for r in records if r["committed"]}.items()):
        total += len(r["trained"]) * (step - last)
        last = step
    return total


def _survivor_steps(text: str):
    return [int(s) for s in re.findall(r"step\s+(\d+) \| worker 0 loss", text)]


def _step_times(run: Run, worker: int):
    return [(t, int(m.group(1))) for t, line in run.lines
            for m in [re.match(rf"step\s+(\d+) \| worker {worker} loss", line)] if m]


def _stall(run: Run, kills) -> list:
    """Per fault: the longest gap between worker 0's logged steps in the 30 s after the kill,
    minus the median gap of the whole run (what the fault added)."""
    times = _step_times(run, 0)
    gaps = [b[0] - a[0] for a, b in zip(times, times[1:])]
    if not gaps:
        return []
    median = statistics.median(gaps)
    out = []
    for at, _ in kills:
        around = [b[0] - a[0] for a, b in zip(times, times[1:]) if at - 1 <= b[0] <= at + 30]
        out.append(max(0.0, max(around, default=median) - median))
    return out


def first_sync_after(records, worker: int, at: float):
    """Seconds from ``at`` (Unix time) to the end of ``worker``'s first sync after it (its record's
    ``time``), or None."""
    return next((r["time"] - at for r in sorted(records, key=lambda r: r["time"])
                 if r["worker"] == worker and r["time"] > at), None)


def _rejoin(records, kills) -> list:
    """Per fault: seconds from the kill to the relaunched worker's first sync after its heal."""
    return [first_sync_after(records, victim, at) for at, victim in kills]


def torch_run(args, folder: Path, faults: bool) -> dict:
    """One world; with faults the whole job is killed at the same moments and restarted for the
    steps left after its last checkpoint (every --save-interval steps)."""
    kept, restarts, start = 0, 0, time.time()
    left = args.steps
    next_fault = None
    while left > 0:
        flags = _flags(args, steps=left)
        run = Run(flags + ["--local-sgd-warmup-steps", "0"], folder, f"torch-{restarts}")
        done, killed = 0, False
        deadline = time.monotonic() + args.limit
        try:
            while run.poll():
                if time.monotonic() > deadline:
                    raise SystemExit(f"bench_ft: a torch run did not end within {args.limit} s: {run.log}")
                steps = [s for _, s in _step_times(run, 0)]
                done = max(steps, default=0)
                if faults and next_fault is None and any(re.match(r"sync 1 after", line) for _, line in run.lines):
                    next_fault = time.time() + args.fault_every
                if faults and next_fault is not None and time.time() >= next_fault and done < left:
                    _kill(run.mark)
                    killed = True
                    next_fault += args.fault_every
                    break
                time.sleep(0.1)
        finally:
            run.stop()
        if not killed:
            if run.proc.returncode != 0:
                raise SystemExit(f"bench_ft: a torch run failed (exit {run.proc.returncode}): {run.log}")
            kept += left
            break
        saved = done - done % args.save_interval  # the last checkpoint (steps of this start)
        kept += saved
        left -= saved
        restarts += 1
    return dict(seconds=time.time() - start, worker_steps=kept * args.workers, restarts=restarts)


def _flags(args, steps=None):
    steps = args.steps if steps is None else steps
    return ["--workers", str(args.workers), "--nproc-per-node", str(args.workers * args.ranks),
            "--steps", str(steps), "--eval-interval", str(steps), "--lr-warmup-steps", "2",
            "--local-sgd-sync-interval", str(args.h), "--log-interval", str(args.log_interval),
            "--data-dir", str(args.data_dir), "--compute-sleep-ms", f"{args.compute_ms:g}"]


def _import_seconds() -> float:
    """What a fresh worker job spends importing (python, torch, megatron-core, torchft)."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch, megatron.core, torchft"], check=True)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--ranks", type=int, default=2, help="ranks per worker")
    p.add_argument("--steps", type=int, default=1600)
    p.add_argument("--h", type=int, default=8, help="--local-sgd-sync-interval")
    p.add_argument("--log-interval", type=int, default=2)
    p.add_argument("--fault-every", type=float, default=60.0, help="seconds between faults")
    p.add_argument("--save-interval", type=int, default=40, help="the torch backend's checkpoint interval")
    p.add_argument("--compute-ms", type=float, default=0.0,
                   help="the main job's --compute-sleep-ms: every step also sleeps this long (a device's "
                        "compute), so that the workers, sharing this machine's cores, train as on devices of "
                        "their own (0: CPU-bound, the workers compete for the cores)")
    p.add_argument("--limit", type=float, default=1800.0, help="seconds a run may take")
    p.add_argument("--data-dir", default=os.environ.get("MEGATRON_EDIT_DATA", "data-cache"))
    p.add_argument("--out", default=str(RESULTS / "ft.md"))
    args = p.parse_args(argv)
    if args.workers < 2 or args.steps % args.log_interval or args.save_interval % args.log_interval:
        p.error("--workers >= 2; --steps and --save-interval multiples of --log-interval")
    if args.compute_ms < 0:
        p.error(f"--compute-ms {args.compute_ms:g}: a sleep per step, >= 0")
    folder = Path(tempfile.mkdtemp(prefix="bench_ft_"))
    load0 = os.getloadavg()
    runs = {}
    for name, fn, faults in (("torchft, no fault", torchft_run, False), ("torchft, faults", torchft_run, True),
                             ("torch, no fault", torch_run, False), ("torch, faults (restart)", torch_run, True)):
        print(f"bench_ft: {name} ...", flush=True)
        runs[name] = fn(args, folder, faults)
        print(f"bench_ft: {name}: {runs[name]['seconds']:.1f} s, {runs[name]['worker_steps']} worker-steps", flush=True)
    imports = _import_seconds()
    load1 = os.getloadavg()
    rate = {k: v["worker_steps"] / v["seconds"] for k, v in runs.items()}
    ft = runs["torchft, faults"]
    fmt = lambda xs: ", ".join("-" if x is None else f"{x:.1f}" for x in xs) or "-"  # noqa: E731
    lines = [
        f"`python scripts/bench/bench_ft.py --workers {args.workers} --ranks {args.ranks} --steps {args.steps} "
        f"--h {args.h} --fault-every {args.fault_every:g} --save-interval {args.save_interval}"
        f"{f' --compute-ms {args.compute_ms:g}' if args.compute_ms else ''}` "
        f"(load average {load0[0]:.1f} before, {load1[0]:.1f} after; {os.cpu_count()} cores)",
        "",
        "| run | wall s | worker-steps in the model | goodput vs its no-fault run | faults | survivors' stall per fault, s | rejoin: kill to first sync, s |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        base = rate["torchft, no fault"] if name.startswith("torchft") else rate["torch, no fault"]
        faults = len(r.get("kills", [])) or r.get("restarts", 0)
        stall = fmt(r["stall"]) if "stall" in r else ("whole run restarts" if faults else "-")
        lines.append(f"| {name} | {r['seconds']:.1f} | {r['worker_steps']} | {rate[name] / base:.2f} | {faults} | "
                     f"{stall} | {fmt(r.get('rejoin', []))} |")
    lines += ["", f"Survivors' steps lost with torchft: {'0 (worker 0 logged each step once)' if ft['survivor_steps_ok'] else 'SOME (see the log)'}; "
              f"the torch backend's restarts lost every worker's steps since each last checkpoint "
              f"(every {args.save_interval}). A fresh job's imports alone: {imports:.1f} s."]
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
