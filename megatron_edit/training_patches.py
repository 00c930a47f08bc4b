"""EDiT (arXiv 2412.07210) in Megatron-LM's training code: flags, validation, metrics in the log.

megatron-core carries the algorithm (:mod:`megatron_edit.megatron_patches` wraps methods of
``DistributedDataParallel``, ``DistributedOptimizer`` and the bucket groups). Megatron-LM's
``megatron/training`` (repository only, not on PyPI) needs three more things, provided here as
plain functions that both routes call, so the logic lives in one place:

* :func:`add_local_sgd_args`: the ``--use-local-sgd`` ... flags on Megatron's parser, whatever
  ``extra_args_provider`` the script passes (``pretrain_gpt.py`` passes its own).
* :func:`validate_local_sgd_args`: checks the flags together with Megatron's options at start-up,
  through the same checks the DDP / optimizer patches run (``check_megatron_options``,
  ``check_workers``, ``check_optimizer_options``), plus the options only Megatron-LM has.
* :class:`SyncMetrics`: each sync's figures (``SyncReport.scalars()``, every key, so new ones
  flow through) on Megatron's console line and in TensorBoard / W&B through Megatron's writers.

Runtime route: :func:`add_training_patches` declares wrap patches on the names Megatron-LM looks
up (``parse_args`` / ``validate_args`` in ``megatron.training.arguments`` and ``.initialize``,
``training_log`` and ``print_rank_last`` in ``megatron.training.training``). Fork route: the
files in ``patches/`` call the same functions from Megatron-LM's source and set
``MEGATRON_EDIT_NATIVE = True`` in each module they edit; the runtime patches of such a module
then stand aside.

Names Megatron-LM binds at import (``DDP``, ``get_megatron_optimizer``, ``finalize_model_grads``,
the checkpoint functions) need no patch by name: the core patches wrap methods of the classes
those names refer to, so ``isinstance(model, DDP)`` holds and the bound names stay the real
objects (:func:`check_import_bindings` verifies it).

Metrics are per rank and come from the rank that logs (Megatron's last rank): bytes and seconds
are that rank's share of the sync. Nothing here communicates.
"""

from __future__ import annotations

import argparse
import inspect
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from .arguments import configs_from_args, local_sgd_args_provider
from .config import ConfigError, NotSupportedYet
from .megatron_patches import (
    SUPPORTED,
    LocalSGDRuntime,
    check_megatron_options,
    check_optimizer_options,
    check_workers,
)
from .patching import Patch, PatchRegistry

logger = logging.getLogger(__name__)

NATIVE_MARKER = "MEGATRON_EDIT_NATIVE"
"""Module attribute a forked Megatron-LM sets where it calls megatron_edit itself."""

_ARGS = "megatron.training.arguments"
_INIT = "megatron.training.initialize"
_TRAINING = "megatron.training.training"


# --------------------------------------------------------------------------- flags
def add_local_sgd_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the EDiT flags unless the parser has them already (idempotent); returns the parser."""
    if "--use-local-sgd" not in parser._option_string_actions:
        local_sgd_args_provider(parser)
    return parser


def with_local_sgd_args(extra_args_provider: Optional[Callable]) -> Callable:
    """An ``extra_args_provider`` that runs the script's own one, then adds the EDiT flags."""

    def provider(parser):
        if extra_args_provider is not None:
            parser = extra_args_provider(parser)
        return add_local_sgd_args(parser)

    return provider


