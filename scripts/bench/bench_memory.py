"""Memory benchmark: EDiT's extra bytes per rank against model size and Megatron's own state.

    torchrun --nproc_per_node 4 scripts/bench/bench_memory.py [--sizes 64x2 128x2 256x4] [--layouts 2x2 4x1]

For each model size (hidden x layers) and layout (workers x shards per worker) the main job's GPT
is built with EDiT (H=1, no warmup), trained 2 steps so that the anchor and the outer Nesterov
momentum exist, once with the state where the training tensors live and once with
``--local-sgd-cpu-offload``. Measured per rank, from the tensors themselves:
  Megatron      the model's param and grad buffers and the distributed optimizer's state
                (fp32 model here: the main params are the param buffer itself; Adam's two moments
                are sharded);
  EDiT          ``LocalSGD.state_bytes()``: anchor + outer momentum, sharded like the main params
                (2 x 4 B x params / shards), on the training device or, with cpu_offload, in host
                memory;
  full copy     a design that keeps a full fp32 anchor (+ momentum) per rank, as the reference
                implementation's Megatron path does (computed: 8 B x params).
This machine has no GPU: the "device" is the CPU, so "device bytes" and "host bytes" are both
host memory here; the split says where the tensors would live on a GPU machine (the tensors'
``.device`` is checked against the setting). Projected rows for 1B and 7B (bf16 model, fp32
grads, 8 shards per worker) use the same formulas. Writes scripts/bench/results/memory.{png,md}.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import bench_common as bc

GB = 1e9


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["64x2", "128x2", "256x4"], help="hidden x layers")
    parser.add_argument("--layouts", nargs="+", default=["2x2", "4x1"], help="workers x shards per worker")
    parser.add_argument("--megatron-fsdp", action="store_true",
                        help="only Megatron-FSDP (HSDP: a worker is an instance), state on the device; results "
                             "in memory_fsdp.md (megatron-core 0.16.x)")
    return bc.parse_args(parser)


def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


def megatron_bytes(ddp, optimizer) -> dict:
    """Per-rank bytes of Megatron's own training state, from the tensors."""
    if hasattr(ddp, "module") and hasattr(ddp.module, "param_and_grad_buffer"):  # Megatron-FSDP
        groups = ddp.module.param_and_grad_buffer.parameter_groups
        data = lambda name: [getattr(getattr(g, name), "data", None) for g in groups if getattr(g, name, None)]  # noqa: E731
        def held(names):  # each buffer its own allocation; a freed one (an unsharded weight between uses) is 0
            total = 0
            for name in names:
                for t in data(name):
                    try:
                        total += t.untyped_storage().nbytes() if t is not None else 0
                    except RuntimeError:
                        pass
            return total

        params = held(("model_weight_buffer", "transpose_weight_buffer", "main_weight_buffer", "hsdp_wbuf"))
        grads = held(("main_grad_buffer", "hsdp_gbuf"))
        opt_state = [v.to_local() if hasattr(v, "to_local") else v  # DTensors: this rank's shard
                     for opt in getattr(optimizer, "chained_optimizers", [optimizer])
                     for state in opt.optimizer.state.values() for v in state.values()
                     if torch.is_tensor(v) and v.dim() > 0]
        return dict(params=params, grads=grads, optimizer=tensor_bytes(opt_state))
    params = sum(b.param_data.numel() * b.param_data.element_size() for b in ddp.buffers if b.param_data is not None)
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers)
    opt_state, mains = [], []
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        for state in opt.optimizer.state.values():
            opt_state += [v for v in state.values() if torch.is_tensor(v) and v.dim() > 0]
        for group in getattr(opt, "shard_fp32_from_float16_groups", []):
            mains += list(group)
    return dict(params=params, grads=grads, optimizer=tensor_bytes(opt_state) + tensor_bytes(mains))


