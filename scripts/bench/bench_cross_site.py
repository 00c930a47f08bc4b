"""Cross-site benchmark (issue 60): the torchft backend, A-EDiT, a straggler and a slow link
together, in the main job on two "sites", with and without a worker's site dying.

    # as root (network namespaces, tc); about a minute per run
    python scripts/bench/bench_cross_site.py [--rate 20mbit] [--steps 300] [--compute-ms 60]
        [--slow-ms 40] [--sync-time 1.5] [--kill-after 30] [--modes bound,fp32,int8,topk,auto]

Each run is scripts/dev/ft_two_nodes.sh: two network namespaces joined by one link limited to
--rate (tc's tbf, both directions), the supervisor's --serve and worker 0's job on site a, worker
1's on site b, one rank each, the main job over torchft with A-EDiT (``--local-sgd-async``, a
sync every --sync-time seconds of training, the first after 8 steps, a budget of --steps x 2
worker-steps). Every step sleeps --compute-ms (a device's compute, so that the two jobs on this
2-core machine train as on devices of their own) and worker 1's --slow-ms more (a straggler:
A-EDiT gives it fewer steps per interval; no one waits for it). With --kill-after S every
process of site b is SIGKILLed S seconds after the jobs start and worker 1's job is started again
there: it heals from worker 0 over the link at their next sync.

Modes (each a set of flags; a mode the package refuses is reported with its line):
  bound   no exchange between the first and the last sync (--local-sgd-sync-time 1e6): the
          no-communication bound, both workers training at their own pace;
  fp32, int8, topk   the exchange in that format (topk: 2 % of each chunk's values in int2, error
          feedback), layer-wise, no delay;
  fp32-delay, topk-delay   the same with --local-sgd-outer-step-delay --delay;
  auto    --local-sgd-auto-overlap --local-sgd-auto-formats fp32,int8,topk0.02-int2, started in
          fp32 with the delay --delay (it chooses the delay and format from its measurements).

Measured from the survivor's per-sync record (worker 0, ``--local-sgd-sync-record``): worker-steps
in the model = over its committed syncs after the first, the steps every worker took since the
last (``worker_steps``: a killed worker's steps since its last sync are not in it); the window =
the time from the first sync's record to the last's; worker-steps/s = their ratio (the bound pays
one blocking fp32 exchange in its window, its last sync: about 0.2 s at 20 Mbit/s). "vs bound" and
"vs best fixed" divide by the bound's and by the best fixed mode's rate of the same fault
setting. The planner's prediction (``python -m megatron_edit.plan`` at the bound's measured step
time of worker 0, H = the median steps per interval of worker 0 in the fp32 run, the link's rate):
a fixed mode's "no delay" fraction, the auto run's choice. Every run must end with one model
(exit code 0: the supervisor compares every rank's digest) and the table says so.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "scripts" / "bench" / "results"
TWO_NODES = ROOT / "scripts" / "dev" / "ft_two_nodes.sh"
sys.path.insert(0, str(ROOT / "scripts" / "bench"))
import bench_common as bc  # noqa: E402  (the per-sync record's reader)

TOPK = ["--local-sgd-exchange-topk-density", "0.02", "--local-sgd-exchange-dtype", "int2"]
FIXED = ("fp32", "int8", "topk", "fp32-delay", "topk-delay")


def mode_flags(mode: str, args) -> list:
    """The main job's flags of ``mode`` (see the module)."""
    delay = ["--local-sgd-outer-step-delay", str(args.delay)]
    return {
        "bound": ["--local-sgd-sync-time", "1000000"],
        "fp32": [],
        "int8": ["--local-sgd-exchange-dtype", "int8"],
        "topk": TOPK,
        "fp32-delay": delay,
        "topk-delay": TOPK + delay,
        "auto": ["--local-sgd-auto-overlap", "--local-sgd-auto-formats", "fp32,int8,topk0.02-int2", *delay],
    }[mode]


