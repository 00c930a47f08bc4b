"""A-EDiT's schedule for one optimizer (arXiv 2412.07210, Sec. 3.4): when this worker syncs next.

:class:`AsyncPlan` holds what the time-based schedule needs between syncs: the step of this
worker's next sync, the global progress each of its steps makes, the speeds measured over the
last intervals, the interval's clock, and the latest sync as every worker saw it
(:class:`SyncPoint`). At each sync it agrees on the workers' figures in one small all-reduce over
every rank (:meth:`AsyncPlan.plan`), so every rank of every worker plans the same thing; the math
is in :mod:`megatron_edit.algorithm.asynchronous`. The controller
(:class:`~megatron_edit.mcore.controller.LocalSGD`) owns one and counts the steps.

MoE with expert parallelism has two controllers per model (the dense and the expert optimizer):
the expert one follows the dense one's plan (:class:`FollowerPlan`), so both halves of the model
sync after the same steps with one schedule all-reduce per sync.

With ``auto_overlap`` the measurements of the link ride on the schedule's all-reduce
(:attr:`AsyncPlan.rider`, :mod:`.auto_overlap_async`): the sync is where every worker is.

Over the torchft backend (workers that die, leave and join; :attr:`AsyncPlan.dynamic`) the
workers of a sync are its quorum, so the plan keys what it keeps by worker id, not by place:
each worker's speeds (:attr:`AsyncPlan.rates_by_worker`; one that has just joined or healed
takes the mean of the measured ones), and the budget counts the worker-steps applied to the
anchor (:attr:`AsyncPlan.applied_steps`), so a dead worker's unsynced steps are not counted
and the workers that remain train until the budget is used. Global progress (the
learning-rate schedule) is applied worker-steps over the run's workers
(:attr:`AsyncPlan.budget_workers`, fixed at the start).

This module is long because the plan at a sync is one agreement (the schedule message and what
rides on it) read by one function, and its state is saved and restored with it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Callable, Dict, List, Optional

import torch
import torch.distributed as dist

from ..algorithm import asynchronous
from ..config import LocalSGDConfig

logger = logging.getLogger(__name__)


@dataclass
class SyncPoint:
    """A-EDiT: the latest sync as every rank of every worker saw it (from the all-reduced
    schedule, so identical everywhere)."""

    step: int
    """This worker's step count at the sync."""
    worker_steps: List[int]
    """Every worker's step count at the sync."""
    last_exchange: List[int]
    """Every worker's step count at its latest real exchange (this one unless skipped)."""
    interval: Optional[List[int]]
    """Steps each worker takes until the next sync (None after the final one)."""
    skipped: bool
    final: bool
    progress: Optional[float] = None
    """Global progress at the sync where workers come and go (torchft): applied worker-steps
    over the run's workers; None: from ``worker_steps``."""
    replica_ids: Optional[List[int]] = None
    """The worker ids of ``worker_steps``' entries (torchft: the sync's quorum); None: 0 .. W-1."""

    @property
    def global_progress(self) -> float:
        """Synchronous iterations of global progress at the sync: worker-steps / workers."""
        if self.progress is not None:
            return self.progress
        return sum(self.worker_steps) / len(self.worker_steps)


