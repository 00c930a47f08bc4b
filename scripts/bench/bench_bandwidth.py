"""Bandwidth benchmark: tokens/s over bandwidth-limited links between workers, on one machine.

    # as root (network namespaces, tc):
    .venv/bin/python scripts/bench/bench_bandwidth.py [--rates none 1gbit 100mbit] [--repeats 5]
    .venv/bin/python scripts/bench/bench_bandwidth.py --workers 4 --procs-per-worker 1   # through a bridge

For each rate, scripts/bench/netns_cluster.sh puts each worker's ranks in its own network namespace,
joins the workers by veth links (through a bridge for more than two) limited by tc's
token-bucket filter in both directions, checks the link with a TCP stream, and runs this script
under torchrun in every namespace (``--inner``). Ranks of one worker talk to each other over the
namespace's loopback at full speed, as inside a node; gloo between workers uses the links. Runs,
same model and data:
  synchronous       unpatched Megatron: every step all-reduces each gradient shard across workers;
  EDiT step-end     sync every H steps, blocking exchange after the optimizer step;
  EDiT layer-wise   sync every H steps, exchange bucket by bucket during the next forward pass;
  A-EDiT            sync every T seconds (T = H x the no-communication step time), layer-wise;
  EDiT layer-wise int8 + EF, int4 + EF
                    layer-wise with the quantized exchange and error feedback (``--exchange-dtypes``);
  no-comm bound     EDiT with H larger than the run: the workers never talk (upper bound).
tokens/s = tokens of all ranks over the slowest rank's wall time. Bytes: payload counted by
wrapping torch.distributed (bench_common.TrafficCounter: synchronous Megatron's all-reduces too,
which no record holds) and what actually left each worker's link (the interface's tx_bytes: TCP/IP
framing and gloo's algorithm included). The syncs of the timed window: worker 0's per-sync record
(``--local-sgd-sync-record``). Writes
scripts/bench/results/bandwidth.{png,md,json}; bench_model.py fits its step-time model to the JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BASE_MODES = ("synchronous", "EDiT step-end", "EDiT layer-wise", "A-EDiT")
MODES = BASE_MODES + ("no-comm bound",)  # with --exchange-dtypes: quantized modes before the bound


def quantized_mode(dtype: str) -> str:
    return f"EDiT layer-wise {dtype} + EF"


def modes_for(dtypes) -> tuple:
    return BASE_MODES + tuple(quantized_mode(d) for d in dtypes) + ("no-comm bound",)


def mode_dtype(mode: str):
    """The exchange dtype of a quantized mode, else None."""
    m = re.fullmatch(r"EDiT layer-wise (\w+) \+ EF", mode)
    return m.group(1) if m else None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", nargs="+", default=["none", "1gbit", "100mbit"],
                        help="tbf rates of the links (none: unlimited veth)")
    parser.add_argument("--procs-per-worker", type=int, default=2)
    parser.add_argument("--interval", type=int, default=8, help="H of EDiT")
    parser.add_argument("--syncs", type=int, default=3, help="syncs per timed EDiT / A-EDiT run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps before timing")
    parser.add_argument("--repeats", type=int, default=5,
                        help="interleaved repetitions of every run; the median is reported")
    parser.add_argument("--exchange-dtypes", nargs="*", default=["int8", "int4"],
                        help="quantized exchange formats run layer-wise with error feedback, beside fp32 "
                             "(none: fp32 only)")
    parser.add_argument("--name", default="bandwidth",
                        help="results as scripts/bench/results/<name>.{md,png,json} and <name>_<rate>.json")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return parser.parse_known_args(argv)


# ------------------------------------------------------------------ inside the namespaces
def tx_bytes() -> int:
    """Bytes sent by this namespace's link to the other workers (-1 outside netns_cluster)."""
    try:
        with open("/sys/class/net/edw/statistics/tx_bytes") as f:
            return int(f.read())
    except OSError:
        return -1


