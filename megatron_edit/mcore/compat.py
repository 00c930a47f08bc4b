"""The megatron-core releases megatron_edit supports, and everything that differs between them.

EDiT (arXiv 2412.07210) needs Megatron's *partial* distributed optimizer
(``num_distributed_optimizer_instances``: one instance per EDiT worker), which PyPI releases
have since 0.12.0. This module is the one place that knows how those releases differ; the
patches (:mod:`megatron_edit.mcore.patches`, :mod:`megatron_edit.training.patches`) and the
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

This module is long because it is the one table of release differences (eight minor releases
of megatron-core and four of Megatron-LM's training code): splitting it would put version
knowledge back into the patches.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Dict, Optional, Tuple

from .patching import VersionRange, version_tuple

SUPPORTED = VersionRange("0.12.0", "0.20.0")
"""megatron-core releases megatron_edit supports (the PyPI releases with the partial
distributed optimizer, 0.12.0 - 0.19.2; a newer release is refused until checked)."""

TRAINING_SUPPORTED = VersionRange("0.16.0", "0.20.0")
"""megatron-core releases whose matching Megatron-LM training code (``megatron.training``, tag
``core_v<version>``; since 0.17 also shipped in the megatron-core wheel) the training patches
were written against. End to end (``pretrain_gpt.py``) at tags core_v0.16.1 and core_v0.19.0;
0.17.1 and 0.18.2 through the wheels' own ``megatron.training`` (signatures, flags, validation)."""

MEGATRON_LM_TAGS = {"0.16": "core_v0.16.1", "0.17": "core_v0.17.1", "0.18": "core_v0.18.2",
                    "0.19": "core_v0.19.0"}
"""Per release line, the Megatron-LM tag whose training code runs on that megatron-core (since
0.17 the wheel ships the same ``megatron/training``; there is no core_v0.19.1 / 0.19.2 tag, and
core_v0.19.0's ``package_info`` says 0.19.1)."""

TESTED = ("0.12.3", "0.13.1", "0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2")
"""Releases the multi-rank tests ran against (the newest patch release of each minor)."""

_V12 = VersionRange("0.12.0", "0.13.0")
_V13_14 = VersionRange("0.13.0", "0.15.0")
_V12_15 = VersionRange("0.12.0", "0.16.0")
_V15_17 = VersionRange("0.15.0", "0.18.0")
_V16_17 = VersionRange("0.16.0", "0.18.0")
_V16_19 = VersionRange("0.16.0", "0.20.0")
_V13_19 = VersionRange("0.13.0", "0.20.0")
_V18 = VersionRange("0.18.0", "0.19.0")
_V18_19 = VersionRange("0.18.0", "0.20.0")
_V19 = VersionRange("0.19.0", "0.20.0")

_DDP = "megatron.core.distributed.distributed_data_parallel:DistributedDataParallel"
_BUCKET_GROUP = "megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBucketGroup"
_DISTOPT = "megatron.core.optimizer.distrib_optimizer:DistributedOptimizer"
_PS = "megatron.core.parallel_state"

_DISTOPT_INIT = ("self", "optimizer", "config", "grad_scaler", "init_state_fn", "model_chunks",
                 "per_model_buffers", "data_parallel_group", "data_parallel_group_gloo",
                 "data_parallel_group_idx", "distributed_optimizer_instance_id")
_DIST_LOAD = ("sharded_state_dict", "checkpoint_dir", "sharded_strategy", "common_strategy",
              "validate_access_integrity", "strict")

