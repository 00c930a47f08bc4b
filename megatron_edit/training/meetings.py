"""Megatron-LM's per-iteration checks across all ranks, held to the points where EDiT workers meet.

Megatron-LM asks every rank a question at every iteration for some options: whether an
asynchronous checkpoint write has finished (``--async-save``: ``maybe_finalize_async_save``, an
all-reduce over the world in megatron-core's ``AsyncCallsQueue`` and a second one that finalizes
the save) and whether the run's time is up (``--exit-duration-in-mins``: an all-reduce of each
rank's elapsed-time verdict in ``checkpoint_and_decide_exit``, and in ``evaluate`` at every
evaluation iteration), and, every few iterations, whether all replicas hold the same weights. Under local SGD each is a barrier
across workers at every iteration; under A-EDiT, whose workers reach a given iteration at
different times and sync at different iterations, one worker's k-th question would meet another
worker's k-th at another point of its run, or never (a hang, or Megatron's "Unmatched async
calls").

:class:`ChecksAtMeetings` keeps Megatron's meaning and asks only where every worker is at the
same logical time (:func:`workers_meet`): synchronous warmup steps and syncs (A-EDiT: every sync
of its plan, whose schedule the workers agree on with an all-reduce of their own, at each
worker's own iteration). So:

* ``--async-save``: a write finishes in the background as before and is finalized (its
  ``latest_checkpointed_iteration.txt`` written) at the first meeting after it, at most one sync
  interval later. A-EDiT saves only at syncs, so every rank schedules the same saves in the same
  order. Megatron's blocking finalization (at the end of training and of ``pretrain``) is left as
  it is: every worker reaches it after the final sync.
* ``--check-weight-hash-across-dp-replicas-interval``: replicas are equal only right after a
  sync, so the check owed since each multiple of the interval (A-EDiT: of global progress) is
  made at the first sync at or after it (:func:`replicas_equal`), with Megatron's own code.
  Megatron also checks once before the loop; after a resume from a checkpoint taken between
  syncs (each worker saved its own model) that check is owed at the first sync too.
* ``--exit-duration-in-mins`` (EDiT): the run stops (and saves, with ``--save``) at the first
  warmup step or sync at or after the time, on every worker at once, at most one sync interval
  late. A-EDiT's is asked by :mod:`megatron_edit.training.global_budget` at its real syncs,
  where its checkpoints are taken (labelled with global progress, not a worker's iteration).
"""

from __future__ import annotations

import inspect
import math
from contextlib import contextmanager
from typing import Callable, List, Optional

from ..algorithm.schedule import is_sync_step
from ..mcore.runtime import LocalSGDRuntime


def workers_meet(controllers) -> bool:
    """Whether the step just taken is one every worker takes at the same logical time, where a
    collective across workers costs no barrier of its own: a synchronous warmup step, or a step
    a sync followed (EDiT: on the grid of --local-sgd-sync-interval; A-EDiT: the step of the
    latest sync of its plan, skipped or not, known only once that sync has run). False without
    EDiT objects."""
    if not controllers:
        return False
    controller = controllers[0]
    c, steps = controller.config, controller.steps_done
    if steps <= c.local_sgd_warmup_steps:
        return True
    if c.use_async:
        return controller.at_sync
    return is_sync_step(steps, c.local_sgd_warmup_steps, c.local_sgd_sync_interval)


def replicas_equal(controllers) -> bool:
    """:func:`workers_meet` where every worker holds the same model: not at an A-EDiT sync that
    was skipped (nothing exchanged there). Start-up refuses what keeps replicas apart after a
    sync (fragments, a merge that keeps local progress: ``--check-weight-hash-across-dp-replicas-
    interval``'s checks in :mod:`megatron_edit.training.validation`)."""
    if not workers_meet(controllers):
        return False
    controller = controllers[0]
    if controller.config.use_async and controller.steps_done > controller.config.local_sgd_warmup_steps:
        return not controller.last_sync.skipped
    return True


HASH_CHECK = "check_weight_hash_across_dp_replicas_interval"


def replicas_equal_at_start(controllers) -> bool:
    """Whether every worker holds the same model before the training loop: a fresh start, a load
    that left every fragment identical (another number of workers, a synchronous checkpoint, or
    one saved right after a sync), or a step where the workers meet with equal models."""
    if all(c.steps_done == 0 for c in controllers):
        return True
    if all(c.identical_fragments == list(range(c.config.fragments)) for c in controllers):
        return True
    return replicas_equal(controllers)


def _get_args():
    from megatron.training.global_vars import get_args

    return get_args()


@contextmanager
def _without(args, name, value=None):
    """``args.name`` set to ``value`` (default None: the option off) inside the block."""
    saved = getattr(args, name)
    setattr(args, name, value)
    try:
        yield
    finally:
        setattr(args, name, saved)


