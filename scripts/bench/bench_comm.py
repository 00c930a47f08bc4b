"""Communication benchmark: bytes across the sync group per training step, counted.

    torchrun --nproc_per_node 4 scripts/bench/bench_comm.py [--steps 64] [--intervals 1 4 16 64]

The main job's GPT (2 workers x 2 shards, CPU, gloo) trains ``--steps`` steps with
  synchronous   unpatched Megatron, same partial distributed optimizer: every step each rank
                all-reduces its gradient shard of every bucket across the workers;
  EDiT H=...    no warmup, one exchange of each fp32 pseudo-gradient shard every H steps
                (layer-wise), plain mean;
  EDiT H=... +penalty  the same with anomaly elimination and norm-weighted averaging, which adds
                one small all-gather of per-layer norms per sync;
  EDiT H=16 <dtype>  the quantized exchange (``--dtypes``): a reduce-scatter of quantized chunks
                (all-to-all), an fp32 sum, an all-gather of the requantized result.
Every ``torch.distributed`` collective whose group spans two workers is counted by wrapping
``torch.distributed`` (and megatron-core's bucket collectives) in this process; nothing else is
assumed. The table gives bytes per step per rank as ring algorithms send them (see
bench_common.TrafficCounter) and the ratio against synchronous. The syncs, and the bytes EDiT says
it sent, come from each EDiT run's per-sync record (``--local-sgd-sync-record``): "= record
bytes" checks every worker's record against what was counted on its ranks.
Writes scripts/bench/results/comm.png and scripts/bench/results/comm.md.
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

import bench_common as bc


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", dest="bench_steps", type=int, default=64,
                        help="training steps per run (a multiple of every H)")
    parser.add_argument("--intervals", type=int, nargs="+", default=[1, 4, 16, 64], help="H values of EDiT")
    parser.add_argument("--no-penalty-runs", action="store_true", help="skip the runs with the penalty on")
    parser.add_argument("--dtypes", nargs="*", default=["bf16", "fp8", "int8", "int4"],
                        help="quantized exchange formats to run at H=--dtype-interval")
    parser.add_argument("--dtype-interval", type=int, default=16)
    parser.add_argument("--megatron-fsdp", action="store_true",
                        help="also Megatron-FSDP (HSDP: a worker is an instance) synchronous and EDiT at "
                             "H=--dtype-interval; results in comm_fsdp.md (megatron-core 0.16.x)")
    return bc.parse_args(parser)


def measure(args, run_args, counter, train_ds, name):
    counter.enabled = False
    edit = bool(run_args.use_local_sgd)
    if edit:
        run_args.local_sgd_sync_record = bc.record_path(name.replace(" ", "_").replace("=", ""))
    ddp, optimizer, scheduler, controllers = bc.build(run_args)
    it = bc.batches(run_args, train_ds)
    counter.reset()
    counter.enabled = True
    for step in range(args.bench_steps):
        counter.step = step
        bc.train_step(run_args, ddp, optimizer, scheduler, next(it))
    fsdp = getattr(run_args, "use_megatron_fsdp", False)
    if fsdp:  # the last sync completes, and no parameter all-gather is left in flight
        for c in controllers:
            c.flush()
        ddp.module.synchronize_param_gather()
    else:
        bc.flush(ddp, controllers)  # the last layer-wise sync completes here (counted)
    counter.enabled = False
    size = bc.layout(args)["worker_size"]
    if fsdp:  # each rank's fp32 shard of every parameter
        shard_bytes = sum(p.numel() for p in ddp.parameters()) * 4 // size
    else:
        shard_bytes = sum(b.grad_data.numel() * 4 // size for buf in ddp.buffers for b in buf.buckets)
    by_name = {}
    for _, collective, nbytes in counter.events:
        by_name.setdefault(collective, [0, 0])
        by_name[collective][0] += 1
        by_name[collective][1] += nbytes
    # The counter is kept: it counts the wire (every collective across workers, synchronous
    # Megatron's too), which the record does not; EDiT's syncs and bytes are the record's.
    counted = {}  # worker -> bytes counted on its ranks
    for rank, total in enumerate(bc.gather_floats([counter.total()])[:, 0].tolist()):
        worker = counter.worker_of_rank[rank]
        counted[worker] = counted.get(worker, 0) + int(total)
    out = dict(total=counter.total(), collectives=counter.count(), by_name=by_name, shard_bytes=shard_bytes,
               identical=bc.replicas_identical(args, ddp), counted=counted, syncs=0, record_bytes=None)
    if edit:
        records = bc.close_records(run_args.local_sgd_sync_record)
        out.update(syncs=sum(1 for r in records if r["worker"] == 0), record_bytes=bc.per_worker(records, "bytes_sent"))
    return out


def main():
    args = parse_args()
    if any(args.bench_steps % h for h in args.intervals):
        raise SystemExit(f"--steps {args.bench_steps} must be a multiple of every H {args.intervals}")
    train_ds, _ = bc.setup(args, train_samples=(args.bench_steps + 8) * 4 * args.micro_batch_size * 4)
    counter = bc.TrafficCounter(bc.worker_of_rank(args))
    runs = [("synchronous", None, False, bc.edit_args(args, use_local_sgd=False))]
    for penalty in (False, True):
        if penalty and args.no_penalty_runs:
            continue
        for h in args.intervals:
            name = f"EDiT H={h}" + (" +penalty" if penalty else "")
            run_args = bc.edit_args(
                args, use_local_sgd=True, local_sgd_sync_interval=h, local_sgd_warmup_steps=0,
                local_sgd_sync_mode="layerwise", local_sgd_skip_anomaly=penalty,
                local_sgd_pseudo_gradnorm_reduce=penalty,
            )
            runs.append((name, h, penalty, run_args))
    for dtype in args.dtypes:
        h = args.dtype_interval
        run_args = bc.edit_args(args, use_local_sgd=True, local_sgd_sync_interval=h, local_sgd_warmup_steps=0,
                                local_sgd_sync_mode="layerwise", local_sgd_exchange_dtype=dtype,
                                local_sgd_exchange_error_feedback=True)
        runs.append((f"EDiT H={h} {dtype}+EF", h, False, run_args))
    if args.megatron_fsdp:
        h = args.dtype_interval
        runs.append(("Megatron-FSDP synchronous", None, False,
                     bc.edit_args(args, use_local_sgd=False, use_megatron_fsdp=True)))
        runs.append((f"EDiT H={h} Megatron-FSDP", h, False,
                     bc.edit_args(args, use_local_sgd=True, use_megatron_fsdp=True, local_sgd_sync_interval=h,
                                  local_sgd_warmup_steps=0, local_sgd_sync_mode="layerwise")))
        for dtype in args.dtypes:  # the quantized exchange on Megatron-FSDP's shards
            runs.append((f"EDiT H={h} Megatron-FSDP {dtype}+EF", h, False,
                         bc.edit_args(args, use_local_sgd=True, use_megatron_fsdp=True, local_sgd_sync_interval=h,
                                      local_sgd_warmup_steps=0, local_sgd_sync_mode="layerwise",
                                      local_sgd_exchange_dtype=dtype, local_sgd_exchange_error_feedback=True)))
    results = []
    for name, h, penalty, run_args in runs:
        r = measure(args, run_args, counter, train_ds, name)
        r.update(name=name, h=h, penalty=penalty, fsdp=getattr(run_args, "use_megatron_fsdp", False))
        results.append(r)
        bc.log0(f"{name:22s} {r['total'] / args.bench_steps:12.1f} B/step  {r['collectives']} collectives "
                f"{r['by_name']}  syncs {r['syncs']}")
    counter.close()
    # The same on every rank of a 2x2 layout (equal shards); rank 0 reports.
    if dist.get_rank() == 0:
        report(args, results)
    dist.destroy_process_group()


def _record_cell(r) -> str:
    """Whether every worker's record says the bytes counted on its ranks."""
    if r["record_bytes"] == r["counted"]:
        return "yes"
    return "no (" + ", ".join(f"worker {w}: record {r['record_bytes'].get(w, 0):,.0f}, counted {c:,}"
                              for w, c in sorted(r["counted"].items())) + ")"