def edit_bytes(controllers, offload: bool) -> dict:
    """EDiT state per rank, and where it lives (checked against the setting)."""
    total = sum(c.state_bytes() for c in controllers)
    expected = "cpu" if offload else str(controllers[0].shards[0].device.type)
    devices = {s.anchor.device.type for c in controllers for s in c.shards}
    for c in controllers:
        for state in c.outer_optimizer.state.values():
            devices |= {v.device.type for v in state.values() if torch.is_tensor(v) and v.dim() > 0}
    assert devices == {expected}, (devices, expected)
    return dict(total=total, host=total if offload else 0, device=0 if offload else total)


def measure(args, hidden, layers, offload, train_ds):
    run_args = bc.edit_args(
        args, hidden=hidden, layers=layers, heads=4, use_local_sgd=True, local_sgd_sync_interval=1,
        local_sgd_warmup_steps=0, local_sgd_cpu_offload=offload, use_megatron_fsdp=args.megatron_fsdp,
    )
    ddp, optimizer, scheduler, controllers = bc.build(run_args)
    it = bc.batches(run_args, train_ds)
    for _ in range(2):
        bc.train_step(run_args, ddp, optimizer, scheduler, next(it))
    if args.megatron_fsdp:
        for c in controllers:
            c.flush()
        ddp.module.synchronize_param_gather()
    else:
        bc.flush(ddp, controllers)
    params = sum(p.numel() for p in ddp.parameters())
    mega = megatron_bytes(ddp, optimizer)
    edit = edit_bytes(controllers, offload)
    lay = bc.layout(run_args)
    return dict(hidden=hidden, layers=layers, params=params, offload=offload, workers=args.workers,
                shards=lay["worker_size"], megatron=mega, edit=edit)


def main():
    args = parse_args()
    from megatron.core import parallel_state as ps

    results = []
    train_ds = None
    for layout in args.layouts:
        workers, shards = map(int, layout.split("x"))
        args.workers = workers
        if train_ds is None:
            train_ds, _ = bc.setup(args, train_samples=2000)
        else:
            ps.destroy_model_parallel()
            ps.initialize_model_parallel(num_distributed_optimizer_instances=workers)
        if bc.layout(args)["worker_size"] != shards:
            raise SystemExit(f"layout {layout} needs {workers * shards} processes, not {dist.get_world_size()}")
        for size in args.sizes:
            hidden, layers = map(int, size.split("x"))
            for offload in (False,) if args.megatron_fsdp else (False, True):
                r = measure(args, hidden, layers, offload, train_ds)
                # Buckets pad shards: take the largest rank's figures (the one that bounds memory).
                r["edit"]["total"] = int(bc.max_over_ranks(r["edit"]["total"]))
                results.append(r)
    if dist.get_rank() == 0:
        report(results, "memory_fsdp" if args.megatron_fsdp else "memory")
    dist.destroy_process_group()


def fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def report(results, stem: str = "memory"):
    rows = []
    for r in results:
        m, e, p = r["megatron"], r["edit"], r["params"]
        mega_total = m["params"] + m["grads"] + m["optimizer"]
        full = 8 * p
        rows.append([
            f"GPT {r['hidden']}x{r['layers']}", f"{p:,}", f"{r['workers']}x{r['shards']}",
            "cpu_offload" if r["offload"] else "on device", fmt_bytes(mega_total),
            fmt_bytes(e["device"] if not r["offload"] else 0), fmt_bytes(e["host"] if r["offload"] else 0),
            f"{e['total'] / p:.2f}", f"{e['total'] / mega_total:.1%}", fmt_bytes(full),
            f"{full / e['total']:.1f}x",
        ])
    # Projections, same formulas (bf16 params, fp32 grads, fp32 main + Adam 2 moments sharded).
    for name, p in (("1B (projected)", 1.0e9), ("7B (projected)", 7.0e9)) if stem == "memory" else ():
        shards = 8
        mega_total = (2 + 4) * p + (4 + 8) * p / shards
        edit = 8 * p / shards
        for offload in (False, True):
            rows.append([
                name, f"{p:,.0f}", f"Nx{shards}", "cpu_offload" if offload else "on device", fmt_bytes(mega_total),
                fmt_bytes(0 if offload else edit), fmt_bytes(edit if offload else 0), f"{edit / p:.2f}",
                f"{edit / mega_total:.1%}", fmt_bytes(8 * p), f"{8 * p / edit:.1f}x",
            ])
    headers = ["model", "params", "workers x shards", "EDiT state", "Megatron state/rank", "EDiT device B/rank",
               "EDiT host B/rank", "EDiT B/param", "EDiT vs Megatron", "full copy B/rank", "full copy / EDiT"]
    notes = (
        "Measured rows: tensors of one rank (the largest, bucket padding included) after 2 steps and one sync; "
        "Megatron state = param + grad buffers + distributed-optimizer state (fp32 model: main params are the param "
        "buffer).\n"
        "EDiT = anchor + outer Nesterov momentum = 2 x 4 B x params / shards (+ padding). 'device' = the training "
        "device, 'host' = CPU memory with cpu_offload: on this CPU-only machine both are host memory; the check is "
        "that each tensor lives where the setting says.\n"
        "full copy = a full fp32 anchor + momentum per rank (8 B x params), what a non-sharded design needs; "
        "the reference implementation's Megatron path keeps the full anchor (4 B x params) on CPU per rank.\n"
        "Projected rows: bf16 params (2 B), fp32 grads (4 B), fp32 main params + Adam (12 B / shards), 8 shards "
        "per worker (one node); a 7B full copy is 56 GB of host memory per rank, 448 GB per 8-GPU node."
    )
    text = bc.table(headers, rows)
    print(f"\nmemory per rank\n{text}\n{notes}")
    if stem != "memory":
        notes = notes[:notes.index("\nProjected rows")]  # none for Megatron-FSDP
        notes += ("\nMegatron-FSDP (HSDP: a worker is one instance, optim_grads_params inside it, no_shard across): "
                  "Megatron's column is its parameter-group buffers (model weights, fp32 main weights, fp32 "
                  "gradient shards) and Adam's moments; EDiT's state is sharded like the main weights.")
        bc.write_result(f"{stem}.md", bc.table(headers, rows, markdown=True) + "\n\n" + notes.replace("\n", "  \n") + "\n")
        return
    bc.write_result("memory.md", bc.table(headers, rows, markdown=True) + "\n\n" + notes.replace("\n", "  \n") + "\n")

    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    xs = [1e5, 1e10]
    colors = {1: "tab:red", 2: "tab:blue", 4: "tab:purple", 8: "tab:green"}
    ax.plot(xs, [8 * x for x in xs], "--", color="tab:red",
            label="full fp32 anchor + momentum per rank, 8 B x P\n(= EDiT with 1 shard per worker)")
    for shards in (2, 8):
        ax.plot(xs, [8 * x / shards for x in xs], "-", color=colors[shards],
                label=f"EDiT, {shards} shards per worker: 8 B x P / {shards}")
    measured = {}
    for r in results:
        if not r["offload"]:
            measured.setdefault(r["shards"], []).append((r["params"], r["edit"]["total"]))
    for shards, pts in sorted(measured.items()):
        ax.plot(*zip(*pts), "o", markersize=7, color=colors.get(shards, "k"),
                label=f"measured (LocalSGD.state_bytes), {shards} shard{'s' if shards > 1 else ''}/worker")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("model parameters P")
    ax.set_ylabel("extra bytes per rank")
    ax.set_title("EDiT anchor + outer state per rank")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(bc.plot_path("memory.png"), dpi=110)
    print(f"wrote {bc.plot_path('memory.png')} and {bc.plot_path('memory.md')}")


if __name__ == "__main__":
    bc.run_main(main)
