"""EDiT (arXiv 2412.07210) in Megatron-LM's training code: the training wraps (registry patches of
``megatron.training``) and the functions the ``patches/`` folder's git patch files call.

megatron-core carries the algorithm (:mod:`megatron_edit.mcore.core_wraps` wraps methods of
``DistributedDataParallel``, ``DistributedOptimizer`` and the bucket groups). Megatron-LM's
``megatron/training`` (repository only, not on PyPI) needs three more things, provided here as
plain functions that both routes call, so the logic lives in one place:

* :func:`~megatron_edit.training.flags.add_local_sgd_args`: the ``--use-local-sgd`` ... flags on Megatron's parser, whatever
  ``extra_args_provider`` the script passes (``pretrain_gpt.py`` passes its own).
* :func:`~megatron_edit.training.validation.validate_local_sgd_args`: checks the flags together with Megatron's options at start-up,
  through the same checks the DDP / optimizer patches run (``check_megatron_options``,
  ``check_workers``, ``check_optimizer_options``), plus the options only Megatron-LM has.
* :class:`~megatron_edit.training.metrics.SyncMetrics`: each sync's figures (``SyncReport.scalars()``, every key, so new ones
  flow through) on Megatron's console line and in TensorBoard / W&B through Megatron's writers;
  with ``--local-sgd-sync-record``, the logging rank's worker's records too
  (:mod:`~megatron_edit.training.record_log`).
* :class:`~megatron_edit.training.worker_local.WorkerLocalCollectives`: nothing crosses the sync group between syncs. Megatron-LM's
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

Start-up, on every device and both routes: Megatron-LM's ``initialize_megatron`` runs
``compile_helpers`` (``make`` in the installed ``megatron/core/datasets``). The megatron-core
wheel ships the compiled ``helpers_cpp`` but no Makefile, so ``make`` fails and the run exits at
"compiling dataset index builder". :func:`add_startup_patches` declares the patch that skips
``make`` when ``helpers_cpp`` is importable (a source checkout without it builds as usual). The
launcher applies it before the script runs (:func:`apply_startup_patches`), on both routes: a
fork calls ``patch_megatron_for_local_sgd`` only after ``initialize_megatron``.
:func:`add_training_patches` declares it too (a script that calls ``patch_megatron_for_local_sgd``
itself), unless the launcher already applied it.

Names Megatron-LM binds at import (``DDP``, ``get_megatron_optimizer``, ``finalize_model_grads``,
the checkpoint functions) need no patch by name: the core patches wrap methods of the classes
those names refer to, so ``isinstance(model, DDP)`` holds and the bound names stay the real
objects (:func:`check_import_bindings` verifies it).

Metrics are per rank and come from the rank that logs (Megatron's last rank): bytes and seconds
are that rank's share of the sync; with local SGD, Megatron's own figures on that line (loss,
params norm, timers) are that rank's worker's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import io
import sys
from functools import partial
from typing import Callable, Dict, List, Optional

from ..config import ConfigError, NotSupportedYet
from ..mcore import compat
from ..mcore.wrap_registry import Patch, PatchRegistry
from ..mcore.runtime import LocalSGDRuntime
from ..mcore.session import SESSION, current_runtime
from .flags import with_local_sgd_args
from .follow_heals import FollowHeals
from .global_budget import GlobalBudget
from .meetings import ChecksAtMeetings
from .metrics import SyncMetrics, training_log_fields
from .record_log import RecordLog
from .replica_data import ReplicaData
from .run_length import RunLength
from .validation import validate_local_sgd_args
from .worker_local import add_worker_local_patches

NATIVE_MARKER = "MEGATRON_EDIT_NATIVE"
"""Module attribute a forked Megatron-LM sets where it calls megatron_edit itself."""

_ARGS = "megatron.training.arguments"
_INIT = "megatron.training.initialize"
_TRAINING = "megatron.training.training"
_DATASETS_UTILS = "megatron.core.datasets.utils"
_SAMPLERS = "megatron.training.datasets.data_samplers"
HELPERS_MODULE = "megatron.core.datasets.helpers_cpp"
"""The compiled dataset index helpers; ``compile_helpers`` builds them with ``make``."""


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


def _native_state() -> _TrainingLogState:
    """The forked ``training_log``'s state, kept in the process's session object."""
    if SESSION.training_log is None:
        SESSION.training_log = _TrainingLogState()
    return SESSION.training_log


def native_training_log(args, iteration: int, writer, wandb_writer, is_first_iteration=False) -> str:
    """For a forked ``training_log`` (the git patch files of the ``patches/`` folder): write
    this rank's sync metrics with Megatron's writers and return the fields for the console line
    (see :func:`training_log_fields`). Empty while EDiT is off."""
    runtime = current_runtime()
    if runtime is None or not runtime.controllers:
        return ""
    return training_log_fields(
        _native_state().metrics(runtime), list(runtime.controllers.values()), args, iteration,
        writer, wandb_writer, is_first_iteration, runtime.sync_record,
    )


def is_native(module_name: str) -> bool:
    """Whether a forked Megatron-LM already calls megatron_edit from this module."""
    import importlib

    return bool(getattr(importlib.import_module(module_name), NATIVE_MARKER, False))


def _skip_make_when_helpers_are_built(original):
    def compile_helpers():
        # The wheel ships helpers_cpp but no Makefile: `make` there fails and the run exits.
        if importlib.util.find_spec(HELPERS_MODULE) is not None:
            return None
        return original()  # a source checkout without the built helpers: Megatron's `make`

    return compile_helpers


def compat_patch(pid: str, target: str, wrap, description: str) -> Patch:
    """A patch whose releases and signature come from :data:`compat.TRAINING_SIGNATURES`
    (parameters checked only where the installed release has the function)."""
    versions = compat.release_range(target)
    names = compat.params(target) if versions.contains(compat.megatron_core_version()) else ()
    return Patch(pid, target, wrap, versions, names, description)


def add_startup_patches(registry: PatchRegistry) -> List[str]:
    """Declare the start-up patches (every device, both routes); returns their ids."""
    registry.add(Patch(
        "lm-compile-helpers", f"{_DATASETS_UTILS}:compile_helpers",
        _skip_make_when_helpers_are_built, compat.TRAINING_SUPPORTED, (),
        "skip make when the compiled dataset helpers (helpers_cpp) are importable"))
    return ["lm-compile-helpers"]


def apply_startup_patches() -> PatchRegistry:
    """Apply the start-up patches for the installed megatron-core (the launcher, before the
    script runs; a no-op when they are applied already); returns their registry (``.revert()``
    undoes them)."""
    registry = PatchRegistry()
    add_startup_patches(registry)
    if not _startup_patches_applied():  # by another registry: once is enough
        registry.apply(compat.megatron_core_version())
    return registry


def _startup_patches_applied() -> bool:
    utils = importlib.import_module(_DATASETS_UTILS)
    return getattr(utils.compile_helpers, "_megatron_edit_patch", None) is not None


def _wrap_parse_args(runtime_ref, original):
    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        if runtime_ref() is not None:
            extra_args_provider = with_local_sgd_args(extra_args_provider)
        return original(extra_args_provider, ignore_unknown_args)

    return parse_args


def _wrap_validate_args(runtime_ref, original):
    def validate_args(args, *rest, **kwargs):
        if runtime_ref() is None:
            return original(args, *rest, **kwargs)
        # What Megatron prints while it validates (on rank 0 the whole argument table, about
        # 700 lines) is held back until EDiT's checks pass: a refusal is then the only line.
        held = io.StringIO()
        try:
            with contextlib.redirect_stdout(held), contextlib.redirect_stderr(held):
                result = original(args, *rest, **kwargs)
                validate_local_sgd_args(args)
        except (ConfigError, NotSupportedYet):
            raise  # EDiT's refusal: one line, without Megatron's table
        except BaseException:
            sys.stdout.write(held.getvalue())  # Megatron's own error: with what led to it
            raise
        sys.stdout.write(held.getvalue())
        sys.stdout.flush()
        return result

    return validate_args


def _wrap_training_log(runtime_ref, state, original):
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
            runtime.sync_record,
        ) or None
        try:
            return original(*args, **kwargs)
        finally:
            state.pending = None

    return training_log


def _wrap_print_rank_last(state, original):
    def print_rank_last(message):
        if state.pending:  # inside training_log: this is its console line
            message, state.pending = message + state.pending, None
        return original(message)

    return print_rank_last


def add_training_patches(
    registry: PatchRegistry, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]
) -> List[str]:
    """Declare the patches on Megatron-LM's ``megatron.training``; returns their ids.

    Modules of a fork with the native integration (``MEGATRON_EDIT_NATIVE``) get none of the
    ``lm-*`` patches; the ``worker-local-*`` ones (:func:`add_worker_local_patches`) apply on
    both routes. ``lm-compile-helpers`` (:func:`add_startup_patches`) is declared unless the
    launcher applied it already.
    """
    state = _TrainingLogState()
    added: List[str] = []
    if not _startup_patches_applied():
        added += add_startup_patches(registry)

    def add(patch: Patch) -> None:
        registry.add(patch)
        added.append(patch.id)

    def declare(pid, target, wrap, description):
        # initialize stops binding parse_args / validate_args in 0.18 (scripts call
        # arguments.parse_and_validate_args): the table's release range says so.
        add(compat_patch(pid, target, wrap, description))

    if not is_native(_ARGS):
        for module in (_ARGS, _INIT):  # until 0.18 initialize binds both names at import
            where = module.rsplit(".", 1)[1]
            declare(f"lm-parse-args-{where}", f"{module}:parse_args", partial(_wrap_parse_args, runtime_ref),
                    "add the EDiT flags to Megatron's parser, whatever extra_args_provider")
            declare(f"lm-validate-args-{where}", f"{module}:validate_args", partial(_wrap_validate_args, runtime_ref),
                    "check the EDiT flags with Megatron's options at start-up")
    if not is_native(_TRAINING):
        declare("lm-training-log", f"{_TRAINING}:training_log", partial(_wrap_training_log, runtime_ref, state),
                "EDiT sync metrics to TensorBoard / W&B at Megatron's intervals")
        declare("lm-print-rank-last", f"{_TRAINING}:print_rank_last", partial(_wrap_print_rank_last, state),
                "EDiT sync metrics on training_log's console line")
    added += add_worker_local_patches(registry, runtime_ref)
    added += add_global_budget_patches(registry, runtime_ref)
    return added


def add_global_budget_patches(
    registry: PatchRegistry, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]
) -> List[str]:
    """Declare the patches on Megatron-LM's loop: :class:`GlobalBudget` (A-EDiT), :class:`RunLength`
    (synchronous EDiT's last sync), and, over the torchft backend, :class:`FollowHeals` (the
    loop counter follows a heal) and :class:`ReplicaData` (each worker's own data); returns their
    ids. Applied on both routes: the fork in ``patches/`` does not do this."""
    budget = GlobalBudget(runtime_ref)
    heals = FollowHeals(runtime_ref)
    data = ReplicaData(runtime_ref)
    meetings = ChecksAtMeetings(runtime_ref)
    records = RecordLog(runtime_ref)

    def patch(pid, name, wrap, description):
        return compat_patch(pid, f"{_TRAINING}:{name}", wrap, description)

    def sampler_patch(pid, name, description):  # a class, wrapped by a subclass
        return compat_patch(pid, f"{_SAMPLERS}:{name}", data.wrap_sampler, description)

    patches = [
        # One patch per target (the registry restores each original exactly): the run's length
        # (synchronous EDiT's last sync: --train-samples, less --iterations-to-skip), torchft's
        # heal at start-up and A-EDiT's loop cap all wrap setup_model_and_optimizer.
        patch("edit-last-step", "setup_model_and_optimizer",
              lambda original: records.wrap_setup_model_and_optimizer(
                  RunLength(runtime_ref).wrap_setup_model_and_optimizer(
                      heals.wrap_setup_model_and_optimizer(budget.wrap_setup_model_and_optimizer(original)))),
              "EDiT: the run's last sync at Megatron's last optimizer step (--train-iters or "
              "--train-samples, less --iterations-to-skip); torchft: the loop starts at the step a heal "
              "put the worker at; A-EDiT: the loop may run to --train-iters x workers (data sets built for that); "
              "--local-sgd-sync-record: the logging rank reads its worker's records"),
        patch("a-edit-common-iteration", "train",
              lambda original: records.wrap_train(budget.wrap_train(meetings.wrap_train(original))),
              "A-EDiT: train returns --train-iters, the common iteration, on every worker; "
              "--check-weight-hash-across-dp-replicas-interval: resumed between syncs, the check "
              "before the loop is made at the first sync; --local-sgd-sync-record: the last records to "
              "TensorBoard after the loop"),
        patch("a-edit-save-exit-at-sync", "checkpoint_and_decide_exit",
              lambda original: heals.wrap_checkpoint_and_decide_exit(budget.wrap_checkpoint_and_decide_exit(
                  meetings.wrap_checkpoint_and_decide_exit(original))),
              "A-EDiT: --save-interval / --exit-interval in global progress, at a sync; every "
              "worker leaves the loop right after the final sync; torchft: a worker healed k steps "
              "ahead skips its next k iterations; --exit-duration-in-mins asked at syncs only"),
        patch("async-save-check-at-meetings", "maybe_finalize_async_save", meetings.wrap_maybe_finalize_async_save,
              "--async-save: the per-iteration completion check (an all-reduce over all ranks) only at "
              "warmup steps and syncs, where every worker meets (A-EDiT: at each worker's sync)"),
        patch("hash-check-at-syncs", "post_training_step_callbacks", meetings.wrap_post_training_step_callbacks,
              "--check-weight-hash-across-dp-replicas-interval: the check owed since each multiple of the "
              "interval at the first sync at or after it, where replicas are equal"),
        patch("ft-data-sizes", "get_train_valid_test_num_samples", data.wrap_num_samples,
              "torchft: the data sets built for every worker's slice (x workers)"),
        sampler_patch("ft-data-sampler", "MegatronPretrainingSampler",
                      "torchft: each worker reads its own slice (data-parallel rank w D + d of W D)"),
        sampler_patch("ft-data-random-sampler", "MegatronPretrainingRandomSampler",
                      "torchft: each worker reads its own slice (--dataloader-type cyclic)"),
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
