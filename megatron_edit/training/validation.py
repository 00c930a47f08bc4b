"""EDiT's flags checked together with Megatron-LM's options at start-up.

The megatron-core checks (:mod:`megatron_edit.mcore.checks`, the same ones the DDP / optimizer
patches run) on Megatron-LM's parsed flags, plus the options only Megatron-LM's training loop
has: those whose collectives across workers cannot be kept inside a worker (see
:mod:`megatron_edit.training.worker_local` for those that are) are refused, naming the flag.
"""

from __future__ import annotations

import argparse
import logging
import os
from types import SimpleNamespace

from ..arguments import check_flags_need_local_sgd, configs_from_args
from ..config import ConfigError, NotSupportedYet
from ..exchange.run_gate import START_GATE_ENV, supervised_workers
from ..mcore import compat
from ..mcore.checks import check_megatron_options, check_moe_options, check_optimizer_options, check_workers
from ..mcore.wrap_registry import VersionRange

logger = logging.getLogger(__name__)


def validate_local_sgd_args(args: argparse.Namespace) -> None:
    """Check the EDiT flags against Megatron-LM's parsed, validated arguments.

    Call after Megatron's ``validate_args`` (which computes ``data_parallel_size``). Raises
    :class:`ConfigError` / :class:`NotSupportedYet` naming the flag; does nothing without
    ``--use-local-sgd``.
    """
    configs = configs_from_args(args)  # the flags alone (ConfigError names the flag)
    if configs is None:
        check_flags_need_local_sgd(args)
        return
    local = configs[0]
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    if local.sync_backend == "torchft":
        _check_torchft_route(local, args)
    if get("use_torch_fsdp2"):  # before the distributed optimizer's check: Megatron refuses both together
        raise ConfigError(
            "--use-local-sgd does not work with --use-torch-fsdp2: EDiT attaches to Megatron's "
            "distributed optimizer (or Megatron-FSDP, --use-megatron-fsdp), which FSDP2 replaces. Use "
            "--use-distributed-optimizer or --use-megatron-fsdp instead.")
    # First: Megatron's validate_args turns --use-distributed-optimizer off for these (0.18+).
    if get("optimizer", "adam") not in ("adam", "sgd") or get("use_layer_wise_distributed_optimizer"):
        raise NotSupportedYet(
            f"--optimizer {get('optimizer')} with --use-local-sgd is not supported yet: EDiT's outer "
            "step works over any inner optimizer (its pseudo-gradient is the change of the "
            "parameters), but Megatron trains Muon-like optimizers (whose update needs a whole "
            "matrix) with its layer-wise optimizer, which refuses --num-distributed-optimizer-"
            "instances > 1, the instances that are EDiT's workers (and megatron_edit keeps its state "
            "on the distributed optimizer's element-wise shards). Use --optimizer adam or sgd with "
            "--use-distributed-optimizer."
        )
    # The same checks the DDP / optimizer patches run, on Megatron's flags.
    model_options = SimpleNamespace(
        cuda_graph_impl=get("cuda_graph_impl", "none") or "none",
        enable_cuda_graph=get("enable_cuda_graph", False),
        external_cuda_graph=get("external_cuda_graph", False),
        calculate_per_token_loss=get("calculate_per_token_loss", False),
        tensor_model_parallel_size=get("tensor_model_parallel_size", 1),
        pipeline_model_parallel_size=get("pipeline_model_parallel_size", 1),
        context_parallel_size=get("context_parallel_size", 1),
        num_moe_experts=get("num_experts", None),
        expert_model_parallel_size=get("expert_model_parallel_size", 1),
    )
    ddp_options = SimpleNamespace(
        use_distributed_optimizer=get("use_distributed_optimizer", False),
        use_megatron_fsdp=get("use_megatron_fsdp", False),
        use_custom_fsdp=get("use_custom_fsdp", False),
        overlap_param_gather=get("overlap_param_gather", False),
        # The parameter buffers hold FP8 bytes: refused, naming --fp8-param-gather.
        fp8_param_gather=get("fp8_param_gather", False),
        reuse_grad_buf_for_mxfp8_param_ag=get("reuse_grad_buf_for_mxfp8_param_ag", False),
        # Megatron-FSDP (megatron_edit.mcore.fsdp's checks; 0.16 keeps fp32 main weights)
        data_parallel_sharding_strategy=get("data_parallel_sharding_strategy", "no_shard"),
        outer_dp_sharding_strategy=get("outer_dp_sharding_strategy", "no_shard"),
        num_distributed_optimizer_instances=get("num_distributed_optimizer_instances", 1),
        preserve_fp32_weights=True,
        megatron_fsdp_main_params_dtype=get("megatron_fsdp_main_params_dtype", "fp32"),  # 0.17+
        fsdp_double_buffer=get("fsdp_double_buffer", False),
        nccl_ub=get("nccl_ub", False),
    )
    fsdp = ddp_options.use_megatron_fsdp or ddp_options.use_custom_fsdp
    check_megatron_options(local, model_options, ddp_options,  # (Megatron-FSDP: its release first)
                           tokens_counted_in_worker=not fsdp)  # training.worker_local counts them
    if (get("use_megatron_fsdp") or get("use_custom_fsdp")) and (get("save") or get("load")) and \
            get("ckpt_format", "torch_dist") != "fsdp_dtensor":
        raise NotSupportedYet(
            f"--ckpt-format {get('ckpt_format', 'torch_dist')} with --use-megatron-fsdp and --use-local-sgd: "
            "EDiT's state on Megatron-FSDP is saved in Megatron-FSDP's own format; use --ckpt-format "
            "fsdp_dtensor (docs/concepts/megatron-fsdp.md).")
    # DDP's group for the instances is data x context parallel.
    check_workers(
        args.data_parallel_size * get("context_parallel_size", 1),
        get("num_distributed_optimizer_instances", 1),
    )
    optimizer_options = SimpleNamespace(
        use_precision_aware_optimizer=get("use_precision_aware_optimizer", False),
        overlap_param_gather_with_optimizer_step=get("overlap_param_gather_with_optimizer_step", False),
        optimizer_cpu_offload=get("optimizer_cpu_offload", False),
        optimizer_cuda_graph=get("optimizer_cuda_graph", False),
    )
    # Megatron builds a grad scaler for fp16, and for any --loss-scale.
    check_optimizer_options(optimizer_options, bool(get("fp16")) or bool(get("loss_scale")),
                            bool(get("use_megatron_fsdp")))
    _check_megatron_lm_options(local, args)
    if get("rank", 0) != 0:
        return
    if get("num_distributed_optimizer_instances", 1) == 1 and local.sync_backend == "torch":
        logger.warning(
            "megatron_edit: --use-local-sgd with --num-distributed-optimizer-instances 1 is one "
            "worker: ordinary synchronous training plus an outer optimizer, nothing is saved. "
            "Set it to the number of workers (e.g. nodes, or the data-parallel size)."
        )
    _warn_if_edit_never_acts(local, get("train_iters"))


