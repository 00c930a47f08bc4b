"""EDiT on Megatron-FSDP in HSDP (megatron-core's ``megatron/core/distributed/fsdp``; EDiT,
arXiv 2412.07210, Sec. 3).

With ``num_distributed_optimizer_instances`` > 1 and the outer strategy ``no_shard``,
Megatron-FSDP shards the model inside an instance and replicates it across instances, over
Megatron's inter-instance group: the shape of EDiT's workers. Each rank of a worker keeps the
fp32 main weights of its shard of every parameter group (Megatron-FSDP's bucket) in the group's
``main_weight_buffer``; the optimizer's DTensor parameters are views of it. So this module reads
each such shard into the :class:`~megatron_edit.exchange.shard.BucketShard` the distributed-
optimizer path uses (:mod:`megatron_edit.mcore.shards`), and the controller, the exchange and
the outer step are the same objects (:class:`~megatron_edit.mcore.controller.LocalSGD`,
:class:`~megatron_edit.exchange.outer_sync.OuterSync`).

What differs from DDP + distributed optimizer is where EDiT attaches
(:mod:`megatron_edit.mcore.fsdp_wraps`): the per-step gradient all-reduce across instances
(``GradReducePipeline``) is switched off after warmup, with the gradient scale raised to
1 / inner data-parallel size; the model weights a sync installs are Megatron-FSDP's model-weight
shards (``model_weight_buffer``), which the next forward pass all-gathers; and a bucket already
gathered before a layer-wise sync (the step's prefetch of the first bucket) is dropped and
gathered again (:meth:`FSDPModel.drop_stale_gathers`).

Checked with megatron-core 0.16.1-0.19.x (:data:`~megatron_edit.mcore.releases.FSDP_SUPPORTED`):
these are Megatron-FSDP internals, not a public API. What is not built yet is refused by
:func:`check_fsdp_options`, naming the flag.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ..config import ConfigError, LocalSGDConfig, NotSupportedYet
from ..exchange.shard import BucketShard
from . import compat
from .releases import FSDP_EXPERT_PARALLEL, FSDP_SUPPORTED, FSDP_TESTED
from .shards import ShardLayout, layer_key
from .worker_layout import WorkerLayout



def check_fsdp_release(version: Optional[str] = None) -> None:
    """Megatron-FSDP's internals EDiT uses were checked on :data:`FSDP_TESTED` only."""
    version = version or compat.megatron_core_version()
    if not FSDP_SUPPORTED.contains(version):
        raise ConfigError(
            f"EDiT on Megatron-FSDP (--use-megatron-fsdp) is checked with megatron-core "
            f"{', '.join(FSDP_TESTED)} only; megatron-core {version} is installed: install "
            f"megatron-core=={FSDP_TESTED[-1]}, or train with DDP and --use-distributed-optimizer."
        )


def check_fsdp_local_settings(local_cfg) -> None:
    """The EDiT settings that are not built on Megatron-FSDP (``local_cfg``: a
    :class:`LocalSGDConfig`, or anything with its fields)."""
    if getattr(local_cfg, "cpu_offload", False):
        raise NotSupportedYet(
            "--local-sgd-cpu-offload with EDiT on Megatron-FSDP (--use-megatron-fsdp) is not supported "
            "yet: the offload of EDiT's anchor and outer state was built and checked with the "
            "distributed optimizer's buffers only; drop --local-sgd-cpu-offload.")


