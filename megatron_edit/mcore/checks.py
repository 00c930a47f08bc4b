"""Megatron options that cannot work with EDiT, refused at start-up with the flag and the fix.

One place for both routes: the DDP / optimizer patches (megatron-core alone) call these on
Megatron's config objects, and Megatron-LM's argument validation
(:mod:`megatron_edit.training.validation`) calls them on its parsed flags.
"""

from __future__ import annotations

import math

from ..config import ConfigError, NotSupportedYet, LocalSGDConfig
from . import compat


def check_megatron_options(local_cfg: LocalSGDConfig, transformer_config, ddp_config,
                           tokens_counted_in_worker: bool = False) -> None:
    """Reject model / DDP options that cannot work with EDiT (clear message, at start-up).
    ``tokens_counted_in_worker``: ``--calculate-per-token-loss``'s tokens are counted over the
    worker once gradients stay inside it (Megatron-LM's training loop, patched, over the
    distributed optimizer)."""
    fsdp = compat.uses_megatron_fsdp(ddp_config)
    if fsdp:  # Megatron-FSDP's own optimizer sharding takes the distributed optimizer's place
        from .fsdp import check_fsdp_options

        check_fsdp_options(local_cfg, transformer_config, ddp_config)
    elif not ddp_config.use_distributed_optimizer:
        raise ConfigError(
            "--use-local-sgd needs Megatron's distributed optimizer: pass "
            "--use-distributed-optimizer (DistributedDataParallelConfig.use_distributed_optimizer"
            "=True). Each worker is one distributed-optimizer instance: set "
            "--num-distributed-optimizer-instances to the number of workers (the data-parallel "
            "size gives one rank per worker, shard size 1)."
        )
    if compat.uses_cuda_graphs(transformer_config):
        raise ConfigError(
            "--use-local-sgd does not work with CUDA graphs (--cuda-graph-impl / "
            "--enable-cuda-graph): a captured step cannot run the outer sync."
        )
    if getattr(transformer_config, "calculate_per_token_loss", False) and not tokens_counted_in_worker:
        raise NotSupportedYet(
            "calculate_per_token_loss with local SGD is not supported yet here: only through Megatron-LM's "
            "training loop (python -m megatron_edit.launch) with the distributed optimizer are the tokens counted "
            "over the worker and its gradients summed inside it (finalize_model_grads of megatron-core alone counts "
            "them over every data-parallel rank at each step; Megatron-FSDP is not checked)."
        )
    if getattr(ddp_config, "fp8_param_gather", False) or getattr(ddp_config, "reuse_grad_buf_for_mxfp8_param_ag", False):
        raise ConfigError(
            "--use-local-sgd does not work with --fp8-param-gather (or MXFP8 buffer reuse): the "
            "parameter buffers then hold FP8 bytes, and EDiT writes the outer step's fp32 result "
            "into the model's parameter buffer. Drop --fp8-param-gather (FP8 compute with bf16 "
            "parameters still works)."
        )
    # (Megatron-FSDP gathers each bucket in the forward pass whatever the flag says.)
    if local_cfg.sync_mode == "layerwise" and not ddp_config.overlap_param_gather and not fsdp:
        raise ConfigError(
            "--local-sgd-sync-mode layerwise syncs each bucket just before its parameters are "
            "gathered in the forward pass, which needs --overlap-param-gather (and "
            "--overlap-grad-reduce); pass them, or use --local-sgd-sync-mode step_end."
        )


def check_workers(data_parallel_size: int, num_workers: int) -> None:
    """The workers (distributed-optimizer instances) must split data parallelism evenly."""
    if num_workers < 1 or data_parallel_size % num_workers != 0:
        raise ConfigError(
            f"--num-distributed-optimizer-instances={num_workers} (the number of EDiT workers) "
            f"must divide the data-parallel size {data_parallel_size}."
        )


