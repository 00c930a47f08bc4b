"""A-EDiT's global budget in Megatron-LM's training loop (arXiv 2412.07210, Sec. 3.4).

A-EDiT's run is ``--train-iters`` x workers worker-steps in total (what the synchronous run
consumes), shared out by speed: a fast worker takes more than ``--train-iters`` steps, a slow
one fewer, and each stops at its own step count after the final sync
(:attr:`LocalSGD.finished`). Megatron-LM's ``train`` loop runs to ``args.train_iters`` on every
rank; :class:`GlobalBudget` makes it follow the budget instead:

* **Loop cap.** Once the model, optimizer and scheduler are built (the scheduler's horizon is
  the synchronous ``--train-iters`` T, or ``--train-samples`` over the global batch size as the
  scheduler computes it, which then also sets the budget; followed by every worker through the patch
  ``sched-step-global-progress``) and before the data sets are, ``args.train_iters`` becomes
  T x W, what one worker could at most take (and ``--train-samples`` that many global batches).
  The training data set is therefore built W times larger than the synchronous run's: a fast
  worker reads its ranks' slices of global batches beyond T, and never runs out (the workers
  read T global batches' worth of samples in total).
* **End.** After the ``train_step`` in which the final sync ran, the loop's cap is this
  iteration: every worker leaves the loop right after the final sync, at its own iteration.
  ``train`` then returns T, the common iteration (global progress), so the final checkpoint and
  evaluation Megatron runs after it use one iteration number on every rank.
* **Checkpoints and exits** (``--save-interval``, ``--exit-interval``; ``--exit-duration-in-mins``
  asked there) count global progress
  (worker-steps / workers, in synchronous iterations) and happen only at a sync, the one point
  all workers reach at the same logical time: at the first real (not skipped) sync at or past
  each multiple of the interval (at the final sync, global iteration T, as Megatron does at
  ``--train-iters``: there only when T is a multiple; otherwise Megatron's save after the loop
  takes it). The checkpoint is labelled with the global progress there
  (rounded down, so the same on every rank); all workers hold the same model, and their own
  counters and plan are in the EDiT state, so each resumes with its own. Its consumed-samples
  count is the furthest any worker read (one all-reduce at the save), so no worker reads a
  sample twice after resuming. Checkpoints Megatron would take at a worker's own iteration
  (``--non-persistent-save-interval``, batch-size ramp-up) are refused at start-up.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager
from typing import Callable, List, Optional

import torch

from ..mcore.runtime import LocalSGDRuntime

logger = logging.getLogger(__name__)


@contextmanager
def _replaced(args, **values):
    """``args``' attributes set to ``values`` inside the block, restored after it."""
    saved = {name: getattr(args, name, None) for name in values}
    for name, value in values.items():
        setattr(args, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(args, name, value)


def _get_args():
    from megatron.training.global_vars import get_args

    return get_args()


def _device():
    """Where a collective of Megatron's process groups takes its tensors (NCCL: this rank's GPU)."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"


def crossed(previous: float, now: float, interval: Optional[int]) -> bool:
    """Whether global progress passed a multiple of ``interval`` in (previous, now]."""
    return bool(interval) and math.floor(now / interval) > math.floor(previous / interval)


def checkpoint_iteration(progress: float) -> int:
    """The common iteration a checkpoint at global progress ``progress`` is labelled with."""
    return math.floor(progress + 1e-9)


class GlobalBudget:
    """The patches that make Megatron-LM's ``train`` loop follow A-EDiT's global budget."""

    def __init__(self, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]):
        self.runtime_ref = runtime_ref
        self.train_iters: Optional[int] = None
        """T: the synchronous run's ``--train-iters`` (the loop's cap is raised past it)."""
        self._progress_at_last_sync: Optional[float] = None
        self.train_samples: Optional[int] = None
        """--train-samples as given (None: --train-iters): the data set is built for the loop's cap."""

    def controllers(self) -> List:
        """This rank's A-EDiT objects (none while EDiT is off or synchronous)."""
        runtime = self.runtime_ref()
        if runtime is None:
            return []
        return [c for c in runtime.controllers.values() if c.config.use_async]

    # ----------------------------------------------------------------- set-up: the loop cap
    def wrap_setup_model_and_optimizer(self, original):
        def setup_model_and_optimizer(*args, **kwargs):
            result = original(*args, **kwargs)
            controllers = self.controllers()
            if controllers:
                self.start(_get_args(), controllers[0])
            return result

        return setup_model_and_optimizer

    def start(self, args, controller) -> None:
        """After the scheduler is built and a checkpoint loaded, before the data sets: raise the
        loop's cap to what one worker could take."""
        self.train_iters = args.train_iters
        self._progress_at_last_sync = controller.global_progress
        if getattr(args, "train_samples", None) and controller.budget_steps is None:
            # --train-samples: the length is known once the scheduler has computed it
            for c in self.controllers():
                c.set_train_iters(args.train_iters)
        # Resumed from a checkpoint (labelled with global progress): each worker's loop goes on
        # from its own step count, which the EDiT state restored (a fast worker had taken more).
        # Over torchft, a fresh job that healed from a live peer while its optimizer was built
        # goes on from the peer's count.
        before, args.iteration = args.iteration, getattr(controller, "steps_done", args.iteration)
        healed = controller.backend.healed_sync_step is not None
        if healed and args.iteration != before and getattr(args, "rank", 0) == 0:
            logger.warning(
                "megatron_edit: worker %s healed from a live peer into optimizer step %d: Megatron's loop starts at "
                "iteration %d (not %d); its data position is its own.",
                controller.config.replica_id, controller.steps_done, args.iteration, before)
        cap = self.train_iters * controller.budget_workers
        args.train_iters = args.iteration if controller.finished else args.iteration + cap
        self.train_samples = getattr(args, "train_samples", None)
        if self.train_samples:  # the data set is built for this many samples: the same cap
            args.train_samples = args.train_iters * args.global_batch_size
        if getattr(args, "rank", 0) == 0:
            logger.info(
                "megatron_edit: A-EDiT shares %d x %d worker-steps by speed: the training loop may "
                "run to iteration %d on a fast worker and ends on every worker at the final sync; "
                "the training data set is built for that many iterations",
                self.train_iters, controller.budget_workers, args.train_iters,
            )

    # ----------------------------------------------------------------- the end
    @staticmethod
    def _finished(controllers) -> bool:
        done = [c.finished for c in controllers]
        if any(done) and not all(done):
            raise RuntimeError(
                "megatron_edit: the A-EDiT optimizers of this rank ended at different steps."
            )
        return all(done)

    def wrap_train(self, original):
        def train(*args, **kwargs):
            controllers = self.controllers()
            if not controllers:
                return original(*args, **kwargs)
            iteration, flops = original(*args, **kwargs)
            megatron_args = _get_args()
            if not self._finished(controllers):
                raise RuntimeError(
                    f"megatron_edit: Megatron's training loop ended at iteration {iteration} before "
                    "A-EDiT's final sync; the other workers would wait for this one forever."
                )
            megatron_args.train_iters = self.train_iters
            if self.train_samples:
                megatron_args.train_samples = self.train_samples
            return self.train_iters, flops

        return train

    # ----------------------------------------------------------------- checkpoints, exits
    def wrap_checkpoint_and_decide_exit(self, original):
        def checkpoint_and_decide_exit(model, optimizer, opt_param_scheduler, iteration,
                                       num_floating_point_operations_so_far, checkpointing_context,
                                       train_data_iterator):
            controllers = self.controllers()
            call = (model, optimizer, opt_param_scheduler, iteration,
                    num_floating_point_operations_so_far, checkpointing_context,
                    train_data_iterator)
            if not controllers:
                return original(*call)
            leave = self._save_or_exit(original, call, controllers[0])
            if self._finished(controllers):  # the final sync is behind: this iteration is the last
                _get_args().train_iters = iteration
            return leave

        return checkpoint_and_decide_exit

    def _save_or_exit(self, original, call, controller) -> bool:
        """Megatron's own checks without its intervals, then the intervals in global progress
        at a real sync; whether to leave the loop."""
        (model, optimizer, opt_param_scheduler, iteration, num_floating_point_operations_so_far,
         checkpointing_context, train_data_iterator) = call
        args = _get_args()
        # Megatron's interval and duration checks count this worker's iterations and time: taken
        # over below.
        with _replaced(args, save_interval=None, exit_interval=None, exit_duration_in_mins=None):
            if original(*call):
                return True
        point = controller.last_sync
        if not controller.at_sync or point.skipped:
            return False  # only a real sync is a point every worker shares
        previous, now = self._progress_at_last_sync, point.global_progress
        self._progress_at_last_sync = now
        label = checkpoint_iteration(now)
        if point.final:  # as Megatron at --train-iters: after the loop it saves unless here
            save = bool(args.save and args.save_interval) and label % args.save_interval == 0
            leave = bool(args.exit_interval) and label % args.exit_interval == 0
        else:
            save = bool(args.save) and crossed(previous, now, args.save_interval)
            leave = crossed(previous, now, args.exit_interval) or self._time_is_up(args)
        if save or (leave and args.save):
            self.save(label, model, optimizer, opt_param_scheduler,
                      num_floating_point_operations_so_far, checkpointing_context,
                      train_data_iterator)
        if leave and args.exit_interval and getattr(args, "rank", 0) == 0:
            logger.info("megatron_edit: exiting at A-EDiT's sync at global iteration %d "
                        "(--exit-interval %d)", label, args.exit_interval)
        return leave

    @staticmethod
    def _time_is_up(args) -> bool:
        """--exit-duration-in-mins, as Megatron asks it (any rank past the time: all leave), at a
        real sync instead of every iteration; the save that follows is the sync's own."""
        if not getattr(args, "exit_duration_in_mins", None):
            return False
        from megatron.training import training

        minutes = (time.time() - training._TRAIN_START_TIME) / 60.0
        done = torch.tensor([int(minutes > args.exit_duration_in_mins)], dtype=torch.int, device=_device())
        torch.distributed.all_reduce(done, op=torch.distributed.ReduceOp.MAX)
        if done.item() and getattr(args, "rank", 0) == 0:
            logger.info("megatron_edit: exiting at A-EDiT's sync after %.1f minutes "
                        "(--exit-duration-in-mins %s)", minutes, args.exit_duration_in_mins)
        return bool(done.item())

    @staticmethod
    def save(label, model, optimizer, opt_param_scheduler, flops, checkpointing_context,
             train_data_iterator) -> None:
        """Megatron's checkpoint at ``label`` (every rank, right after the same sync)."""
        from megatron.training import training

        args = _get_args()
        consumed = torch.tensor([float(args.consumed_train_samples)], dtype=torch.float64, device=_device())
        torch.distributed.all_reduce(consumed, op=torch.distributed.ReduceOp.MAX)
        with _replaced(args, consumed_train_samples=int(consumed.item())):
            training.save_checkpoint_and_time(
                label, model, optimizer, opt_param_scheduler, flops, checkpointing_context,
                train_data_iterator=train_data_iterator,
            )