def _check_torchft_route(local, args: argparse.Namespace) -> None:
    """``--local-sgd-sync-backend torchft`` through Megatron-LM: each worker's job is one worker
    (:mod:`megatron_edit.training.replica_data` gives it its own data, and
    :mod:`megatron_edit.training.follow_heals` keeps Megatron's loop counter with a heal)."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    version = compat.megatron_core_version()
    if compat.skipped_iteration_base(version) is None:
        raise NotSupportedYet(
            f"--local-sgd-sync-backend torchft through Megatron-LM is not supported yet on megatron-core {version} "
            "(checked: 0.16.x-0.19.x: how the loop skips iterations, which a healed worker's loop does to keep "
            "the others' iteration); the megatron-core API runs it.")
    instances = get("num_distributed_optimizer_instances", 1)
    if instances != 1:
        raise ConfigError(
            f"--num-distributed-optimizer-instances {instances} with --local-sgd-sync-backend torchft: each job "
            "is one worker; pass 1 and start one job per worker (python -m megatron_edit.supervise).")
    if supervised_workers(os.environ.get(START_GATE_ENV)) is None:
        raise ConfigError(
            "--local-sgd-sync-backend torchft through Megatron-LM needs the run's number of workers, to give each "
            "worker its own slice of the data: start the jobs with python -m megatron_edit.supervise --workers N "
            "(or its --serve mode on several nodes), which tells every job.")
    if get("train_samples"):  # a fresh job that heals to the others' step has consumed no samples
        raise NotSupportedYet(
            "--train-samples with --local-sgd-sync-backend torchft is not supported yet: a relaunched worker heals "
            "to the others' step without their consumed samples, which Megatron's sample-based loop needs. Give "
            "the run's length in iterations (--train-iters, and --lr-decay-iters for the schedule).")
    if get("hybrid_context_parallel") or get("dataloader_type", "single") not in ("single", "cyclic"):
        flag = ("--hybrid-context-parallel" if get("hybrid_context_parallel")
                else f"--dataloader-type {get('dataloader_type')}")
        raise NotSupportedYet(
            f"{flag} with --local-sgd-sync-backend torchft is not supported yet: each worker's job must read its "
            "own slice of the data, which megatron_edit gives Megatron's single and cyclic samplers only.")


def _warn_if_edit_never_acts(local, train_iters) -> None:
    """A warmup or a first sync beyond --train-iters leaves EDiT with nothing to do. Warned, not
    refused: a run resumed from a checkpoint, or one meant as a warmup, may want it."""
    if train_iters is None:
        return
    w, h = local.local_sgd_warmup_steps, local.local_sgd_sync_interval
    if w >= train_iters:
        logger.warning(
            "megatron_edit: --local-sgd-warmup-steps %d >= --train-iters %d: every iteration is "
            "ordinary synchronous training, EDiT never trains locally.", w, train_iters,
        )
    elif not local.use_async and w + h > train_iters:
        logger.warning(
            "megatron_edit: the first sync would follow iteration %d (--local-sgd-warmup-steps %d "
            "+ --local-sgd-sync-interval %d), after --train-iters %d: the workers train locally "
            "and never sync.", w + h, w, h, train_iters,
        )


# Releases whose MoE metrics logging worker_local keeps inside the worker (0.17 / 0.18 log
# through other functions, not covered).
_MOE_LOGGING_LOCAL = (VersionRange("0.16.0", "0.17.0"), VersionRange("0.19.0", "0.20.0"))


def _check_moe_args(local, args: argparse.Namespace) -> None:
    """MoE (--num-experts): what megatron-core refuses (:func:`check_moe_options`, on the flags
    of the same names), the MoE options only Megatron-LM has, and the releases whose MoE logging
    reduction is kept inside the worker (:mod:`megatron_edit.training.worker_local`)."""
    version = compat.megatron_core_version()
    if not any(r.contains(version) for r in _MOE_LOGGING_LOCAL):
        raise NotSupportedYet(
            f"--num-experts with --use-local-sgd on megatron-core {version} is not supported yet "
            "(checked with 0.16.x and 0.19.x, whose MoE metrics logging is kept inside the worker).")
    if getattr(args, "moe_use_upcycling", False):
        raise NotSupportedYet("--moe-use-upcycling with --use-local-sgd is not supported yet.")
    check_moe_options(local, args, (getattr(args, "expert_model_parallel_size", 1) or 1) > 1)


def _check_megatron_lm_options(local, args: argparse.Namespace) -> None:
    """Options only Megatron-LM's training loop has."""
    if getattr(args, "num_experts", None):
        _check_moe_args(local, args)
    if (getattr(args, "gtp_weight_remat_size", 1) or 1) > 1:  # 0.19+
        raise NotSupportedYet(
            "--tensor-parallel-num-weight-shards > 1 (GTP weight rematerialisation) with "
            "--use-local-sgd is not supported yet: it adds a data-distribution axis across the "
            "workers' data-parallel groups."
        )
    if getattr(args, "ckpt_format", "torch_dist") == "torch":
        raise ConfigError(
            "--ckpt-format torch with --use-local-sgd: the legacy format gathers the optimizer "
            "state of one EDiT worker only and cannot hold EDiT's anchors and outer state, so the "
            "first save would fail after training. Use --ckpt-format torch_dist (Megatron's "
            "default)."
        )
    if getattr(args, "ckpt_assume_constant_structure", False) and local.auto_overlap:
        # Every other EDiT entry is in every checkpoint (megatron_edit.mcore.checkpoint.constant).
        raise ConfigError(
            "--ckpt-assume-constant-structure with --local-sgd-auto-overlap: the delay and exchange "
            "format it changes between syncs decide which EDiT entries a checkpoint holds (a delayed "
            "exchange in flight, error-feedback residuals), and Megatron would reuse the first saves' "
            "plan, leaving out the new entries. Drop one of the two flags.")
    _check_cross_worker_options(local, args)
    interval = getattr(args, "check_weight_hash_across_dp_replicas_interval", None)
    if interval is not None and max(local.allowed_fragments) > 1:
        given = (f"--local-sgd-fragments {local.fragments}" if local.fragments > 1
                 else f"--local-sgd-auto-fragments {local.auto_fragments}")
        raise ConfigError(
            f"--check-weight-hash-across-dp-replicas-interval={interval} with {given}: each sync makes "
            "one fragment identical on every worker, never the whole model (until the run's last "
            f"step), so Megatron's check could never pass. Drop the flag, or {given.split()[0]}.")
    if interval is not None and local.auto_overlap and local.merge_keeps_local:
        raise ConfigError(
            f"--check-weight-hash-across-dp-replicas-interval={interval} with --local-sgd-auto-overlap: "
            "the delay it may choose merges with a rule that keeps each worker's own progress, so "
            "replicas may differ right after a sync and Megatron's check would fail. Add "
            "--local-sgd-outer-merge-alpha 0, or drop the flag.")
    if interval is not None and local.outer_step_delay and local.merge_keeps_local:
        merge = ("--local-sgd-outer-merge-rule keep_local" if local.outer_merge_rule == "keep_local"
                 else f"--local-sgd-outer-merge-alpha {local.merge_alpha:g}")
        raise ConfigError(
            f"--check-weight-hash-across-dp-replicas-interval={interval} with "
            f"--local-sgd-outer-step-delay {local.outer_step_delay} and {merge}: after a delayed "
            "outer step each worker keeps part of its own progress, so replicas differ by design "
            "even right after a sync and Megatron's check would fail at the first one. Add "
            "--local-sgd-outer-merge-alpha 0 (every worker takes the new anchor), or drop the flag.")