SIGNATURES: Dict[str, Tuple[Tuple[VersionRange, Tuple[str, ...]], ...]] = {
    f"{_DDP}.__init__": (
        (_V12, ("self", "config", "ddp_config", "module", "disable_bucketing")),
        (_V13_14, ("self", "config", "ddp_config", "module", "disable_bucketing",
                   "grad_comm_pgs", "model_comm_pgs")),
        (_V15_17, ("self", "config", "ddp_config", "module", "disable_bucketing", "pg_collection")),
        (_V18_19, ("self", "config", "ddp_config", "module", "disable_bucketing", "pg_collection",
                   "full_param_layout")),
    ),
    f"{_BUCKET_GROUP}.start_grad_sync": (
        (_V12_15, ("self",)),
        (_V16_19, ("self", "force_all_reduce")),
    ),
    f"{_BUCKET_GROUP}.finish_grad_sync": (
        (_V12_15, ("self",)),
        (_V16_19, ("self", "force_all_reduce")),
    ),
    f"{_BUCKET_GROUP}.start_param_sync": ((SUPPORTED, ("self", "force_sync")),),
    f"{_DISTOPT}.__init__": ((SUPPORTED, _DISTOPT_INIT),),
    f"{_DISTOPT}.step_with_ready_grads": ((SUPPORTED, ("self",)),),
    f"{_DISTOPT}._copy_main_params_to_model_params": ((SUPPORTED, ("self",)),),
    f"{_DISTOPT}.get_grad_stats_parallel_group": ((SUPPORTED, ("self",)),),
    "megatron.core.optimizer_param_scheduler:OptimizerParamScheduler.step": ((SUPPORTED, ("self", "increment")),),
    f"{_DISTOPT}.state_dict": ((SUPPORTED, ("self",)),),
    f"{_DISTOPT}.load_state_dict": ((SUPPORTED, ("self", "state_dict")),),
    f"{_DISTOPT}.sharded_state_dict": (
        (_V12, ("self", "model_sharded_state_dict", "is_loading", "sharding_type")),
        (_V13_19, ("self", "model_sharded_state_dict", "is_loading", "sharding_type", "metadata")),
    ),
    "megatron.core.distributed.finalize_model_grads:finalize_model_grads": (
        (VersionRange("0.12.0", "0.14.0"), ("model", "num_tokens")),
        (VersionRange("0.14.0", "0.15.0"), ("model", "num_tokens", "grad_finalize_pgs")),
        (VersionRange("0.15.0", "0.16.0"), ("model", "num_tokens", "pg_collection")),
        (_V16_19, ("model", "num_tokens", "pg_collection", "force_all_reduce")),
    ),
    "megatron.core.optimizer:get_megatron_optimizer": (
        (VersionRange("0.12.0", "0.14.0"),
         ("config", "model_chunks", "no_weight_decay_cond", "scale_lr_cond", "lr_mult",
          "use_gloo_process_groups")),
        (VersionRange("0.14.0", "0.15.0"),
         ("config", "model_chunks", "no_weight_decay_cond", "scale_lr_cond", "lr_mult",
          "use_gloo_process_groups", "default_skip_embedding_weight_decay", "grad_comm_pgs",
          "model_comm_pgs")),
        (VersionRange("0.15.0", "0.16.0"),
         ("config", "model_chunks", "no_weight_decay_cond", "scale_lr_cond", "lr_mult",
          "use_gloo_process_groups", "default_skip_embedding_weight_decay", "pg_collection")),
        (_V16_19, ("config", "model_chunks", "config_overrides", "use_gloo_process_groups",
                   "pg_collection", "dump_param_to_param_group_map")),
    ),
    "megatron.core.dist_checkpointing:load": (
        (VersionRange("0.12.0", "0.17.0"), _DIST_LOAD),
        (VersionRange("0.17.0", "0.19.0"), _DIST_LOAD + ("verify_integrity",)),
        (_V19, ("sharded_state_dict", "checkpoint_dir", "sharded_strategy",
                "validate_access_integrity", "strict", "verify_integrity", "process_group")),
    ),
    f"{_PS}:get_data_parallel_group": (
        (_V12_15, ("with_context_parallel", "partial_data_parallel")),
        (_V16_17, ("with_context_parallel", "partial_data_parallel", "independent_all_gather")),
        (_V18, ("with_context_parallel", "partial_data_parallel")),
        (_V19, ("with_context_parallel", "with_gtp_remat", "partial_data_parallel")),
    ),
    f"{_PS}:get_expert_data_parallel_group": (
        (_V12, ()),
        (VersionRange("0.13.0", "0.19.0"), ("check_initialized", "partial_expert_data_parallel")),
        (_V19, ("check_initialized", "with_gtp_remat", "partial_expert_data_parallel")),
    ),
}
"""Parameter names of each megatron-core function megatron_edit wraps or calls by keyword, per
release range (``module:Owner.attr`` as in :class:`~megatron_edit.mcore.patching.Patch`
targets)."""

_LM_TRAINING = "megatron.training.training"
_LM_INIT = "megatron.training.initialize"
_LM_ARGS = "megatron.training.arguments"
_TRAIN_STEP = ("forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler",
               "config", "forward_backward_func", "iteration")
_EVALUATE = ("forward_step_func", "data_iterator", "model", "process_non_loss_data_func",
             "config", "verbose", "non_loss_data_func", "eval_iters")
_TRAIN = ("forward_step_func", "model", "optimizer", "opt_param_scheduler", "train_data_iterator",
          "valid_data_iterator", "process_non_loss_data_func", "config", "checkpointing_context",
          "non_loss_data_func", "inference_model")
_TRAINING_LOG = ("loss_dict", "total_loss_dict", "learning_rate", "iteration", "loss_scale",
                 "report_memory_flag", "skipped_iter", "grad_norm", "params_norm",
                 "num_zeros_in_grad", "max_attention_logit", "pg_collection", "is_first_iteration")