def check_fsdp_options(local_cfg: LocalSGDConfig, transformer_config, ddp_config,
                       version: Optional[str] = None) -> None:
    """Refuse, naming the flag, what EDiT on Megatron-FSDP cannot do or does not do yet (the
    checks every EDiT path shares are :func:`megatron_edit.mcore.checks.check_megatron_options`'s)."""
    check_fsdp_release(version)
    check_fsdp_local_settings(local_cfg)
    strategy = getattr(ddp_config, "data_parallel_sharding_strategy", "no_shard")
    if strategy != "optim_grads_params":
        raise NotSupportedYet(
            f"--data-parallel-sharding-strategy {strategy} with EDiT on Megatron-FSDP "
            "(--use-megatron-fsdp) and --use-local-sgd is not supported yet: use optim_grads_params "
            "(each worker's ranks shard the parameters, gradients and optimizer state).")
    outer = getattr(ddp_config, "outer_dp_sharding_strategy", "no_shard")
    if outer != "no_shard":
        raise ConfigError(
            f"--outer-dp-sharding-strategy {outer} with EDiT on Megatron-FSDP (--use-megatron-fsdp) "
            "and --use-local-sgd: it shards each worker's optimizer over the other workers, and an "
            "EDiT worker keeps its own; use --outer-dp-sharding-strategy no_shard.")
    if not getattr(ddp_config, "preserve_fp32_weights", True):
        raise NotSupportedYet(
            "DistributedDataParallelConfig.preserve_fp32_weights=False with EDiT on Megatron-FSDP "
            "(--use-megatron-fsdp) and --use-local-sgd is not supported yet: EDiT exchanges the "
            "fp32 main weights' shards.")
    main_dtype = _dtype_flag(getattr(ddp_config, "megatron_fsdp_main_params_dtype", "fp32"))  # 0.17+
    if main_dtype != "fp32":
        raise NotSupportedYet(
            f"--megatron-fsdp-main-params-dtype {main_dtype} with EDiT on Megatron-FSDP "
            "(--use-megatron-fsdp) and --use-local-sgd is not supported yet: EDiT exchanges the "
            "fp32 main weights' shards; use --megatron-fsdp-main-params-dtype fp32.")
    if getattr(ddp_config, "fsdp_double_buffer", False) or getattr(ddp_config, "nccl_ub", False):
        raise NotSupportedYet(
            "--fsdp-double-buffer / --nccl-ub with EDiT on Megatron-FSDP (--use-megatron-fsdp) and "
            "--use-local-sgd is not supported yet.")
    c = transformer_config
    for field, flag in (("tensor_model_parallel_size", "--tensor-model-parallel-size"),
                        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
                        ("context_parallel_size", "--context-parallel-size")):
        if (getattr(c, field, 1) or 1) > 1:
            raise NotSupportedYet(
                f"{flag} > 1 with EDiT on Megatron-FSDP (--use-megatron-fsdp) and --use-local-sgd "
                "is not supported yet.")
    ep = getattr(c, "expert_model_parallel_size", 1) or 1
    version = version or compat.megatron_core_version()
    hsdp = (getattr(ddp_config, "num_distributed_optimizer_instances", 1) or 1) > 1
    if getattr(c, "num_moe_experts", None) and ep > 1 and hsdp and not FSDP_EXPERT_PARALLEL.contains(version):
        raise ConfigError(
            f"--expert-model-parallel-size {ep} with Megatron-FSDP in HSDP (--use-megatron-fsdp, "
            f"--num-distributed-optimizer-instances > 1) on megatron-core {version}: its HSDP builds no "
            "expert mesh, so expert parameters would be sharded and reduced as dense ones; use "
            "megatron-core 0.17+ or --expert-model-parallel-size 1.")


def _dtype_flag(value) -> str:
    """Megatron-LM's name of a dtype flag's value: ``fp32`` for ``torch.float32`` (its
    arguments hold the name until ``validate_args`` maps it), ``auto`` for ``None``."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", None: "auto"}
    return names.get(value, str(value))


class FSDPBucket:
    """One Megatron-FSDP parameter group (its bucket) with a main-weight shard on this rank: the
    unit EDiT syncs, in the forward pass's gather order. Compared by identity."""

    __slots__ = ("bucket_id", "params", "__weakref__")

    def __init__(self, bucket_id: int, params: List[torch.nn.Parameter]):
        self.bucket_id = bucket_id
        self.params = params

    def __repr__(self) -> str:
        return f"FSDPBucket({self.bucket_id}, {len(self.params)} params)"