class AsyncPlan:
    """A-EDiT's schedule of one controller (see the module docstring).

    ``sync_group``: the worker's sync group (its rank is the worker's index); ``schedule_group``:
    every rank of every worker (None: the world group)."""

    def __init__(self, config: LocalSGDConfig, sync_group, schedule_group=None,
                 clock: Callable[[], float] = time.monotonic, rider=None):
        self.config = config
        """The settings in force (``auto_overlap`` changes the delay: the intervals' minimum)."""
        self.rider = rider
        """What rides on the schedule's all-reduce (``auto_overlap``: :class:`~.auto_overlap_async.
        AsyncAutoOverlap`): ``message()`` adds float64 numbers to MAX, ``agreed(numbers, sync point)``
        reads them after the plan; None: nothing."""
        self.sync_group = sync_group
        self.schedule_group = schedule_group
        self.clock = clock
        """A float64 clock in seconds; injectable for tests."""
        self.budget_steps: Optional[int] = None
        """Worker-steps of the whole run (Megatron-LM: --train-iters x workers), None: none."""
        self.finished = False
        """The final sync has been planned and reached: the run has used its budget."""
        self.last_sync: Optional[SyncPoint] = None
        self.next_sync_at: Optional[int] = None
        self.final_planned = False
        self.progress_scale = 1.0
        """Synchronous steps of global progress per step of this worker in this interval."""
        self.rate_history: List[tuple] = []  # (interval steps [W], interval seconds [W])
        self.interval_start: Optional[float] = None
        self.interval_start_step = 0
        self.train_start: Optional[float] = None
        self.planned_at: Optional[int] = None
        """The step of the latest :meth:`plan` (a follower syncs there too)."""
        self.last_plan = None
        self.dynamic = bool(getattr(sync_group, "dynamic", False))
        """The workers change from sync to sync (the torchft backend)."""
        self.run_workers: Optional[int] = None
        """Dynamic: the run's workers, that the budget and global progress count (set when the
        run starts, :meth:`start_run`)."""
        self.applied_steps = 0
        """Dynamic: worker-steps applied to the anchor by the real exchanges before the current
        window (what the budget has used)."""
        self.rates_by_worker: Dict[int, List[tuple]] = {}
        """Dynamic: worker id -> its last measured intervals, (steps, seconds) each."""
        self._done_at_plan = 0
        self.held: List[int] = []  # the workers planned tau + 1 steps, more than their speed gave (.async_delayed)

    @property
    def workers(self) -> int:
        """The workers of the current sync."""
        return self.sync_group.size

    @property
    def budget_workers(self) -> int:
        """The workers global progress and the budget count: the run's (dynamic), else the
        current ones."""
        return self.run_workers if self.dynamic and self.run_workers is not None else self.workers

    def start_run(self, workers: int) -> None:
        """Dynamic: the run starts with ``workers`` workers (its budget is theirs)."""
        self.run_workers = int(workers)

    def due(self, steps_done: int) -> bool:
        return self.next_sync_at is not None and steps_done == self.next_sync_at

    def start_clock(self, step: int) -> None:
        """Training (after warmup) starts at ``step``: the first interval's clock starts now."""
        self.interval_start, self.interval_start_step = self.clock(), step
        self.train_start = self.interval_start

    @property
    def clock_started(self) -> bool:
        return self.interval_start is not None

    def plan_first(self, steps_done: int, global_progress: float) -> None:
        """Before any speed is known: ``local_sgd_sync_interval`` steps for everyone (H/F with
        fragments: ``async_first_interval``), or the
        whole remaining budget split evenly when that is about as much."""
        workers = self.workers
        first = asynchronous.first_interval(self.config.async_first_interval)
        interval = torch.full((workers,), first, dtype=torch.int64)
        if self.budget_steps is not None:
            # Worker-steps done so far from global progress (synchronous iterations): after an
            # elastic resume the workers' own counts differ from the saved run's.
            remaining = self.budget_steps - round(global_progress * self.budget_workers)
            if remaining < workers:
                raise ValueError(
                    f"megatron_edit: A-EDiT's budget leaves {remaining} worker-steps after step "
                    f"{steps_done}, fewer than the {workers} workers (each takes at least one "
                    "step before the final sync): raise --train-iters or shorten the warmup."
                )
            if remaining < 2 * self.config.min_total_global_steps and dist.get_rank() == 0:
                logger.warning(
                    "megatron_edit: A-EDiT's budget after warmup is %d worker-steps and "
                    "--local-sgd-min-total-global-steps is %d: every sync before the final one "
                    "will be skipped (only the final sync exchanges). Lower "
                    "--local-sgd-min-total-global-steps or train longer.",
                    remaining, self.config.min_total_global_steps,
                )
            if first * workers * 1.5 >= remaining or remaining - first * workers < workers:
                interval = asynchronous.plan_final_interval(torch.ones(workers), remaining)
                self.final_planned = True
        self.next_sync_at = steps_done + int(interval[self.sync_group.rank])
        self.progress_scale = asynchronous.progress_per_step(interval, self.sync_group.rank, self.budget_workers)

    def plan(self, step: int, last_sync_step: int, device: torch.device, arrived: Optional[float] = None,
             joining: bool = False, progress: Optional[float] = None):
        """At the sync after ``step``: one small all-reduce over every rank gives an identical
        schedule everywhere. ``arrived``: the clock when this worker reached the sync, before
        it waited for the others (default: now). ``joining`` (dynamic): this worker joins the
        others' sync (the torchft backend's join round): it brings no steps and no speed.
        ``progress`` (dynamic): where this worker's learning-rate schedule is after ``step``;
        the next interval's steps bring it to the global progress at the next sync (a worker
        lost in the last interval had its planned steps counted there).
        Returns (the workers' figures, skip this exchange?, is this the run's last sync?)."""
        c = self.config
        group = self.sync_group
        now = self.clock() if arrived is None else arrived
        # A worker that trained nothing since the last sync (dynamic: it joins, or has just
        # healed from a peer) brings no steps; one with no measured interval brings no speed.
        trained = not joining and (not self.dynamic or bool(group.trained[group.rank]))
        measured = trained and self.interval_start is not None
        message = asynchronous.schedule_message(
            group.size,
            group.rank,
            step - last_sync_step if trained else 0,
            step - self.interval_start_step if measured else 0,
            now - self.interval_start if measured else 0.0,
            step,
            now - self.train_start if self.train_start is not None else 0.0,
            self.applied_steps if self.dynamic else 0,
        )
        sent = message if self.rider is None else torch.cat([message.flatten(), self.rider.message()])
        flat = group.all_reduce_max_everywhere(sent.to(device), self.schedule_group).cpu().flatten()
        schedule = asynchronous.read_schedule(flat[: message.numel()].view_as(message))
        if self.dynamic:  # the budget counts what reaches the anchor (a dead worker's steps do not)
            done = int(schedule.applied.max()) + int(schedule.steps_since_exchange.sum())
            rates = self._dynamic_rates(schedule)
        else:
            done = int(schedule.steps.sum())
            self.rate_history.append((schedule.interval_steps, schedule.interval_seconds))
            del self.rate_history[: -asynchronous.RATE_WINDOW]
        self._done_at_plan = done
        budget = self.budget_steps
        if self.dynamic and budget is not None:
            # Not final_planned: a worker lost in the last interval leaves budget to train; a loss
            # that leaves fewer worker-steps than workers (each takes one at least) ends the run.
            final = done >= budget - (group.size - 1)
        else:
            final = self.final_planned or (budget is not None and done >= budget)
        # The run's last sync is never skipped: the workers end with identical models.
        skip = not final and asynchronous.skip_sync(schedule.steps_since_exchange, c.min_total_global_steps)
        interval = None
        if final:
            self.finished = True
            self.next_sync_at = None
            self.progress_scale = 1.0
        else:  # (a final sync that did not commit, planned again with fewer workers, may not be final)
            self.finished = False
            if not self.dynamic:
                rates = asynchronous.smoothed_rates(
                    torch.stack([h[0] for h in self.rate_history]), torch.stack([h[1] for h in self.rate_history])
                )
            remaining_seconds = None
            if c.async_time_budget is not None:
                remaining_seconds = c.async_time_budget - float(schedule.elapsed.max())
            interval, self.final_planned = asynchronous.plan(
                schedule.steps, rates, c.async_sync_time, budget, remaining_seconds, done_steps=done,
                # (a delayed outer step: tau + 1; over torchft a fresh run's join, every worker at
                # step 0, launches nothing: its first interval is H, as plan_first's)
                min_steps=asynchronous.min_interval(c.outer_step_delay if int(schedule.steps.max()) else 0))
            self.held = []  # (a delay only: the workers its tau + 1 steps held back)
            if c.outer_step_delay and not self.final_planned:
                by_speed = asynchronous.plan_next_interval(rates, c.async_sync_time)
                self.held = [w for w, n in enumerate(by_speed) if interval[w] > n]
            me = group.rank
            self.next_sync_at = step + int(interval[me])
            self.progress_scale = asynchronous.progress_per_step(interval, me, self.budget_workers)
            if self.dynamic and progress is not None:
                target = (done + int(interval.sum())) / self.budget_workers
                self.progress_scale = max(0.0, (target - progress) / int(interval[me]))
        steps = [int(n) for n in schedule.steps]
        self.last_sync = SyncPoint(
            step=step,
            worker_steps=steps,
            last_exchange=[n - int(k) for n, k in zip(steps, schedule.steps_since_exchange)] if skip else steps,
            interval=None if interval is None else [int(n) for n in interval],
            skipped=skip,
            final=final,
            progress=done / self.budget_workers if self.dynamic else None,
            replica_ids=list(group.replica_ids) if self.dynamic else None,
        )
        self.interval_start, self.interval_start_step = self.clock(), step
        if self.train_start is None:
            self.train_start = self.interval_start
        self.planned_at, self.last_plan = step, (schedule, skip, final)
        if self.rider is not None:  # (auto_overlap: the agreed measurements, read after the plan)
            self.rider.agreed(flat[message.numel():], self.last_sync)
        return schedule, skip, final

    def _dynamic_rates(self, schedule) -> torch.Tensor:
        """Dynamic: every worker of the sync's rate from its own last measured intervals (by
        worker id); one with none takes the mean of the others; before any is measured, the
        first interval's (``local_sgd_sync_interval`` steps each)."""
        ids = list(self.sync_group.replica_ids)
        for w, n, seconds in zip(ids, schedule.interval_steps.tolist(), schedule.interval_seconds.tolist()):
            if n > 0:
                self.rates_by_worker[w] = (self.rates_by_worker.get(w, []) + [(n, seconds)])[-asynchronous.RATE_WINDOW:]
        measured = torch.tensor([w in self.rates_by_worker for w in ids])
        rates = torch.zeros(len(ids), dtype=torch.float64)
        for i, w in enumerate(ids):
            if w in self.rates_by_worker:  # its own window, as smoothed_rates measures every worker's
                history = torch.tensor(self.rates_by_worker[w], dtype=torch.float64)  # [K, 2]
                rates[i] = asynchronous.smoothed_rates(history[:, :1], history[:, 1:])[0]
        filled = asynchronous.fill_unmeasured(rates, measured)
        if filled is None:  # the first interval: local_sgd_sync_interval steps each
            first = asynchronous.first_interval(self.config.async_first_interval)
            return torch.full((len(ids),), first / self.config.async_sync_time, dtype=torch.float64)
        return filled

    def applied(self) -> None:
        """Dynamic: the sync just planned was applied to the anchor (a committed real exchange)."""
        self.applied_steps = self._done_at_plan

    def restart_clock(self) -> None:
        """The clock starts again at the next step (a worker that joins: the time before its
        first step is not training time)."""
        self.interval_start = self.train_start = None

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, at_sync: bool) -> dict:
        """The planned next sync and the speeds measured so far; with ``at_sync`` (a checkpoint
        right after a sync, where Megatron-LM saves) every worker's counters and plan."""
        state = {
            "next_sync_at": self.next_sync_at,
            "final_planned": self.final_planned,
            "progress_scale": self.progress_scale,
            "rate_history": [(a.clone(), b.clone()) for a, b in self.rate_history],
            "sync_point": asdict(self.last_sync) if at_sync else None,
        }
        if self.dynamic:
            state["dynamic"] = self.dynamic_state()
        return state

    def dynamic_state(self) -> dict:
        """Dynamic: what every worker shares of the plan (a healing worker receives it): the
        run's workers, the applied worker-steps, every worker's measured speeds (copies)."""
        return {"run_workers": self.run_workers, "applied_steps": self.applied_steps,
                "rates": {w: list(h) for w, h in self.rates_by_worker.items()}}

    def load_dynamic_state(self, state: dict) -> None:
        self.run_workers = state["run_workers"]
        self.applied_steps = int(state["applied_steps"])
        self.rates_by_worker = {int(w): [tuple(x) for x in h] for w, h in state["rates"].items()}

    def load_state_dict(self, state: dict, steps_done: int) -> Optional[SyncPoint]:
        """Restore :meth:`state_dict`; the clock restarts (time while the job was down is not
        training time). Returns the saved sync point, whose counters the caller takes."""
        self.next_sync_at = state.get("next_sync_at")
        self.final_planned = bool(state.get("final_planned", False))
        self.progress_scale = float(state.get("progress_scale", 1.0))
        self.rate_history = list(state.get("rate_history", []))
        if self.dynamic and "dynamic" in state:
            self.load_dynamic_state(state["dynamic"])
        point = state.get("sync_point")
        point = None if point is None else self._resume_at_sync(SyncPoint(**point))
        if self.next_sync_at is not None:
            self.start_clock(point.step if point is not None else steps_done)
        return point

    def place(self, point: SyncPoint) -> int:
        """This worker's index in ``point``'s lists (dynamic: its id's place in that sync)."""
        if point.replica_ids is not None:
            return point.replica_ids.index(self.sync_group.replica_id)
        return self.sync_group.rank

    def _resume_at_sync(self, point: SyncPoint) -> SyncPoint:
        """A checkpoint taken right after a sync: this worker's own plan (the record holds
        worker 0's); ``point.step`` becomes this worker's step count. Dynamic: every worker
        saves its own; its place in the saved sync is its id's."""
        me = self.place(point)
        if point.replica_ids is None and len(point.worker_steps) != self.workers:
            raise ValueError(
                f"A-EDiT checkpoint state of {len(point.worker_steps)} workers, this run has "
                f"{self.workers}"
            )
        point.step = point.worker_steps[me]
        self.last_sync = point
        self.finished = point.final
        if point.interval is None:
            self.next_sync_at, self.progress_scale = None, 1.0
        else:
            interval = torch.tensor(point.interval, dtype=torch.int64)
            self.next_sync_at = point.step + point.interval[me]
            self.progress_scale = asynchronous.progress_per_step(interval, me, self.budget_workers)
        return point


