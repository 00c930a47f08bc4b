"""A step the loss scaler skips is the worker's own: it still counts, and a sync due at it runs.

With fp16 (or any ``--loss-scale``) Megatron's optimizer ``step()`` unscales the gradients, and
when it finds an inf or a nan it lowers the loss scale and returns ``(False, None, None)``
before ``step_with_ready_grads``: no inner update, no main -> model copy. Megatron-LM's loop
still counts the iteration (``skipped_iter``) and leaves the learning-rate schedule where it is.
The finding is agreed over the optimizer's gradient-statistics group, which EDiT keeps inside
the worker (patch ``distopt-grad-stats-group``): every rank of the worker skips together, the
other workers do not.

The workers meet by step count (the sync grid, A-EDiT's plan), so a worker that skipped must
still reach a sync due at that step, or the others would wait for it. Here a skipped step runs
the optimizer's ``step_with_ready_grads`` with the inner update left out: the controller counts
the step (patch ``distopt-step-with-ready-grads``), a sync due then runs where it always does
(step-end: before the main -> model copy; layer-wise: in the next forward pass), and the
parameter gather spreads the result inside the worker. Without a sync the copy writes the
unchanged main parameters back, so the step changes nothing. The worker's pseudo-gradient at
such a sync is what it trained before the skip. Megatron's return value is unchanged (a skipped
step), so its loop, its loss-scale log and its learning-rate schedule keep their meaning; each
worker's loss scale is its own (saved per worker with its optimizer state, Megatron's
``dp_reshardable`` format).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterable, Optional

from .runtime import LocalSGDRuntime, get_local_sgd
from .wrap_registry import Patch, PatchRegistry
from . import compat

_MIXED_STEP = "megatron.core.optimizer.optimizer:MixedPrecisionOptimizer.step"  # DistributedOptimizer's
_CHAINED_STEP = "megatron.core.optimizer.optimizer:ChainedOptimizer.step"


def _no_update(*args, **kwargs) -> None:
    return None


@contextlib.contextmanager
def inner_update_left_out(optimizers: Iterable):
    """Megatron optimizers whose inner (torch) optimizer ``step`` does nothing inside."""
    inners = [o.optimizer for o in optimizers if not getattr(o, "is_stub_optimizer", False)]
    own = [inner.__dict__.get("step") for inner in inners]
    for inner in inners:
        inner.step = _no_update
    try:
        yield
    finally:
        for inner, step in zip(inners, own):
            if step is None:
                del inner.step
            else:
                inner.step = step


def _wrap_step(runtime_ref: Callable[[], Optional[LocalSGDRuntime]]):
    def wrap(original):
        def wrapper(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            if result[0]:
                return result
            if not get_local_sgd(self, runtime_ref()):
                return result
            with inner_update_left_out(getattr(self, "chained_optimizers", [self])):
                self.step_with_ready_grads()  # wrapped: counts the step, syncs when due
            return result

        return wrapper

    return wrap


def add_skipped_step_patches(registry: PatchRegistry, runtime_ref: Callable[[], Optional[LocalSGDRuntime]]) -> None:
    """Declare the patches of a step the loss scaler skips."""
    for pid, target in (("distopt-skipped-step", _MIXED_STEP), ("chained-skipped-step", _CHAINED_STEP)):
        registry.add(Patch(pid, target, _wrap_step(runtime_ref), compat.SUPPORTED, compat.params(target),
                           "fp16 / loss scaling: a step skipped on an inf or nan still counts and "
                           "syncs when due (the inner update left out)"))