def measure(args, mode, train_ds, counter, t_step):
    """One timed run of ``mode``: tokens/s, bytes, and whether replicas agree at the next sync."""
    import torch.distributed as dist

    import bench_common as bc

    steps = args.syncs * args.interval
    run_args = bc.edit_args(
        args, use_local_sgd=mode != "synchronous", local_sgd_warmup_steps=0,
        local_sgd_sync_interval=10**6 if mode == "no-comm bound" else args.interval,
        local_sgd_sync_mode="step_end" if mode == "EDiT step-end" else "layerwise",
        local_sgd_async=mode == "A-EDiT",
    )
    if mode_dtype(mode):
        run_args.local_sgd_exchange_dtype = mode_dtype(mode)
        run_args.local_sgd_exchange_error_feedback = True
    if mode == "A-EDiT":  # A-EDiT's flags only with A-EDiT (elsewhere they are refused)
        run_args.local_sgd_sync_time = args.interval * (t_step or 0.05)
        run_args.local_sgd_min_total_global_steps = 1
    recorded = mode not in ("synchronous", "no-comm bound")  # (the bound never syncs: no record)
    run_args.local_sgd_sync_record = bc.record_path("bandwidth") if recorded else None
    ddp, optimizer, scheduler, controllers = bc.build(run_args)
    it = bc.batches(run_args, train_ds)
    lay = bc.layout(args)
    forward = []

    def timed_forward(data_iterator, model):
        t = time.perf_counter()
        out = bc.main_job_model.forward_step(data_iterator, model)
        forward.append(time.perf_counter() - t)
        return out

    for _ in range(args.warmup):
        bc.train_step(run_args, ddp, optimizer, scheduler, next(it))
    for c in controllers:
        c.drain_reports()
    done, syncs = 0, 0  # (syncs: the loop's own count, A-EDiT stops on it; the table's is the record's)
    counter.reset()
    counter.enabled = True
    tx0 = tx_bytes()
    dist.barrier()
    t0, since = time.perf_counter(), time.time()
    while True:
        if mode == "A-EDiT":
            # Stop on a sync count (identical everywhere), never on a local step count.
            if syncs + controllers[0].sync_in_progress >= args.syncs:
                break
        elif done >= steps:
            break
        bc.train_step(run_args, ddp, optimizer, scheduler, next(it), forward_step=timed_forward)
        done += 1
        syncs += len([r for c in controllers for r in c.drain_reports()])
    syncs += len(bc.flush(ddp, controllers))
    elapsed, until = time.perf_counter() - t0, time.time()
    counter.enabled = False
    tx = tx_bytes() - tx0 if tx0 >= 0 else -1
    identical = None
    if mode in ("EDiT step-end", "EDiT layer-wise") or mode_dtype(mode):  # untimed: on to the next sync, then compare
        while controllers[0].steps_done % args.interval:
            bc.train_step(run_args, ddp, optimizer, scheduler, next(it))
        bc.flush(ddp, controllers)
    if mode != "no-comm bound":
        identical = bc.replicas_identical(args, ddp)
    if recorded:  # the syncs that ended in the timed window: worker 0's records (its ``time``: rank 0's clock)
        records = bc.close_records(run_args.local_sgd_sync_record)
        syncs = sum(1 for r in records if r["worker"] == 0 and since <= r["time"] <= until + 1e-3)
    wall = bc.max_over_ranks(elapsed)
    per_rank = bc.gather_floats([done, counter.total(), tx if lay["rank_in_worker"] == 0 else 0])
    total_steps = per_rank[:, 0].sum().item()
    tokens = total_steps * args.micro_batch_size * args.seq_length
    steps_per_rank = total_steps / dist.get_world_size()
    return dict(
        tokens_per_s=tokens / wall, wall=wall, steps_per_rank=per_rank[:, 0].tolist(), syncs=syncs,
        payload_per_rank_step=per_rank[:, 1].sum().item() / total_steps,
        tx_per_worker_step=per_rank[:, 2].sum().item() / args.workers / steps_per_rank if tx >= 0 else None,
        step_s=wall / steps_per_rank,
        forward_s=bc.gather_floats([statistics.median(forward)]).mean().item(),
        sync_time=run_args.local_sgd_sync_time if mode == "A-EDiT" else None, identical=identical,
        buckets=sum(len(buf.buckets) for buf in ddp.buffers), params=sum(p.numel() for p in ddp.parameters()),
    )


