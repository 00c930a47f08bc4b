"""Hiding benchmark: how much of the bound a delayed outer step keeps on a slow link.

    # as root, on the network namespaces (one per worker, tbf-limited links):
    bash scripts/bench/netns_cluster.sh --workers 2 --procs-per-worker 2 --rate 20mbit --check -- \\
        scripts/bench/bench_hiding.py [--interval 8] [--syncs 8] [--repeats 2]
    # calibration of the rate (the exchange alone against the ordinary step), about a minute:
    bash scripts/bench/netns_cluster.sh --rate 20mbit -- scripts/bench/bench_hiding.py --calibrate --syncs 3 --skip-syncs 1
    # 2 workers x 2 ranks: the fp32 exchange is 549 kB per worker's link; at 20 Mbit/s about
    # 230 ms, about 4 ordinary steps (H/2 at H = 8) on the shared 2-core machine.

The main job's GPT (bench_common, as bench_overlap.py) trains, in one run, in these modes:
  bound             EDiT with H larger than the run: nothing crosses workers (pure local compute);
  bound + barrier   the same with a barrier of all ranks every H steps (a sync that sends nothing:
                    what meeting the other worker costs on a machine shared with other jobs);
  synchronous       unpatched Megatron: every step all-reduces the gradient shards across workers;
  EDiT layer-wise   sync every H steps, completed bucket by bucket in the next forward pass;
  EDiT delay tau    --local-sgd-outer-step-delay tau (default H/2): launched after step s - tau,
                    applied after step s (alpha 0; with --alpha-half also alpha 0.5);
  EDiT F fragments  --local-sgd-fragments F with delay max(1, H/(2F)).
--auto instead: the bound, the auto run (--local-sgd-auto-overlap, --local-sgd-auto-formats
--auto-formats, --local-sgd-auto-fragments --auto-fragments, starting with F = 1) and the fixed
settings it chooses among (each format layer-wise, tau = 1, 2, H/2; with 2 fragments tau = 1 ..
H/2 - 1; with 4 fragments tau = 1); the summary gives the auto run's tokens/s and validation loss
against the best of them, its decisions and its predicted against its measured exposed wait
(scripts/bench/plot_hiding_auto.py: the table and plot over rates). The auto run starts with
--auto-start-delay (default H/2); --auto-measured STEP_MS:FP32_MS fixes its measurements, so that
its decisions and loss are the same on any link (the loss question without the link's noise).
--confirm N then runs N more rounds of the bound, the auto run and the grid's best fixed setting,
and compares the auto run with that setting in those rounds only (the best of 24 noisy points is
picked for its luck too: it reads high).
Every mode's validation loss
is taken after its last step (a blocking sync of everything: one model on every worker), on
--eval-samples held-out samples. --rate-change STEP:RATE
slows (or speeds) the link after step STEP of every mode.
No warmup (local from step 1). Each mode trains (skip + syncs) x H steps; the first `skip`
intervals are not measured (build, caches, first exchanges); one more step ends each run (its
last step: a blocking sync of everything, untimed, after which replicas are compared). Modes run
in a rotated order per repetition (--repeats). On a shared machine the workers drift apart
between syncs (other jobs preempt them at random): compare "bound + barrier every H", and see
the reading in scripts/bench/results/hiding.md.

tokens/s = tokens of all ranks in the measured window / the slowest rank's time for it (the sum
of its step times; no barrier inside the window). "vs bound" = tokens/s / bound's tokens/s
(medians over repetitions; each repetition's own ratio in brackets). Two more references, from
the same step times: "per-position medians" (each of the H step positions of an interval at its
median over intervals: robust to other jobs' preemptions, not to systematic waits) and "with a
barrier per interval" (the bound's steps with every interval at its slowest rank: a sync that
costs nothing but meeting the other worker).
Per sync: "sync start" = the blocking part of a sync before its exchange is launched (the
arrival check in the store, the all-gather of the per-layer norms), timed by wrapping
Arrivals.wait and SyncGroup.all_gather in this process: time in it, spread of the ranks'
arrivals (one clock: CLOCK_MONOTONIC), the last arriver's time. "extra vs bound" = median over
measured intervals of (the H steps' time, mean over ranks) minus the bound's median interval;
"exposed wait" = SyncReport.exposed_wait_seconds (delayed syncs: host seconds in the exchange's
waits at the apply; mean over ranks, median over syncs; "(max rank)": the per-sync record's
exposed_wait_seconds, the slowest rank's, ``--local-sgd-sync-record``; the syncs, their settings
and bytes are the record's too); layer-wise: steps s and s+1 above the
run's median ordinary step (bench_overlap's "extra per sync"). For the delayed modes the launch
step (s - tau), the steps while the exchange is in flight and the apply step (s) are each given
above the run's ordinary steps. "exchange alone" = the same all-reduces (every rank's shards,
all at once), blocking, no compute, median of 7, before and after the modes.
Writes scripts/bench/results/hiding{suffix}.{md,json,png}.
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
import megatron_edit as me


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=int, default=8, help="H")
    parser.add_argument("--syncs", type=int, default=8, help="measured syncs (intervals) per EDiT mode")
    parser.add_argument("--sync-syncs", type=int, default=3,
                        help="measured intervals of H steps of synchronous training (each step pays the exchange)")
    parser.add_argument("--skip-syncs", type=int, default=2, help="first intervals not measured (warm-up)")
    parser.add_argument("--tau", type=int, default=None, help="delay of the delayed modes (default H/2)")
    parser.add_argument("--fragments", type=int, default=4, help="F of the fragments mode")
    parser.add_argument("--fragment-delay", type=int, default=None,
                        help="delay of the fragments mode (default max(1, H/(2F)))")
    parser.add_argument("--alpha-half", action=argparse.BooleanOptionalAction, default=True,
                        help="also the delayed mode with merge alpha 0.5")
    parser.add_argument("--modes", nargs="*", default=None,
                        help="only these modes (names as in the report, e.g. 'EDiT delay 4'); bound always runs")
    parser.add_argument("--repeats", type=int, default=2, help="repetitions of every mode (rotated order)")
    parser.add_argument("--calibrate", action="store_true",
                        help="only the bound's ordinary step and the exchange alone (to choose the rate)")
    parser.add_argument("--suffix", default=os.environ.get("BENCH_SUFFIX", ""),
                        help="appended to the output names (e.g. _1proc)")
    parser.add_argument("--label", default=None, help="what the link is (default: from netns_cluster.sh)")
    parser.add_argument("--auto", action="store_true",
                        help="--local-sgd-auto-overlap against a grid of fixed (tau, F, format) settings")
    parser.add_argument("--rate-change", default=None, metavar="STEP:RATE",
                        help="in every mode, change the link's rate to RATE (e.g. 10mbit) after step STEP "
                             "(netns_cluster.sh: each worker's local rank 0 changes its end's tbf); each mode "
                             "starts at --rate again")
    parser.add_argument("--auto-formats", default="fp32,int8,int4",
                        help="--local-sgd-auto-formats of the auto run, and the grid's formats")
    parser.add_argument("--auto-fragments", default="1,2",
                        help="--local-sgd-auto-fragments of the auto run (it starts with 1)")
    parser.add_argument("--auto-start-delay", type=int, default=None,
                        help="--local-sgd-outer-step-delay of the auto run: the delay it starts with, until its "
                             "first decision (default H/2; 0: its first syncs block)")
    parser.add_argument("--auto-measured", default=None, metavar="STEP_MS:FP32_MS",
                        help="the auto run's measurements fixed at these (an inner step, the fp32 exchange; the "
                             "other formats scaled by their bytes; no exposed wait) instead of its clocks: its "
                             "decisions, and so its loss, are then the same on any link and machine")
    parser.add_argument("--confirm", type=int, default=0, metavar="N",
                        help="--auto: after the grid, N more rounds of the bound, the auto run and the grid's "
                             "best fixed setting (rotated order), and the auto run against that setting taken "
                             "from these rounds only (the best of many noisy grid points is biased upward)")
    args = bc.parse_args(parser)
    if args.confirm and not args.auto:
        parser.error("--confirm needs --auto (it re-measures the auto run against the grid's best setting)")
    if "NETNS_WORKER" in os.environ:  # netns_cluster.sh: one torchrun node per worker
        args.workers = int(os.environ["GROUP_WORLD_SIZE"])
    rate = os.environ.get("NETNS_RATE")
    args.rate = rate or "loopback"
    if args.label is None:
        args.label = (f"2 network namespaces, tbf {rate}" if rate and rate != "none"
                      else "network namespaces, unlimited veth" if rate else "loopback (one machine, no limit)")
    if args.tau is None:
        args.tau = args.interval // 2
    if args.auto_start_delay is None:
        args.auto_start_delay = args.interval // 2
    if args.fragment_delay is None:
        args.fragment_delay = max(1, args.interval // (2 * args.fragments))
    return args


def fix_measurements(auto, spec: str) -> None:
    """--auto-measured STEP_MS:FP32_MS: the auto run measures these numbers at every sync (the
    other allowed formats' exchange scaled by their bytes, no exposed wait), whatever its clocks
    say; what is measured then is the algorithm's choice, not this machine's timing."""
    from megatron_edit.algorithm import overlap_plan

    step_ms, fp32_ms = (float(x) for x in spec.split(":"))
    numel = sum(s.numel for s in auto.controller.shards)
    exchange = overlap_plan.scale_to_formats(fp32_ms / 1e3, "fp32", numel, auto.formats,
                                             auto.user.exchange_block_size)
    auto.measure = lambda: overlap_plan.Measurement(step_ms / 1e3, dict(exchange), 0.0)


def set_rate(rate: str) -> None:
    """netns_cluster.sh's tbf on this worker's end of the link (local rank 0 only), at ``rate``."""
    import subprocess

    import tbf

    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    burst = tbf.burst_bytes(tbf.rate_bits(rate))
    subprocess.run(["tc", "qdisc", "change", "dev", "edw", "root", "tbf", "rate", rate, "burst", str(burst),
                    "latency", "100ms"], check=True)


def auto_modes(args):
    """--auto: the bound, the auto run (starting with F = 1; the formats and fragments
    allowed), and the fixed settings it chooses among: each format layer-wise, with tau = 1, 2,
    H/2, with 2 fragments and tau = 1 .. H/2 - 1, and with 4 fragments and tau = 1."""
    h = args.interval
    formats = args.auto_formats.split(",")
    out = {"bound": dict(local_sgd_sync_interval=10**6),
           "EDiT auto": dict(local_sgd_sync_interval=h, local_sgd_auto_overlap=True,
                             local_sgd_auto_formats=args.auto_formats, local_sgd_auto_fragments=args.auto_fragments,
                             local_sgd_outer_step_delay=args.auto_start_delay)}
    for fmt in formats:
        base = dict(local_sgd_sync_interval=h, local_sgd_exchange_dtype=fmt)
        out[f"{fmt} layer-wise"] = base
        for tau in sorted({1, 2, h // 2}):
            out[f"{fmt} delay {tau}"] = dict(base, local_sgd_outer_step_delay=tau)
        for tau in range(1, h // 2):
            out[f"{fmt} F=2 delay {tau}"] = dict(base, local_sgd_outer_step_delay=tau, local_sgd_fragments=2)
        out[f"{fmt} F=4 delay 1"] = dict(base, local_sgd_outer_step_delay=1, local_sgd_fragments=4)
    return out


def modes(args):
    """name -> EDiT flags (None: synchronous), in the order of the report."""
    if args.auto:
        return auto_modes(args)
    h, tau = args.interval, args.tau
    out = {
        "bound": dict(local_sgd_sync_interval=10**6),
        # The cost of meeting the other worker every H steps without exchanging anything.
        "bound + barrier every H": dict(local_sgd_sync_interval=10**6, _barrier=True),
        "synchronous": None,
        "EDiT layer-wise": dict(local_sgd_sync_interval=h),
        f"EDiT delay {tau}": dict(local_sgd_sync_interval=h, local_sgd_outer_step_delay=tau,
                                  local_sgd_outer_merge_alpha=0.0),
    }
    if args.alpha_half:
        out[f"EDiT delay {tau}, alpha 0.5"] = dict(local_sgd_sync_interval=h, local_sgd_outer_step_delay=tau,
                                                   local_sgd_outer_merge_alpha=0.5)
    out[f"EDiT F={args.fragments} fragments, delay {args.fragment_delay}"] = dict(
        local_sgd_sync_interval=h, local_sgd_outer_step_delay=args.fragment_delay,
        local_sgd_fragments=args.fragments)
    return out


GATHERS: list = []
"""(kind, perf_counter before, after) of the blocking calls at a sync's start on this rank: the
arrival check (``Arrivals.wait``: every worker announces itself in the store and waits for the
others) and the all-gather of the per-layer norms (``SyncGroup.all_gather``). perf_counter is
CLOCK_MONOTONIC, one clock for every process of this machine, so arrivals of ranks compare."""


def instrument_gathers() -> None:
    """Time those two calls in this process, without changing them: how much of a sync's
    start is waiting for the other worker (skew) and how much the collective itself."""
    from megatron_edit.exchange.arrival import Arrivals
    from megatron_edit.exchange.groups import SyncGroup

    for cls, attr, kind in ((SyncGroup, "all_gather", "gather"), (Arrivals, "wait", "arrive")):
        original = getattr(cls, attr)
        if getattr(original, "_timed", False):
            continue

        def timed(self, *a, _original=original, _kind=kind, **k):
            t0 = time.perf_counter()
            out = _original(self, *a, **k)
            GATHERS.append((_kind, t0, time.perf_counter()))
            return out

        timed._timed = True
        setattr(cls, attr, timed)


def validation_loss(args, ddp, valid_ds) -> float:
    """The held-out samples' loss, shared over every rank (one model on every worker: after the
    run's last, blocking, sync)."""
    losses = bc.main_job_model.validation_losses(args, ddp, valid_ds, dist.get_rank(), dist.get_world_size())
    total = torch.tensor([sum(losses), len(losses)], dtype=torch.float64)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def run(args, name, flags, train_ds, intervals, valid_ds=None):
    """Train (skip + intervals) x H steps, then one more (untimed: the run's last step, a
    blocking sync of everything, so that replicas can be compared and nothing is in flight);
    every rank's step times and sync reports."""
    h = args.interval
    steps = (args.skip_syncs + intervals) * h
    edit = flags is not None
    flags = dict(flags or {})
    barrier = flags.pop("_barrier", False)
    run_args = bc.edit_args(args, use_local_sgd=edit, local_sgd_warmup_steps=0, local_sgd_sync_mode="layerwise",
                            local_sgd_sync_record=bc.record_path("hiding") if edit else None, **flags)
    ddp, optimizer, scheduler, controllers = bc.build(run_args)
    if controllers:  # off the grid: the run's last sync is outside the measured window
        me.set_train_iters(optimizer, steps + 1)
    if args.auto_measured and controllers and controllers[0].auto is not None:
        fix_measurements(controllers[0].auto, args.auto_measured)
    it = bc.batches(run_args, train_ds)
    load = bc.load_average()
    step_times, step_starts, reports = [], [], []
    GATHERS.clear()
    gathers_at = []  # step index (1-based) of each all-gather
    change_at, change_to = (int(args.rate_change.split(":")[0]), args.rate_change.split(":")[1]) \
        if args.rate_change else (None, None)
    if change_at is not None:
        set_rate(os.environ["NETNS_RATE"])
    dist.barrier()
    for i in range(steps + 1):
        if i == change_at:
            set_rate(change_to)
        t0 = time.perf_counter()
        n_gathers = len(GATHERS)
        bc.train_step(run_args, ddp, optimizer, scheduler, next(it))
        if barrier and (i + 1) % h == 0:
            dist.barrier()  # every rank, across the link: a sync that exchanges nothing
        step_times.append(time.perf_counter() - t0)
        step_starts.append(t0)
        gathers_at += [i + 1] * (len(GATHERS) - n_gathers)
        reports += [r for c in controllers for r in c.drain_reports()]
    reports += bc.flush(ddp, controllers)
    auto = controllers[0].auto if controllers and getattr(controllers[0], "auto", None) is not None else None
    loss = validation_loss(run_args, ddp, valid_ds) if valid_ds is not None else None
    decisions = [dict(step=st, delay=ch.outer_step_delay, format=ch.exchange_dtype, fragments=ch.fragments,
                      predicted_exposed=ch.exposed_s / ch.fragments, step_s=m.step_s, exchange_s=m.exchange_s)
                 for st, ch, m in auto.decisions] if auto else []
    in_flight = any(getattr(c, "sync_in_progress", False) for c in controllers)
    identical = bc.replicas_identical(args, ddp) if edit and not name.startswith("bound") else None
    shard_numels = [b.grad_data.numel() // bc.layout(args)["worker_size"] for buf in ddp.buffers for b in buf.buckets]
    global SYNC_GROUP
    if SYNC_GROUP is None:  # the group across workers the exchange uses (DDP's, per bucket group)
        from megatron_edit.mcore import compat

        SYNC_GROUP = compat.inter_instance_group(ddp.bucket_groups[0])
    first = args.skip_syncs * h  # steps 1..first are not measured, nor step steps + 1
    records = bc.close_records(run_args.local_sgd_sync_record) if edit else []
    # The syncs, their settings, bytes and the slowest rank's exposed wait: the per-sync record's
    # (worker 0's records; the max over workers of each sync's slowest rank).
    mine = [r for r in records if r["worker"] == 0 and first < r["step"] <= steps]
    slowest = bc.by_step([r for r in records if first < r["step"] <= steps], "exposed_wait_seconds")
    # Kept from each rank's reports: the mean over ranks of the exposed wait and of the seconds
    # in EDiT code (the record holds each worker's slowest rank only). Every rank has the same
    # syncs (same grid); gather their figures per sync.
    measured = [r for r in reports if first < r.step <= steps]
    n_rep = len(measured)
    counts = bc.gather_floats([n_rep])[:, 0].tolist()
    same = len(set(counts)) == 1
    wait = bc.gather_floats([r.exposed_wait_seconds for r in measured]) if same and n_rep else None
    seconds = bc.gather_floats([r.seconds for r in measured]) if same and n_rep else None
    per_rank = bc.gather_floats(step_times[:steps])  # [world, steps]
    starts = bc.gather_floats(step_starts[:steps])
    # The all-gathers inside the window (one per measured sync's launch on every rank).
    gathers = {}
    for kind in ("arrive", "gather"):
        g = [(a, b) for (k, a, b), s in zip(GATHERS, gathers_at) if k == kind and first < s <= steps]
        if len(set(bc.gather_floats([len(g)])[:, 0].tolist())) == 1 and g:
            gathers[kind] = dict(before=bc.gather_floats([a for a, _ in g]).tolist(),
                                 after=bc.gather_floats([b for _, b in g]).tolist())
    window = per_rank[:, first:].sum(dim=1)  # each rank's time for the measured window
    wall = window.max().item()
    tokens = dist.get_world_size() * args.micro_batch_size * args.seq_length * (steps - first)
    del ddp, optimizer, scheduler, controllers
    return dict(
        mode=name, steps=steps, first=first, step=per_rank.mean(dim=0).tolist(), step_per_rank=per_rank.tolist(),
        starts=starts.tolist(), wall=wall, tokens=tokens, tokens_per_s=tokens / wall, load=load,
        sync_steps=[r["step"] for r in mine], delay=[r["delay"] for r in mine],
        exposed_wait=wait.mean(dim=0).tolist() if wait is not None else [],
        exposed_wait_max=[slowest[r["step"]] for r in mine],
        edit_seconds=seconds.mean(dim=0).tolist() if seconds is not None else [],
        worker_bytes=[r["bytes_sent"] for r in mine], shard_numels=shard_numels,
        identical=identical, left_in_flight=in_flight, gathers=gathers, decisions=decisions,
        formats=[r["exchange_dtype"] for r in mine], fragments=[r["fragments"] for r in mine], loss=loss,
    )


SYNC_GROUP = None


def exchange_alone(shard_numels, reps=7) -> float:
    """Seconds for the sync's all-reduces across the workers, blocking, nothing else running
    (every rank's shards at once: the ranks of a worker share its link)."""
    return bc.exchange_alone(shard_numels, SYNC_GROUP, reps)


def median(xs, default=float("nan")):
    return statistics.median(xs) if xs else default


def analyse(args, r, bound_interval=None):
    """Ordinary step, per-interval time, and the delayed / layer-wise per-sync figures."""
    h, n, first = args.interval, r["steps"], r["first"]
    step = r["step"]  # mean over ranks, index i = step i+1
    window = list(range(first + 1, n + 1))
    starts = list(range(first + 1, n + 1, h))
    intervals = [sum(step[s - 1] for s in range(a, a + h)) for a in starts]
    # Robust to the other jobs' preemptions: each position in the interval at its median.
    robust = sum(median([step[a + p - 1] for a in starts]) for p in range(h))
    # Each interval at its slowest rank: what a sync that cost nothing but a barrier would take.
    per_rank = r["step_per_rank"]
    barrier = sum(max(sum(rank[a - 1:a - 1 + h]) for rank in per_rank) for a in starts)
    out = dict(tokens_per_s=r["tokens_per_s"], step_mean=r["wall"] / (n - first), interval=median(intervals),
               robust_interval=robust, barrier_wall=barrier, syncs=len(r["sync_steps"]))
    grid = [s for s in range(first + h, n + 1, h)]
    tau = max(r["delay"]) if r["delay"] else 0
    fragments = len(r["sync_steps"]) > len(grid)
    if tau and not fragments:  # delayed: launch after s - tau, apply after s
        launch = {s - tau for s in grid}
        flying = {x for s in grid for x in range(s - tau + 1, s)}
        touched = launch | flying | set(grid)
        ordinary = [step[s - 1] for s in window if s not in touched]
        base = median(ordinary)
        out.update(
            base=base, launch=median([step[s - 1] - base for s in launch]),
            flying=median([step[s - 1] - base for s in flying]) if flying else 0.0,
            apply=median([step[s - 1] - base for s in grid]),
        )
    elif r["sync_steps"] and r["mode"] != "synchronous" and not fragments:  # layer-wise: steps s and s+1
        touched = {x for s in grid for x in (s, s + 1)}
        ordinary = [step[s - 1] for s in window if s not in touched]
        base = median(ordinary)
        out.update(base=base, lw_extra=median([step[s - 1] + step[s] - 2 * base for s in grid if s < n]))
    else:
        out.update(base=median([step[s - 1] for s in window]))
    g = r.get("gathers") or {}
    if "gather" in g:  # a sync's start: arrival check, then the all-gather; [rank][sync]
        before = (g.get("arrive") or g["gather"])["before"]
        after = g["gather"]["after"]
        if len(before[0]) == len(after[0]):
            k = len(before[0])
            waits = [[after[i][j] - before[i][j] for i in range(len(before))] for j in range(k)]
            out.update(
                gather_wait=median([statistics.mean(w) for w in waits]),
                gather_latency=median([min(w) for w in waits]),
                arrival_skew=median([max(b[j] for b in before) - min(b[j] for b in before) for j in range(k)]),
            )
    out["exposed_wait"] = median(r["exposed_wait"], 0.0)
    out["exposed_wait_max"] = max(r["exposed_wait_max"]) if r["exposed_wait_max"] else 0.0
    out["edit_seconds"] = median(r["edit_seconds"], 0.0)
    if r.get("loss") is not None:
        out["loss"] = r["loss"]
    if bound_interval is not None:
        out["extra_vs_bound"] = out["interval"] - bound_interval
    return out


def main():
    args = parse_args()
    instrument_gathers()
    h = args.interval
    all_modes = modes(args)
    if args.modes:
        unknown = set(args.modes) - set(all_modes)
        if unknown:
            raise SystemExit(f"--modes: unknown {sorted(unknown)}; known: {list(all_modes)}")
        all_modes = {k: v for k, v in all_modes.items() if k == "bound" or k in args.modes}
    longest = args.skip_syncs + max(args.syncs, args.sync_syncs)
    train_ds, valid_ds = bc.setup(args, train_samples=(longest * h + 8) * 8 * args.micro_batch_size)
    valid_ds = valid_ds if args.auto else None
    lay = bc.layout(args)
    bc.log0(f"hiding benchmark: {args.label}; {args.workers} workers x {lay['worker_size']} ranks, H={h}, "
            f"tau={args.tau}, load {bc.load_average()}")

    if args.calibrate:
        r = run(args, "bound", all_modes["bound"], train_ds, args.syncs)
        alone = exchange_alone(r["shard_numels"])
        s = analyse(args, r)
        bc.log0(f"[calibrate {args.rate}] ordinary step {s['base'] * 1e3:.1f} ms, exchange alone "
                f"{alone * 1e3:.1f} ms = {alone / s['base']:.2f} steps (H/2 = {h / 2:g}); payload "
                f"{sum(r['shard_numels']) * 4 / 1e3:.0f} kB per rank; load {bc.load_average()}")
        dist.destroy_process_group()
        return

    results = {name: [] for name in all_modes}
    order = list(all_modes)
    alone_before = None
    for rep in range(args.repeats):
        k = rep % len(order)
        for name in order[k:] + order[:k]:
            flags = all_modes[name]
            intervals = args.sync_syncs if flags is None else args.syncs
            r = run(args, name, flags, train_ds, intervals, valid_ds)
            results[name].append(r)
            if alone_before is None:
                alone_before = exchange_alone(r["shard_numels"])
            bc.log0(f"[{args.rate}] rep {rep} {name:28s} {r['tokens_per_s']:8.0f} tokens/s "
                    f"{r['wall'] / (r['steps'] - r['first']) * 1e3:6.1f} ms/step  syncs {len(r['sync_steps'])}  "
                    f"load {r['load']}")
    confirm = confirm_rounds(args, all_modes, results, train_ds, valid_ds) if args.confirm else None
    alone_after = exchange_alone(results["bound"][0]["shard_numels"])
    if dist.get_rank() == 0:
        report(args, results, (alone_before, alone_after), confirm)
    dist.destroy_process_group()


def best_fixed(results) -> str:
    """The grid's fixed setting with the highest median tokens/s (the same on every rank: each
    run's tokens/s is over the slowest rank's gathered time)."""
    fixed = [n for n in results if not n.startswith("bound") and n != "EDiT auto"]
    return max(fixed, key=lambda n: median([r["tokens_per_s"] for r in results[n]]))


def confirm_rounds(args, all_modes, results, train_ds, valid_ds) -> dict:
    """--confirm N: N more rounds of the bound, the auto run and the grid's best fixed setting
    (rotated order). The best of a grid of noisy points is chosen by its luck as well as its
    setting; these rounds measure it again, so the comparison with the auto run is unbiased."""
    best = best_fixed(results)
    names = ["bound", "EDiT auto", best]
    out = dict(best=best, runs={n: [] for n in names})
    for rnd in range(args.confirm):
        k = rnd % len(names)
        for name in names[k:] + names[:k]:
            flags = all_modes[name]
            r = run(args, name, flags, train_ds, args.syncs, valid_ds)
            out["runs"][name].append(dict(tokens_per_s=r["tokens_per_s"], loss=r["loss"], load=r["load"]))
            bc.log0(f"[{args.rate}] confirm {rnd} {name:28s} {r['tokens_per_s']:8.0f} tokens/s  load {r['load']}")
    return out


def confirm_summary(confirm) -> str:
    """The confirmation rounds: per round, the auto run's tokens/s over the best fixed setting's
    and over the bound's; the median of the per-round ratios."""
    runs, best = confirm["runs"], confirm["best"]
    pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["EDiT auto"], runs[best])]
    bound = [r["tokens_per_s"] for r in runs["bound"]]
    auto_b = [a["tokens_per_s"] / b for a, b in zip(runs["EDiT auto"], bound)]
    best_b = [a["tokens_per_s"] / b for a, b in zip(runs[best], bound)]
    f = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    return (f"confirmation ({len(pairs)} rounds of the bound, the auto run and {best}, rotated): auto / {best} "
            f"{median(pairs):.2f} [{f(pairs)}]; vs bound: auto {median(auto_b):.2f} [{f(auto_b)}], "
            f"{best} {median(best_b):.2f} [{f(best_b)}]")


