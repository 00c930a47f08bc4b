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


def is_plain_momentum_sgd(optimizer_class: type, kwargs: dict) -> bool:
    """Whether the outer optimizer is ``torch.optim.SGD`` with momentum and nothing else
    (no weight decay, dampening, maximize): the default, which :func:`momentum_sgd_step_`
    computes in fewer passes over memory than ``torch.optim.SGD.step``."""
    return (
        optimizer_class is torch.optim.SGD
        and float(kwargs.get("momentum", 0.0)) > 0.0
        and float(kwargs.get("weight_decay", 0.0)) == 0.0
        and float(kwargs.get("dampening", 0.0)) == 0.0
        and not kwargs.get("maximize", False)
    )


@torch.no_grad()
def momentum_sgd_step_(
    anchor: torch.Tensor,
    momentum: torch.Tensor,
    delta: torch.Tensor,
    lr: float,
    mu: float,
    nesterov: bool,
    first: bool,
) -> None:
    """torch.optim.SGD's update (momentum ``mu``, no weight decay or dampening) of ``anchor`` with
    gradient ``delta``, with the same operations in the same order as ``torch.optim.SGD`` (so
    the same numbers), in place and without an optimizer object. ``delta`` is scratch
    (overwritten); ``momentum`` is only written on the ``first`` step::

        m = mu * m + delta          (m = delta on the first step)
        u = delta + mu * m          (nesterov; otherwise u = m)
        anchor -= lr * u
    """
    if first:
        momentum.copy_(delta)
    else:
        momentum.mul_(mu).add_(delta)
    update = delta.add_(momentum, alpha=mu) if nesterov else momentum
    anchor.add_(update, alpha=-lr)


def fused_momentum_sgd_step_(
    anchor: torch.Tensor,
    momentum: torch.Tensor,
    delta: torch.Tensor,
    scale: torch.Tensor,
    lr: float,
    mu: float,
    nesterov: bool,
    first: bool,
    mains: "torch.Tensor | None",
    model: "torch.Tensor | None",
) -> None:
    """``delta * scale`` (the mean's 1/workers, possibly times a layer's clip factor; a 0 scale
    gives 0, even for NaN/Inf), then :func:`momentum_sgd_step_` and the writes that follow it, as
    one elementwise function meant for ``torch.compile`` (one kernel: reads anchor, momentum and
    delta once, writes anchor, momentum, the fp32 main params ``mains`` and the model's 16-bit
    copy ``model``). ``scale`` is a 0-dim tensor (a Python float would be compiled in as a
    constant). ``momentum`` is written, not read, on the ``first`` step. The same math as
    :func:`momentum_sgd_step_`; a compiler may contract multiply-adds, so the last bit can
    differ."""
    delta = torch.where(scale == 0, torch.zeros_like(delta), delta * scale)
    m = delta if first else momentum * mu + delta
    update = delta + m * mu if nesterov else m
    new = anchor - update * lr
    anchor.copy_(new)
    momentum.copy_(m)
    if mains is not None:
        mains.copy_(new)
    if model is not None:
        model.copy_(new)
