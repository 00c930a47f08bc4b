"""EDiT's step schedule (arXiv 2412.07210, Sec. 3): warmup, local steps, syncs every H steps.

Steps 1..W are ordinary synchronous data-parallel training; after them each worker trains on its
own and the workers synchronise after steps W+H, W+2H, ...
"""

from __future__ import annotations


def is_sync_step(steps_done: int, warmup_steps: int, sync_interval: int) -> bool:
    """True when the optimizer step that brought the count to ``steps_done`` ends an interval.

    Steps 1..W are synchronous warmup; syncs follow at W+H, W+2H, ...
    """
    return steps_done > warmup_steps and (steps_done - warmup_steps) % sync_interval == 0


def grads_are_local(steps_done: int, warmup_steps: int) -> bool:
    """Whether the step now running (number ``steps_done + 1``) reduces gradients only inside
    the worker. Warmup steps reduce them across all data-parallel ranks."""
    return steps_done >= warmup_steps


def delay_limit(sync_interval: int, fragments: int = 1) -> int:
    """The bound on the delay of the outer step: tau < H/F (one exchange in flight at a time, the
    previous one, of the previous fragment, applied before the next is launched)."""
    return sync_interval // fragments
