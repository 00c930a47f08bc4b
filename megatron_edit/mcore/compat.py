"""The megatron-core releases megatron_edit supports, and everything that differs between them.

EDiT (arXiv 2412.07210) needs Megatron's *partial* distributed optimizer
(``num_distributed_optimizer_instances``: one instance per EDiT worker), which PyPI releases
have since 0.12.0. This module is the one place that knows how those releases differ; the
patches (:mod:`megatron_edit.mcore.core_wraps`, :mod:`megatron_edit.training.training_wraps`) and the
EDiT core ask it instead of testing versions themselves. CPU-only differences live in
:mod:`megatron_edit.cpu.adapter` and :mod:`megatron_edit.cpu.training_adapter`.

What differs, for what megatron_edit touches (checked on every PyPI release from 0.12.0 to
0.19.2; 0.12.3, 0.13.1, 0.14.0, 0.15.3, 0.16.1, 0.17.1, 0.18.2 and 0.19.2 also run the
multi-rank tests; 0.17+ need Python 3.12)::

    ===================================  ================================================  =======
    what                                 how                                               since
    ===================================  ================================================  =======
    DistributedDataParallel.__init__     (config, ddp_config, module, disable_bucketing)   0.12.0
                                         ... + grad_comm_pgs, model_comm_pgs               0.13.0
                                         ... + pg_collection (instead)                     0.15.0
                                         ... + full_param_layout                           0.18.0
    DDP process-group attributes         none: DDP reads parallel_state                    0.12.0
                                         dp_cp_group, intra_dp_cp_group, inter_dist_opt..  0.13.0
                                         tp_group                                          0.15.0
    _ParamAndGradBucketGroup             start/finish_grad_sync(self)                      0.12.0
      .start_grad_sync/.finish_grad_sync ... (self, force_all_reduce=False)                0.16.0
      .start_param_sync                  (self, force_sync=False)                          0.12.0
    bucket-group attributes              intra_/inter_distributed_optimizer_instance_group, all
                                         communication_stream (inter only with >1 instance),
                                         next_param_gather_bucket_group, buckets,
                                         ddp_config; bucket.gradient_scaling_factor
    inter-instance all-reduce            inside start_grad_sync when ddp_config has         all
                                         num_distributed_optimizer_instances > 1, after the
                                         reduce-scatter, synchronous on communication_stream
    finish_grad_sync, first batch        starts the reduction itself (re-entrant)          0.16.0
                                         idempotent within an iteration                    0.18.0
    DistributedOptimizer.__init__        (optimizer, config, grad_scaler, init_state_fn,    all
                                         model_chunks, per_model_buffers,
                                         data_parallel_group, data_parallel_group_gloo,
                                         data_parallel_group_idx,
                                         distributed_optimizer_instance_id)
      .step_with_ready_grads,            (self); main -> model copy, then param all-gather  all
      ._copy_main_params_to_model_params
      .state_dict, .load_state_dict      (self), (self, state_dict)                        all
      .sharded_state_dict                (self, model_sharded_state_dict, is_loading,       0.12.0
                                         sharding_type)
                                         ... + metadata                                    0.13.0
      gbuf_ranges, "gbuf_local" /        unchanged; model_float16_groups,                  all
      "gbuf_world_in_bucket",            shard_fp32_from_float16_groups, model_fp32_groups,
      buffer.data_parallel_group         shard_fp32_groups unchanged
    gradient statistics (norm, zeros)    over ALL ranks with the distributed optimizer     0.12.0
      of the distributed optimizer       (partial: norm sqrt(instances) too large)
                                         over the instance (get_megatron_optimizer sets    0.13.0
                                         grad_stats_parallel_group)
    finalize_model_grads                 (model, num_tokens)                               0.12.0
                                         ... + grad_finalize_pgs                           0.14.0
                                         ... + pg_collection (instead)                     0.15.0
                                         ... + force_all_reduce                            0.16.0
    finalize_model_grads.                (model, config); the counts' group read from      0.12.0
      _update_router_expert_bias         parallel_state inside get_updated_expert_bias
      (MoE expert bias)                  ... + tp_dp_cp_group (passed down)                0.18.0
    parallel_state.                      (with_context_parallel)                           0.12.0
      get_tensor_and_data_parallel_group (check_initialized, with_context_parallel)        0.15.0
    get_megatron_optimizer               (config, model_chunks, no_weight_decay_cond,      0.12.0
                                         scale_lr_cond, lr_mult, use_gloo_process_groups)
                                         ... + default_skip_embedding_weight_decay,        0.14.0
                                         grad_comm_pgs, model_comm_pgs
                                         ... pg_collection instead of the two              0.15.0
                                         (config, model_chunks, config_overrides,          0.16.0
                                         use_gloo_process_groups, pg_collection, ...)
    dist_checkpointing.load              (sharded_state_dict, checkpoint_dir,              0.12.0
                                         sharded_strategy, common_strategy, ...)
                                         ... + verify_integrity                            0.17.0
                                         ... common_strategy removed                       0.19.0
    parallel_state instance groups       get_inter_partial_data_parallel_group()           0.12.0
                                         get_intra_/get_inter_distributed_optimizer_       0.13.0
                                         instance_group()
    parallel_state.                      (with_context_parallel, partial_data_parallel)    0.12.0
      get_data_parallel_group            ... + independent_all_gather                      0.16.0
                                         ... independent_all_gather removed                0.18.0
                                         (with_context_parallel, with_gtp_remat,           0.19.0
                                         partial_data_parallel)
      get_expert_data_parallel_group     ()                                                0.12.0
                                         (check_initialized, partial_expert_data_parallel) 0.13.0
                                         ... with_gtp_remat second                         0.19.0
    DistributedDataParallelConfig        use_custom_fsdp                                   all
                                         use_megatron_fsdp                                 0.14.0
    TransformerConfig                    enable_cuda_graph, external_cuda_graph            all
                                         cuda_graph_impl                                   0.15.0
    OptimizerConfig                      use_precision_aware_optimizer,                    all
                                         overlap_param_gather_with_optimizer_step,
                                         optimizer_cpu_offload
                                         optimizer_cuda_graph                              0.17.0
                                         grad_norm_skip_threshold,                         0.18.0
                                         use_layer_wise_distributed_optimizer
    checkpoint sharding_type             fully_sharded_model_space, ...bucket_space        0.12.0
      (distributed optimizer)            ... + dp_reshardable, fully_reshardable           0.15.0
    megatron.core.tokenizers             absent (datasets.megatron_tokenizer instead)      0.12.0
      .MegatronTokenizerBase             present                                           0.15.0
    model_parallel_cuda_manual_seed      (seed, te_rng_tracker, inference_rng_tracker,     0.12.0
                                         use_cudagraphable_rng)
                                         ... + tp_rank, ep_rank, etp_rank                  0.13.0
                                         ... + force_reset_rng                             0.14.0
    megatron/training in the wheel       absent (Megatron-LM checkout only)                0.12.0
                                         the matching tag's copy                           0.17.0
    ===================================  ================================================  =======

Megatron-LM's training code (``megatron.training``, tags ``core_v0.16.1`` ... ``core_v0.19.0``)
differs too; :data:`TRAINING_SIGNATURES` lists it the same way::

    ===================================  ================================================  =======
    initialize_megatron                  parses arguments (extra_args_provider, ...)       0.16.0
                                         reads get_args() (allow_no_cuda, ...)             0.18.0
    initialize binds parse_args /        yes                                               0.16.0
      validate_args                      no (scripts call arguments.parse_and_validate_    0.18.0
                                         args, then pretrain(cfg_container, ...))
    megatron.legacy.fused_kernels        loaded by initialize                              0.16.0
                                         gone                                              0.17.0
    training_log                         ... + seqlen_squared_sum_in_batch,                0.18.0
                                         total_real_tokens_in_batch
    packed-sequence statistics           a world all-reduce per iteration (--sft, ...)     0.18.0
    train_step, evaluate                 loss reduced over get_data_parallel_group()       0.16.0
                                         over the model's pg_collection.dp_cp              0.19.0
                                         (+ pg_collection, p2p_communicator parameters)
    calc_params_l2_norm                  + two reductions over the expert DP group         0.19.0
    ===================================  ================================================  =======

Older releases (0.11.0 and before) have no partial distributed optimizer and are refused;
releases after the newest one checked here (0.20.0 and later) are refused too, until checked.

The version ranges and the signature tables are in :mod:`megatron_edit.mcore.releases`.
"""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

