"""The main job's model, data and step (``scripts/train_gpt_edit.py``); the benchmarks train the
same (``scripts/bench/bench_common.py``).

:func:`build`: megatron-core's GPTModel in DistributedDataParallel with the (partial)
distributed optimizer, one instance per EDiT worker (or Megatron-FSDP in HSDP), Megatron's
optimizer and learning-rate schedule, patched for EDiT or not. :func:`build_datasets`:
megatron-core's GPTDataset over an indexed dataset built from text that ships with Python.
:func:`forward_step`: the forward step Megatron's schedule runs. Validation is worker-local
(:func:`evaluate`): each worker evaluates its own model over its own ranks, with no collective
across workers.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

import megatron_edit
from main_job_flags import all_processes, uses_torchft
from main_job_report import log0


def build(args, use_local_sgd):
    """(model, optimizer, learning-rate scheduler) of one run: Megatron patched for EDiT
    (``use_local_sgd``) or restored to synchronous training first, the model seeded from --seed."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig
    from megatron_edit.cpu import data

    if use_local_sgd:
        megatron_edit.patch_megatron_for_local_sgd(*megatron_edit.configs_from_args(args))
    else:
        megatron_edit.unpatch_megatron_for_local_sgd()
    model_parallel_cuda_manual_seed(args.seed)
    torch.manual_seed(args.seed)
    moe = {}
    if args.num_experts:  # sequential experts on CPU; 0.16.1's expert bias is added in place on a view
        moe = dict(num_moe_experts=args.num_experts, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
                   expert_model_parallel_size=args.expert_model_parallel_size, add_bias_linear=False)
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True, **moe,
    )
    spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False)
    model = GPTModel(config=config, transformer_layer_spec=spec,
                     vocab_size=data.VOCAB_SIZE, max_sequence_length=args.seq_length)
    if args.use_megatron_fsdp:  # HSDP: a worker is an instance, fully sharded inside, replicated across
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        # gloo has no PREMUL_SUM (gradient_reduce_div_fusion off); fp32 main weights. The
        # communication unit twice a layer (Megatron-FSDP's own rule, which megatron-core 0.16.1
        # then raises to 1B elements): the prefetch window holds the next layer, not the whole
        # model, so a layer-wise sync overlaps the next forward pass.
        layer = sum(p.numel() for p in model.decoder.layers[0].parameters())
        ddp_config = DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
            num_distributed_optimizer_instances=args.workers, outer_dp_sharding_strategy="no_shard",
            overlap_grad_reduce=True, overlap_param_gather=True, grad_reduce_in_fp32=True,
            gradient_reduce_div_fusion=False, bucket_size=args.bucket_size,
            suggested_communication_unit_size=2 * layer,
        )
        ddp = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model,
                                       device=torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    else:
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True,
            num_distributed_optimizer_instances=1 if uses_torchft(args) else args.workers,
            bucket_size=args.bucket_size,
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


def build_datasets(args, world: int):
    """(training, validation) GPTDatasets for every worker's processes (``world``: this job's),
    built once under --data-dir; rank 0 prints the data line."""
    from megatron.core import parallel_state as ps
    from megatron_edit.cpu import data

    prefix = os.path.join(args.data_dir, "stdlib_docs")
    os.makedirs(args.data_dir, exist_ok=True)
    data.prepare_indexed_dataset(prefix)
    dp = all_processes(args, ps.get_data_parallel_world_size())
    # A-EDiT: a fast worker may take up to every worker's share of steps.
    train_steps = args.steps * (args.workers if args.local_sgd_async else 1)
    train_ds, valid_ds, _ = data.build_gpt_datasets(
        prefix, args.seq_length, (train_steps * dp * args.micro_batch_size, args.eval_samples, 0), args.seed,
    )
    log0(f"data: {prefix}.bin, {len(train_ds)} training samples of {args.seq_length} tokens "
         f"({world} processes" + (f" of worker {args.local_sgd_replica_id}, {args.workers} workers)"
                                   if uses_torchft(args) else ")"))
    return train_ds, valid_ds


def gradient_shards(args, ddp, intra) -> tuple:
    """(elements, buckets) of this rank's gradient shards: what Megatron all-reduces across
    workers at each synchronous step (``intra``: this worker's ranks)."""
    if args.use_megatron_fsdp:  # its gradient shards: each bucket's, reduced across workers per step
        fsdp_buckets = ddp.module.param_and_grad_buffer.parameter_groups
        shard_numel = sum(p.numel() for p in ddp.parameters()) // intra.size()
        buckets = len(fsdp_buckets)
    else:
        buffers = [*ddp.buffers, *ddp.expert_parallel_buffers]  # MoE, expert parallelism: the experts'
        shard_numel = sum(b.grad_data.numel() // buf.data_parallel_group.size() for buf in buffers for b in buf.buckets)
        buckets = len([b for buf in buffers for b in buf.buckets])
    return shard_numel, buckets


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    output = model(input_ids=batch["tokens"], position_ids=batch["position_ids"], attention_mask=None,
                   labels=batch["labels"])
    mask = batch["loss_mask"].float()

    def loss_func(per_token_loss):
        loss = (per_token_loss.float() * mask).sum() / mask.sum()
        return loss, {"lm loss": loss.detach().clone()}  # the schedule divides `loss` in place

    return output, loss_func


def worker_group():
    """The data-parallel ranks of this worker (every megatron-core release since 0.12 has it)."""
    from megatron.core import parallel_state as ps

    return ps.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)


def worker_mean(value, group):
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return t.item() / dist.get_world_size(group)


def validation_losses(args, ddp, valid_ds, rank: int, size: int) -> list:
    """This rank's share of the held-out samples (every ``size``-th micro-batch from ``rank``):
    the loss of each of its micro-batches under the current model. No collective; completes a
    pending layer-wise sync first."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron_edit.cpu import data

    ddp.start_param_sync(force_sync=True)  # completes a pending layer-wise sync, gathers params
    n = args.eval_samples // (size * args.micro_batch_size)
    it = data.batch_iterator(valid_ds, args.micro_batch_size, start=rank, stride=size)
    batches = [next(it) for _ in range(n)]
    ddp.eval()
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp], num_microbatches=n,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=True,
        )
    ddp.train()
    return [d["lm loss"].item() for d in out]


def evaluate(args, ddp, valid_ds) -> float:
    """Validation loss of this worker's current model on the held-out samples, computed over this
    worker's ranks only (each takes its share, the mean is taken inside the worker): no
    collective across workers, so it is safe at any step, with A-EDiT too."""
    intra = worker_group()
    losses = validation_losses(args, ddp, valid_ds, intra.rank(), intra.size())
    return worker_mean(sum(losses) / len(losses), intra)


def gather_per_worker(value: float) -> dict:
    """{worker: value} from every worker's first rank, on every rank. A collective across
    workers: call it only where every worker is at the same logical point (after the last sync;
    with synchronous EDiT, after any step), never at a fixed step with A-EDiT."""
    size = worker_group().size()
    values = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(values, torch.tensor([value], dtype=torch.float64))
    return {r // size: v.item() for r, v in enumerate(values) if r % size == 0}