# --------------------------------------------------------------------------- validation
def validate_local_sgd_args(args: argparse.Namespace) -> None:
    """Check the EDiT flags against Megatron-LM's parsed, validated arguments.

    Call after Megatron's ``validate_args`` (which computes ``data_parallel_size``). Raises
    :class:`ConfigError` / :class:`NotSupportedYet` naming the flag; does nothing without
    ``--use-local-sgd``.
    """
    configs = configs_from_args(args)  # the flags alone (ConfigError names the flag)
    if configs is None:
        return
    local = configs[0]
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    # The same checks the DDP / optimizer patches run, on Megatron's flags.
    model_options = SimpleNamespace(
        cuda_graph_impl=get("cuda_graph_impl", "none") or "none",
        enable_cuda_graph=get("enable_cuda_graph", False),
        external_cuda_graph=get("external_cuda_graph", False),
        calculate_per_token_loss=get("calculate_per_token_loss", False),
    )
    ddp_options = SimpleNamespace(
        use_distributed_optimizer=get("use_distributed_optimizer", False),
        use_megatron_fsdp=get("use_megatron_fsdp", False),
        use_custom_fsdp=get("use_custom_fsdp", False),
        overlap_param_gather=get("overlap_param_gather", False),
    )
    check_megatron_options(local, model_options, ddp_options)
    # DDP's group for the instances is data x context parallel.
    check_workers(
        args.data_parallel_size * get("context_parallel_size", 1),
        get("num_distributed_optimizer_instances", 1),
    )
    optimizer_options = SimpleNamespace(
        use_precision_aware_optimizer=get("use_precision_aware_optimizer", False),
        overlap_param_gather_with_optimizer_step=get("overlap_param_gather_with_optimizer_step", False),
        optimizer_cpu_offload=get("optimizer_cpu_offload", False),
    )
    # Megatron builds a grad scaler for fp16, and for any --loss-scale.
    check_optimizer_options(optimizer_options, bool(get("fp16")) or bool(get("loss_scale")))
    _check_megatron_lm_options(local, args)
    if get("num_distributed_optimizer_instances", 1) == 1 and get("rank", 0) == 0:
        logger.warning(
            "megatron_edit: --use-local-sgd with --num-distributed-optimizer-instances 1 is one "
            "worker: ordinary synchronous training plus an outer optimizer, nothing is saved. "
            "Set it to the number of workers (e.g. nodes, or the data-parallel size)."
        )


def _check_megatron_lm_options(local, args: argparse.Namespace) -> None:
    """Options only Megatron-LM's training loop has."""
    if getattr(args, "use_torch_fsdp2", False):
        raise ConfigError("--use-local-sgd does not work with --use-torch-fsdp2.")
    if getattr(args, "num_experts", None):
        raise NotSupportedYet("--use-local-sgd with MoE (--num-experts) is not supported yet.")
    interval = getattr(args, "check_weight_hash_across_dp_replicas_interval", None)
    if interval is not None:
        # Replicas are identical only during warmup and right after a sync: every iteration
        # Megatron checks must be one of those. It checks every `interval` iterations and once
        # at the start of training, i.e. at the iteration of the checkpoint it resumed from.
        h, w = local.local_sgd_sync_interval, local.local_sgd_warmup_steps
        aligned = lambda n: n is None or n % h == 0  # noqa: E731
        checkpoints = getattr(args, "save", None) or getattr(args, "load", None)
        if (
            local.use_async
            or not aligned(interval)
            or not aligned(w)
            or (checkpoints and not (aligned(getattr(args, "save_interval", None))
                                     and aligned(getattr(args, "exit_interval", None))))
        ):
            raise ConfigError(
                f"--check-weight-hash-across-dp-replicas-interval={interval} with --use-local-sgd: "
                "data-parallel replicas differ between syncs by design, so they can only be "
                "compared right after a sync. Use an interval that is a multiple of "
                f"--local-sgd-sync-interval ({h}), with --local-sgd-warmup-steps ({w}) and, when "
                "saving or loading checkpoints, --save-interval and --exit-interval multiples of "
                "it too (Megatron checks again when training resumes); synchronous EDiT only. Or "
                "drop the flag."
            )


# --------------------------------------------------------------------------- metrics
SUMMED_KEYS = frozenset({"local-sgd/sync-seconds", "local-sgd/sync-bytes"})
"""Keys of ``SyncReport.scalars()`` that add up over syncs; every other key is a level (the
latest sync's value is reported)."""


def merge_reports(reports: Iterable) -> List[Tuple[int, Dict[str, float]]]:
    """One (step, scalars) per sync, in step order.

    A rank with several distributed optimizers (a chained optimizer) has one report per optimizer
    for the same sync: their summed keys add up, other keys take the last optimizer's value.
    """
    by_step: Dict[int, Dict[str, float]] = {}
    for report in reports:
        merged = by_step.setdefault(report.step, {})
        for key, value in report.scalars().items():
            merged[key] = merged.get(key, 0.0) + value if key in SUMMED_KEYS else value
    return sorted(by_step.items())


