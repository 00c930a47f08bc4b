"""The run's last optimizer step in Megatron-LM's training loop, for synchronous EDiT (arXiv
2412.07210): the run ends with a sync of every shard there (:meth:`LocalSGD.set_train_iters`),
so every worker ends with the same model and no delayed exchange is left in flight.

Megatron-LM's ``--train-iters`` is known when the first DDP is built (the runtime passes it on);
two options move the last step away from it, handled here once the model, optimizer and
scheduler are built and a checkpoint is loaded (``setup_model_and_optimizer``):

* ``--train-samples``: ``args.train_iters`` is only computed while the scheduler is built
  (``update_train_iters``), after the optimizer;
* ``--iterations-to-skip`` (and ``--result-rejected-tracker-filename``, which adds to it): a
  skipped iteration runs no optimizer step, and EDiT counts optimizer steps.

The last step is this worker's optimizer steps so far plus the iterations still to run that are
not skipped: ``steps_done + |{i in [iteration, train_iters) : i + base not skipped}|`` (with ``i``
iterations completed Megatron skips the next when ``i + base`` is listed: base 0 up to 0.16, 1
from 0.19, :func:`megatron_edit.mcore.compat.skipped_iteration_base`).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Optional

from ..mcore import compat
from ..mcore.runtime import LocalSGDRuntime

logger = logging.getLogger(__name__)


def _get_args():
    from megatron.training.global_vars import get_args

    return get_args()


def last_step(steps_done: int, iteration: int, train_iters: int, skipped: Iterable[int] = (), base: int = 0) -> int:
    """The optimizer step the run ends at: ``steps_done`` taken, Megatron's loop at
    ``iteration`` (completed iterations) running to ``train_iters``, the iterations ``skipped``
    (read with ``base``, see the module) running no optimizer step."""
    skip = set(skipped or ())
    return steps_done + sum(1 for i in range(iteration, train_iters) if i + base not in skip)


class RunLength:
    """The patch that tells synchronous EDiT where Megatron-LM's run ends."""

    def __init__(self, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]):
        self.runtime_ref = runtime_ref

    def controllers(self) -> list:
        """This rank's synchronous EDiT objects (A-EDiT's budget is the global budget's)."""
        runtime = self.runtime_ref()
        if runtime is None:
            return []
        return [c for c in runtime.controllers.values() if not c.config.use_async]

    def wrap_setup_model_and_optimizer(self, original):
        def setup_model_and_optimizer(*args, **kwargs):
            result = original(*args, **kwargs)
            controllers = self.controllers()
            if controllers:
                self.apply(_get_args(), controllers)
            return result

        return setup_model_and_optimizer

    @staticmethod
    def apply(args, controllers) -> None:
        """Set every controller's last step from Megatron-LM's ``args`` (after the load)."""
        if not args.train_iters:
            raise RuntimeError(
                "megatron_edit: Megatron-LM's args.train_iters is still unset after the scheduler was "
                "built (neither --train-iters nor --train-samples?): EDiT cannot place the run's last "
                "sync.")
        skipped = list(getattr(args, "iterations_to_skip", None) or ())
        base = compat.skipped_iteration_base() if skipped else 0
        if base is None:
            raise RuntimeError(
                f"megatron_edit: --iterations-to-skip with --use-local-sgd is not checked on megatron-core "
                f"{compat.megatron_core_version()} (checked: 0.16.x-0.19.x); EDiT could not place the run's last sync.")
        for controller in controllers:
            end = last_step(controller.steps_done, args.iteration, args.train_iters, skipped, base)
            controller.set_train_iters(end)
        if getattr(args, "rank", 0) == 0 and controllers and controllers[0].last_step != args.train_iters:
            logger.info(
                "megatron_edit: the run ends with a sync after optimizer step %d (Megatron's iteration "
                "%d; %d optimizer step(s) done, %d iteration(s) skipped)", controllers[0].last_step,
                args.train_iters, controllers[0].steps_done,
                sum(1 for i in set(skipped) if args.iteration <= i - base < args.train_iters))