class FollowerPlan:
    """The A-EDiT schedule of a second optimizer of the same model (MoE with expert parallelism:
    the expert optimizer steps right after the dense one, whose plan leads). It syncs at the
    step its leader planned a sync at, with the leader's answer (no collective of its own), and
    keeps its own view of what its controller reads between its steps: the learning-rate
    progress of the interval and whether its final sync is behind it. Clock, budget, speeds
    and checkpoint state are the leader's."""

    def __init__(self, leader: AsyncPlan):
        self.leader = leader
        self.finished = False
        self.progress_scale = leader.progress_scale
        self._synced_at: Optional[int] = None

    def __getattr__(self, name):  # clock_started, last_sync, state_dict, workers, ...
        return getattr(self.leader, name)

    clock = property(lambda self: self.leader.clock, lambda self, c: setattr(self.leader, "clock", c))
    budget_steps = property(lambda self: self.leader.budget_steps,
                            lambda self, n: setattr(self.leader, "budget_steps", n))

    def due(self, steps_done: int) -> bool:
        return self.leader.planned_at == steps_done and self._synced_at != steps_done

    def start_clock(self, step: int) -> None:
        """The leader's clock (started by its controller at the same step)."""

    def plan_first(self, steps_done: int, global_progress: float) -> None:
        """The leader plans (its controller reaches the end of warmup first)."""
        self.progress_scale = self.leader.progress_scale

    def plan(self, step: int, last_sync_step: int, device, arrived: Optional[float] = None, joining: bool = False,
             progress: Optional[float] = None):
        if self.leader.planned_at != step:
            raise RuntimeError(f"megatron_edit: A-EDiT follower plan at step {step}, its leader "
                               f"planned at {self.leader.planned_at}")
        self._synced_at = step
        schedule, skip, final = self.leader.last_plan
        self.finished = final
        self.progress_scale = self.leader.progress_scale
        return schedule, skip, final

    def load_state_dict(self, state: dict, steps_done: int):
        point = self.leader.load_state_dict(state, steps_done)
        self.finished, self.progress_scale = self.leader.finished, self.leader.progress_scale
        return point
