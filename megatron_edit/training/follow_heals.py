"""Megatron-LM's loop counter follows a torchft heal (``--local-sgd-sync-backend torchft``).

A worker that heals from a live peer (:mod:`megatron_edit.mcore.fault_tolerant`) takes the
peer's step count with its state: a fresh job for a dead worker heals while its optimizer is
built, a live worker that missed a sync heals at its next one. Megatron-LM's ``train`` keeps
its own count (``iteration``, a local of the loop), which the run's end, the checkpoints'
numbering, the evaluation interval and the batch-size ramp read. So:

* **At start-up** (after ``setup_model_and_optimizer``: the optimizer built, a checkpoint
  loaded), ``args.iteration``, where ``train`` starts counting, is moved to where the
  controller's optimizer steps put it (:func:`iteration_for`). A fresh job that healed into
  step S starts its loop at iteration S; its data position is its own (a fresh job's:
  Megatron's start from ``args.iteration`` x the global batch, of its own shard).
* **Mid-run** (at ``checkpoint_and_decide_exit``, after every iteration): a worker that healed
  k steps ahead lets Megatron skip its next k iterations (``args.iterations_to_skip``; Megatron
  runs no step there and drops their batches), so its loop ends, saves and evaluates at the
  peers' iterations. The learning-rate schedule jumps with the heal already
  (``sched-step-global-progress``).

Megatron counts ``--iterations-to-skip`` 0-based up to 0.16 and 1-based from 0.17
(:func:`megatron_edit.mcore.compat.skipped_iteration_base`).

A-EDiT (``--local-sgd-async``) is left to the global budget: its workers' step counts differ by
design, and a heal (which gives a worker the peer's count) changes neither where its loop ends
(at the final sync) nor its schedule (global progress).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, List, Optional

from ..mcore import compat
from ..mcore.runtime import LocalSGDRuntime

logger = logging.getLogger(__name__)


def _get_args():
    from megatron.training.global_vars import get_args

    return get_args()


def optimizer_steps(iteration: int, skipped: Iterable[int], base: int) -> int:
    """Optimizer steps Megatron's loop took in its first ``iteration`` iterations, those listed
    in ``skipped`` (read with ``base``, see the module) taking none."""
    return iteration - sum(1 for s in set(skipped) if base <= s < iteration + base)


def iteration_for(steps: int, skipped: Iterable[int], base: int) -> int:
    """The fewest iterations in which the loop takes ``steps`` optimizer steps."""
    skip = set(skipped)
    iteration = steps
    while optimizer_steps(iteration, skip, base) < steps:
        iteration += 1
    return iteration


def skips_for(lag: int, iteration: int, skipped: Iterable[int], base: int) -> List[int]:
    """The entries to add to ``--iterations-to-skip`` so that the ``lag`` iterations after
    ``iteration`` (those not skipped already) run no step."""
    skip, added, i = set(skipped), [], iteration
    while len(added) < lag:
        if i + base not in skip:
            added.append(i + base)
        i += 1
    return added


class FollowHeals:
    """The patches that keep Megatron-LM's loop counter with a torchft worker's controller."""

    def __init__(self, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]):
        self.runtime_ref = runtime_ref
        self.added: set = set()
        """The entries of ``--iterations-to-skip`` added here (each stands for a step the peers took)."""

    def controllers(self) -> list:
        """This rank's synchronous EDiT objects on the torchft backend (none otherwise). A-EDiT's
        workers are at their own step counts by design: its loop counter is the global budget's
        (:mod:`megatron_edit.training.global_budget`, which starts the loop at the controller's
        step, healed or not, and ends it at the final sync)."""
        runtime = self.runtime_ref()
        if runtime is None:
            return []
        return [c for c in runtime.controllers.values()
                if c.backend.dynamic and not c.config.use_async]

    @staticmethod
    def _steps(controllers) -> int:
        steps = {c.steps_done for c in controllers}
        if len(steps) != 1:
            raise RuntimeError(f"megatron_edit: this rank's EDiT optimizers are at different steps {sorted(steps)}.")
        return steps.pop()

    @staticmethod
    def _base() -> int:
        base = compat.skipped_iteration_base()
        if base is None:  # validate_local_sgd_args refuses these releases first
            raise RuntimeError(
                f"megatron_edit: --local-sgd-sync-backend torchft through Megatron-LM is not checked on megatron-core "
                f"{compat.megatron_core_version()} (checked: 0.16.x-0.19.x).")
        return base

    # ----------------------------------------------------------------- start-up
    def wrap_setup_model_and_optimizer(self, original):
        def setup_model_and_optimizer(*args, **kwargs):
            result = original(*args, **kwargs)
            controllers = self.controllers()
            if controllers:
                self.start(_get_args(), controllers)
            return result

        return setup_model_and_optimizer

    def start(self, args, controllers) -> None:
        """Move ``args.iteration`` to the controller's step (a heal while the optimizer was built)."""
        base, steps = self._base(), self._steps(controllers)
        skipped = list(getattr(args, "iterations_to_skip", None) or ())
        done = optimizer_steps(args.iteration, skipped, base)
        if steps < done:
            raise RuntimeError(
                f"megatron_edit: the EDiT state is at optimizer step {steps}, behind Megatron's iteration "
                f"{args.iteration} ({done} optimizer steps): the checkpoint's EDiT state and its iteration disagree.")
        if steps == done:
            return
        before, args.iteration = args.iteration, iteration_for(steps, skipped, base)
        if getattr(args, "rank", 0) == 0:
            logger.warning(
                "megatron_edit: worker %s healed from a live peer into optimizer step %d: Megatron's loop starts at "
                "iteration %d (not %d); its data position is its own.",
                controllers[0].config.replica_id, steps, args.iteration, before)

    # ----------------------------------------------------------------- mid-run
    def wrap_checkpoint_and_decide_exit(self, original):
        def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration,
                                       num_floating_point_operations_so_far, checkpointing_context,
                                       train_data_iterator):
            controllers = self.controllers()
            if controllers:
                self.catch_up(_get_args(), iteration, controllers)
            return original(model, optimizer, opt_param_scheduler, iteration, num_floating_point_operations_so_far,
                            checkpointing_context, train_data_iterator)

        return checkpoint_and_decide_exit

    def catch_up(self, args, iteration: int, controllers) -> List[int]:
        """After ``iteration`` iterations: skip as many of the next ones as a heal put the
        controller ahead of the loop (returns the entries added to ``--iterations-to-skip``).
        An iteration skipped here stands for a step the peers took (the loop is level when its
        iterations less the user's own skips are the controller's steps); one the user listed
        takes no step anywhere."""
        base = self._base()
        if args.iterations_to_skip is None:
            args.iterations_to_skip = []
        own = [s for s in args.iterations_to_skip if s not in self.added]
        pending = sum(1 for s in self.added if s >= iteration + base)
        lag = self._steps(controllers) - optimizer_steps(iteration, own, base) - pending
        if lag <= 0:
            return []
        added = skips_for(lag, iteration, args.iterations_to_skip, base)
        args.iterations_to_skip.extend(added)
        self.added.update(added)
        if getattr(args, "rank", 0) == 0:
            logger.warning(
                "megatron_edit: worker %s healed from a live peer %d optimizer step(s) ahead of its own: Megatron "
                "skips its next %d iteration(s) (%d .. %d), so its loop stays at the others' iteration.",
                controllers[0].config.replica_id, lag, lag, iteration + 1, iteration + lag)
        return added