def auto_summary(results, stats) -> str:
    """--auto: what the auto run chose (rank 0's decisions, each repetition), its tokens/s
    against the best fixed setting of the grid, and its predicted exposed wait per sync against
    the measured one (delayed: SyncReport.exposed_wait_seconds; no delay: the time in EDiT code)."""
    fixed = {n: s for n, s in stats.items() if not n.startswith("bound") and n != "EDiT auto"}
    best = max(fixed, key=lambda n: fixed[n]["tokens_per_s"])
    auto = stats["EDiT auto"]
    lines = [f"auto: {auto['tokens_per_s'] / fixed[best]['tokens_per_s']:.2f} of the best fixed setting's "
             f"tokens/s ({best}: {fixed[best]['ratio']:.2f} of the bound; auto {auto['ratio']:.2f})"]
    if auto.get("loss") is not None and fixed[best].get("loss") is not None:
        lines.append(f"validation loss after the run: auto {auto['loss']:.4f}, {best} {fixed[best]['loss']:.4f} "
                     f"({(auto['loss'] / fixed[best]['loss'] - 1) * 100:+.2f}%)")
    for i, r in enumerate(results["EDiT auto"]):
        chosen = "; ".join(f"after step {d['step']}: delay {d['delay']}, {d['format']}, F={d['fragments']} "
                           f"(step {d['step_s'] * 1e3:.1f} ms, "
                           + ", ".join(f"{f} {x * 1e3:.1f}" for f, x in d["exchange_s"].items())
                           + f" ms; predicted exposed {d['predicted_exposed'] * 1e3:.1f} ms)"
                           for d in r["decisions"])
        delayed = any(r["delay"])
        measured = median(r["exposed_wait"] if delayed else r["edit_seconds"], 0.0)
        lines.append(f"auto repetition {i}: {chosen or 'no decision'}; in the window: formats "
                     f"{sorted(set(r['formats']))}, delays {sorted(set(r['delay']))}, fragments "
                     f"{sorted(set(r['fragments']))}, measured exposed "
                     f"{measured * 1e3:.1f} ms per sync")
    return "\n".join(lines)