@dataclass
class _Window:
    """Syncs completed since a log point."""

    syncs: int = 0
    last_step: Optional[int] = None
    values: Dict[str, float] = field(default_factory=dict)

    def add(self, step: int, scalars: Dict[str, float]) -> None:
        self.syncs += 1
        self.last_step = step
        for key, value in scalars.items():
            self.values[key] = self.values.get(key, 0.0) + value if key in SUMMED_KEYS else value

    def scalars(self) -> Dict[str, float]:
        out = {"local-sgd/syncs": float(self.syncs)}
        if self.syncs:
            out["local-sgd/last-sync-step"] = float(self.last_step)
            out.update(self.values)
        return out


class SyncMetrics:
    """The sync reports of one rank, accumulated between Megatron's log points.

    Two windows, because Megatron has two intervals: the console line (``--log-interval``) and
    TensorBoard / W&B (``--tensorboard-log-interval``). Each window reports, when it is emitted:
    ``local-sgd/syncs`` (syncs completed since the window's previous emission),
    ``local-sgd/last-sync-step`` (the optimizer step the latest of them was due after), the sum
    over those syncs of the :data:`SUMMED_KEYS` (time, bytes), and the latest sync's value of
    every other key. No report is lost between emissions.
    """

    def __init__(self):
        self.total_syncs = 0
        self._console = _Window()
        self._writers = _Window()

    def collect(self, controllers: Iterable) -> None:
        """Take the new reports of this rank's EDiT objects (``LocalSGD.drain_reports``)."""
        reports = [r for c in controllers for r in c.drain_reports()]
        for step, scalars in merge_reports(reports):
            self.total_syncs += 1
            self._console.add(step, scalars)
            self._writers.add(step, scalars)

    def console(self, reset: bool = True) -> str:
        """Fields to append to Megatron's console line (`` name: value |`` like Megatron's)."""
        text = "".join(f" {_short(k)}: {_fmt(v)} |" for k, v in self._console.scalars().items())
        if reset:
            self._console = _Window()
        return text

    def write(self, writer, wandb_writer, iteration: int) -> Dict[str, float]:
        """Write the window to Megatron's TensorBoard writer and W&B writer (either may be
        None) at ``iteration``; returns what was written."""
        scalars = self._writers.scalars()
        self._writers = _Window()
        if writer is not None:
            for key, value in scalars.items():
                writer.add_scalar(key, value, iteration)
        if wandb_writer is not None:
            wandb_writer.log(scalars, iteration)
        return scalars


def _short(key: str) -> str:
    return key.replace("local-sgd/", "local-sgd ").replace("-", " ")


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def training_log_fields(
    metrics: SyncMetrics,
    controllers: Iterable,
    args,
    iteration: int,
    writer,
    wandb_writer,
    is_first_iteration: bool = False,
) -> str:
    """What Megatron-LM's ``training_log`` does for EDiT at ``iteration``; returns the console
    fields (empty when this is not a console iteration).

    Same conditions as Megatron's: TensorBoard / W&B when the TensorBoard writer exists (the
    last rank) and ``iteration % tensorboard_log_interval == 0``; the console line when
    ``iteration % log_interval == 0`` or on the first iteration (which, like Megatron, does not
    reset the console window).
    """
    controllers = list(controllers)
    if not controllers:
        return ""
    metrics.collect(controllers)
    if writer and iteration % args.tensorboard_log_interval == 0:
        metrics.write(writer, wandb_writer, iteration)
    if iteration % args.log_interval == 0 or is_first_iteration:
        return metrics.console(reset=not is_first_iteration)
    return ""


# --------------------------------------------------------------------------- runtime patches
class _TrainingLogState:
    """Between the ``training_log`` wrapper and the ``print_rank_last`` wrapper: the fields
    to append to the console line Megatron is about to print."""

    def __init__(self):
        self.pending: Optional[str] = None
        self._runtime: Optional[LocalSGDRuntime] = None
        self._metrics = SyncMetrics()

    def metrics(self, runtime: LocalSGDRuntime) -> SyncMetrics:
        """The accumulator of ``runtime`` (a new one when the session was re-patched)."""
        if runtime is not self._runtime:
            self._runtime, self._metrics = runtime, SyncMetrics()
        return self._metrics


_NATIVE_STATE = _TrainingLogState()


def native_training_log(args, iteration: int, writer, wandb_writer, is_first_iteration=False) -> str:
    """For a forked ``training_log`` (``patches/``): write this rank's sync metrics with
    Megatron's writers and return the fields for the console line (see
    :func:`training_log_fields`). Empty while EDiT is off."""
    from .api import _Session

    runtime = _Session.runtime
    if runtime is None or not runtime.controllers:
        return ""
    return training_log_fields(
        _NATIVE_STATE.metrics(runtime), list(runtime.controllers.values()), args, iteration,
        writer, wandb_writer, is_first_iteration,
    )


