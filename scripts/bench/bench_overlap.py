"""Overlap benchmark: what a sync costs in step time, step-end against layer-wise.

    torchrun --nproc_per_node 4 scripts/bench/bench_overlap.py [--interval 4] [--syncs 12]
    # over bandwidth-limited links (see scripts/bench/netns_cluster.sh):
    bash scripts/bench/netns_cluster.sh --workers 2 --rate 100mbit -- scripts/bench/bench_overlap.py

The main job's GPT (2 workers x 2 shards) trains with EDiT (no warmup, sync every H steps) in
both sync modes, and synchronously for reference. Every step and every forward pass is timed
on every rank (mean over ranks per step). For each sync due after step s:
  step_end   the exchange and the outer step run, blocking, inside the optimizer step of s;
  layerwise  the first bucket group's exchange is launched at the end of s, the rest complete
             bucket by bucket in the forward pass of s+1, each just before its parameters are
             gathered, while the next group's exchange is in flight.
"extra per sync" = time of steps s and s+1 above the median ordinary step (steps neither s nor
s+1). The exchange alone (the same all-reduces, blocking, no compute) is timed afterwards.
"hidden" = 1 - extra(layer-wise) / extra(step-end): the share of the sync's cost the forward
pass hides. The seconds in EDiT code and the exposed wait of each sync are its per-sync record's
(``--local-sgd-sync-record``: the slowest rank of each worker, the slower worker's); "extra /
exposed" is the median over syncs of the extra per sync over the record's exposed wait, which
should be 1 within 5% on a quiet machine (run it on one: on a loaded machine other jobs' time
lands in the steps, not in the record). Writes scripts/bench/results/overlap{suffix}.{png,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist

import bench_common as bc


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=int, default=4, help="H")
    parser.add_argument("--syncs", type=int, default=12, help="syncs measured per EDiT run")
    parser.add_argument("--skip-syncs", type=int, default=1, help="first syncs not measured (warm-up)")
    parser.add_argument("--suffix", default=os.environ.get("BENCH_SUFFIX", ""),
                        help="appended to the output names (e.g. _100mbit)")
    parser.add_argument("--label", default=os.environ.get("BENCH_LABEL", "loopback (one machine, no limit)"))
    return bc.parse_args(parser)


def run(args, mode, train_ds):
    h = args.interval
    steps = (args.syncs + args.skip_syncs) * h + 1
    edit = mode != "synchronous"
    run_args = bc.edit_args(
        args, use_local_sgd=edit, local_sgd_sync_interval=h, local_sgd_warmup_steps=0,
        local_sgd_sync_mode=mode if edit else "layerwise",
        local_sgd_sync_record=bc.record_path(f"overlap-{mode}") if edit else None,
    )
    ddp, optimizer, scheduler, controllers = bc.build(run_args)
    it = bc.batches(run_args, train_ds)
    forward = []

    def timed_forward(data_iterator, model):
        t0 = time.perf_counter()
        out = bc.main_job_model.forward_step(data_iterator, model)
        forward.append(time.perf_counter() - t0)
        return out

    step_times = []
    dist.barrier()
    for _ in range(steps):
        t0 = time.perf_counter()
        bc.train_step(run_args, ddp, optimizer, scheduler, next(it), forward_step=timed_forward)
        step_times.append(time.perf_counter() - t0)
        for c in controllers:
            c.drain_reports()  # (the record has their figures)
    bc.flush(ddp, controllers)
    shard_numels = [b.grad_data.numel() // bc.layout(args)["worker_size"] for buf in ddp.buffers for b in buf.buckets]
    in_flight = forward_in_flight(ddp, it, shard_numels) if mode == "layerwise" else None
    per_rank = bc.gather_floats(step_times + forward + [bc.layout(args)["worker"]])
    mean = per_rank[:, :-1].mean(dim=0).tolist()
    workers = per_rank[:, -1].long().tolist()
    # each worker's step times: the mean over its ranks
    worker_step = {w: per_rank[[r for r, x in enumerate(workers) if x == w], :steps].mean(dim=0).tolist()
                   for w in sorted(set(workers))}
    records = bc.close_records(run_args.local_sgd_sync_record) if edit else []
    # (worker, step) -> what the worker's record says the sync after that step held its steps:
    # the exposed wait (its slowest rank's), the wait for the other workers at the sync's start and
    # the record's own time
    accounted = {(r["worker"], r["step"]): r["exposed_wait_seconds"] + (r["arrival_wait_seconds"] or 0.0)
                 + r["record_seconds"] for r in records}
    # step -> the slower worker's figure of the sync after it (each worker's: its slowest rank's)
    return dict(mode=mode, step=mean[:steps], forward=mean[steps:], shard_numels=shard_numels, in_flight=in_flight,
                worker_step=worker_step, accounted=accounted,
                edit_seconds=bc.by_step(records, "exchange_seconds"),
                exposed=bc.by_step(records, "exposed_wait_seconds"), syncs=len(bc.by_step(records, "step")))


@torch.no_grad()
def forward_in_flight(ddp, it, shard_numels, reps=15) -> tuple:
    """A forward pass alone and with a sync's all-reduces in flight across the workers (launched
    just before it, waited for after it): (median seconds without, with), mean over ranks. On a
    CPU, gloo's threads reduce and copy on the cores the forward pass computes on, so an exchange
    "hidden" behind compute still costs the compute time: no timer in EDiT's code sees it."""
    from megatron.core import parallel_state as ps

    group = ps.get_inter_distributed_optimizer_instance_group()
    tensors = [torch.zeros(n) for n in shard_numels]
    alone, loaded = [], []
    for i in range(reps + 1):
        for busy in (False, True):
            batch = next(it)
            dist.barrier()
            handles = [dist.all_reduce(t, group=group, async_op=True) for t in tensors] if busy else []
            t0 = time.perf_counter()
            bc.main_job_model.forward_step(iter([batch]), ddp)
            took = time.perf_counter() - t0
            for handle in handles:
                handle.wait()
            if i:  # the first pair warms up
                (loaded if busy else alone).append(took)
    per_rank = bc.gather_floats([statistics.median(alone), statistics.median(loaded)]).mean(dim=0).tolist()
    return per_rank[0], per_rank[1]