class FSDPModel:
    """The Megatron-FSDP model behind one ``DistributedOptimizer``, as EDiT reads and drives it.

    Read once, when the controller is built: the shards (:meth:`layouts`) and the pipelines EDiT's
    wraps recognise (:attr:`pipelines`)."""

    def __init__(self, optimizer):
        chunks = list(optimizer.model_chunks)
        if len(chunks) != 1:
            raise NotSupportedYet(
                f"EDiT on Megatron-FSDP (--use-megatron-fsdp) with {len(chunks)} model chunks "
                "(virtual pipeline stages) and --use-local-sgd is not supported yet.")
        self.fsdp = chunks[0].module
        """megatron-core's ``MegatronFSDP`` (the wrapper is ``FullyShardedDataParallel``)."""
        self.buffer = self.fsdp.param_and_grad_buffer
        self.dist_index = self.fsdp.dist_index
        self.buckets: Dict[int, FSDPBucket] = {}

    @property
    def pipelines(self) -> Tuple[object, object]:
        """The gradient-reduce and parameter all-gather pipelines of this model."""
        return self.fsdp.grad_reduce_pipeline, self.fsdp.all_gather_pipeline

    @property
    def prefetches_everything(self) -> bool:
        """The parameter all-gather's prefetch window holds the whole model: the step's prefetch
        of the first bucket gathers every bucket, so a layer-wise sync completes at the end of
        the optimizer step instead of in the next forward pass. megatron-core 0.16-0.19 make the
        window at least 500M elements unless ``suggested_communication_unit_size`` is given."""
        window = getattr(self.fsdp, "suggested_AG_prefetch_size", None)
        if window is None:
            return False
        return window >= sum(p.numel() for g in self.buffer.parameter_groups for p in g.params)

    def group_of(self, bucket_id: int) -> Optional[FSDPBucket]:
        return self.buckets.get(bucket_id)

    def layouts(self, optimizer) -> Tuple[ShardLayout, WorkerLayout]:
        """Every main-weight shard of this rank as a :class:`BucketShard` (one per bucket, in
        gather order), and the place of this optimizer among the workers."""
        shard_group = _own_copy(self.dist_index.get_fsdp_group())
        workers = int(optimizer.ddp_config.num_distributed_optimizer_instances)
        layout = WorkerLayout(
            worker=int(optimizer.distributed_optimizer_instance_id),
            num_workers=workers,
            worker_size=shard_group.size(),
            intra_rank=shard_group.rank(),
            dp_group_idx=0,  # one tensor / pipeline slice: model parallelism is refused
            sync_group=self.dist_index.get_outer_fsdp_group() if workers > 1 else None,
            shard_group=shard_group,
            tp_group=None,
        )
        return self._shard_layout(), layout

    def _shard_layout(self) -> ShardLayout:
        names = self.fsdp.param_to_name
        groups = [(i, g) for i, g in enumerate(self.buffer.parameter_groups) if g.main_weight_buffer is not None]
        layer_of = {p: layer_key(names[p]) for _, g in groups for p in g.params}
        layer_names = sorted(set(layer_of.values()))
        index_of = {name: i for i, name in enumerate(layer_names)}
        shards: List[BucketShard] = []
        order: List[FSDPBucket] = []
        group_shards: Dict[object, List[BucketShard]] = {}
        for bucket_id, group in groups:  # bucket ids ascend in the forward pass's gather order
            shard = _bucket_shard(group, layer_of, index_of, len(shards))
            key = FSDPBucket(bucket_id, list(group.params))
            self.buckets[bucket_id] = key
            shards.append(shard)
            order.append(key)
            group_shards[key] = [shard]
        return ShardLayout(shards, order, group_shards, layer_names)

    def wait_stale_gathers(self) -> None:
        """Wait for (and drop) the gathers the optimizer step started from the model weights, before
        EDiT changes those weights: a gather still reading a shard while it is written is a race on
        any device (on the CPU, where Megatron-FSDP's stream ordering does not exist, a crash
        besides; issue 62). Collectives inside the worker only."""
        self.fsdp.synchronize_param_gather()

    def drop_stale_gathers(self) -> None:
        """Parameters changed outside ``optimizer.step()`` (a layer-wise sync marked pending, or
        completed at the end of the run): drop what the step already gathered or prefetched from
        the old model weights and prefetch the first bucket again (its gather completes that
        bucket's pending outer step first). Collectives inside the worker only."""
        self.fsdp.synchronize_param_gather()
        self.fsdp.start_param_sync()