def report(args, results):
    n = args.bench_steps
    base_ddp = results[0]["total"] / n
    base_fsdp = next((r["total"] / n for r in results if r["fsdp"] and r["h"] is None), None)
    rows = []
    fp32_at = {(r["h"], r["fsdp"]): r["total"] for r in results  # a quantized row against its path's fp32
               if r["h"] and not r["penalty"] and "+EF" not in r["name"]}
    for r in results:
        base = base_fsdp if r["fsdp"] else base_ddp  # Megatron-FSDP's rows against its own HSDP
        per_step = r["total"] / n
        quantized = "+EF" in r["name"]
        shard_part = r["shard_bytes"] * r["syncs"] / n if r["h"] else per_step
        scalars = per_step - shard_part if r["h"] and not quantized else 0.0
        fewer = base / per_step if per_step else float("inf")
        key = (r["h"], r["fsdp"])
        of_fp32 = f"{r['total'] / fp32_at[key]:.3f}" if quantized and key in fp32_at else "-"
        cells = [
            r["name"], "-" if r["h"] is None else r["h"], r["syncs"], f"{r['collectives'] / n:.3f}",
            f"{per_step:,.0f}", "-" if quantized else f"{scalars:,.1f}", f"{fewer:.3f}",
            "-" if r["h"] is None or quantized else f"{fewer / r['h']:.4f}", of_fp32,
            "-" if r["h"] is None else _record_cell(r),
            "yes" if r["identical"] else "no",
        ]
        rows.append(cells)
    base = base_ddp
    headers = ["run", "H", "syncs", "collectives/step", "B/step/rank", "of which scalars",
               "x fewer than sync", "(x fewer)/H", "x of fp32 exchange", "= record bytes",
               "replicas equal at end"]
    shard = results[0]["shard_bytes"]
    notes = (
        f"{n} steps per run, {args.workers} workers x {bc.layout(args)['worker_size']} shards, "
        f"fp32 gradient/pseudo-gradient shard per rank {shard:,} B over all buckets.\n"
        "Counted: every collective whose group spans two workers (torch.distributed wrapped in-process); "
        "bytes as ring algorithms send them per rank (headers not included). syncs: worker 0's records; "
        "'= record bytes': each worker's bytes_sent in its per-sync record, summed over the run, equal to "
        "what was counted on its ranks.\n"
        "EDiT sends one fp32 pseudo-gradient shard per H steps and one all-gather of per-layer float64 "
        "norms per sync (every sync checks them for non-finite values before anything else is sent; the "
        "penalty decides on them): the 'scalars' column, so (x fewer)/H is slightly below 1.\n"
        "Here gradients are fp32. With bf16 gradients reduced in bf16 (Megatron's default for bf16 "
        "models) the synchronous all-reduce moves 2 B/param and the fp32 pseudo-gradient 4 B/param: "
        "x fewer = H/2.\n"
        "Quantized exchange (+EF: with error feedback): int8 and fp8 send 1 byte per element plus one fp32 "
        "scale per block of at most 256 (each worker's chunk cut into equal blocks), int4 half a byte: 0.254x "
        "and 0.129x of the fp32 exchange asymptotically; small buckets pay a little more for scales and padding."
    )
    if base_fsdp is not None:
        notes += ("\nMegatron-FSDP rows (HSDP: a worker is one instance, optim_grads_params inside it, no_shard "
                  "across): 'x fewer than sync' is against Megatron-FSDP's own synchronous HSDP, whose per-step "
                  "outer all-reduce of the gradient shards is what EDiT replaces; 'of which scalars' also holds "
                  "the padding Megatron-FSDP adds to each bucket's shard (its shard is counted from the parameters).")
    text = bc.table(headers, rows)
    print(f"\ncommunication per training step (bytes sent per rank across the sync group)\n{text}\n{notes}")
    name = "comm_fsdp.md" if args.megatron_fsdp else "comm.md"
    bc.write_result(name, bc.table(headers, rows, markdown=True) + "\n\n" + notes.replace("\n", "  \n") + "\n")
    if args.megatron_fsdp:
        return  # the plot is the full run's (comm.png)

    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    hs = sorted({r["h"] for r in results if r["h"]})
    for penalty, marker in ((False, "o"), (True, "x")):
        pts = [(r["h"], r["total"] / n) for r in results
               if r["h"] and r["penalty"] == penalty and "+EF" not in r["name"]]
        if pts:
            ax.plot(*zip(*pts), marker=marker, linestyle="none", markersize=8,
                    label="EDiT" + (" + penalty" if penalty else "") + " (counted)")
    ax.plot(hs, [base / h for h in hs], "k--", linewidth=1, label="synchronous / H")
    ax.axhline(base, color="tab:red", label="synchronous (counted)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("H (steps between syncs)")
    ax.set_ylabel("bytes sent per step per rank\nacross the sync group")
    ax.set_title(f"Cross-worker traffic, {args.workers} workers, counted")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(bc.plot_path("comm.png"), dpi=110)
    print(f"wrote {bc.plot_path('comm.png')} and {bc.plot_path('comm.md')}")


if __name__ == "__main__":
    bc.run_main(main)