def exchange_alone(shard_numels, reps=7) -> float:
    """Seconds for the sync's all-reduces across the workers, blocking, nothing else running."""
    from megatron.core import parallel_state as ps

    return bc.exchange_alone(shard_numels, ps.get_inter_distributed_optimizer_instance_group(), reps)


def analyse(args, r):
    """Ordinary step/forward time, and the extra time of the steps around each measured sync."""
    h, n = args.interval, len(r["step"])
    sync_after = [s for s in range(1, n + 1) if s % h == 0 and s // h > args.skip_syncs and s < n]
    touched = {s for t in sync_after for s in (t, t + 1)}
    ordinary = [r["step"][i - 1] for i in range(h + 1, n + 1) if i not in touched]
    ordinary_fwd = [r["forward"][i - 1] for i in range(h + 1, n + 1) if i not in touched]
    base, base_fwd = statistics.median(ordinary), statistics.median(ordinary_fwd)
    extra = [r["step"][s - 1] + r["step"][s] - 2 * base for s in sync_after]
    sync_step = [r["step"][s - 1] - base for s in sync_after]
    next_step = [r["step"][s] - base for s in sync_after]
    next_fwd = [r["forward"][s] - base_fwd for s in sync_after]
    spread = statistics.quantiles(ordinary, n=4) if len(ordinary) >= 4 else [base, base, base]
    exposed = [r["exposed"][s] for s in sync_after if s in r["exposed"]]
    # each worker's extra time around each sync against what its record accounts for (the exposed
    # wait plus the arrival wait): a worker that arrives first waits for the last one, which no
    # ordinary step does
    ratios, ratios_s = [], []
    for w, times in (r.get("worker_step") or {}).items():
        base_w = statistics.median(times[i - 1] for i in range(h + 1, n + 1) if i not in touched)
        for s in sync_after:
            held = r["accounted"].get((w, s))
            if held:
                ratios.append((times[s - 1] + times[s] - 2 * base_w) / held)
                ratios_s.append((times[s - 1] - base_w) / held)
    edit = [r["edit_seconds"][s] for s in sync_after if s in r["edit_seconds"]]
    return dict(base=base, base_iqr=(spread[0], spread[2]), base_fwd=base_fwd,
                extra=statistics.median(extra) if extra else 0.0,
                extra_all=extra, sync_step=statistics.median(sync_step) if sync_step else 0.0,
                next_step=statistics.median(next_step) if next_step else 0.0,
                next_fwd=statistics.median(next_fwd) if next_fwd else 0.0,
                edit=statistics.median(edit) if edit else 0.0,
                exposed=statistics.median(exposed) if exposed else 0.0, exposed_all=exposed,
                extra_over_exposed=statistics.median(ratios) if ratios else float("nan"),
                step_s_over_exposed=statistics.median(ratios_s) if ratios_s else float("nan"))


def main():
    args = parse_args()
    train_ds, _ = bc.setup(args, train_samples=((args.syncs + args.skip_syncs + 1) * args.interval * 3 + 8)
                           * 4 * args.micro_batch_size)
    results = {mode: run(args, mode, train_ds) for mode in ("step_end", "layerwise", "synchronous")}
    alone = exchange_alone(results["layerwise"]["shard_numels"])
    if dist.get_rank() == 0:
        report(args, results, alone)
    dist.destroy_process_group()


def report(args, results, alone):
    stats = {mode: analyse(args, r) for mode, r in results.items()}
    se, lw = stats["step_end"], stats["layerwise"]
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    rows = []
    for mode in ("synchronous", "step_end", "layerwise"):
        s = stats[mode]
        edit = mode != "synchronous"
        rows.append([
            "synchronous (every step)" if not edit else f"EDiT {mode}",
            f"{ms(s['base'])} [{ms(s['base_iqr'][0])}-{ms(s['base_iqr'][1])}]",
            ms(s["base_fwd"]),
            ms(s["sync_step"]) if edit else "-", ms(s["next_step"]) if edit else "-",
            ms(s["next_fwd"]) if edit else "-", ms(s["extra"]) if edit else "-",
            ms(s["edit"]) if edit else "-", ms(s["exposed"]) if edit else "-",
            f"{s['extra_over_exposed']:.3f}" if edit else "-",
            f"{s['step_s_over_exposed']:.3f}" if edit else "-",
            f"{s['base'] / stats['synchronous']['base']:.2f}",
        ])
    hidden = 1 - lw["extra"] / se["extra"] if se["extra"] > 0 else float("nan")
    payload = sum(results["layerwise"]["shard_numels"]) * 4
    headers = ["run", "ordinary step ms [IQR]", "forward ms", "step s +ms", "step s+1 +ms", "forward s+1 +ms",
               "extra per sync ms", "in EDiT code ms", "record exposed wait ms", "extra / recorded", "step s / recorded",
               "ordinary step vs sync"]
    summary = (
        f"{args.label}; H={args.interval}, {args.syncs} syncs measured per mode, "
        f"{args.workers} workers x {bc.layout(args)['worker_size']} shards, "
        f"pseudo-gradient payload {payload / 1e3:.0f} kB per rank per sync.\n"
        f"exchange alone (same all-reduces, blocking, no compute): {alone * 1e3:.1f} ms.\n"
        f"hidden by the forward pass: 1 - extra(layerwise)/extra(step_end) = {hidden:.0%} "
        f"({ms(lw['extra'])} ms vs {ms(se['extra'])} ms per sync); load average {bc.load_average()}.\n"
        "'+ms' = median over syncs of the step's time above the median ordinary step; step s runs the "
        "optimizer step the sync is due after, step s+1 the forward pass where layer-wise completes it.\n"
        "in EDiT code, record exposed wait: the per-sync record's exchange_seconds and exposed_wait_seconds "
        "(each worker's slowest rank, the slower worker), medians over the measured syncs; extra / recorded: median over the syncs and workers of the worker's extra time in steps s and s+1 (mean over "
        "its ranks, above its median ordinary step) over what its record says the sync held it: exposed_wait_seconds + arrival_wait_seconds + record_seconds; step s / recorded: the same for step s alone (a step-end sync runs wholly inside it) "
        "(1 within 5% expected on a quiet machine)."
    )
    text = bc.table(headers, rows)
    fwd_alone, fwd_loaded = results["layerwise"]["in_flight"]
    summary += (f"\na forward pass alone {ms(fwd_alone)} ms, with the sync's all-reduces in flight "
                f"{ms(fwd_loaded)} ms (+{ms(fwd_loaded - fwd_alone)} ms): on a CPU gloo reduces on the cores "
                "the forward pass computes on, so a layer-wise exchange in flight costs compute time no timer "
                "in EDiT's code sees.")
    print(f"\noverlap of the sync with compute\n{text}\n{summary}")
    suffix = args.suffix
    bc.write_result(f"overlap{suffix}.md", bc.table(headers, rows, markdown=True) + "\n\n"
                    + summary.replace("\n", "  \n") + "\n")
    bc.write_result(f"overlap{suffix}.json", json.dumps(dict(stats=stats, alone=alone, label=args.label,
                                                             interval=args.interval, payload=payload)))

    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    h = args.interval
    for mode, color in (("step_end", "tab:red"), ("layerwise", "tab:blue"), ("synchronous", "0.5")):
        t = [x * 1e3 for x in results[mode]["step"]]
        ax.plot(range(1, len(t) + 1), t, "-o", markersize=3, color=color, label=mode)
    for s in range(h, len(results["layerwise"]["step"]), h):
        ax.axvline(s + 0.5, color="k", alpha=0.15)
    ax.set_xlabel(f"step (sync due after every {h}th; grey line between s and s+1)")
    ax.set_ylabel("step time, ms (mean over ranks)")
    ax.set_title(f"Sync cost per step: {args.label}\nhidden by forward: {hidden:.0%}", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(bc.plot_path(f"overlap{suffix}.png"), dpi=110)
    print(f"wrote {bc.plot_path(f'overlap{suffix}.png')}")


if __name__ == "__main__":
    bc.run_main(main)