def _own_copy(group):
    """A process group of the same ranks as Megatron-FSDP's ``group``, for EDiT's collectives
    inside the worker (the per-layer norms' sums). A layer-wise sync completes a bucket inside
    Megatron-FSDP's coalesced all-gather of ``group``, where a collective on ``group`` itself
    would be captured into the coalesced batch instead of run (torch's ``_coalescing_manager``).
    Built once per model, when the controller is built: ``new_group`` is a collective over every
    rank, so each rank creates every worker's copy, in the order of the worker's first rank."""
    import torch.distributed as dist

    ranks = dist.get_process_group_ranks(group)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, ranks)
    mine = None
    for worker_ranks in sorted({tuple(r) for r in every}):
        copy = dist.new_group(list(worker_ranks), backend=dist.get_backend(group))
        if list(worker_ranks) == list(ranks):
            mine = copy
    return mine


def _bucket_shard(group, layer_of, index_of, index: int) -> BucketShard:
    """This rank's shard of one parameter group: a view of its fp32 main-weight shard (the
    optimizer's parameters are views of it), its model-weight shard, and each parameter's range."""
    mbuf, wbuf = group.main_weight_buffer, group.model_weight_buffer
    model_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    if mbuf.dtype != torch.float32 or wbuf is None or wbuf.dtype not in model_dtypes:
        raise RuntimeError(
            f"megatron_edit: a Megatron-FSDP bucket holds {mbuf.dtype} main weights and "
            f"{None if wbuf is None else wbuf.dtype} model weights: EDiT needs fp32 main weights and "
            "fp32 / bf16 / fp16 model weights (no FP8 parameters).")
    flat = mbuf.get_shard_from_local_buffer()
    model = wbuf.get_shard_from_local_buffer()
    if model.numel() != flat.numel() or wbuf.item_index_map.keys() != mbuf.item_index_map.keys():
        raise RuntimeError(
            "megatron_edit: a Megatron-FSDP bucket's model-weight and main-weight shards differ in "
            "layout: this megatron-core changed Megatron-FSDP's buffers.")
    base = mbuf.shard_bucket_index.local_data_index
    mains, ranges, segments = [], [], []
    for item_id, param in enumerate(group.params):
        start, end = mbuf._get_item_local_shard_index(item_id)
        if start == end:
            continue  # none of this parameter is in this rank's shard
        start, end = start - base, end - base
        mains.append(flat[start:end])
        ranges.append((start, end))
        segments.append((start, end, index_of[layer_of[param]], True))
    return BucketShard(
        numel=flat.numel(),
        mains=mains,
        local_ranges=ranges,
        segments=segments,
        bucket_layers={index_of[layer_of[p]] for p in group.params},
        model=model,
        flat_mains=flat,
        device=flat.device,
        bucket=group,
        index=index,
    )


def fsdp_model_of(optimizer) -> Optional[FSDPModel]:
    """The :class:`FSDPModel` behind a ``DistributedOptimizer`` built over Megatron-FSDP; None
    for one built over DDP."""
    if not compat.uses_megatron_fsdp(optimizer.ddp_config):
        return None
    return FSDPModel(optimizer)