def _ms(s) -> str:
    return f"{s * 1e3:.1f}"


def _stats(args, results):
    """(every mode's figures, the bound's tokens/s, the bound's ordinary step): each figure the
    median over repetitions (of a median over syncs / steps where it is one), against the bound."""
    bound_runs = [analyse(args, r) for r in results["bound"]]
    bound_interval = median([b["interval"] for b in bound_runs])
    bound_tps = median([b["tokens_per_s"] for b in bound_runs])
    bound_robust = median([b["robust_interval"] for b in bound_runs])
    bound_barrier_tps = median([r["tokens"] / b["barrier_wall"] for r, b in zip(results["bound"], bound_runs)])
    bound_base = median([b["base"] for b in bound_runs])
    stats = {}
    for name, runs in results.items():
        per = [analyse(args, r, bound_interval) for r in runs]
        keys = set().union(*per)
        # Each figure: the median over repetitions (of a median over syncs / steps where it is one).
        agg = {k: median([s[k] for s in per if k in s]) for k in keys}
        agg.update(tokens_per_s_all=[s["tokens_per_s"] for s in per],
                   ratio_all=[s["tokens_per_s"] / b["tokens_per_s"] for s, b in zip(per, bound_runs)],
                   identical=[r["identical"] for r in runs], left_in_flight=[r["left_in_flight"] for r in runs],
                   loads=[r["load"] for r in runs])
        agg["ratio"] = agg["tokens_per_s"] / bound_tps
        agg["ratio_robust"] = bound_robust / agg["robust_interval"]
        agg["ratio_barrier"] = agg["tokens_per_s"] / bound_barrier_tps
        stats[name] = agg
    return stats, bound_tps, bound_base