_BETWEEN_SYNCS = (
    "a collective across all ranks between syncs: a barrier that holds every EDiT worker to the "
    "slowest one, which local SGD exists to avoid"
)


def _check_cross_worker_options(local, args: argparse.Namespace) -> None:
    """Megatron-LM options whose collectives across workers cannot be kept inside one (see
    :class:`WorkerLocalCollectives` for those that are)."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    if get("exit_signal_handler") and local.use_async:
        raise ConfigError(
            "--exit-signal-handler with --local-sgd-async: Megatron checks for the signal with an "
            "all-gather over all ranks, and A-EDiT workers never finish an iteration together "
            "(they sync at different iterations), so there is no step to check it at. Use "
            "--exit-interval / --train-iters."
        )
    if local.use_async:
        if get("train_iters") is None and not get("train_samples"):
            raise ConfigError(
                "--local-sgd-async needs --train-iters or --train-samples: A-EDiT shares the run's "
                "length among the workers by speed and ends it with one final sync."
            )
        # --save-interval / --exit-interval count global progress and act at syncs
        # (training.global_budget); these would act at a worker's own iteration.
        if get("non_persistent_save_interval"):
            raise ConfigError(
                "--non-persistent-save-interval with --local-sgd-async: Megatron takes it at each "
                "worker's own iterations, which A-EDiT workers reach at different times (and "
                "between different syncs), so the save would wait on collectives some workers "
                "never join. Use --save-interval (with A-EDiT it counts global progress and saves "
                "at a sync)."
            )
        stops = [f for f in ("save_interval", "exit_interval", "exit_duration_in_mins") if get(f)]
        if (local.outer_step_delay or local.auto_overlap) and stops:  # (auto_overlap may choose a delay)
            delay = "--local-sgd-outer-step-delay" if local.outer_step_delay else "--local-sgd-auto-overlap"
            raise NotSupportedYet(
                f"--{stops[0].replace('_', '-')} with --local-sgd-async and {delay} is not "
                "supported yet: A-EDiT saves and stops at a sync, where a delayed exchange has just been "
                f"launched, and a checkpoint with it in flight is not built for A-EDiT. Drop the flag or {delay}."
            )
        if get("rampup_batch_size") or get("step_batch_size_schedule"):
            flag = "--rampup-batch-size" if get("rampup_batch_size") else "--step-batch-size-schedule"
            raise ConfigError(
                f"{flag} with --local-sgd-async: Megatron saves a checkpoint whenever "
                "the batch size changes, at each worker's own iteration, which A-EDiT workers "
                "reach at different times, so the save would hang. Use a fixed "
                "--global-batch-size."
            )
    if compat.packed_sequence_stats_all_reduced():
        for flag in ("sft", "dataloader_inter_document_masking"):
            if get(flag):
                raise NotSupportedYet(
                    f"--{flag.replace('_', '-')} with --use-local-sgd is not supported yet: with "
                    "packed sequences Megatron-LM all-reduces their length statistics over all "
                    f"ranks after every iteration, {_BETWEEN_SYNCS}."
                )
    if get("log_straggler"):
        raise ConfigError(
            "--log-straggler with --use-local-sgd: the straggler detector broadcasts and gathers "
            f"over all ranks at every --log-interval, {_BETWEEN_SYNCS}. Drop the flag (the "
            "local-sgd metrics show each sync's time)."
        )
    if get("log_energy"):
        raise ConfigError(
            "--log-energy with --use-local-sgd: the energy monitor all-reduces over all ranks at "
            f"every --log-interval, {_BETWEEN_SYNCS}. Drop the flag."
        )
    if get("rerun_mode") == "report_stats":
        raise ConfigError(
            "--rerun-mode report_stats with --use-local-sgd: it re-runs every iteration and "
            f"gathers its statistics from all ranks every few iterations, {_BETWEEN_SYNCS}. Use "
            "--rerun-mode validate_results (its per-step vote is taken inside each worker) or "
            "disabled."
        )
    if get("adlr_autoresume"):
        raise ConfigError(
            "--adlr-autoresume with --use-local-sgd: its termination check is a barrier over all "
            f"ranks every --adlr-autoresume-interval iterations, {_BETWEEN_SYNCS}. Drop the flag."
        )