def check_optimizer_options(config, has_grad_scaler: bool, megatron_fsdp: bool = False) -> None:
    """Reject optimizer options (megatron.core OptimizerConfig) that cannot work with EDiT.

    ``has_grad_scaler``: fp16 or a ``--loss-scale`` (a step may be skipped on an inf or nan:
    :mod:`megatron_edit.mcore.skipped_step`); ``megatron_fsdp``: over Megatron-FSDP."""
    if getattr(config, "use_precision_aware_optimizer", False):
        raise ConfigError(
            "--use-local-sgd does not work with --use-precision-aware-optimizer: that optimizer "
            "keeps main params inside itself and skips the main->model copy the sync relies on."
        )
    if getattr(config, "overlap_param_gather_with_optimizer_step", False):
        raise ConfigError(
            "--use-local-sgd does not work with --overlap-param-gather-with-optimizer-step: the "
            "all-gather would start before the outer step has run."
        )
    if getattr(config, "optimizer_cpu_offload", False):
        raise NotSupportedYet("--optimizer-cpu-offload with --use-local-sgd is not supported yet.")
    if getattr(config, "optimizer_cuda_graph", False):  # 0.17+
        raise ConfigError(
            "--use-local-sgd does not work with --optimizer-cuda-graph (OptimizerConfig."
            "optimizer_cuda_graph): a captured optimizer step cannot run the outer sync."
        )
    threshold = getattr(config, "grad_norm_skip_threshold", float("inf"))  # 0.18+
    if threshold is not None and math.isfinite(threshold):
        raise ConfigError(
            f"OptimizerConfig.grad_norm_skip_threshold={threshold} with --use-local-sgd: each EDiT "
            "worker has its own gradient norm, so one worker would skip a step the others take "
            "and the workers' schedules would drift apart. Leave it at inf (the default)."
        )
    optimizer = getattr(config, "optimizer", "adam")
    if optimizer not in ("adam", "sgd"):
        raise NotSupportedYet(
            f"--optimizer {optimizer} with --use-local-sgd is not supported yet: EDiT was checked "
            "with Megatron's distributed optimizer over Adam and SGD (its checkpoints carry "
            "their state); use --optimizer adam or sgd."
        )
    if has_grad_scaler and megatron_fsdp:
        raise NotSupportedYet(
            "--fp16 (or --loss-scale) with --use-megatron-fsdp and --use-local-sgd is not supported "
            "yet: a step the loss scaler skips was checked with Megatron's distributed optimizer "
            "over DDP only; use --bf16 without --loss-scale, or drop --use-megatron-fsdp."
        )


def check_moe_options(local_cfg: LocalSGDConfig, transformer_config, expert_parallel: bool) -> None:
    """MoE: refuse what would cross workers between syncs or is not covered yet.

    ``expert_parallel``: the model has expert-parallel buffers (expert parallelism > 1: with DDP
    a second distributed optimizer, and a second EDiT controller, for the experts)."""
    import torch

    c = transformer_config
    if getattr(c, "moe_router_enable_expert_bias", False):
        _check_expert_bias(local_cfg)
    balancing = getattr(c, "moe_router_load_balancing_type", "aux_loss")
    types = [balancing] if isinstance(balancing, str) else list(balancing)
    if "global_aux_loss" in types:
        raise NotSupportedYet(
            "--moe-router-load-balancing-type global_aux_loss with --use-local-sgd is not supported yet: "
            "it all-reduces token counts over every data-parallel rank (across workers) each step.")
    if "quantile_balancing" in types:  # 0.19+
        raise NotSupportedYet(
            "--moe-router-load-balancing-type quantile_balancing with --use-local-sgd is not supported "
            "yet: it all-reduces each router's quantile estimate (qb_beta) over every data-parallel "
            "rank (across workers) each step, and the bias is a buffer the sync does not average.")
    if not torch.cuda.is_available():
        if getattr(c, "moe_grouped_gemm", False):
            raise ConfigError("--moe-grouped-gemm needs CUDA (the grouped_gemm package): on CPU use sequential experts.")
        if getattr(c, "moe_token_dispatcher_type", "allgather") == "flex":
            raise ConfigError("--moe-token-dispatcher-type flex needs CUDA: on CPU use allgather or alltoall.")


def _check_expert_bias(local_cfg: LocalSGDConfig) -> None:
    """``--moe-router-enable-expert-bias``: counted inside the worker, averaged at each sync
    (:mod:`megatron_edit.mcore.expert_bias`), on the torch backend (DDP or Megatron-FSDP)."""
    if local_cfg.sync_backend == "torchft":
        raise NotSupportedYet(
            "--moe-router-enable-expert-bias with --local-sgd-sync-backend torchft is not supported yet: "
            "a heal copies a peer's parameters and EDiT state but not the routers' expert biases (buffers), "
            "and a round that does not commit would have to undo their average.")