from .wrap_registry import VersionRange, version_tuple
from .process_state import PROCESS

from .releases import (  # noqa: F401  (the data this module answers from; compat.X reads it)
    FSDP_SUPPORTED,
    MEGATRON_LM_TAGS,
    SIGNATURES,
    SKIPPED_ITERATION_BASE,
    SUPPORTED,
    TESTED,
    TRAINING_SIGNATURES,
    TRAINING_SUPPORTED,
)


def megatron_core_version() -> str:
    from megatron.core import package_info

    return package_info.__version__


def is_supported(version: Optional[str] = None) -> bool:
    return SUPPORTED.contains(version or megatron_core_version())


def version_at_least(minimum: str, version: Optional[str] = None) -> bool:
    return version_tuple(version or megatron_core_version()) >= version_tuple(minimum)


def params(target: str, version: Optional[str] = None) -> Tuple[str, ...]:
    """The parameter names ``target`` has in ``version`` (default: the installed release), from
    :data:`SIGNATURES` or :data:`TRAINING_SIGNATURES`.

    Raises KeyError for a target this module does not track and LookupError for a version no
    range covers (outside :data:`SUPPORTED`, or a release that lacks the function)."""
    version = version or megatron_core_version()
    table = SIGNATURES if target in SIGNATURES else TRAINING_SIGNATURES
    for versions, names in table[target]:
        if versions.contains(version):
            return names
    raise LookupError(f"{target}: no known signature for megatron-core {version} (supported: {SUPPORTED})")