def _tables(stats, h):
    """(headers, rows, cost headers, cost rows): tokens/s against the bound, and the cost per sync."""
    ms = _ms
    headers = ["run", "tokens/s [min-max]", "vs bound [per repetition]", "vs bound, per-position medians",
               "vs bound with a barrier per interval", "step ms (window mean)", "ordinary step ms", "syncs measured"]
    rows = []
    for name, s in stats.items():
        quiet = name.startswith("bound") or name == "synchronous"
        rows.append([
            name,
            f"{s['tokens_per_s']:,.0f} [{min(s['tokens_per_s_all']):,.0f}-{max(s['tokens_per_s_all']):,.0f}]",
            f"{s['ratio']:.2f} [" + ", ".join(f"{x:.2f}" for x in s["ratio_all"]) + "]",
            f"{s['ratio_robust']:.2f}", f"{s['ratio_barrier']:.2f}",
            ms(s["step_mean"]), ms(s["base"]), "-" if quiet else str(int(s["syncs"])),
        ])
    cheaders = ["run", "extra per sync vs bound ms",
                "sync start (arrival check + all-gather): wait / arrival skew / last arriver ms",
                "launch step +ms", "steps in flight +ms", "apply step +ms", "exposed wait ms (max rank)",
                "in EDiT code ms / sync"]
    crows = []
    for name, s in stats.items():
        if name == "bound":
            continue
        if name.startswith("bound"):
            crows.append([name, ms(s["extra_vs_bound"]), "-", "-", "-", "-", "-", "-"])
            continue
        if name == "synchronous":
            crows.append([name, f"{ms(s['extra_vs_bound'] / h)} per step", "-", "-", "-", "-", "-", "-"])
            continue
        delayed = "launch" in s
        lw = "lw_extra" in s
        crows.append([
            name, ms(s["extra_vs_bound"]),
            (f"{ms(s['gather_wait'])} / {ms(s['arrival_skew'])} / {ms(s['gather_latency'])}"
             if "gather_wait" in s else "-"),
            ms(s["launch"]) if delayed else "-", ms(s["flying"]) if delayed else "-",
            ms(s["apply"]) if delayed else "-",
            (f"{ms(s['exposed_wait'])} ({ms(s['exposed_wait_max'])})" if "delay" in name
             else f"{ms(s['lw_extra'])} (steps s, s+1)" if lw else "-"),
            ms(s["edit_seconds"]),
        ])
    return headers, rows, cheaders, crows