def inner(own, rest):
    import torch.distributed as dist

    import bench_common as bc

    args = bc.parse_args(argparse.ArgumentParser(add_help=False), rest)
    for key, value in vars(own).items():
        setattr(args, key, value)
    if "GROUP_WORLD_SIZE" in os.environ:  # netns_cluster.sh: one torchrun node per worker
        args.workers = int(os.environ["GROUP_WORLD_SIZE"])
    steps = args.syncs * args.interval
    modes = modes_for(own.exchange_dtypes)
    runs = args.repeats * len(modes)
    train_ds, _ = bc.setup(args, train_samples=(steps * 2 + 16 + args.warmup) * runs * 4 * args.micro_batch_size)
    counter = bc.TrafficCounter(bc.worker_of_rank(args))
    counter.enabled = False
    lay = bc.layout(args)
    rate = os.environ.get("NETNS_RATE", "none")
    runs = {mode: [] for mode in modes}
    t_step = None
    order = ["no-comm bound"] + [m for m in modes if m != "no-comm bound"]
    for rep in range(args.repeats):
        # Interleaved: each repetition runs every mode once, starting one mode later.
        for mode in order[rep % len(order):] + order[:rep % len(order)] if rep else order:
            r = measure(args, mode, train_ds, counter, t_step)
            if mode == "no-comm bound" and t_step is None:
                t_step = r["step_s"]  # A-EDiT's T = H x this
            runs[mode].append(r)
            bc.log0(f"[{rate}] rep {rep} {mode:26s} {r['tokens_per_s']:8.0f} tokens/s  {r['step_s'] * 1e3:6.1f} "
                    f"ms/step  syncs {r['syncs']}  steps {'/'.join(str(int(x)) for x in r['steps_per_rank'])}  "
                    f"load {bc.load_average()}")
    counter.close()
    results = {}
    for mode, reps in runs.items():
        best = sorted(reps, key=lambda r: r["tokens_per_s"])[len(reps) // 2]  # the median run
        results[mode] = dict(best, tokens_per_s_all=[r["tokens_per_s"] for r in reps],
                             identical_all=[r["identical"] for r in reps])
    if dist.get_rank() == 0 and args.out:
        any_run = runs["synchronous"][0]
        with open(args.out, "w") as f:
            json.dump(dict(rate=rate, workers=args.workers, procs_per_worker=lay["worker_size"],
                           interval=args.interval, params=any_run["params"], buckets=any_run["buckets"],
                           tokens_per_step_per_rank=args.micro_batch_size * args.seq_length,
                           repeats=args.repeats, timed_steps=steps, load=bc.load_average(), modes=results),
                      f, indent=1)
    dist.destroy_process_group()


# ------------------------------------------------------------------ the driver
def driver(own, rest):
    sys.path.insert(0, HERE)
    import bench_common as bc

    workers = 2
    if "--workers" in rest:
        workers = int(rest[rest.index("--workers") + 1])
    runs = []
    for rate in own.rates:
        out = bc.plot_path(f"{own.name}_{rate}.json")
        cmd = ["bash", os.path.join(HERE, "netns_cluster.sh"), "--workers", str(workers),
               "--procs-per-worker", str(own.procs_per_worker), "--rate", rate, "--check", "--python", sys.executable,
               "--", os.path.join(HERE, "bench_bandwidth.py"), "--inner", "--out", out,
               "--interval", str(own.interval), "--syncs", str(own.syncs), "--warmup", str(own.warmup),
               "--repeats", str(own.repeats), "--exchange-dtypes", *own.exchange_dtypes, *rest]
        print("$ " + " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = [ln for ln in proc.stdout.splitlines()
                 if not re.search(r"Warning|warn\(|return func|^W\d{4}|\*{5}|OMP_NUM_THREADS", ln)]
        print("\n".join(lines[-20:]), flush=True)
        if proc.returncode:
            raise SystemExit(f"rate {rate}: the cluster run failed ({proc.returncode})")
        check = re.search(r"link check .*: ([\d.]+) Mbit/s", proc.stdout)
        with open(out) as f:
            result = json.load(f)
        result["measured_mbit"] = float(check.group(1)) if check else None
        runs.append(result)
    with open(bc.plot_path(f"{own.name}.json"), "w") as f:
        json.dump(runs, f, indent=1)
    report(bc, runs, own.name)


def report(bc, runs, name="bandwidth"):
    modes = [m for m in runs[0]["modes"]]
    headers = ["run"]
    for r in runs:
        label = "unlimited veth" if r["rate"] == "none" else f"tbf {r['rate']}"
        headers += [f"{label} tokens/s [min-max]", "vs sync"]
    rows = []
    for mode in modes:
        row = [mode]
        for r in runs:
            m, base = r["modes"][mode], r["modes"]["synchronous"]["tokens_per_s"]
            spread = m.get("tokens_per_s_all", [m["tokens_per_s"]])
            row += [f"{m['tokens_per_s']:,.0f} [{min(spread):,.0f}-{max(spread):,.0f}]",
                    f"{m['tokens_per_s'] / base:.2f}"]
        rows.append(row)
    r0 = runs[0]
    bytes_rows = []
    for mode in modes:
        m = r0["modes"][mode]
        tx = [r["modes"][mode]["tx_per_worker_step"] for r in runs]
        tx = [t for t in tx if t is not None]
        tx_cell = f"{statistics.median(tx) / 1e3:,.1f}" if tx else "-"
        equal = [x for r in runs for x in r["modes"][mode].get("identical_all", []) if x is not None]
        bytes_rows.append([mode, f"{m['payload_per_rank_step'] / 1e3:,.1f}", tx_cell,
                           " / ".join(str(r["modes"][mode]["syncs"]) for r in runs),
                           "-" if not equal else f"{sum(equal)}/{len(equal)}"])
    links = ", ".join(f"{r['rate']}: {r['measured_mbit']:.0f} Mbit/s" for r in runs if r.get("measured_mbit"))
    notes = (
        f"{r0['workers']} workers x {r0['procs_per_worker']} ranks (one network namespace per worker), "
        f"{r0['params']:,}-parameter GPT, fp32 exchange unless named, H={r0['interval']}, A-EDiT T = H x no-comm step time; "
        f"median of {r0.get('repeats', 1)} interleaved runs of {r0.get('timed_steps', '?')} timed steps "
        "(A-EDiT: of the same number of syncs). "
        f"Links (TCP check w0->w1): {links}. Load average during the runs: "
        + ", ".join(f"{r['rate']}: {r['load']}" for r in runs) + "."
    )
    text = bc.table(headers, rows)
    bheaders = ["run", "payload kB/step/rank", "link tx kB/step/worker", "syncs per run (per rate)",
                "replicas equal at a sync"]
    btext = bc.table(bheaders, bytes_rows)
    print(f"\nthroughput over bandwidth-limited links\n{text}\n\nbytes per step\n{btext}\n{notes}")
    bc.write_result(f"{name}.md", bc.table(headers, rows, markdown=True) + "\n\n"
                    + bc.table(bheaders, bytes_rows, markdown=True) + "\n\n" + notes + "\n")

    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.8 / len(modes)
    for i, mode in enumerate(modes):
        ys = [r["modes"][mode]["tokens_per_s"] for r in runs]
        lo = [y - min(r["modes"][mode].get("tokens_per_s_all", [y])) for y, r in zip(ys, runs)]
        hi = [max(r["modes"][mode].get("tokens_per_s_all", [y])) - y for y, r in zip(ys, runs)]
        ax.bar([x + i * width for x in range(len(runs))], ys, width, yerr=[lo, hi], capsize=2, label=mode)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(runs))])
    ax.set_xticklabels([("unlimited" if r["rate"] == "none" else r["rate"])
                        + (f"\n(measured {r['measured_mbit']:.0f} Mbit/s)" if r.get("measured_mbit") else "")
                        for r in runs], fontsize=8)
    ax.set_ylabel("tokens/s (all workers)")
    ax.set_title(f"{r0['workers']} workers in network namespaces, tbf-limited links, H={r0['interval']}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(bc.plot_path(f"{name}.png"), dpi=110)
    print(f"wrote {bc.plot_path(name + '.png')}, {bc.plot_path(name + '.md')}, {bc.plot_path(name + '.json')}")


def main():
    own, rest = parse_args()
    if own.inner:
        sys.path.insert(0, HERE)
        inner(own, rest)
    else:
        driver(own, rest)


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    import bench_common as bc

    bc.run_main(main)
