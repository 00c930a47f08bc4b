"""A-EDiT's time-based schedule (arXiv 2412.07210, Sec. 3.4), as pure functions.

Workers of different speeds train for the same wall-clock time between syncs, so fast workers
take more steps. The schedule needs no per-step communication: at each sync (a rendezvous of
all workers anyway) every rank contributes its worker's figures (float64) to one small
all-reduce over all ranks (:func:`schedule_message`); from those identical numbers every rank of
every worker plans each worker's next sync as a number of its own steps. The decision is
therefore the same on every tensor-, pipeline- and shard-rank of every worker, and the
collectives cannot deadlock.

* Speeds are smoothed: a worker's rate is its steps over its seconds in the last
  :data:`RATE_WINDOW` intervals (:func:`smoothed_rates`), so equally fast workers do not drift
  apart on one noisy interval.
* A sync at which all workers together took fewer than ``min_total_global_steps`` steps since
  the last real exchange is skipped (no exchange; the count keeps accumulating).
* The run's budget is global: ``budget_steps`` worker-steps in total (a synchronous run of T
  iterations with W workers is W x T worker-steps: each worker-step consumes the global batch /
  W), or a wall-clock budget. The last interval is planned like the others, from the rates, so
  that the budget is used exactly and every worker reaches the final sync at about the same
  time (:func:`plan_final_interval`); each worker then stops at its own step count.
* The learning-rate schedule follows global progress: during an interval where worker w takes
  n_w of the workers' N steps, each of its steps advances the schedule by N / (W n_w)
  synchronous steps (:func:`progress_per_step`), so every worker's schedule arrives at the same
  point at the sync, and a fast worker does not run off the end of its schedule.
* With a delayed outer step (tau of a worker's own steps between the launch of a sync's
  exchange and its apply) every interval but the last is at least tau + 1 steps for every
  worker (:func:`min_interval`), so a sync's exchange is applied before the next is launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

RATE_WINDOW = 3
"""Intervals over which a worker's speed is measured."""

_ROWS = 6


def schedule_message(
    workers: int,
    worker: int,
    steps_since_exchange: int,
    interval_steps: int,
    interval_seconds: float,
    step: int = 0,
    elapsed: float = 0.0,
    applied: int = 0,
) -> torch.Tensor:
    """This rank's contribution, its worker's column filled, others 0 (all-reduce with MAX):
    steps since the last real exchange (for the min-steps skip and the step weights, which
    accumulate across skipped syncs), the steps and seconds of the latest interval (the speed
    estimate), the worker's step count, its training seconds so far (time budget), and the
    worker-steps applied to the anchor before the last real exchange's window (workers that
    come and go, the torchft backend: the budget counts what reached the anchor; 0 otherwise)."""
    message = torch.zeros(_ROWS, workers, dtype=torch.float64)
    message[0, worker] = steps_since_exchange
    message[1, worker] = interval_steps
    message[2, worker] = interval_seconds
    message[3, worker] = step
    message[4, worker] = elapsed
    message[5, worker] = applied
    return message


@dataclass
class Schedule:
    """The all-reduced figures of every worker, each ``[W]`` float64."""

    steps_since_exchange: torch.Tensor
    interval_steps: torch.Tensor
    interval_seconds: torch.Tensor
    steps: torch.Tensor
    elapsed: torch.Tensor
    applied: torch.Tensor

    @property
    def idle(self) -> torch.Tensor:
        """[W] seconds each worker waited at this sync for the last one to arrive."""
        return self.interval_seconds.max() - self.interval_seconds


def read_schedule(reduced: torch.Tensor) -> Schedule:
    return Schedule(*[reduced[i].clone() for i in range(_ROWS)])


def smoothed_rates(history_steps: torch.Tensor, history_seconds: torch.Tensor) -> torch.Tensor:
    """[W] steps per second over the intervals given (``[K, W]`` each, the latest last)."""
    steps = history_steps[-RATE_WINDOW:].to(torch.float64).sum(0)
    seconds = history_seconds[-RATE_WINDOW:].to(torch.float64).sum(0)
    return steps / seconds.clamp_min(1e-9)


def fill_unmeasured(rates: torch.Tensor, measured: torch.Tensor) -> Optional[torch.Tensor]:
    """[W] rates where a worker with no measured interval (``measured`` False: it has just joined
    or healed) takes the mean rate of those measured; None when no worker is measured (plan the
    first interval, :func:`first_interval`)."""
    if not bool(measured.any()):
        return None
    mean = rates[measured].to(torch.float64).mean()
    return torch.where(measured, rates.to(torch.float64), mean)


def plan_next_interval(rates: torch.Tensor, sync_time: float, max_steps: int = 1_000_000,
                       min_steps: int = 1) -> torch.Tensor:
    """[W] steps each worker takes until the next sync: its rate times ``sync_time``, at least
    ``min_steps`` (1; with a delayed outer step tau + 1, :func:`min_interval`)."""
    return torch.clamp(torch.round(rates.to(torch.float64) * sync_time), min_steps, max_steps).to(torch.int64)


def min_interval(delay: int) -> int:
    """The fewest steps a worker may take between two syncs when the outer step is delayed by
    ``delay`` of its own steps (0: none): the exchange launched at a sync is applied ``delay``
    steps later, before the next sync launches the next one (one in flight at a time). A worker
    whose speed gives fewer is planned this many (it reaches the next sync later than the
    others, who wait for it there). The final interval is not held to it: the exchange still in
    flight at the final sync is applied there, before the final (blocking) sync."""
    return int(delay) + 1