def _summary(args, results, stats, alone, bound_base, confirm, payload, procs, loads) -> str:
    """The text under the tables: the setting, the exchange alone, the load, what each column
    means, any problem, and the auto and confirmation rounds' lines."""
    h, ms = args.interval, _ms
    a0, a1 = alone
    problems = [f"{name}: replicas differ after the run's last (blocking) sync" for name, s in stats.items()
                if any(x is False for x in s["identical"])]
    problems += [f"{name}: an exchange left in flight at the end" for name, s in stats.items()
                 if any(s["left_in_flight"])]
    summary = (
        f"{args.label}; {args.workers} workers x {procs} ranks, H={h}, "
        f"{args.syncs} measured intervals per EDiT mode ({args.sync_syncs} for synchronous) after {args.skip_syncs} "
        f"unmeasured, {args.repeats} repetitions in rotated order (median shown); fp32 exchange, pseudo-gradient "
        f"payload {payload / 1e3:.0f} kB per rank per sync ({len(results['bound'][0]['shard_numels'])} buckets), "
        f"{procs * payload / 1e3:.0f} kB per worker on its link.\n"
        f"exchange alone (the same all-reduces, every rank at once, blocking, no compute): {ms(a0)} ms before, "
        f"{ms(a1)} ms after the modes = {a0 / bound_base:.1f} / {a1 / bound_base:.1f} ordinary steps of the "
        f"bound ({ms(bound_base)} ms; H/2 = {h / 2:g}).\n"
        f"load average (1, 5, 15 min) when each mode started: from {loads[0]} to {loads[-1]}; "
        f"at the end {bc.load_average()}.\n"
        "vs bound = tokens/s (the slowest rank's time for the window) over the bound's, medians over "
        "repetitions; per-position medians = the bound's H-step interval over the mode's, each step position "
        "in the interval at its median over intervals (robust to preemption by other jobs); with a barrier per "
        "interval = against the bound's own steps with every interval at its slowest rank (what a sync that "
        "cost nothing but waiting for the other worker would take).\n"
        "extra per sync vs bound = median interval minus the bound's; sync start = the sync's blocking part "
        "before its exchange is launched (the arrival check in the store, the all-gather of the per-layer norms): "
        "mean over ranks of the time in it / spread of the ranks' arrivals / the last arriver's time, medians "
        "over syncs; launch, in-flight and apply steps above the run's own "
        "ordinary steps; exposed wait = SyncReport.exposed_wait_seconds (mean over ranks, median over syncs; "
        "max rank: the per-sync record's exposed_wait_seconds, the slowest rank's, largest over syncs; "
        "layer-wise: steps s and s+1 above its ordinary step, as bench_overlap)."
        + ("\nPROBLEMS: " + "; ".join(problems) if problems else "")
    )
    if args.auto and "EDiT auto" in stats:
        summary += "\n" + auto_summary(results, stats)
    if confirm:
        summary += "\n" + confirm_summary(confirm)
    return summary