def release_range(target: str) -> VersionRange:
    """The releases ``target`` exists in (one contiguous range in the tables)."""
    table = SIGNATURES if target in SIGNATURES else TRAINING_SIGNATURES
    ranges = [r for r, _ in table[target]]
    return VersionRange(min((r.minimum for r in ranges), key=version_tuple),
                        max((r.below for r in ranges), key=version_tuple))


def call_kwargs(fn, **kwargs) -> dict:
    """``kwargs`` restricted to the parameters ``fn`` has in the installed release: for optional
    arguments that older releases lack (e.g. ``force_all_reduce`` before 0.16)."""
    names = inspect.signature(inspect.unwrap(fn)).parameters
    return {k: v for k, v in kwargs.items() if k in names}


# --- process groups ---------------------------------------------------------------------------


def skipped_iteration_base(version: Optional[str] = None) -> Optional[int]:
    """How Megatron-LM's loop reads ``--iterations-to-skip`` on ``version`` (default: the
    installed release): with ``i`` iterations done, the next is skipped when ``i + base`` is
    listed (:data:`SKIPPED_ITERATION_BASE`); None on a release not checked."""
    version = version or megatron_core_version()
    for versions, base in SKIPPED_ITERATION_BASE:
        if versions.contains(version):
            return base
    return None


def inter_instance_group(bucket_group):
    """The group across distributed-optimizer instances for this bucket group's shard (EDiT's
    sync group), or None with a single instance. Same attribute on every supported release,
    set by DDP only when ``num_distributed_optimizer_instances > 1``."""
    return getattr(bucket_group, "inter_distributed_optimizer_instance_group", None)