_INITIALIZE_MEGATRON = (
    (_V16_17, ("extra_args_provider", "args_defaults", "ignore_unknown_args", "allow_no_cuda",
               "skip_mpu_initialization", "get_embedding_ranks", "get_position_embedding_ranks",
               "parsed_args", "store")),
    (_V18, ("allow_no_cuda", "skip_mpu_initialization", "get_embedding_ranks",
            "get_position_embedding_ranks", "store")),
    (_V19, ("allow_no_cuda", "skip_mpu_initialization", "get_embedding_ranks",
            "get_position_embedding_ranks", "store", "skip_model_parallel_init", "seed_pp_group",
            "seed_dp_group", "seed_tp_group", "seed_ep_group", "seed_etp_group",
            "skip_random_seed")),
)

TRAINING_SIGNATURES: Dict[str, Tuple[Tuple[VersionRange, Tuple[str, ...]], ...]] = {
    f"{_LM_ARGS}:parse_args": ((TRAINING_SUPPORTED, ("extra_args_provider", "ignore_unknown_args")),),
    f"{_LM_ARGS}:validate_args": ((TRAINING_SUPPORTED, ("args", "defaults")),),
    # initialize imports both names (and calls them from initialize_megatron) until 0.18.
    f"{_LM_INIT}:parse_args": ((_V16_17, ("extra_args_provider", "ignore_unknown_args")),),
    f"{_LM_INIT}:validate_args": ((_V16_17, ("args", "defaults")),),
    f"{_LM_INIT}:initialize_megatron": _INITIALIZE_MEGATRON,
    f"{_LM_TRAINING}:initialize_megatron": _INITIALIZE_MEGATRON,
    f"{_LM_TRAINING}:training_log": (
        (_V16_17, _TRAINING_LOG),
        (_V18_19, _TRAINING_LOG + ("seqlen_squared_sum_in_batch", "total_real_tokens_in_batch")),
    ),
    f"{_LM_TRAINING}:print_rank_last": ((TRAINING_SUPPORTED, ("message",)),),
    f"{_LM_TRAINING}:train_step": (
        (VersionRange("0.16.0", "0.19.0"), _TRAIN_STEP),
        (_V19, _TRAIN_STEP + ("pg_collection", "p2p_communicator")),
    ),
    f"{_LM_TRAINING}:evaluate": (
        (VersionRange("0.16.0", "0.19.0"), _EVALUATE),
        (_V19, _EVALUATE + ("pg_collection", "p2p_communicator")),
    ),
    # A-EDiT's global budget (megatron_edit.training.global_budget): 0.19 puts model_type first.
    f"{_LM_TRAINING}:setup_model_and_optimizer": (
        (VersionRange("0.16.0", "0.19.0"), ("model_provider_func", "model_type", "checkpointing_context")),
        (_V19, ("model_type", "model_provider_func", "checkpointing_context", "cfg_container", "pg_collection")),
    ),
    f"{_LM_TRAINING}:train": (
        (VersionRange("0.16.0", "0.19.0"), _TRAIN),
        (_V19, _TRAIN + ("p2p_communicator", "pg_collection")),
    ),
    f"{_LM_TRAINING}:checkpoint_and_decide_exit": (
        (TRAINING_SUPPORTED, ("model", "optimizer", "opt_param_scheduler", "iteration",
                              "num_floating_point_operations_so_far", "checkpointing_context",
                              "train_data_iterator")),
    ),
    f"{_LM_TRAINING}:calc_params_l2_norm": ((TRAINING_SUPPORTED, ("model", "force_create_fp32_copy")),),
    f"{_LM_TRAINING}:get_attr_wrapped_model": (
        (TRAINING_SUPPORTED, ("model", "attr", "allow_none", "return_model_obj")),
    ),
    f"{_LM_TRAINING}:consume_seqlen_stats_in_iteration": ((_V18_19, ()),),
    "megatron.legacy.fused_kernels:load": ((VersionRange("0.16.0", "0.17.0"), ("args",)),),
}
"""The same for Megatron-LM's ``megatron.training`` (and ``megatron.legacy``), per release of the
megatron-core it ships with; only the releases in :data:`TRAINING_SUPPORTED`. A range that ends
early means the function is gone after it."""


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


def pipeline_parallel_group(ddp):
    """The pipeline-parallel group of a DDP-wrapped model chunk: ``pp_group`` since 0.15;
    before, ``parallel_state``'s."""
    group = getattr(ddp, "pp_group", None)
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_group()


# inter-instance group -> the instance group built from it (0.12.x only; see instance_group)
_BUILT_INSTANCE_GROUPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


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
    cached = _BUILT_INSTANCE_GROUPS.get(inter_group)
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
    _BUILT_INSTANCE_GROUPS[inter_group] = mine
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
