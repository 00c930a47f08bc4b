"""The main job: a small megatron-core GPT trained with EDiT on CPU, over gloo.

    torchrun --nproc_per_node 4 scripts/train_gpt_edit.py              # EDiT, 2 workers x 2 shards
    torchrun --nproc_per_node 4 scripts/train_gpt_edit.py --mode both  # then synchronous, same data

Real Megatron parts throughout: GPTModel, DistributedDataParallel with the (partial) distributed
optimizer, get_megatron_optimizer, OptimizerParamScheduler, the forward/backward schedule and
megatron-core's GPTDataset over an indexed dataset built from text that ships with Python
(megatron_edit.cpu.data). megatron_edit.cpu.adapter lets megatron-core run without CUDA.

Each worker (one distributed-optimizer instance) trains on its own slice of every global batch.
Per step, rank 0 prints its worker's loss; after each sync it prints the bytes this rank sent
across the sync group. Nothing crosses workers between syncs: the per-step loss is averaged
inside the worker only; validation (every --eval-interval steps) is the one place where the
script itself reduces across workers.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
# megatron-core warns at import that transformer-engine/apex are absent and it uses torch's
# implementations; expected on CPU, so keep the demo's output readable.
warnings.filterwarnings("ignore", module=r"megatron\.")
warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")

import megatron_edit  # noqa: E402
from megatron_edit.cpu import adapter as cpu_adapter, data  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("edit", "baseline", "both"), default="edit",
                        help="edit: EDiT; baseline: ordinary synchronous training; both: one, then the other")
    parser.add_argument("--workers", type=int, default=2,
                        help="EDiT workers = distributed-optimizer instances (must divide the world size)")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--micro-batch-size", type=int, default=4, help="samples per rank per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lr-warmup-steps", type=int, default=10)
    parser.add_argument("--eval-interval", type=int, default=40)
    parser.add_argument("--eval-samples", type=int, default=64)
    parser.add_argument("--log-interval", type=int, default=1)
    parser.add_argument("--data-dir", default=os.environ.get("MEGATRON_EDIT_DATA", "data-cache"),
                        help="where the indexed dataset is built (once)")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--bucket-size", type=int, default=20000,
                        help="DDP bucket size in elements (small: several layer-wise buckets)")
    megatron_edit.local_sgd_args_provider(parser)
    parser.set_defaults(local_sgd_sync_interval=8, local_sgd_warmup_steps=8)
    return parser.parse_args(argv)


def log0(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def build(args, use_local_sgd):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    if use_local_sgd:
        megatron_edit.patch_megatron_for_local_sgd(*megatron_edit.configs_from_args(args))
    else:
        megatron_edit.unpatch_megatron_for_local_sgd()
    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True,
    )
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=data.VOCAB_SIZE, max_sequence_length=args.seq_length)
    ddp_config = DistributedDataParallelConfig(
        use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
        num_distributed_optimizer_instances=args.workers, bucket_size=args.bucket_size,
    )
    ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.no_sync_func = ddp.no_sync
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.lr / 10, weight_decay=0.01, clip_grad=1.0,
                        adam_beta2=0.95, use_distributed_optimizer=True),
        [ddp],
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=args.lr, min_lr=args.lr / 10, lr_warmup_steps=args.lr_warmup_steps,
        lr_decay_steps=args.steps, lr_decay_style="cosine", start_wd=0.01, end_wd=0.01,
        wd_incr_steps=args.steps, wd_incr_style="constant",
    )
    return ddp, optimizer, scheduler


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                   labels=batch["labels"])
    mask = batch["loss_mask"].float()

    def loss_func(per_token_loss):
        loss = (per_token_loss.float() * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

    return output, loss_func


def worker_mean(value, group):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def evaluate(args, ddp, valid_ds):
    """Validation loss of every worker's current model on the same samples (cross-worker: only here)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ddp.start_param_sync(force_sync=True)  # completes a pending layer-wise sync, gathers params
    # The data-parallel ranks of this worker (every megatron-core release since 0.12 has it).
    intra = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    rank_in_worker, worker_size = intra.rank(), intra.size()
    n = args.eval_samples // (worker_size * args.micro_batch_size)
    it = data.batch_iterator(valid_ds, args.micro_batch_size, start=rank_in_worker, stride=worker_size)
    batches = [next(it) for _ in range(n)]
    ddp.eval()
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp], num_microbatches=n,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=True,
        )
    ddp.train()
    loss = worker_mean(sum(d["lm loss"].item() for d in out) / len(out), intra)
    losses = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(losses, torch.tensor([loss], dtype=torch.float64))
    worker_of = [r // worker_size for r in range(dist.get_world_size())]
    per_worker = {}
    for r, l in enumerate(losses):
        per_worker.setdefault(worker_of[r], l.item())
    return per_worker


def train(args, use_local_sgd, datasets):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    train_ds, valid_ds = datasets
    ddp, optimizer, scheduler = build(args, use_local_sgd)
    controllers = megatron_edit.get_local_sgd(optimizer)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    # The data-parallel ranks of this worker (every megatron-core release since 0.12 has it).
    intra = ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)
    worker = dp_rank // intra.size()
    it = data.batch_iterator(train_ds, args.micro_batch_size, start=dp_rank, stride=dp)
    name = "EDiT" if use_local_sgd else "synchronous"
    shard_numel = sum(b.grad_data.numel() // intra.size() for buf in ddp.buffers for b in buf.buckets)
    log0(f"\n=== {name}: {args.steps} steps, {args.workers} workers x {intra.size()} shards, "
         f"{sum(p.numel() for p in ddp.parameters()):,} parameters, "
         f"{len([b for buf in ddp.buffers for b in buf.buckets])} buckets ===")
    if use_local_sgd:
        c = controllers[0].config
        log0(f"sync every {c.local_sgd_sync_interval} steps after {c.local_sgd_warmup_steps} synchronous warmup "
             f"steps, {c.sync_mode} mode; outer {args.outer_optimizer} lr {args.outer_optimizer_lr}")
    sync_bytes = grad_bytes = syncs = 0
    evals = []
    t_start = time.perf_counter()
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        local_grads = bool(controllers) and controllers[0].grads_are_local
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter([next(it)]), model=[ddp], num_microbatches=1,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False,
        )
        ok, grad_norm, _ = optimizer.step()
        scheduler.step(1)
        loss = worker_mean(out[0]["lm loss"].item(), intra)  # inside the worker only
        if args.workers > 1 and not local_grads:
            grad_bytes += 4 * shard_numel  # Megatron all-reduces each gradient shard across workers
        ms = (time.perf_counter() - t0) * 1e3
        reports = [r for c in controllers for r in c.drain_reports()]
        if step % args.log_interval == 0 or reports:
            phase = "" if not controllers else ("  local" if local_grads else "  warmup (synchronous)")
            log0(f"step {step:4d} | worker {worker} loss {loss:.4f} | lr {scheduler.get_lr(optimizer.param_groups[0]):.2e} "
                 f"| {ms:6.1f} ms{phase}")
        for r in reports:
            sync_bytes += r.payload_bytes
            syncs += 1
            log0(f"          sync {syncs} after step {r.step}: {r.buckets} buckets, "
                 f"{r.payload_bytes / 1e3:.1f} kB sent by this rank across the sync group "
                 f"({r.workers} workers), {r.seconds * 1e3:.1f} ms in EDiT code")
        if step % args.eval_interval == 0 or step == args.steps:
            per_worker = evaluate(args, ddp, valid_ds)
            evals.append((step, per_worker))
            log0(f"          validation after step {step}: " + ", ".join(f"worker {w} {l:.4f}" for w, l in per_worker.items()))
    elapsed = time.perf_counter() - t_start
    cross = sync_bytes + grad_bytes
    return dict(name=name, final=evals[-1][1], cross_bytes=cross, seconds=elapsed, syncs=syncs)