class ChecksAtMeetings:
    """The patches on Megatron-LM's per-iteration checks across all ranks."""

    def __init__(self, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]):
        self.runtime_ref = runtime_ref
        self.deferred = 0
        """How many per-iteration checks were held back to the next meeting."""
        self.hash_check_due = False
        """--check-weight-hash-across-dp-replicas-interval: a check is owed since a multiple of
        the interval passed (EDiT: iterations; A-EDiT: global progress at its real syncs)."""
        self._hash_progress = 0.0
        self._held_interval: Optional[int] = None
        """The interval while Megatron's own start-of-training check is held (see wrap_train)."""

    def controllers(self) -> List:
        runtime = self.runtime_ref()
        return list(runtime.controllers.values()) if runtime is not None else []

    def wrap_maybe_finalize_async_save(self, original):
        def maybe_finalize_async_save(blocking: bool = False, terminate=False):
            controllers = self.controllers()
            if blocking or terminate or not controllers or workers_meet(controllers):
                return original(blocking=blocking, terminate=terminate)
            self.deferred += 1
            return None

        return maybe_finalize_async_save

    def wrap_checkpoint_and_decide_exit(self, original):
        def checkpoint_and_decide_exit(*args, **kwargs):
            megatron_args = _get_args()
            controllers = self.controllers()
            if (not getattr(megatron_args, "exit_duration_in_mins", None) or not controllers
                    or workers_meet(controllers)):
                return original(*args, **kwargs)
            self.deferred += 1
            with _without(megatron_args, "exit_duration_in_mins"):
                return original(*args, **kwargs)

        return checkpoint_and_decide_exit

    def wrap_evaluate(self, original):
        """``evaluate`` asks --exit-duration-in-mins at every evaluation iteration (an all-reduce
        over all ranks); with local SGD the next meeting asks instead."""
        def evaluate(*args, **kwargs):
            megatron_args = _get_args()
            if not getattr(megatron_args, "exit_duration_in_mins", None) or not self.controllers():
                return original(*args, **kwargs)
            with _without(megatron_args, "exit_duration_in_mins"):
                return original(*args, **kwargs)

        return evaluate

    def wrap_post_training_step_callbacks(self, original):
        """Megatron checks that every data-parallel replica holds the same weights after each
        multiple of --check-weight-hash-across-dp-replicas-interval (hashes gathered over the
        data-parallel group, then a barrier over all ranks). With local SGD replicas are equal
        only right after a sync: the check owed is made at the first sync (or warmup step) at or
        after the multiple, on every worker at once, with Megatron's own code and message."""
        names = tuple(inspect.signature(original).parameters)

        def post_training_step_callbacks(*args, **kwargs):
            megatron_args = _get_args()
            name = HASH_CHECK
            interval = getattr(megatron_args, name, None) or self._held_interval
            controllers = self.controllers()
            if interval is None or not controllers:
                return original(*args, **kwargs)
            iteration = kwargs["iteration"] if "iteration" in kwargs else args[names.index("iteration")]
            self.hash_check_due = self.hash_check_due or self._hash_interval_passed(
                controllers[0], iteration, interval)
            check = self.hash_check_due and replicas_equal(controllers)
            # Megatron checks when iteration % interval == 0: 1 makes it check now.
            with _without(megatron_args, name, 1 if check else None):
                result = original(*args, **kwargs)
            if check:
                self.hash_check_due = False
            return result

        return post_training_step_callbacks

    def wrap_train(self, original):
        """Megatron checks the replicas' hashes once before its loop, at the iteration it
        resumed from. Resumed from a checkpoint taken between syncs, the workers hold their own
        models there by design: that check is owed at the first sync instead (made by
        :meth:`wrap_post_training_step_callbacks`), and Megatron's option is off inside ``train``
        (its loop reads it nowhere else)."""
        def train(*args, **kwargs):
            megatron_args = _get_args()
            interval = getattr(megatron_args, HASH_CHECK, None)
            controllers = self.controllers()
            if interval is None or not controllers or replicas_equal_at_start(controllers):
                return original(*args, **kwargs)
            self.hash_check_due, self._held_interval = True, interval
            try:
                with _without(megatron_args, HASH_CHECK):
                    return original(*args, **kwargs)
            finally:
                self._held_interval = None

        return train

    def _hash_interval_passed(self, controller, iteration: int, interval: int) -> bool:
        c = controller.config
        if not c.use_async or controller.steps_done <= c.local_sgd_warmup_steps:
            return iteration % interval == 0  # Megatron's rule (A-EDiT's warmup is synchronous)
        if not controller.at_sync or controller.last_sync.skipped:
            return False  # A-EDiT: global progress is agreed at real syncs only
        previous, self._hash_progress = self._hash_progress, controller.last_sync.global_progress
        return math.floor(self._hash_progress / interval) > math.floor(previous / interval)