def _plot(args, stats, alone, bound_base, procs, loads) -> None:
    """hiding<suffix>.png: each mode's tokens/s against the bound (range over repetitions)."""
    h, ms = args.interval, _ms
    a0 = alone[0]
    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    names = list(stats)
    ys = [stats[n]["ratio"] for n in names]
    lo = [max(0.0, y - min(stats[n]["ratio_all"])) for y, n in zip(ys, names)]
    hi = [max(0.0, max(stats[n]["ratio_all"]) - y) for y, n in zip(ys, names)]
    colors = ["0.5" if n.startswith("bound") else "tab:red" if n == "synchronous" else
              "tab:blue" if n == "EDiT layer-wise" else "tab:green" for n in names]
    x = list(range(len(names)))
    ax.bar(x, ys, yerr=[lo, hi], capsize=3, color=colors, label="tokens/s vs bound (median, range over repetitions)")
    ax.plot(x, [stats[n]["ratio_robust"] for n in names], "kD", markersize=4, label="per-position medians")
    for i, y in enumerate(ys):
        ax.text(i + 0.1, y + 0.02, f"{y:.2f}", ha="left", fontsize=8)
    ax.axhline(0.95, color="k", linestyle="--", linewidth=0.8, alpha=0.6)
    ax.set_xticks(x)
    ax.set_xticklabels([n.replace("EDiT ", "EDiT\n").replace(", ", "\n").replace(" + ", "\n+ ") for n in names],
                       fontsize=7)
    ax.set_ylabel("tokens/s vs no-communication bound")
    ax.set_title(f"Hiding the exchange: {args.label}, {args.workers}x{procs} ranks, H={h}\nexchange alone "
                 f"{ms(a0)} ms = {a0 / bound_base:.1f} steps; dashed: 0.95; load {loads[0].split()[0]}-"
                 f"{loads[-1].split()[0]}", fontsize=9)
    ax.set_ylim(0, max(1.15, max(max(s["ratio_all"]) for s in stats.values()) + 0.1))
    ax.legend(fontsize=7, loc="upper right")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(bc.plot_path(f"hiding{args.suffix}.png"), dpi=110)