def data_parallel_group(ddp):
    """The full data-parallel group (with context parallelism) a DDP reduces over: ``dp_cp_group``
    since 0.13; 0.12's DDP keeps no group and reads ``parallel_state`` itself."""
    group = getattr(ddp, "dp_cp_group", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_group(with_context_parallel=True)


def tensor_parallel_group(ddp):
    """The tensor-parallel group of a DDP-wrapped model chunk: ``tp_group`` since 0.15; before,
    Megatron's layers read ``parallel_state``, so that is the group they use."""
    group = getattr(ddp, "tp_group", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def expert_groups(ddp):
    """MoE with expert parallelism: ``(expert tensor-parallel group, expert tensor x model
    parallel group)`` of a DDP-wrapped model chunk, the groups its token dispatchers use
    (``tp_group`` / ``tp_ep_group`` since 0.15); before, ``parallel_state``'s."""
    for module in ddp.modules():
        tp_ep = getattr(module, "tp_ep_group", None)
        if tp_ep is not None and getattr(module, "tp_group", None) is not None:
            return module.tp_group, tp_ep
    from megatron.core import parallel_state

    return (parallel_state.get_expert_tensor_parallel_group(),
            parallel_state.get_expert_tensor_and_model_parallel_group())


def pipeline_parallel_group(ddp):
    """The pipeline-parallel group of a DDP-wrapped model chunk: ``pp_group`` since 0.15;
    before, ``parallel_state``'s."""
    group = getattr(ddp, "pp_group", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


def instance_group(inter_group, build: Optional[bool] = None):
    """All ranks of this rank's distributed-optimizer instance (tensor, pipeline and sharding
    ranks of one EDiT worker): where gradient statistics (the clipping norm, zero counts) must
    be reduced. None with a single instance (then it is every rank).

    Since 0.13 ``parallel_state`` builds this group (None here when ``parallel_state`` is not
    initialized: groups passed explicitly, Megatron then knows its own). 0.12.x has none (its
    distributed optimizer reduces statistics over all ranks), so it is built here from the
    inter-instance group: a collective over the default group (``all_gather_object`` + one
    ``new_group`` per instance), so every rank must call this at the same point, e.g. while
    building the optimizer. Built once per inter-instance group. ``build=True`` forces that path
    on any release (tests compare it with Megatron's own group).
    """
    import torch.distributed as dist

    if inter_group is None or dist.get_world_size(inter_group) == 1:
        return None
    if build is None:
        build = not version_at_least("0.13.0")
    if not build:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return None
        return parallel_state.get_intra_distributed_optimizer_instance_group()
    cached = PROCESS.built_instance_groups.get(inter_group)  # the process's, see process_state
    if cached is not None:
        return cached
    # Instances are contiguous blocks of data-parallel ranks, so a rank's index in its
    # inter-instance group (ordered by rank) is its instance; 0.12's get_megatron_optimizer
    # computes distributed_optimizer_instance_id the same way.
    instance_of = [None] * dist.get_world_size()
    dist.all_gather_object(instance_of, dist.get_rank(inter_group))
    mine = None
    for instance in range(dist.get_world_size(inter_group)):
        ranks = [r for r, i in enumerate(instance_of) if i == instance]
        group = dist.new_group(ranks)  # every rank creates every group, in the same order
        if instance_of[dist.get_rank()] == instance:
            mine = group
    PROCESS.built_instance_groups[inter_group] = mine
    return mine


def grad_stats_reduced_per_instance(version: Optional[str] = None) -> bool:
    """Whether Megatron's distributed optimizer reduces gradient statistics inside one instance
    (0.13+). In 0.12.x it reduces them over all ranks: across EDiT workers every step, and
    sqrt(instances) too large even in synchronous training."""
    return version_at_least("0.13.0", version)


# --- config fields ------------------------------------------------------------------------------


def uses_megatron_fsdp(ddp_config) -> bool:
    """Megatron-FSDP: ``use_megatron_fsdp`` (0.14+) or its older name ``use_custom_fsdp``."""
    return bool(getattr(ddp_config, "use_megatron_fsdp", False) or getattr(ddp_config, "use_custom_fsdp", False))


def uses_cuda_graphs(transformer_config) -> bool:
    """CUDA graphs: ``cuda_graph_impl`` != "none" (0.15+), or ``enable_cuda_graph`` /
    ``external_cuda_graph`` (every release; 0.15+ maps them onto ``cuda_graph_impl``)."""
    return (
        getattr(transformer_config, "cuda_graph_impl", "none") != "none"
        or bool(getattr(transformer_config, "enable_cuda_graph", False))
        or bool(getattr(transformer_config, "external_cuda_graph", False))
    )


# --- Megatron-LM's training loop ---------------------------------------------------------------


def packed_sequence_stats_all_reduced(version: Optional[str] = None) -> bool:
    """Whether Megatron-LM's training loop all-reduces packed-sequence (THD) length statistics
    over all ranks every iteration (``consume_seqlen_stats_in_iteration``, 0.18+)."""
    return version_at_least("0.18.0", version)


# --- data ---------------------------------------------------------------------------------------


class _TokenizerBase:
    """Before 0.15 there is no ``megatron.core.tokenizers``; ``GPTDataset`` only reads a
    tokenizer's attributes (``eod``, ``pad``, ``vocab_size``, ``unique_identifiers``), and the
    old ``MegatronTokenizer`` base has another constructor and sets ``unique_identifiers``
    itself, so a tokenizer written for 0.15+ derives from this stand-in instead."""

    def __init__(self, path: str = "", config: Optional[dict] = None, **kwargs) -> None:
        self.path, self.config = path, config or {}


def tokenizer_base() -> type:
    """The base class of a megatron-core tokenizer object: ``MegatronTokenizerBase`` (0.15+)."""
    try:
        from megatron.core.tokenizers import MegatronTokenizerBase
    except ImportError:
        return _TokenizerBase
    return MegatronTokenizerBase