def main():
    args = parse_args()
    torch.set_num_threads(1)
    cpu_adapter.activate()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    world = dist.get_world_size()
    if world % args.workers:
        raise SystemExit(f"--workers {args.workers} must divide the number of processes {world}")
    ps.initialize_model_parallel(num_distributed_optimizer_instances=args.workers)

    prefix = os.path.join(args.data_dir, "stdlib_docs")
    os.makedirs(args.data_dir, exist_ok=True)
    data.prepare_indexed_dataset(prefix)
    dp = ps.get_data_parallel_world_size()
    train_ds, valid_ds, _ = data.build_gpt_datasets(
        prefix, args.seq_length, (args.steps * dp * args.micro_batch_size, args.eval_samples, 0), args.seed,
    )
    log0(f"data: {prefix}.bin, {len(train_ds)} training samples of {args.seq_length} tokens")

    results = []
    if args.mode in ("edit", "both"):
        args.use_local_sgd = True
        results.append(train(args, True, (train_ds, valid_ds)))
    if args.mode in ("baseline", "both"):
        results.append(train(args, False, (train_ds, valid_ds)))

    log0("\n=== summary (per rank; cross-worker bytes = EDiT pseudo-gradient exchange or Megatron's "
         "per-step gradient all-reduce across workers) ===")
    log0(f"{'run':12s} {'valid loss (per worker)':26s} {'syncs':>6s} {'cross-worker MB':>16s} {'wall s':>8s}")
    for r in results:
        losses = ", ".join(f"{l:.4f}" for l in r["final"].values())
        log0(f"{r['name']:12s} {losses:26s} {r['syncs']:6d} {r['cross_bytes'] / 1e6:16.3f} {r['seconds']:8.1f}")
    if len(results) == 2 and results[0]["cross_bytes"]:
        log0(f"EDiT sent {results[1]['cross_bytes'] / results[0]['cross_bytes']:.1f}x fewer bytes across workers")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