def run(mode: str, args, folder: Path, kill: bool) -> dict:
    """One run of ``mode``; its figures from worker 0's record and the logs."""
    out = folder / f"{mode}{'-kill' if kill else ''}"
    record = out / "syncs-{worker}.jsonl"
    command = ["bash", str(TWO_NODES), "--out", str(out), "--steps", str(args.steps), "--compute-ms",
               f"{args.compute_ms:g}", "--slow-ms", f"{args.slow_ms:g}", "--rate", args.rate, "--python", sys.executable,
               *(["--kill-after", f"{args.kill_after:g}"] if kill else []), "--",
               "--local-sgd-async", "--local-sgd-sync-time", f"{args.sync_time:g}", "--local-sgd-sync-interval", "8",
               "--local-sgd-min-total-global-steps", "1", "--lr-warmup-steps", "2", "--eval-interval", str(args.steps),
               "--log-interval", "4", "--local-sgd-sync-record", str(record), *mode_flags(mode, args)]
    print(f"bench_cross_site: {mode}{', worker 1 killed' if kill else ''} ...", flush=True)
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=args.limit)
    logs = [(out / f"w{w}.log").read_text() if (out / f"w{w}.log").exists() else "" for w in (0, 1)]
    refused = re.search(r"train_gpt_edit\.py: error: (?:megatron_edit: )?(.*)", logs[0])
    if refused:
        return dict(refused=refused.group(1))
    if proc.returncode != 0 or not Path(str(record).format(worker=0)).exists():
        raise SystemExit(f"bench_cross_site: {mode} failed (exit {proc.returncode}): {out}\n"
                         f"{(proc.stdout + proc.stderr)[-2000:]}\n{logs[0][-2000:]}\n{logs[1][-2000:]}")
    records = [r for r in bc.read_records(str(record).format(worker=0)) if r["committed"]]
    window = records[-1]["time"] - records[0]["time"]
    steps = sum(sum(r["worker_steps"]) for r in records[1:])
    step_ms = [float(m) for m in re.findall(r"step +\d+ \| worker 0 loss [\d.]+ \| lr \S+ \| +([\d.]+) ms", logs[0])]
    valid = [re.findall(r"validation after step \d+: worker \d ([\d.]+)", log)[-1:] for log in logs]
    return dict(seconds=window, worker_steps=steps, rate=steps / window, syncs=len(records),
                exposed=statistics.median(r["exposed_wait_seconds"] for r in records[1:-1]) if len(records) > 2 else 0.0,
                per_interval=statistics.median(r["worker_steps"][0] for r in records[1:-1]) if len(records) > 2 else None,
                step_ms=statistics.median(step_ms) if step_ms else None,
                settings=sorted({(r["exchange_dtype"], r["topk_density"], r["delay"]) for r in records[1:-1]}),
                one_model=proc.returncode == 0 and valid[0] == valid[1] != [], valid=valid[0][0] if valid[0] else None,
                healed=bool(re.search(r"worker 1 rank 0 joined a running job: healed from a live worker", logs[1])),
                params=int(re.search(r"([\d,]+) parameters on this rank", logs[0]).group(1).replace(",", "")))


