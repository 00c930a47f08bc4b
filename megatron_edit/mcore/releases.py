"""The megatron-core releases megatron_edit supports, and the signature of every Megatron
function it wraps or calls, per release.

:mod:`megatron_edit.mcore.compat` explains what differs between the releases and answers the
questions the patches ask (:func:`~megatron_edit.mcore.compat.params`,
:func:`~megatron_edit.mcore.compat.release_range`); this module is its data: the version ranges
and the two signature tables, one for megatron-core (:data:`SIGNATURES`) and one for Megatron-LM's
training code (:data:`TRAINING_SIGNATURES`). A patch whose target's signature is not the one
listed for the installed release fails loudly (:mod:`megatron_edit.mcore.wrap_registry`).
"""

from __future__ import annotations

from typing import Dict, Tuple

from .wrap_registry import VersionRange

SUPPORTED = VersionRange("0.12.0", "0.20.0")
"""megatron-core releases megatron_edit supports (the PyPI releases with the partial
distributed optimizer, 0.12.0 - 0.19.2; a newer release is refused until checked)."""

TRAINING_SUPPORTED = VersionRange("0.16.0", "0.20.0")
"""megatron-core releases whose matching Megatron-LM training code (``megatron.training``, tag
``core_v<version>``; since 0.17 also shipped in the megatron-core wheel) the training patches
were written against. End to end (``pretrain_gpt.py``) at tags core_v0.16.1 and core_v0.19.0;
0.17.1 and 0.18.2 through the wheels' own ``megatron.training`` (signatures, flags, validation)
and, for the torchft backend's route, end to end at core_v0.17.1 and core_v0.18.2 too."""

MEGATRON_LM_TAGS = {"0.16": "core_v0.16.1", "0.17": "core_v0.17.1", "0.18": "core_v0.18.2",
                    "0.19": "core_v0.19.0"}
"""Per release line, the Megatron-LM tag whose training code runs on that megatron-core (since
0.17 the wheel ships the same ``megatron/training``; there is no core_v0.19.1 / 0.19.2 tag, and
core_v0.19.0's ``package_info`` says 0.19.1)."""

TESTED = ("0.12.3", "0.13.1", "0.14.0", "0.15.3", "0.16.1", "0.17.1", "0.18.2", "0.19.2")
"""Releases the multi-rank tests ran against (the newest patch release of each minor)."""

FSDP_SUPPORTED = VersionRange("0.16.1", "0.20.0")
"""megatron-core releases whose Megatron-FSDP internals (the HSDP gradient reduce, the main-weight
buffers, the all-gather pipeline) EDiT's Megatron-FSDP path and the CPU adapter's Megatron-FSDP
shims were checked against; Megatron-FSDP with EDiT is refused on any other release."""

FSDP_TESTED = ("0.16.1", "0.17.1", "0.18.2", "0.19.2")
"""The releases of :data:`FSDP_SUPPORTED` the multi-rank tests ran against."""

FSDP_EXPERT_PARALLEL = VersionRange("0.17.0", "0.20.0")
"""megatron-core releases whose Megatron-FSDP in HSDP builds an expert device mesh (expert
parameters sharded over the worker's expert data-parallel ranks); 0.16's HSDP builds none, and
shards and reduces expert parameters as dense ones (plain HSDP with expert parallelism then
trains another model than DDP)."""

_V12 = VersionRange("0.12.0", "0.13.0")
_V13_14 = VersionRange("0.13.0", "0.15.0")
_V12_14 = VersionRange("0.12.0", "0.15.0")
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
_FSDP_BUFFERS = "megatron.core.distributed.fsdp.src.megatron_fsdp.param_and_grad_buffer"

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
    "megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.step": ((SUPPORTED, ("self",)),),
    "megatron.core.optimizer.optimizer:ChainedOptimizer.step": ((SUPPORTED, ("self",)),),
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
    # MoE expert bias (megatron_edit.mcore.expert_bias): 0.18 passes the count group in.
    "megatron.core.distributed.finalize_model_grads:_update_router_expert_bias": (
        (VersionRange("0.12.0", "0.18.0"), ("model", "config")),
        (_V18_19, ("model", "config", "tp_dp_cp_group")),
    ),
    f"{_PS}:get_tensor_and_data_parallel_group": (
        (_V12_14, ("with_context_parallel",)),
        (VersionRange("0.15.0", "0.20.0"), ("check_initialized", "with_context_parallel")),
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
    # Megatron-FSDP (megatron_edit.mcore.fsdp_wraps): checked on FSDP_SUPPORTED only.
    "megatron.core.distributed.fsdp.mcore_fsdp_adapter:FullyShardedDataParallel.__init__": (
        (FSDP_SUPPORTED, ("self", "config", "ddp_config", "module", "fsdp_unit_modules",
                          "disable_bucketing", "device", "pg_collection")),
    ),
    f"{_FSDP_BUFFERS}:GradReducePipeline._bucket_group_gradient_reduce": (
        (FSDP_SUPPORTED, ("self", "bucket_group", "async_op", "outer_fsdp_group_grad_reduce")),
    ),
    f"{_FSDP_BUFFERS}:AllGatherPipeline.async_bucket_gather": ((FSDP_SUPPORTED, ("self", "bucket_id", "bwd")),),
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
release range (``module:Owner.attr`` as in :class:`~megatron_edit.mcore.wrap_registry.Patch`
targets)."""

_LM_TRAINING = "megatron.training.training"
_LM_INIT = "megatron.training.initialize"
_LM_ARGS = "megatron.training.arguments"
_LM_SAMPLERS = "megatron.training.datasets.data_samplers"
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
    # The torchft backend's data shard (megatron_edit.training.replica_data).
    f"{_LM_TRAINING}:get_train_valid_test_num_samples": ((TRAINING_SUPPORTED, ()),),
    f"{_LM_SAMPLERS}:MegatronPretrainingSampler": (
        (TRAINING_SUPPORTED, ("total_samples", "consumed_samples", "micro_batch_size", "data_parallel_rank",
                              "data_parallel_size", "drop_last")),
    ),
    f"{_LM_SAMPLERS}:MegatronPretrainingRandomSampler": (
        (TRAINING_SUPPORTED, ("dataset", "total_samples", "consumed_samples", "micro_batch_size",
                              "data_parallel_rank", "data_parallel_size", "data_sharding")),
    ),
    f"{_LM_TRAINING}:post_training_step_callbacks": (
        (TRAINING_SUPPORTED, ("model", "optimizer", "opt_param_scheduler", "iteration", "prof",
                              "num_floating_point_operations_since_last_log_event", "nsys_nvtx_context")),
    ),
    # --async-save's per-iteration completion check (megatron_edit.training.meetings).
    f"{_LM_TRAINING}:maybe_finalize_async_save": ((TRAINING_SUPPORTED, ("blocking", "terminate")),),
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


SKIPPED_ITERATION_BASE: Tuple[Tuple[VersionRange, int], ...] = (
    (VersionRange("0.16.0", "0.17.0"), 0),
    (VersionRange("0.17.0", "0.20.0"), 1),
)
"""How Megatron-LM's ``train`` reads ``--iterations-to-skip``, per release checked: with
``iteration`` iterations completed, the next one is skipped when ``iteration + base`` is in the
list (core_v0.16.1: 0-based, ``iteration in args.iterations_to_skip``; core_v0.17.0 to
core_v0.19.0: 1-based, ``(iteration + 1) in args.iterations_to_skip``). A release not listed is
refused by the torchft backend's route through Megatron-LM, which skips iterations to follow a
heal (:mod:`megatron_edit.training.follow_heals`)."""
