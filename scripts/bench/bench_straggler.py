"""Straggler benchmark: one worker k times slower than the other, equal tokens for every run.

    torchrun --nproc_per_node 4 scripts/bench/bench_straggler.py [--slowdowns 2,3] [--steps 96]

2 workers x 2 shards of the main job's GPT (CPU, gloo). First each worker's solo step time is
measured (EDiT with H beyond the run: no communication across workers); then worker 1 is made k
times slower: it works the CPU (busy work, not a sleep) for (k - 1) x its solo step time per
step, as a slower machine would compute longer. A sleeping straggler freed the shared cores for
the fast worker, which then ran faster than its solo speed, and A-EDiT came out at 1.33 of the
solo sum, a ratio whose bound is 1. For each k the solo rates are measured again the same way
(worker 1 busy, no communication) in the same run: that is the "solo sum" of that k. Then three
runs train on the same data with the same total tokens, what ``--steps`` synchronous iterations
consume:

* synchronous: ordinary Megatron; every step waits for the slow worker;
* EDiT, H = ``--interval``: each worker takes ``--steps`` steps; the fast one waits at every sync;
* A-EDiT, T = ``--sync-time`` seconds: the budget is ``--steps`` x 2 worker-steps, shared out by
  speed; the last interval is planned so both workers reach the final sync together.

The table: tokens/s, that as a fraction of the sum of the two workers' solo rates (what they
would do if nobody ever waited), each worker's steps, each worker's waiting (wall time minus its
own steps at its own speed), the idle time at A-EDiT's final sync, total tokens, and whether the
replicas are identical at the end. Written to scripts/bench/results/straggler.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_common as bc  # noqa: E402


def busy(seconds: float) -> None:
    """Keep this rank's core busy for ``seconds`` (what a slower worker's longer compute costs
    on shared hardware; a sleep would give the core to the other worker)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def run(args, mode, train_ds, delay):
    """One run; returns this rank's figures (reduced by the caller)."""
    lay = bc.layout(args)
    a = bc.edit_args(args, use_local_sgd=mode != "synchronous", local_sgd_async=mode == "A-EDiT",
                     local_sgd_sync_interval=args.steps * 10 if mode == "solo" else args.interval,
                     local_sgd_warmup_steps=0)
    if mode == "A-EDiT":
        a.local_sgd_sync_time, a.local_sgd_min_total_global_steps = args.sync_time, 1
    ddp, optimizer, scheduler, controllers = bc.build(a)
    if mode == "A-EDiT":
        for c in controllers:
            c.budget_steps = args.steps * args.workers
    it = bc.batches(args, train_ds)
    steps, times, reports = 0, [], []
    limit = args.solo_steps if mode == "solo" else args.steps * (args.workers if mode == "A-EDiT" else 1)
    dist.barrier()
    t0 = time.perf_counter()
    while steps < limit and not (controllers and controllers[0].finished):
        s0 = time.perf_counter()
        if lay["worker"] == 1 and delay:
            busy(delay)
        bc.train_step(a, ddp, optimizer, scheduler, next(it))
        times.append(time.perf_counter() - s0)
        steps += 1
        reports += [r for c in controllers for r in c.drain_reports()]
    reports += bc.flush(ddp, controllers)
    wall = time.perf_counter() - t0
    out = dict(steps=steps, wall=wall, median=statistics.median(times), reports=reports)
    if mode != "solo":
        out["identical"] = bc.replicas_identical(args, ddp)
    return out


def per_worker(args, value) -> list:
    got = bc.gather_floats([value])[:, 0]
    size = bc.layout(args)["worker_size"]
    return [float(got[w * size:(w + 1) * size].max()) for w in range(args.workers)]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--slowdowns", default="2,3", help="comma-separated k: worker 1 is k x slower")
    parser.add_argument("--steps", type=int, default=96, help="synchronous iterations (the token budget)")
    parser.add_argument("--interval", type=int, default=8, help="EDiT's H")
    parser.add_argument("--sync-time", type=float, default=None,
                        help="A-EDiT's T in seconds (default: H x the fast worker's solo step time)")
    parser.add_argument("--solo-steps", type=int, default=24, help="steps to measure the solo speeds")
    args = bc.parse_args(parser)
    train_ds, _ = bc.setup(args, train_samples=args.steps * args.workers * 4 * args.micro_batch_size * 2)
    tokens_per_step = bc.layout(args)["worker_size"] * args.micro_batch_size * args.seq_length
    solo = run(args, "solo", train_ds, 0.0)
    base = per_worker(args, solo["median"])  # each worker's solo step time
    rows = []
    solos = []
    for k in [float(x) for x in args.slowdowns.split(",")]:
        delay = (k - 1) * base[1]
        # The solo rates with worker 1 slowed down the same way, measured now (the bound of this k).
        alone = per_worker(args, run(args, "solo", train_ds, delay)["median"])
        solo_rate = tokens_per_step * (1 / alone[0] + 1 / alone[1])
        solos.append(f"{k:g}x: {alone[0] * 1e3:.1f} / {alone[1] * 1e3:.1f} ms")
        if args.sync_time is None:
            args.sync_time = args.interval * base[0]
        for mode in ("synchronous", "EDiT", "A-EDiT"):
            r = run(args, mode, train_ds, delay)
            steps = per_worker(args, r["steps"])
            wall = max(per_worker(args, r["wall"]))
            own = [steps[0] * alone[0], steps[1] * alone[1]]
            waiting = [wall - o for o in own]
            tokens = sum(steps) * tokens_per_step
            idle = "-"
            final = [rep for rep in r["reports"] if rep.final]
            if final and final[-1].worker_idle is not None:
                idle = "/".join(f"{x:.2f}" for x in final[-1].worker_idle.tolist())
            identical = all(per_worker(args, float(r["identical"])))
            rows.append((f"{k:g}x", mode, f"{tokens / wall:,.0f}", f"{tokens / wall / solo_rate:.2f}",
                         f"{int(steps[0])}/{int(steps[1])}", "/".join(f"{w:.1f}" for w in waiting), idle,
                         f"{tokens:,.0f}", f"{wall:.1f}", str(identical)))
    headers = ("slow worker", "run", "tokens/s", "of solo sum", "steps w0/w1", "waiting s w0/w1",
               "final-sync idle s", "tokens", "wall s", "replicas equal")
    text = (f"solo step time: worker 0 {base[0] * 1e3:.1f} ms, worker 1 {base[1] * 1e3:.1f} ms; slowed "
            f"down (w0 / w1, busy work, measured in this run): {'; '.join(solos)}; "
            f"EDiT H={args.interval}, A-EDiT T={args.sync_time:.2f} s; budget {args.steps} synchronous "
            f"iterations; load average {bc.load_average()}\n\n" + bc.table(headers, rows, markdown=True))
    bc.log0(text)
    if dist.get_rank() == 0:
        bc.write_result("straggler.md", text + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    bc.run_main(main)
