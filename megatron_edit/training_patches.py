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
* :class:`WorkerLocalCollectives`: nothing crosses the sync group between syncs. Megatron-LM's
  per-step collectives over all data-parallel ranks (logged loss, params norm, timers, the
  rerun state machine's vote, the signal check) are kept inside the worker; the options whose
  collectives cannot be are refused by :func:`validate_local_sgd_args`.

Runtime route: :func:`add_training_patches` declares wrap patches on the names Megatron-LM looks
up (``parse_args`` / ``validate_args`` in ``megatron.training.arguments`` and ``.initialize``,
``training_log`` and ``print_rank_last`` in ``megatron.training.training``). Fork route: the
files in ``patches/`` call the same functions from Megatron-LM's source and set
``MEGATRON_EDIT_NATIVE = True`` in each module they edit; the runtime patches of such a module
then stand aside. The ``worker-local-*`` patches apply on both routes (the fork does not make
those calls itself).

Names Megatron-LM binds at import (``DDP``, ``get_megatron_optimizer``, ``finalize_model_grads``,
the checkpoint functions) need no patch by name: the core patches wrap methods of the classes
those names refer to, so ``isinstance(model, DDP)`` holds and the bound names stay the real
objects (:func:`check_import_bindings` verifies it).

Metrics are per rank and come from the rank that logs (Megatron's last rank): bytes and seconds
are that rank's share of the sync; with local SGD, Megatron's own figures on that line (loss,
params norm, timers) are that rank's worker's.
"""

from __future__ import annotations

import argparse
import inspect
import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Dict, Iterable, List, Optional, Tuple

from .arguments import configs_from_args, local_sgd_args_provider
from .patching import VersionRange

# Megatron-LM's training code is tested at tag core_v0.16.1 only (megatron-core's range is wider).
TRAINING_SUPPORTED = VersionRange("0.16.0", "0.17.0")
from .config import ConfigError, NotSupportedYet
from .megatron_patches import (
    LocalSGDRuntime,
    check_megatron_options,
    check_optimizer_options,
    check_workers,
)
from .outer import is_sync_step
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
    _check_cross_worker_options(local, args)
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


_BETWEEN_SYNCS = (
    "a collective across all ranks between syncs: a barrier that holds every EDiT worker to the "
    "slowest one, which local SGD exists to avoid"
)


def _check_cross_worker_options(local, args: argparse.Namespace) -> None:
    """Megatron-LM options whose collectives across workers cannot be kept inside one (see
    :class:`WorkerLocalCollectives` for those that are)."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    if get("exit_duration_in_mins"):
        raise ConfigError(
            "--exit-duration-in-mins with --use-local-sgd: Megatron all-reduces its elapsed-time "
            f"check over all ranks after every iteration, {_BETWEEN_SYNCS}. Use "
            "--exit-signal-handler (with local SGD it is checked at syncs), or --exit-interval / "
            "--train-iters."
        )
    if get("exit_signal_handler") and local.use_async:
        raise ConfigError(
            "--exit-signal-handler with --local-sgd-async: Megatron checks for the signal with an "
            "all-gather over all ranks, and A-EDiT workers never finish an iteration together "
            "(they sync at different iterations), so there is no step to check it at. Use "
            "--exit-interval / --train-iters."
        )
    if local.use_async:
        if get("train_iters") is None:
            raise ConfigError(
                "--local-sgd-async needs --train-iters (not --train-samples): A-EDiT workers take "
                "different numbers of iterations and must all end at one final sync, placed at "
                "the last iteration."
            )
        for flag in ("save_interval", "exit_interval"):
            if get(flag):
                raise ConfigError(
                    f"--{flag.replace('_', '-')} with --local-sgd-async: A-EDiT workers reach a given "
                    "iteration at different times (and between different syncs), so a checkpoint "
                    "or exit there would wait on collectives some workers never join. Save at the "
                    "end of training (--save without --save-interval) or use synchronous EDiT."
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

    Modules of a fork with the native integration (``MEGATRON_EDIT_NATIVE``) get none of the
    ``lm-*`` patches; the ``worker-local-*`` ones (:func:`add_worker_local_patches`) apply on
    both routes.
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

    v = TRAINING_SUPPORTED
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
    added += add_worker_local_patches(registry, runtime_ref)
    return added


# --------------------------------------------------------------------------- worker-local collectives
_PS = "megatron.core.parallel_state"
_TIMERS = "megatron.core.timers"
_RERUN = "megatron.core.rerun_state_machine"
_SIGNALS = "megatron.training.dist_signal_handler"


class WorkerLocalCollectives:
    """Megatron-LM's per-step collectives across data-parallel ranks, kept inside the EDiT worker.

    Between syncs EDiT workers share nothing, but Megatron-LM's training loop still reduces
    figures over every data-parallel rank, or every rank, each step or log interval. Each such
    collective is a barrier across workers: it holds every worker to the slowest one, and with
    A-EDiT (workers reach a given iteration at different times, and their k-th sync at different
    iterations) it can deadlock. While local SGD trains (its optimizer exists):

    * **Reporting regions.** Inside Megatron-LM's ``train_step`` (the logged training loss; the
      MTP loss tracker's and QK-clip's groups are taken there too), ``evaluate`` (validation
      loss) and ``calc_params_l2_norm`` (``--log-params-norm``), ``parallel_state.
      get_data_parallel_group`` hands out the worker's data-parallel group for the full one
      (with context parallelism; without it only when the context-parallel size is 1, where
      the two are the same ranks). Those functions use the group only to average figures for
      the log: the figures become the worker's own. Gradients are untouched (DDP and the
      distributed optimizer keep the groups they were built with).
    * **Timers.** The barriers of Megatron's ``Timers`` (``--timing-log-level`` >= 1 with
      ``--barrier-with-L1-time``, Megatron's default; the interval timer at every log line) and
      the gather behind their console / TensorBoard report span the worker's ranks (its
      distributed-optimizer instance, TP/PP included) instead of the world: the min / max
      reported are over the logging rank's worker.
    * **Rerun state machine** (``--rerun-mode validate_results``, Megatron's default): its
      per-step vote on re-running the step is taken inside the worker once gradients are
      worker-local (after warmup; during warmup a re-run redoes the cross-worker gradient
      reduction, so every worker must vote). An outcome that would save a checkpoint and exit
      on one worker only (a checkpoint needs every worker) raises instead of hanging the job.
    * **Signal handler** (``--exit-signal-handler``): its check, an all-gather over the world,
      runs only after steps where the workers meet anyway (synchronous warmup steps and syncs);
      a signal is acted on at the next of them.

    What cannot be kept inside the worker is refused in :func:`validate_local_sgd_args`.
    """

    def __init__(self, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]):
        self.runtime_ref = runtime_ref
        self._local = threading.local()

    # ------------------------------------------------------------ state
    def controllers(self) -> list:
        """The EDiT objects of the running optimizer; empty while local SGD is off or the
        optimizer is not built yet (start-up collectives stay as Megatron has them)."""
        runtime = self.runtime_ref()
        return list(runtime.controllers.values()) if runtime is not None else []

    @contextmanager
    def reporting(self):
        """A region whose data-parallel reductions only feed the log."""
        depth = getattr(self._local, "depth", 0)
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth

    def in_reporting(self) -> bool:
        return getattr(self._local, "depth", 0) > 0

    def grads_are_local(self) -> bool:
        controllers = self.controllers()
        return bool(controllers) and all(c.grads_are_local for c in controllers)

    def workers_meet(self) -> bool:
        """Whether the step just taken was one all workers take together: a synchronous warmup
        step or one a sync was due after. Never known in advance with A-EDiT."""
        controllers = self.controllers()
        if not controllers or controllers[0].config.use_async:
            return False
        c, steps = controllers[0].config, controllers[0].steps_done
        return steps <= c.local_sgd_warmup_steps or is_sync_step(
            steps, c.local_sgd_warmup_steps, c.local_sgd_sync_interval
        )

    @staticmethod
    def worker_group():
        """All ranks of this worker: Megatron's intra distributed-optimizer instance group."""
        from megatron.core import parallel_state

        return parallel_state.get_intra_distributed_optimizer_instance_group(check_initialized=False)

    # ------------------------------------------------------------ wrappers
    def wrap_reporting_region(self, original):
        def region(*args, **kwargs):
            if not self.controllers():
                return original(*args, **kwargs)
            with self.reporting():
                return original(*args, **kwargs)

        return region

    def wrap_get_data_parallel_group(self, original):
        def get_data_parallel_group(
            with_context_parallel=False, partial_data_parallel=False, independent_all_gather=False
        ):
            if (
                self.in_reporting()
                and not partial_data_parallel
                and not independent_all_gather
                and (with_context_parallel or _context_parallel_size() == 1)
            ):
                return original(with_context_parallel=True, partial_data_parallel=True)
            return original(with_context_parallel, partial_data_parallel, independent_all_gather)

        return get_data_parallel_group

    def wrap_timers_call(self, original):
        def __call__(timers, name, log_level=None):
            timer = original(timers, name, log_level)
            if hasattr(timer, "set_barrier_group"):  # a real Timer, not the DummyTimer
                # Megatron never sets a timer's barrier group itself (None: the world).
                timer.set_barrier_group(self.worker_group() if self.controllers() else None)
            return timer

        return __call__

    def wrap_timers_all_gather(self, original):
        import torch.distributed as dist

        def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
            worker = self.worker_group() if group is None and self.controllers() else None
            if worker is None or async_op:
                return original(output_tensor, input_tensor, group, async_op)
            # Timers gather one row per rank of the world (zeros except their own). Gather the
            # worker's rows only; the others stay zero, which Timers reads as "no timing".
            ranks = dist.get_process_group_ranks(worker)
            rows = output_tensor.view(dist.get_world_size(), -1)
            gathered = rows.new_zeros((len(ranks), rows.shape[1]))
            original(gathered.view(-1), input_tensor, worker, False)
            rows[ranks] = gathered
            return None

        return all_gather_into_tensor

    def _rerun_is_local(self, machine) -> bool:
        from megatron.core.rerun_state_machine import RerunState

        return self.grads_are_local() and machine.state in (
            RerunState.INITIAL_RUN, RerunState.RERUNNING_IN_PLACE, RerunState.WILL_RERUN_FROM_CHECKPOINT
        )

    def wrap_rerun_reduce_any(self, original):
        import torch

        def _reduce_any(machine, value):
            if not self._rerun_is_local(machine):
                return original(machine, value)
            # The same vote as Megatron's (any rank True -> True), over the worker's ranks.
            values = value if isinstance(value, list) else [value]
            flags = torch.tensor(values, dtype=torch.int32, device=torch.cuda.current_device())
            torch.distributed.all_reduce(flags, group=self.worker_group())
            votes = tuple(int(x) > 0 for x in flags.tolist())
            return votes if isinstance(value, list) else votes[0]

        return _reduce_any

    def wrap_rerun_should_checkpoint_and_exit(self, original):
        def should_checkpoint_and_exit(machine):
            local = self._rerun_is_local(machine)
            should_checkpoint, should_exit, exit_code = original(machine)
            if local and (should_checkpoint or should_exit):
                raise RuntimeError(
                    f"megatron_edit: Megatron's rerun state machine asks this worker to "
                    f"{'save a checkpoint and ' if should_checkpoint else ''}stop (exit code "
                    f"{exit_code}) after re-running iteration {machine.current_iteration}. With "
                    "--use-local-sgd the re-run vote is taken inside the worker (a vote across "
                    "workers would be a barrier every step), but a checkpoint and a clean exit "
                    "need every worker, so the job stops here instead; resume from the latest "
                    "checkpoint. The log above says what failed validation."
                )
            return should_checkpoint, should_exit, exit_code

        return should_checkpoint_and_exit

    def wrap_signals_received(self, original):
        def signals_received(handler):
            controllers = self.controllers()
            if controllers and not controllers[0].config.use_async and not self.workers_meet():
                return []  # checked (all ranks together) after the next warmup step or sync
            return original(handler)

        return signals_received


def _context_parallel_size() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_world_size()


def add_worker_local_patches(
    registry: PatchRegistry, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]
) -> List[str]:
    """Declare the :class:`WorkerLocalCollectives` patches; returns their ids. Applied on both
    routes: the fork in ``patches/`` does not make these calls itself."""
    wl = WorkerLocalCollectives(runtime_ref)
    v = TRAINING_SUPPORTED
    patches = [
        Patch("worker-local-train-step", f"{_TRAINING}:train_step", wl.wrap_reporting_region, v,
              ("forward_step_func", "data_iterator", "model", "optimizer", "opt_param_scheduler",
               "config", "forward_backward_func", "iteration"),
              "the logged training loss is averaged over the worker, not all data-parallel ranks"),
        Patch("worker-local-evaluate", f"{_TRAINING}:evaluate", wl.wrap_reporting_region, v,
              ("forward_step_func", "data_iterator", "model", "process_non_loss_data_func",
               "config", "verbose", "non_loss_data_func", "eval_iters"),
              "the validation loss is averaged over the worker"),
        Patch("worker-local-params-norm", f"{_TRAINING}:calc_params_l2_norm",
              wl.wrap_reporting_region, v, ("model", "force_create_fp32_copy"),
              "--log-params-norm: the norm of the worker's model"),
        Patch("worker-local-dp-group", f"{_PS}:get_data_parallel_group",
              wl.wrap_get_data_parallel_group, v,
              ("with_context_parallel", "partial_data_parallel", "independent_all_gather"),
              "inside those three: the worker's data-parallel group for the full one"),
        Patch("worker-local-timer-barrier", f"{_TIMERS}:Timers.__call__", wl.wrap_timers_call, v,
              ("self", "name", "log_level"), "timer barriers span the worker, not the world"),
        Patch("worker-local-timers-gather", f"{_TIMERS}:dist_all_gather_func",
              wl.wrap_timers_all_gather, v,
              ("output_tensor", "input_tensor", "group", "async_op"),
              "timer reports gather the worker's timings, not the world's"),
        Patch("worker-local-rerun-vote", f"{_RERUN}:RerunStateMachine._reduce_any",
              wl.wrap_rerun_reduce_any, v, ("self", "value"),
              "after warmup, the per-step re-run vote is taken inside the worker"),
        Patch("worker-local-rerun-exit", f"{_RERUN}:RerunStateMachine.should_checkpoint_and_exit",
              wl.wrap_rerun_should_checkpoint_and_exit, v, ("self",),
              "a worker-local re-run verdict that needs a checkpoint raises instead of hanging"),
        Patch("worker-local-signal-check", f"{_SIGNALS}:DistributedSignalHandler.signals_received",
              wl.wrap_signals_received, v, ("self",),
              "--exit-signal-handler: checked after warmup steps and syncs only"),
    ]
    for patch in patches:
        registry.add(patch)
    return [p.id for p in patches]


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
