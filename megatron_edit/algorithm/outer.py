"""The pure math of EDiT's outer step (arXiv 2412.07210, Sec. 3): no communication here.

Per parameter shard, with anchor theta_g (the value at the last sync) and a worker's current
theta_i: the pseudo-gradient is Delta_i = theta_g - theta_i; the workers' Delta_i are reduced to
one Delta; an outer optimizer steps the anchor with Delta as its gradient; every worker restarts
from the new anchor.
"""

from __future__ import annotations

from typing import Sequence

import torch


def pseudo_gradient(anchor: torch.Tensor, current: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Delta = anchor - current, written to ``out`` (which may be ``current``)."""
    return torch.sub(anchor, current, out=out)


def mean_from_sum(summed: torch.Tensor, num_workers: int) -> torch.Tensor:
    """In place: the sum of the workers' pseudo-gradients -> their mean."""
    if num_workers != 1:
        summed.div_(num_workers)
    return summed


@torch.no_grad()
def outer_step(
    optimizer: torch.optim.Optimizer,
    anchors: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
) -> None:
    """Step ``optimizer`` on ``anchors`` only, with ``grads`` as their gradients.

    The optimizer may hold other anchors too: torch optimizers skip parameters whose ``grad``
    is None, so each bucket can be stepped on its own as its exchange completes.
    """
    for anchor, grad in zip(anchors, grads):
        anchor.grad = grad
    optimizer.step()
    for anchor in anchors:
        anchor.grad = None
