"""Overhead benchmark: the patch's cost on steps that do not sync, against unpatched Megatron.

    torchrun --nproc_per_node 4 scripts/bench/bench_overhead.py [--reps 7] [--steps 30]

The same model, data and Megatron configuration are trained patched (EDiT, no warmup, H larger
than the run so no sync happens: every timed step is an ordinary local step) and unpatched, in
interleaved repetitions (the order alternates; each repetition builds both afresh, runs
``--warmup`` untimed steps, then times ``--steps`` steps between barriers, slowest rank).
  1 worker x 4 shards   EDiT with one worker reduces gradients exactly as Megatron does: the
                        ratio is the cost of the wrappers alone (hooks, schedule bookkeeping);
  2 workers x 2 shards  the patched step also skips the per-step gradient all-reduce across
                        workers: the ratio is what a local step saves against a synchronous one.
Reports the median ratio patched/unpatched over repetitions with its min-max spread. Writes
scripts/bench/results/overhead{--suffix}.{png,md}. On this 2-core machine four processes contend for the
cores; ``torchrun --nproc_per_node 1 scripts/bench/bench_overhead.py --layouts 1x1 --suffix _1proc``
measures the wrappers in one process, without that noise.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch.distributed as dist

import bench_common as bc


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", dest="bench_steps", type=int, default=30, help="timed steps per repetition")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--layouts", nargs="+", default=["1x4", "2x2"], help="workers x shards per worker")
    parser.add_argument("--suffix", default="", help="appended to the output names (e.g. _1proc)")
    return bc.parse_args(parser)


def time_steps(args, patched: bool, train_ds) -> float:
    run_args = bc.edit_args(args, use_local_sgd=patched, local_sgd_sync_interval=10**6, local_sgd_warmup_steps=0)
    ddp, optimizer, scheduler, controllers = bc.build(run_args)
    it = bc.batches(run_args, train_ds)
    for _ in range(args.warmup):
        bc.train_step(run_args, ddp, optimizer, scheduler, next(it))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.bench_steps):
        bc.train_step(run_args, ddp, optimizer, scheduler, next(it))
    dist.barrier()
    elapsed = bc.max_over_ranks(time.perf_counter() - t0)
    assert not any(c.reports for c in controllers), "a sync ran during the overhead benchmark"
    return elapsed / args.bench_steps


def main():
    args = parse_args()
    from megatron.core import parallel_state as ps

    train_ds = None
    results = {}
    for layout in args.layouts:
        workers, shards = map(int, layout.split("x"))
        args.workers = workers
        if train_ds is None:
            train_ds, _ = bc.setup(args, train_samples=(args.warmup + args.bench_steps + 2) * 4 * args.micro_batch_size)
        else:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(num_distributed_optimizer_instances=workers)
        times = {True: [], False: []}
        for rep in range(args.reps):
            order = (True, False) if rep % 2 == 0 else (False, True)
            for patched in order:
                times[patched].append(time_steps(args, patched, train_ds))
            bc.log0(f"{layout} rep {rep}: patched {times[True][-1] * 1e3:.1f} ms, "
                    f"unpatched {times[False][-1] * 1e3:.1f} ms per step")
        results[layout] = times
    if dist.get_rank() == 0:
        report(args, results)
    dist.destroy_process_group()


def report(args, results):
    rows = []
    for layout, times in results.items():
        ratios = [p / u for p, u in zip(times[True], times[False])]
        workers = int(layout.split("x")[0])
        what = "wrappers only (same reductions)" if workers == 1 else "local step vs synchronous step"
        rows.append([
            layout, what, f"{statistics.median(times[False]) * 1e3:.1f}", f"{statistics.median(times[True]) * 1e3:.1f}",
            f"{statistics.median(ratios):.3f}", f"{min(ratios):.3f}-{max(ratios):.3f}", len(ratios),
        ])
    headers = ["workers x shards", "what the ratio measures", "unpatched ms/step", "patched ms/step",
               "patched/unpatched (median)", "min-max", "reps"]
    notes = (f"{args.bench_steps} timed steps per repetition after {args.warmup} untimed, interleaved, slowest "
             f"rank; no sync in the timed steps (H > run). Load average at the end: {bc.load_average()}.")
    text = bc.table(headers, rows)
    print(f"\noverhead of the patch on steps that do not sync\n{text}\n{notes}")
    bc.write_result(f"overhead{args.suffix}.md", bc.table(headers, rows, markdown=True) + "\n\n" + notes + "\n")

    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    labels, data = [], []
    for layout, times in results.items():
        data.append([p / u for p, u in zip(times[True], times[False])])
        labels.append(f"{layout}\n" + ("wrappers only" if layout.startswith("1x") else "local vs sync step"))
    ax.boxplot(data, tick_labels=labels)
    for i, d in enumerate(data, start=1):
        ax.plot([i] * len(d), d, "o", color="tab:blue", alpha=0.6, markersize=4)
    ax.axhline(1.0, color="k", linewidth=0.8)
    ax.set_ylabel("step time, patched / unpatched")
    ax.set_title("EDiT patch on non-sync steps (interleaved reps)", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(bc.plot_path(f"overhead{args.suffix}.png"), dpi=110)
    print(f"wrote {bc.plot_path(f'overhead{args.suffix}.png')}")


if __name__ == "__main__":
    bc.run_main(main)