def planner(params: int, rate_mbit: float, step_ms: float, h: int) -> dict:
    """The planner's fractions of the bound: {format: no-delay fraction, "choice": its choice's}."""
    out = subprocess.run([sys.executable, "-m", "megatron_edit.plan", "--params", str(params), "--workers", "2",
                          "--link-mbit", f"{rate_mbit:g}", "--step-ms", f"{step_ms:.1f}", "--sync-interval", str(h),
                          "--formats", "fp32,int8,topk0.02-int2"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^(\S+)\s+[\d.]+\s+[\d.]+\s+([\d.]+)\s+\d+", out, re.M)}
    choice = re.search(r"^choice: (.*), ([\d.]+) of the no-communication bound", out, re.M)
    return dict(fp32=rows.get("fp32"), int8=rows.get("int8"), topk=rows.get("topk0.02-int2"),
                choice=float(choice.group(2)) if choice else None, said=choice.group(1) if choice else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="20mbit", help="the link between the sites (tc tbf), e.g. 20mbit")
    p.add_argument("--steps", type=int, default=300, help="the main job's --steps (a budget of 2x worker-steps)")
    p.add_argument("--compute-ms", type=float, default=60.0, help="sleep per step (a device's compute)")
    p.add_argument("--slow-ms", type=float, default=40.0, help="worker 1's extra sleep per step (the straggler)")
    p.add_argument("--sync-time", type=float, default=1.5, help="--local-sgd-sync-time, seconds")
    p.add_argument("--delay", type=int, default=4, help="--local-sgd-outer-step-delay of the delayed modes and the auto start")
    p.add_argument("--kill-after", type=float, default=30.0, help="seconds after the start at which site b dies")
    p.add_argument("--modes", default="bound,fp32,int8,topk,fp32-delay,topk-delay,auto")
    p.add_argument("--no-kill", action="store_true", help="only the runs without a fault")
    p.add_argument("--limit", type=float, default=900.0, help="seconds a run may take")
    p.add_argument("--out", default=str(RESULTS / "cross_site.md"))
    args = p.parse_args(argv)
    modes = args.modes.split(",")
    unknown = [m for m in modes if m not in ("bound", "auto", *FIXED)]
    if unknown or "bound" not in modes:
        p.error(f"--modes: {unknown or 'bound missing'}; the modes are bound (needed), {', '.join(FIXED)}, auto")
    if os.geteuid() != 0:
        p.error("needs root (network namespaces and tc): run it as root")
    rate_mbit = float(re.fullmatch(r"([\d.]+)mbit", args.rate).group(1))
    folder = Path(tempfile.mkdtemp(prefix="bench_cross_site_"))
    load0 = os.getloadavg()
    results = {(m, k): run(m, args, folder, k) for k in ((False,) if args.no_kill else (False, True)) for m in modes}
    load1 = os.getloadavg()
    bound = results[("bound", False)]
    fp32 = results.get(("fp32", False), {})
    h = int(fp32.get("per_interval") or round(args.sync_time * 1e3 / bound["step_ms"]))
    plan = planner(bound["params"], rate_mbit, bound["step_ms"], h)
    lines = [f"`python scripts/bench/bench_cross_site.py --rate {args.rate} --steps {args.steps} --compute-ms "
             f"{args.compute_ms:g} --slow-ms {args.slow_ms:g} --sync-time {args.sync_time:g} --delay {args.delay} "
             f"--kill-after {args.kill_after:g}` (load average {load0[0]:.1f} before, {load1[0]:.1f} after; "
             f"{os.cpu_count()} cores); {bound['params']:,} parameters, worker 0's step {bound['step_ms']:.0f} ms, "
             f"H = {h} of worker 0's steps per interval; the planner's choice: {plan['said']}", "",
             "| mode | worker 1 killed | worker-steps/s | vs bound | vs best fixed | planner | settings in force "
             "(format, top-k, delay) | exposed wait per sync, ms | syncs | one model |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for kill in sorted({k for _, k in results}):
        fixed = [results[(m, kill)]["rate"] for m in FIXED if (m, kill) in results and "rate" in results[(m, kill)]]
        base = results[("bound", kill)].get("rate")
        for m in modes:
            r = results[(m, kill)]
            if "refused" in r:
                lines.append(f"| {m} | {'yes' if kill else 'no'} | refused: {r['refused'].replace('|', '/')} | | | | | | | |")
                continue
            predicted = {"auto": plan["choice"], "bound": 1.0}.get(m, plan.get(m.split("-")[0]) if "delay" not in m else None)
            lines.append(
                f"| {m} | {'yes' + (' (healed)' if r['healed'] else ' (NOT healed)') if kill else 'no'} | "
                f"{r['rate']:.1f} | {r['rate'] / base:.2f} | {r['rate'] / max(fixed) if fixed else float('nan'):.2f} | "
                f"{'-' if predicted is None else f'{predicted:.2f}'} | "
                f"{'; '.join(f'{d} {t if t else chr(8212)} {tau}' for d, t, tau in r['settings'])} | "
                f"{r['exposed'] * 1e3:.0f} | {r['syncs']} | {'yes' if r['one_model'] else 'NO'} |")
    text = "\n".join(lines)
    print("\n" + text, flush=True)
    Path(args.out).write_text(text + "\n")
    return 0 if all(r.get("one_model", True) for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
