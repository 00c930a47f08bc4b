"""Command-line flags in Megatron's style, and the one mapping from parsed args to configs.

``local_sgd_args_provider(parser)`` adds the flags (usable as Megatron-LM's
``extra_args_provider``); ``configs_from_args(args)`` turns a parsed namespace into
``(LocalSGDConfig, OuterOptimizerConfig, GTAConfig)``, or None when ``--use-local-sgd`` is off.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional, Tuple

from .config import (
    EXCHANGE_DTYPES,
    GTA_CONSENSUS,
    GTA_SPARSIFICATION,
    SYNC_MODES,
    ConfigError,
    GTAConfig,
    LocalSGDConfig,
    OuterOptimizerConfig,
    check_combination,
    resolve_optimizer_class,
)


def _none_or_float(text: str) -> Optional[float]:
    return None if text.lower() == "none" else float(text)


def local_sgd_args_provider(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the EDiT flags to ``parser`` (one argument group) and return it."""
    d, o, g = LocalSGDConfig(), OuterOptimizerConfig(), GTAConfig()
    group = parser.add_argument_group(title="local SGD (EDiT / A-EDiT)")
    add = group.add_argument
    add("--use-local-sgd", action="store_true",
        help="Train data-parallel workers locally and sync them every H steps (EDiT).")
    add("--local-sgd-sync-interval", type=int, default=d.local_sgd_sync_interval,
        help="H: optimizer steps between outer syncs after warmup.")
    add("--local-sgd-warmup-steps", type=int, default=d.local_sgd_warmup_steps,
        help="W: ordinary synchronous steps before local training starts.")
    add("--local-sgd-sync-mode", choices=SYNC_MODES, default=d.sync_mode,
        help="layerwise: sync each bucket during the next forward pass (needs "
             "--overlap-param-gather); step_end: blocking sync after the optimizer step.")
    add("--local-sgd-async", action="store_true", help="A-EDiT: sync by elapsed time.")
    add("--local-sgd-sync-time", type=float, default=d.local_sgd_sync_time,
        help="A-EDiT: seconds between syncs.")
    add("--local-sgd-time-budget", type=_none_or_float, default=d.async_time_budget,
        help="A-EDiT: end after this many seconds of training after warmup (default: the step "
             "budget, --train-iters x workers worker-steps).")
    add("--local-sgd-min-total-global-steps", type=int, default=d.min_total_global_steps,
        help="A-EDiT: skip a sync when fewer steps were taken in total since the last one.")
    add("--local-sgd-use-step-weight", action="store_true",
        help="A-EDiT: blend averaging weights with each worker's share of steps.")
    add("--local-sgd-step-weight-ratio", type=float, default=d.step_weight_ratio,
        help="A-EDiT: weight of the step share in that blend.")
    add("--local-sgd-gradient-accumulation-steps", type=int, default=d.gradient_accumulation_steps,
        help="Must be 1: Megatron accumulates micro-batches itself.")
    add("--local-sgd-clip-pseudo-grad", type=_none_or_float, default=d.clip_pseudo_grad,
        help="Clip each layer's averaged pseudo-gradient to this norm.")
    add("--local-sgd-pseudo-gradnorm-reduce", action="store_true",
        help="Weight workers by softmax(-pseudo-gradient norm / T).")
    add("--local-sgd-weight-softmax-temperature", type=_none_or_float,
        default=d.weight_softmax_temperature, help="T of those weights.")
    add("--local-sgd-skip-anomaly", action="store_true",
        help="Exclude workers whose pseudo-gradient norm is anomalous (EWMA z-score).")
    add("--local-sgd-ewma-alpha", type=float, default=d.ewma_alpha)
    add("--local-sgd-ewma-warmup-steps", type=int, default=d.ewma_warmup_steps,
        help="Syncs before the anomaly detector may exclude anything.")
    add("--local-sgd-ewma-threshold", type=float, default=d.ewma_threshold)
    add("--local-sgd-cpu-offload", action="store_true",
        help="Keep the anchor and the outer optimizer state in CPU memory.")
    add("--local-sgd-debug", action="store_true", help="Log every sync on every rank.")
    add("--local-sgd-exchange-dtype", choices=EXCHANGE_DTYPES, default=d.exchange_dtype,
        help="Format of the pseudo-gradients sent between workers (int8: 0.25x the bytes of fp32).")
    add("--local-sgd-exchange-block-size", type=int, default=d.exchange_block_size,
        help="Elements per quantization scale (fp8, int8, int4).")
    add("--local-sgd-exchange-error-feedback", action="store_true",
        help="Add what quantization dropped to the next sync's pseudo-gradient.")
    add("--outer-optimizer", default="sgd",
        help="Outer optimizer: sgd, adam, adamw or a dotted class path (default sgd).")
    add("--outer-optimizer-lr", type=float, default=o.outer_optim_kwargs["lr"])
    add("--outer-optimizer-momentum", type=float, default=o.outer_optim_kwargs["momentum"],
        help="SGD momentum (ignored by optimizers without one only if --outer-optimizer-kwargs "
             "overrides it).")
    add("--outer-optimizer-nesterov", action=argparse.BooleanOptionalAction,
        default=o.outer_optim_kwargs["nesterov"], help="Nesterov momentum for SGD.")
    add("--outer-optimizer-kwargs", type=json.loads, default=None,
        help='Extra keyword arguments as JSON, e.g. \'{"betas": [0.9, 0.95]}\'; they override '
             "the flags above.")
    add("--local-sgd-reducer", choices=("linear", "gta"), default=g.reducer)
    add("--gta-consensus-method", choices=GTA_CONSENSUS, default=g.consensus_method)
    add("--gta-sparsification-method", choices=GTA_SPARSIFICATION, default=g.sparsification_method)
    add("--gta-normalize", action=argparse.BooleanOptionalAction, default=g.normalize)
    add("--gta-density", type=float, default=g.density)
    add("--gta-int8-mask", action="store_true")
    return parser


