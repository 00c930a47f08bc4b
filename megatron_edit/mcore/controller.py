"""EDiT on one Megatron ``DistributedOptimizer`` (arXiv 2412.07210, Sec. 3 and 3.4).

A *worker* is one instance of Megatron's partial distributed optimizer
(``num_distributed_optimizer_instances`` workers). Inside a worker the ranks form the
model-shard group: gradients are reduce-scattered there every step and each rank owns one shard
of every bucket's fp32 main parameters. Across workers, the ranks owning the same shard form
the sync group (Megatron's inter-instance group); after warmup nothing crosses it except the
pseudo-gradient exchange every H steps (or, with A-EDiT, every ``local_sgd_sync_time``
seconds).

:class:`LocalSGD` owns one optimizer's EDiT state and decides *when*: it counts optimizer
steps, takes the anchor at the end of warmup, plans A-EDiT's syncs, and hands each sync to
:class:`~megatron_edit.exchange.outer_sync.OuterSync`, which does the exchange and the outer step
(the *how*). It is attached to Megatron by :mod:`megatron_edit.mcore.patches` and reads only the
objects it is given (the optimizer, its buckets and the process groups they carry), never
``parallel_state``.

Two ways to run a sync, same numbers:

* ``layerwise``: after the optimizer step of a sync step every bucket is marked pending; when
  Megatron starts a bucket group's parameter all-gather for the next forward pass
  (``overlap_param_gather``), the group's exchange is completed and its outer step applied,
  then the all-gather runs.
* ``step_end``: all exchanges run, blocking, right after the inner optimizer update and before
  Megatron copies main params into the model and gathers them.

This module is long because it holds one state machine: the step count, warmup, when each sync
is due (EDiT) or planned (A-EDiT, with its global progress and the per-worker counters a
checkpoint taken at a sync carries), and the layer-wise hooks all read and write the same
counters; split over files they would be harder to keep consistent.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..algorithm import asynchronous, schedule
from ..config import GTAConfig, LocalSGDConfig, OuterOptimizerConfig
from ..exchange.arrival import Arrivals
from ..exchange.groups import SyncGroup, WorkerGroups, default_store
from ..exchange.outer_state import OuterState
from ..exchange.outer_sync import OuterSync
from ..exchange.report import SyncReport
from . import compat
from .shards import build_layout

logger = logging.getLogger(__name__)

_INSTANCES = 0
"""LocalSGD objects built in this process: keys of their arrival checks (the same count on
every rank, which build them in the same order)."""


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

    @property
    def global_progress(self) -> float:
        """Synchronous iterations of global progress at the sync: worker-steps / workers."""
        return sum(self.worker_steps) / len(self.worker_steps)


class LocalSGD:
    """EDiT state and schedule for one Megatron ``DistributedOptimizer``."""

    def __init__(
        self,
        optimizer,
        local_sgd_config: LocalSGDConfig,
        outer_optim_config: OuterOptimizerConfig,
        gta_config: Optional[GTAConfig] = None,
        schedule_group: Optional[dist.ProcessGroup] = None,
    ):
        """``schedule_group``: every rank of every worker (default: the world group); A-EDiT
        agrees on its schedule over it once per sync."""
        self.config = local_sgd_config
        self.outer_config = outer_optim_config
        self.gta_config = gta_config or GTAConfig()
        self.schedule_group = schedule_group
        self.clock = time.monotonic  # A-EDiT's float64 clock; injectable for tests
        # A-EDiT's budget: worker-steps of the whole run (Megatron-LM: --train-iters x workers,
        # what the synchronous run consumes); the run ends at a final sync planned from the
        # workers' speeds, each worker at its own step count (``finished``).
        self.budget_steps: Optional[int] = None
        self.finished = False
        # The run's last optimizer step when known (Megatron-LM: --train-iters; EDiT only): the
        # run ends with a sync there even off the warmup + k H grid (the workers end with one
        # model); a layer-wise sync due there has no next forward pass to complete in, so it
        # completes at once and the parameters are gathered inside the worker.
        self.last_step: Optional[int] = None
        self.steps_done = 0
        self.reports: List[SyncReport] = []
        self._last_sync_step = self.config.local_sgd_warmup_steps
        self._next_sync_at: Optional[int] = None
        self._interval_start: Optional[float] = None
        self._interval_start_step = 0
        self._train_start: Optional[float] = None
        self._final_planned = False
        self._progress_scale = 1.0
        self._step_progress = 1.0
        self._rate_history: List[tuple] = []  # (interval steps [W], interval seconds [W])
        self.global_progress = 0.0
        """Synchronous iterations of global progress: 1 per warmup step, ``last_step_progress``
        per local step; with A-EDiT equal on every worker at each sync (worker-steps / workers)."""
        self.last_sync: Optional[SyncPoint] = None
        self._in_step = False
        self._synced_in_step = False

        layout = build_layout(optimizer)
        self.shards = layout.shards
        self.group_order = layout.group_order
        self.group_shards = layout.group_shards
        self.layer_names = layout.layer_names

        self.num_workers = optimizer.ddp_config.num_distributed_optimizer_instances
        first_group = self.group_order[0] if self.group_order else None
        inter = compat.inter_instance_group(first_group)
        self.sync_group = SyncGroup(inter if self.num_workers > 1 else None)
        assert self.sync_group.size == self.num_workers, (self.sync_group.size, self.num_workers)
        self.arrivals = self._arrivals(inter) if self.num_workers > 1 else None
        self.worker_groups = WorkerGroups(
            shard_group=optimizer.buffers[0].data_parallel_group if optimizer.buffers else None,
            tp_group=compat.tensor_parallel_group(optimizer.model_chunks[0]),
        )
        self.outer_state = OuterState(
            outer_optim_config, torch.device("cpu") if self.config.cpu_offload else None
        )
        self.sync = OuterSync(
            [self.group_shards[g] for g in self.group_order],
            self.layer_names,
            self.sync_group,
            self.worker_groups,
            self.config,
            self.gta_config,
            self.outer_state,
            on_done=self._on_sync_done,
        )
        self._group_index = {g: i for i, g in enumerate(self.group_order)}

    def _arrivals(self, inter) -> Arrivals:
        """The sync group's arrival checks, in the job's store (see :mod:`..exchange.arrival`)."""
        global _INSTANCES
        _INSTANCES += 1  # controllers are built in the same order on every rank
        timeout = self.config.sync_timeout
        if timeout is None:
            timeout = dist.default_pg_timeout.total_seconds()
        ranks = dist.get_process_group_ranks(inter)
        return Arrivals(default_store(), f"megatron_edit/arrive/{_INSTANCES}", ranks,
                        ranks.index(dist.get_rank()), timeout, report_every=min(60.0, timeout / 4))

    # ------------------------------------------------------------------ state
    @property
    def outer_optimizer(self) -> Optional[torch.optim.Optimizer]:
        return self.outer_state.optimizer

    @property
    def ewma(self):
        """The anomaly detector's running statistics (per worker and layer)."""
        return self.sync.ewma

    def capture_anchor(self) -> None:
        """Anchor := the current main params (at the end of warmup); outer state starts empty."""
        self.outer_state.capture(self.shards)
        self.restart_async_schedule()

    def restart_async_schedule(self) -> None:
        """A-EDiT: plan the next sync as after warmup (first interval from ``steps_done``)."""
        if self.config.use_async:
            self._plan_first_interval()

    def _plan_first_interval(self) -> None:
        """A-EDiT before any speed is known: ``local_sgd_sync_interval`` steps for everyone, or
        the whole remaining budget split evenly when that is about as much."""
        workers = self.num_workers
        first = asynchronous.first_interval(self.config.local_sgd_sync_interval)
        interval = torch.full((workers,), first, dtype=torch.int64)
        if self.budget_steps is not None:
            # Worker-steps done so far from global progress (synchronous iterations): after an
            # elastic resume the workers' own counts differ from the saved run's.
            remaining = self.budget_steps - round(self.global_progress * workers)
            if remaining < workers:
                raise ValueError(
                    f"megatron_edit: A-EDiT's budget leaves {remaining} worker-steps after step "
                    f"{self.steps_done}, fewer than the {workers} workers (each takes at least one "
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
                self._final_planned = True
        self._next_sync_at = self.steps_done + int(interval[self.sync_group.rank])
        self._progress_scale = asynchronous.progress_per_step(interval, self.sync_group.rank)

    def drop_anchor(self) -> None:
        """Back to warmup state: no anchor, no outer optimizer (a checkpoint saved in warmup)."""
        self.outer_state.optimizer = None
        for shard in self.shards:
            shard.anchor = None

    # ------------------------------------------------------------------ schedule
    @property
    def grads_are_local(self) -> bool:
        """Whether gradients of the step now running stay inside the worker."""
        return schedule.grads_are_local(self.steps_done, self.config.local_sgd_warmup_steps)

    def _sync_due(self, steps_done: int) -> bool:
        c = self.config
        if c.use_async:
            return self._next_sync_at is not None and steps_done == self._next_sync_at
        if steps_done == self.last_step and steps_done > c.local_sgd_warmup_steps:
            return True  # the run's last step: end with one model on every worker
        return schedule.is_sync_step(steps_done, c.local_sgd_warmup_steps, c.local_sgd_sync_interval)

    @property
    def progress_scale(self) -> float:
        """Synchronous steps of global progress per optimizer step of this worker: 1 for EDiT;
        with A-EDiT, N / (W n) in an interval where this worker takes n of the workers' N steps.
        The learning-rate schedule advances by this much per step
        (``mcore.patches``: ``OptimizerParamScheduler.step``), so all workers' schedules agree
        at every sync and end together."""
        return self._progress_scale if self.grads_are_local else 1.0

    @property
    def last_step_progress(self) -> float:
        """Global progress (synchronous steps) of the optimizer step last taken: what the
        learning-rate schedule advances by for it (the sync a step triggers plans the next
        interval; the step itself still belongs to its own)."""
        return self._step_progress

    def begin_step(self) -> None:
        """Before the inner optimizer update of step ``steps_done + 1``."""
        if self.finished:
            raise RuntimeError(
                "megatron_edit: this A-EDiT run has used its budget and ended with its final sync "
                f"after {self.steps_done} steps of this worker; stop training (check "
                "LocalSGD.finished after each step; Megatron-LM stops by itself)."
            )
        self.flush()  # a layer-wise sync must be complete before main params change again
        warm = self.steps_done >= self.config.local_sgd_warmup_steps
        if not self.outer_state.captured and warm:
            self.capture_anchor()
        if self.config.use_async and self._interval_start is None and warm:
            # Without warmup the first interval's clock starts inside step 1 (its forward and
            # backward are not timed): only the first plan is slightly optimistic.
            self._interval_start, self._interval_start_step = self.clock(), self.steps_done
            self._train_start = self._interval_start
        self._in_step = True
        self._synced_in_step = False
        self._step_progress = self.progress_scale

    def after_inner_update(self) -> None:
        """Inner update done, main params not yet copied into the model (step-end sync point)."""
        if self._in_step and self.config.sync_mode == "step_end" and self._sync_due(self.steps_done + 1):
            if self._start_sync(self.steps_done + 1):
                # Megatron's own main -> model copy follows: no need to write the model here.
                self.sync.complete(self.shards, write_model=False)
            self._synced_in_step = True

    def end_step(self) -> None:
        """After the optimizer step: count it, and schedule the layer-wise sync if due."""
        self._in_step = False
        self.steps_done += 1
        self.global_progress += self._step_progress
        self._snap_progress()  # step-end: the sync ran inside this step
        if self.config.use_async and self.steps_done == self.config.local_sgd_warmup_steps:
            self._interval_start, self._interval_start_step = self.clock(), self.steps_done
            self._train_start = self._interval_start
        if not self._sync_due(self.steps_done):
            return
        if self.config.sync_mode == "step_end":
            assert self._synced_in_step, "step-end sync did not run inside the optimizer step"
        elif self._start_sync(self.steps_done):
            self.sync.mark_pending()
            if self.finished or (not self.config.use_async and self.steps_done == self.last_step):
                self.complete_now()
        self._snap_progress()

    def _snap_progress(self) -> None:
        """At an A-EDiT sync every worker's global progress is worker-steps / workers: set it
        exactly (no float drift between workers)."""
        if self.at_sync:
            self.global_progress = self.last_sync.global_progress

    @property
    def at_sync(self) -> bool:
        """A-EDiT: this worker has just taken the step of its latest sync (nothing trained since):
        every worker is at the same logical point, the only one they share between syncs."""
        return (
            self.last_sync is not None and self.last_sync.step == self.steps_done and not self._in_step
        )

    def complete_now(self) -> None:
        """Complete a pending layer-wise sync now and all-gather the parameters inside the worker
        (what the next forward pass would do): the run ends here."""
        self.flush()
        self.gather_params_in_worker()

    def gather_params_in_worker(self) -> None:
        """All-gather every bucket group's parameters inside the worker now (a collective over
        the worker's ranks, at the same point on each)."""
        for group in self.group_order:
            if group.param_gather_handle is not None:
                group.param_gather_handle.wait()
                group.param_gather_handle = None
            group.start_param_sync(force_sync=True)

    def _start_sync(self, step: int) -> bool:
        """Begin the sync due after ``step``; False when A-EDiT skips it (no exchange)."""
        if self.arrivals is not None:  # before the sync's first collective: name a missing worker
            self.arrivals.wait(step)
        bytes_at_start = self.sync_group.counters.payload_bytes
        schedule, skip, final = None, False, False
        if self.config.use_async:
            schedule, skip, final = self._plan_async(step)
        return self.sync.start(
            step, step - self._last_sync_step,
            None if schedule is None else schedule.steps_since_exchange,
            None if schedule is None else schedule.interval_seconds,
            skip, bytes_at_start,
            worker_idle=None if schedule is None else schedule.idle,
            final=final,
        )

    def _plan_async(self, step: int):
        """A-EDiT: one small all-reduce over every rank -> identical schedule everywhere.
        Returns (the workers' figures, skip this exchange?, is this the run's last sync?)."""
        c = self.config
        now = self.clock()
        message = asynchronous.schedule_message(
            self.sync_group.size,
            self.sync_group.rank,
            step - self._last_sync_step,
            step - self._interval_start_step,
            now - self._interval_start,
            step,
            now - self._train_start,
        )
        device = self.shards[0].device if self.shards else torch.device("cpu")
        message = self.sync_group.all_reduce_max_everywhere(message.to(device), self.schedule_group).cpu()
        schedule = asynchronous.read_schedule(message)
        self._rate_history.append((schedule.interval_steps, schedule.interval_seconds))
        del self._rate_history[: -asynchronous.RATE_WINDOW]
        final = self._final_planned or (
            self.budget_steps is not None and int(schedule.steps.sum()) >= self.budget_steps
        )
        # The run's last sync is never skipped: the workers end with identical models.
        skip = not final and asynchronous.skip_sync(schedule.steps_since_exchange, c.min_total_global_steps)
        interval = None
        if final:
            self.finished = True
            self._next_sync_at = None
            self._progress_scale = 1.0
        else:
            rates = asynchronous.smoothed_rates(
                torch.stack([h[0] for h in self._rate_history]), torch.stack([h[1] for h in self._rate_history])
            )
            remaining_seconds = None
            if c.async_time_budget is not None:
                remaining_seconds = c.async_time_budget - float(schedule.elapsed.max())
            interval, self._final_planned = asynchronous.plan(
                schedule.steps, rates, c.local_sgd_sync_time, self.budget_steps, remaining_seconds
            )
            me = self.sync_group.rank
            self._next_sync_at = step + int(interval[me])
            self._progress_scale = asynchronous.progress_per_step(interval, me)
        steps = [int(n) for n in schedule.steps]
        self.last_sync = SyncPoint(
            step=step,
            worker_steps=steps,
            last_exchange=[n - int(k) for n, k in zip(steps, schedule.steps_since_exchange)] if skip else steps,
            interval=None if interval is None else [int(n) for n in interval],
            skipped=skip,
            final=final,
        )
        self._interval_start, self._interval_start_step = self.clock(), step
        return schedule, skip, final

    def _on_sync_done(self, report: SyncReport) -> None:
        if not report.skipped_sync:  # a skipped sync exchanged nothing: keep counting from the last one
            self._last_sync_step = report.step
        self.reports.append(report)
        if self.config.is_debug:
            logger.info("rank %d: %s", dist.get_rank(), report)

    # ------------------------------------------------------------------ layer-wise hooks
    def before_param_gather(self, bucket_group) -> None:
        """Megatron is about to all-gather ``bucket_group``: apply its pending outer step first."""
        index = self._group_index.get(bucket_group)
        if index is not None:
            self.sync.complete_group(index)

    def flush(self) -> None:
        """Complete every pending exchange now (before state is read or params change)."""
        self.sync.flush()

    @property
    def sync_in_progress(self) -> bool:
        """A layer-wise sync is pending: it completes in the next forward pass (or a flush)."""
        return self.sync.in_progress

    def drain_reports(self) -> List[SyncReport]:
        reports, self.reports = self.reports, []
        return reports

    # ------------------------------------------------------------------ checkpoints
    def extra_state(self) -> dict:
        """Picklable state identical on every rank (for checkpoints): the anomaly detector's
        statistics and A-EDiT's plan (the step counters are in the checkpoint record)."""
        return {
            "layer_names": list(self.layer_names),
            "ewma": self.sync.ewma.state_dict(),
            # A-EDiT: the planned next sync and the speeds measured so far; the clock restarts
            # on resume (elapsed time while the job was down is not training time).
            "next_sync_at": self._next_sync_at,
            "final_planned": self._final_planned,
            "progress_scale": self._progress_scale,
            "rate_history": [(a.clone(), b.clone()) for a, b in self._rate_history],
            "global_progress": self.global_progress,
            # Saved right after an A-EDiT sync (Megatron-LM saves only there): every worker's
            # counters and plan, so each worker resumes with its own.
            "sync_point": asdict(self.last_sync) if self.at_sync else None,
        }

    def load_extra_state(self, state: dict) -> None:
        from ..algorithm.penalty import EWMAStats

        if list(state["layer_names"]) != self.layer_names:
            raise ValueError(
                "EDiT checkpoint state was saved for different layers: "
                f"{state['layer_names'][:3]}... vs {self.layer_names[:3]}..."
            )
        self.sync.ewma = EWMAStats.from_state_dict(state["ewma"])
        self._next_sync_at = state.get("next_sync_at")
        self._final_planned = bool(state.get("final_planned", False))
        self._progress_scale = float(state.get("progress_scale", 1.0))
        self._rate_history = list(state.get("rate_history", []))
        self.global_progress = float(state.get("global_progress", self.steps_done))
        point = state.get("sync_point")
        if point is not None:
            self._resume_at_sync(SyncPoint(**point))
        if self._next_sync_at is not None:
            self._interval_start = self._train_start = self.clock()
            self._interval_start_step = self.steps_done

    def _resume_at_sync(self, point: SyncPoint) -> None:
        """A checkpoint taken right after an A-EDiT sync: this worker's own counters and plan
        (the record holds worker 0's)."""
        me = self.sync_group.rank
        if len(point.worker_steps) != self.num_workers:
            raise ValueError(
                f"A-EDiT checkpoint state of {len(point.worker_steps)} workers, this run has "
                f"{self.num_workers}"
            )
        self.steps_done = point.worker_steps[me]
        self._last_sync_step = point.last_exchange[me]
        point.step = self.steps_done
        self.last_sync = point
        self.global_progress = point.global_progress
        self.finished = point.final
        if point.interval is None:
            self._next_sync_at, self._progress_scale = None, 1.0
        else:
            interval = torch.tensor(point.interval, dtype=torch.int64)
            self._next_sync_at = self.steps_done + point.interval[me]
            self._progress_scale = asynchronous.progress_per_step(interval, me)

    def chunk_span(self, shard) -> Optional[Tuple[int, int, int]]:
        """Quantized exchange with error feedback: (offset, length, padded length) of the chunk
        of ``shard``'s result this worker reduces (its ``chunk_residual``); None without."""
        quant = self.sync.quantized
        if quant is None or not quant.error_feedback:
            return None
        return quant.chunk_span(shard.numel)

    def state_bytes(self) -> int:
        """Bytes of EDiT state on this rank: anchor + outer optimizer state."""
        return self.outer_state.state_bytes(self.shards)
