"""A-EDiT's time-based schedule (arXiv 2412.07210, Sec. 3.4), as pure functions.

Workers of different speeds train for the same wall-clock time between syncs, so fast workers
take more steps. The schedule needs no per-step communication: at each sync (a rendezvous of
all workers anyway) every rank contributes its worker's steps and elapsed seconds (float64) since
the previous sync to one small all-reduce over all ranks; from those identical numbers every
rank of every worker plans each worker's next sync as a number of its own steps,
``round(sync_time * steps / seconds)`` from the latest interval. The decision to sync is therefore the same on every
tensor-, pipeline- and shard-rank of every worker, and the collectives cannot deadlock. A sync
at which all workers together took fewer than ``min_total_global_steps`` steps since the last
real exchange is skipped (no exchange; the workers keep training from their own parameters and
the count keeps accumulating).
"""

from __future__ import annotations

from typing import Tuple

import torch


def schedule_message(
    workers: int,
    worker: int,
    steps_since_exchange: int,
    interval_steps: int,
    interval_seconds: float,
    step: int = 0,
) -> torch.Tensor:
    """This rank's contribution, its worker's column filled, others 0 (all-reduce with MAX):
    steps since the last real exchange (for the min-steps skip and the step weights, which
    accumulate across skipped syncs), the steps and seconds of the latest interval (the speed
    estimate), and the worker's step count (for the final sync)."""
    message = torch.zeros(4, workers, dtype=torch.float64)
    message[0, worker] = steps_since_exchange
    message[1, worker] = interval_steps
    message[2, worker] = interval_seconds
    message[3, worker] = step
    return message


def next_sync_steps(
    steps: torch.Tensor, plan: torch.Tensor, final_step: "int | None"
) -> torch.Tensor:
    """[W] the step at which each worker syncs next. When any worker would pass the run's last
    step before its next sync, that sync is the final one and every worker takes it at the last
    step, so all workers end together at a sync (with identical models) instead of one waiting
    for a sync the others never reach."""
    nxt = steps.to(torch.int64) + plan
    if final_step is not None and bool((nxt >= final_step).any()):
        nxt = torch.full_like(nxt, final_step)
    return nxt


def plan_next_interval(
    steps: torch.Tensor, seconds: torch.Tensor, sync_time: float, max_steps: int = 1_000_000
) -> torch.Tensor:
    """Steps each worker takes until the next sync: its measured rate times ``sync_time``
    (at least 1). ``steps``/``seconds``: per worker, since the previous sync."""
    rate = steps.to(torch.float64) / seconds.to(torch.float64).clamp_min(1e-9)
    return torch.clamp(torch.round(rate * sync_time), 1, max_steps).to(torch.int64)


def skip_sync(steps: torch.Tensor, min_total_global_steps: int) -> bool:
    """Skip the exchange when all workers together took too few steps since the last sync."""
    return int(steps.sum()) < min_total_global_steps


def blend_step_weights(
    weights: torch.Tensor, steps: torch.Tensor, excluded: torch.Tensor, ratio: float
) -> torch.Tensor:
    """``(1 - ratio) * weights + ratio * step share``, per layer over the workers not excluded.

    ``weights`` [W, L] (columns sum to 1 over included workers), ``steps`` [W],
    ``excluded`` [W, L] bool. A column where every worker is excluded stays 0.
    """
    keep = ~excluded
    share = steps.to(torch.float64).unsqueeze(1) * keep
    total = share.sum(dim=0, keepdim=True)
    share = torch.where(total > 0, share / total.clamp_min(1e-300), torch.zeros_like(share))
    return (1 - ratio) * weights + ratio * share


def first_interval(sync_interval: int) -> int:
    """Before any speed is measured, the first interval after warmup is ``sync_interval`` steps
    for every worker (warmup steps run in lockstep and say nothing about local speed)."""
    return max(1, sync_interval)


def read_schedule(reduced: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(steps since the last exchange, interval steps, interval seconds, step counts), each [W]."""
    return reduced[0], reduced[1], reduced[2], reduced[3]