def configs_from_args(
    args: argparse.Namespace,
) -> Optional[Tuple[LocalSGDConfig, OuterOptimizerConfig, GTAConfig]]:
    """Parsed flags -> configs (validated; ConfigError names the flag), None if local SGD is off."""
    if not getattr(args, "use_local_sgd", False):
        return None
    local = LocalSGDConfig(
        use_async=args.local_sgd_async,
        local_sgd_sync_interval=args.local_sgd_sync_interval,
        local_sgd_sync_time=args.local_sgd_sync_time,
        min_total_global_steps=args.local_sgd_min_total_global_steps,
        async_time_budget=args.local_sgd_time_budget,
        use_step_weight=args.local_sgd_use_step_weight,
        step_weight_ratio=args.local_sgd_step_weight_ratio,
        local_sgd_warmup_steps=args.local_sgd_warmup_steps,
        gradient_accumulation_steps=args.local_sgd_gradient_accumulation_steps,
        clip_pseudo_grad=args.local_sgd_clip_pseudo_grad,
        pseudo_gradnorm_reduce=args.local_sgd_pseudo_gradnorm_reduce,
        weight_softmax_temperature=args.local_sgd_weight_softmax_temperature,
        skip_anomaly=args.local_sgd_skip_anomaly,
        ewma_alpha=args.local_sgd_ewma_alpha,
        ewma_warmup_steps=args.local_sgd_ewma_warmup_steps,
        ewma_threshold=args.local_sgd_ewma_threshold,
        cpu_offload=args.local_sgd_cpu_offload,
        is_debug=args.local_sgd_debug,
        sync_mode=args.local_sgd_sync_mode,
        exchange_dtype=args.local_sgd_exchange_dtype,
        exchange_block_size=args.local_sgd_exchange_block_size,
        exchange_error_feedback=args.local_sgd_exchange_error_feedback,
    )
    import torch

    kwargs = {"lr": args.outer_optimizer_lr}
    if issubclass(resolve_optimizer_class(args.outer_optimizer), torch.optim.SGD):
        kwargs.update(momentum=args.outer_optimizer_momentum, nesterov=args.outer_optimizer_nesterov)
    if args.outer_optimizer_kwargs is not None:
        if not isinstance(args.outer_optimizer_kwargs, dict):
            raise ConfigError("--outer-optimizer-kwargs must be a JSON object.")
        kwargs.update(args.outer_optimizer_kwargs)
    outer = OuterOptimizerConfig(outer_optim_class=args.outer_optimizer, outer_optim_kwargs=kwargs)
    gta = GTAConfig(
        reducer=args.local_sgd_reducer,
        consensus_method=args.gta_consensus_method,
        sparsification_method=args.gta_sparsification_method,
        normalize=args.gta_normalize,
        density=args.gta_density,
        int8_mask=args.gta_int8_mask,
    )
    check_combination(local, gta)
    return local, outer, gta