def report(args, results, alone, confirm=None):
    """The tables, the summary, hiding<suffix>.md / .json / .png."""
    h = args.interval
    stats, bound_tps, bound_base = _stats(args, results)
    headers, rows, cheaders, crows = _tables(stats, h)
    payload = sum(results["bound"][0]["shard_numels"]) * 4
    procs = dist.get_world_size() // args.workers
    loads = sorted({load for s in stats.values() for load in s["loads"]}, key=lambda x: float(x.split()[0]))
    summary = _summary(args, results, stats, alone, bound_base, confirm, payload, procs, loads)
    text, ctext = bc.table(headers, rows), bc.table(cheaders, crows)
    print(f"\nhiding the exchange: tokens/s against the no-communication bound\n{text}\n\n"
          f"cost per sync\n{ctext}\n{summary}")
    suffix = args.suffix
    bc.write_result(f"hiding{suffix}.md", bc.table(headers, rows, markdown=True) + "\n\n"
                    + bc.table(cheaders, crows, markdown=True) + "\n\n" + summary.replace("\n", "  \n") + "\n")
    bc.write_result(f"hiding{suffix}.json", json.dumps(dict(
        label=args.label, rate=args.rate, interval=h, tau=args.tau, payload=payload,
        procs_per_worker=procs, alone=alone, bound_tokens_per_s=bound_tps, stats=stats,
        runs=results, confirm=confirm, rate_change=args.rate_change)))
    _plot(args, stats, alone, bound_base, procs, loads)
    print(f"wrote {bc.plot_path(f'hiding{suffix}.md')}, .json, .png")


if __name__ == "__main__":
    bc.run_main(main)