def split_by_rate(total: int, rates: torch.Tensor) -> torch.Tensor:
    """[W] integers summing to ``total`` (at least 1 each), proportional to ``rates`` (largest
    remainder; ties to the lower worker index). Every worker takes at least one step before a
    sync, so ``total`` must be at least W (:func:`plan` never plans less)."""
    workers = rates.numel()
    if total < workers:
        raise ValueError(
            f"megatron_edit: A-EDiT cannot split {total} worker-steps over {workers} workers: each "
            "worker takes at least one step before a sync. The budget left is too small; raise "
            "--train-iters (or LocalSGD.budget_steps)."
        )
    share = rates.to(torch.float64) / rates.to(torch.float64).sum().clamp_min(1e-300)
    spare = total - workers  # everybody gets 1, the rest by rate
    exact = share * spare
    base = torch.floor(exact).to(torch.int64)
    left = int(spare - int(base.sum()))
    order = sorted(range(workers), key=lambda w: (-(float(exact[w]) - int(base[w])), w))
    for w in order[:left]:
        base[w] += 1
    return base + 1


def plan_final_interval(rates: torch.Tensor, remaining_steps: int) -> torch.Tensor:
    """The last interval: the remaining worker-steps split by rate, so all workers arrive at the
    final sync together (to within one step each)."""
    return split_by_rate(max(int(remaining_steps), 0), rates)


def plan(
    steps: torch.Tensor,
    rates: torch.Tensor,
    sync_time: float,
    budget_steps: Optional[int] = None,
    remaining_seconds: Optional[float] = None,
    done_steps: Optional[int] = None,
    min_steps: int = 1,
) -> Tuple[torch.Tensor, bool]:
    """(steps each worker takes until the next sync, whether that sync is the run's last).

    ``budget_steps``: worker-steps of the whole run (``steps`` counts those done). The next
    interval is the last when it would reach the budget, or leave less than half an interval
    or fewer worker-steps than workers after it (the final interval gives every worker at
    least one step); it then takes exactly the remaining worker-steps. ``remaining_seconds``:
    with a wall-clock budget, the same for time. ``done_steps``: the worker-steps done, when not
    ``steps.sum()`` (workers that come and go: those applied to the anchor). ``min_steps``: the
    fewest steps of a worker in an interval that is not the last (:func:`min_interval`)."""
    interval = plan_next_interval(rates, sync_time, min_steps=min_steps)
    if budget_steps is not None:
        done = int(steps.sum()) if done_steps is None else int(done_steps)
        remaining = int(budget_steps - done)
        after = remaining - int(interval.sum())
        if int(interval.sum()) * 1.5 >= remaining or after < rates.numel():
            return plan_final_interval(rates, remaining), True
    if remaining_seconds is not None and remaining_seconds <= 1.5 * sync_time:
        return plan_next_interval(rates, max(remaining_seconds, 0.0)), True
    return interval, False


def share_steps(total: int, workers: int) -> torch.Tensor:
    """[W] step counts summing to ``total``, as even as possible (the first ``total mod W``
    workers one more): the workers' counts after an elastic resume, so that they add up to the
    worker-steps the saved run had done (its global progress x W)."""
    base, extra = divmod(int(total), workers)
    return torch.tensor([base + (1 if w < extra else 0) for w in range(workers)], dtype=torch.int64)


def progress_per_step(interval: torch.Tensor, worker: int, workers: Optional[int] = None) -> float:
    """Synchronous steps of global progress (learning-rate schedule) per step of ``worker``
    during an interval where the workers take ``interval`` steps: N / (W n_w). ``workers``: W,
    the workers the budget is counted for, when not those of ``interval`` (some have left)."""
    workers = interval.numel() if workers is None else int(workers)
    return float(interval.sum()) / (workers * max(int(interval[worker]), 1))


def skip_sync(steps: torch.Tensor, min_total_global_steps: int) -> bool:
    """Skip the exchange when all workers together took too few steps since the last sync."""
    return int(steps.sum()) < min_total_global_steps


def blend_step_weights(
    weights: torch.Tensor, steps: torch.Tensor, excluded: torch.Tensor, ratio: float
) -> torch.Tensor:
    """``(1 - ratio) * weights + ratio * step share``, per layer over the workers not excluded.

    ``weights`` [W, L] (columns sum to 1 over included workers), ``steps`` [W] (or [W, L]: each
    layer its own, A-EDiT's final sync with fragments), ``excluded`` [W, L] bool. A column where
    every worker is excluded stays 0.
    """
    keep = ~excluded
    steps = steps.to(torch.float64)
    share = (steps if steps.dim() == 2 else steps.unsqueeze(1)) * keep
    total = share.sum(dim=0, keepdim=True)
    share = torch.where(total > 0, share / total.clamp_min(1e-300), torch.zeros_like(share))
    return (1 - ratio) * weights + ratio * share


def first_interval(sync_interval: int) -> int:
    """Before any speed is measured, the first interval after warmup is ``sync_interval`` steps
    for every worker (warmup steps run in lockstep and say nothing about local speed)."""
    return max(1, sync_interval)