def is_native(module_name: str) -> bool:
    """Whether a forked Megatron-LM already calls megatron_edit from this module."""
    import importlib

    return bool(getattr(importlib.import_module(module_name), NATIVE_MARKER, False))


def add_training_patches(
    registry: PatchRegistry, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]
) -> List[str]:
    """Declare the patches on Megatron-LM's ``megatron.training``; returns their ids.

    Modules of a fork with the native integration (``MEGATRON_EDIT_NATIVE``) get none.
    """
    state = _TrainingLogState()
    added: List[str] = []

    def add(patch: Patch) -> None:
        registry.add(patch)
        added.append(patch.id)

    def wrap_parse_args(original):
        def parse_args(extra_args_provider=None, ignore_unknown_args=False):
            if runtime_ref() is not None:
                extra_args_provider = with_local_sgd_args(extra_args_provider)
            return original(extra_args_provider, ignore_unknown_args)

        return parse_args

    def wrap_validate_args(original):
        def validate_args(args, *rest, **kwargs):
            result = original(args, *rest, **kwargs)
            if runtime_ref() is not None:
                validate_local_sgd_args(args)
            return result

        return validate_args

    def wrap_training_log(original):
        signature = inspect.signature(original)

        def training_log(*args, **kwargs):
            runtime = runtime_ref()
            if runtime is None or not runtime.controllers:
                return original(*args, **kwargs)
            from megatron.training.global_vars import get_args, get_tensorboard_writer, get_wandb_writer

            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            state.pending = training_log_fields(
                state.metrics(runtime),
                list(runtime.controllers.values()),
                get_args(),
                bound.arguments["iteration"],
                get_tensorboard_writer(),
                get_wandb_writer(),
                bound.arguments.get("is_first_iteration", False),
            ) or None
            try:
                return original(*args, **kwargs)
            finally:
                state.pending = None

        return training_log

    def wrap_print_rank_last(original):
        def print_rank_last(message):
            if state.pending:  # inside training_log: this is its console line
                message, state.pending = message + state.pending, None
            return original(message)

        return print_rank_last

    v = SUPPORTED
    if not is_native(_ARGS):
        for module in (_ARGS, _INIT):  # initialize binds both names at import
            where = module.rsplit(".", 1)[1]
            add(Patch(f"lm-parse-args-{where}", f"{module}:parse_args", wrap_parse_args, v,
                      ("extra_args_provider", "ignore_unknown_args"),
                      "add the EDiT flags to Megatron's parser, whatever extra_args_provider"))
            add(Patch(f"lm-validate-args-{where}", f"{module}:validate_args", wrap_validate_args, v,
                      ("args", "defaults"),
                      "check the EDiT flags with Megatron's options at start-up"))
    if not is_native(_TRAINING):
        add(Patch("lm-training-log", f"{_TRAINING}:training_log", wrap_training_log, v,
                  ("loss_dict", "total_loss_dict", "learning_rate", "iteration", "loss_scale",
                   "report_memory_flag", "skipped_iter", "grad_norm", "params_norm",
                   "num_zeros_in_grad", "max_attention_logit", "pg_collection",
                   "is_first_iteration"),
                  "EDiT sync metrics to TensorBoard / W&B at Megatron's intervals"))
        add(Patch("lm-print-rank-last", f"{_TRAINING}:print_rank_last", wrap_print_rank_last, v,
                  ("message",), "EDiT sync metrics on training_log's console line"))
    return added


def check_import_bindings() -> Dict[str, bool]:
    """Names Megatron-LM's training binds at import, and whether each is still the object the
    core patches act on (so no by-name patch is needed). All True on a working install."""
    import megatron.core.distributed as mcd
    import megatron.core.optimizer as mco
    import megatron.training.checkpointing as ckpt
    import megatron.training.training as training

    return {
        "DDP": training.DDP is mcd.DistributedDataParallel,
        "get_megatron_optimizer": training.get_megatron_optimizer is mco.get_megatron_optimizer,
        "finalize_model_grads": training.finalize_model_grads is mcd.finalize_model_grads,
        "save_checkpoint": training.save_checkpoint is ckpt.save_checkpoint,
        "load_checkpoint": training.load_checkpoint is ckpt.load_checkpoint,
    }
