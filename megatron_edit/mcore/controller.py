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
:class:`~megatron_edit.exchange.pipeline.OuterSync`, which does the exchange and the outer step
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
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..algorithm import asynchronous, schedule
from ..config import GTAConfig, LocalSGDConfig, OuterOptimizerConfig
from ..exchange.groups import SyncGroup, WorkerGroups
from ..exchange.outer_state import OuterState
from ..exchange.pipeline import OuterSync
from ..exchange.report import SyncReport
from . import compat
from .shards import build_layout

logger = logging.getLogger(__name__)


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
        # The run's last optimizer step when known (Megatron-LM: --train-iters): A-EDiT then
        # ends with a sync there on every worker.
        self.final_step: Optional[int] = None
        self.steps_done = 0
        self.reports: List[SyncReport] = []
        self._last_sync_step = self.config.local_sgd_warmup_steps
        self._next_sync_at: Optional[int] = None
        self._interval_start: Optional[float] = None
        self._interval_start_step = 0
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
            first = self.steps_done + asynchronous.first_interval(self.config.local_sgd_sync_interval)
            self._next_sync_at = first if self.final_step is None else min(first, self.final_step)

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
        return schedule.is_sync_step(steps_done, c.local_sgd_warmup_steps, c.local_sgd_sync_interval)

    def begin_step(self) -> None:
        """Before the inner optimizer update of step ``steps_done + 1``."""
        self.flush()  # a layer-wise sync must be complete before main params change again
        warm = self.steps_done >= self.config.local_sgd_warmup_steps
        if not self.outer_state.captured and warm:
            self.capture_anchor()
        if self.config.use_async and self._interval_start is None and warm:
            # Without warmup the first interval's clock starts inside step 1 (its forward and
            # backward are not timed): only the first plan is slightly optimistic.
            self._interval_start, self._interval_start_step = self.clock(), self.steps_done
        self._in_step = True
        self._synced_in_step = False

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
        if self.config.use_async and self.steps_done == self.config.local_sgd_warmup_steps:
            self._interval_start, self._interval_start_step = self.clock(), self.steps_done
        if not self._sync_due(self.steps_done):
            return
        if self.config.sync_mode == "step_end":
            assert self._synced_in_step, "step-end sync did not run inside the optimizer step"
            return
        if self._start_sync(self.steps_done):
            self.sync.mark_pending()

    def _start_sync(self, step: int) -> bool:
        """Begin the sync due after ``step``; False when A-EDiT skips it (no exchange)."""
        bytes_at_start = self.sync_group.counters.payload_bytes
        worker_steps = worker_seconds = None
        skip = False
        if self.config.use_async:
            worker_steps, worker_seconds, skip = self._plan_async(step)
        return self.sync.start(
            step, step - self._last_sync_step, worker_steps, worker_seconds, skip, bytes_at_start
        )

    def _plan_async(self, step: int):
        """A-EDiT: one small all-reduce over every rank -> identical schedule everywhere."""
        c = self.config
        message = asynchronous.schedule_message(
            self.sync_group.size,
            self.sync_group.rank,
            step - self._last_sync_step,
            step - self._interval_start_step,
            self.clock() - self._interval_start,
            step,
        )
        device = self.shards[0].device if self.shards else torch.device("cpu")
        message = self.sync_group.all_reduce_max_everywhere(message.to(device), self.schedule_group).cpu()
        steps, interval_steps, interval_seconds, step_counts = asynchronous.read_schedule(message)
        final = self.final_step is not None and step >= self.final_step
        # The run's last sync is never skipped: the workers end with identical models.
        skip = not final and asynchronous.skip_sync(steps, c.min_total_global_steps)
        plan = asynchronous.plan_next_interval(interval_steps, interval_seconds, c.local_sgd_sync_time)
        nxt = asynchronous.next_sync_steps(step_counts, plan, self.final_step)
        self._next_sync_at = None if final else int(nxt[self.sync_group.rank])
        self._interval_start, self._interval_start_step = self.clock(), step
        return steps, interval_seconds, skip

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
            # A-EDiT: the planned next sync; the clock restarts on resume (elapsed time while
            # the job was down is not training time).
            "next_sync_at": self._next_sync_at,
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
        if self._next_sync_at is not None:
            self._interval_start = self.clock()

    def chunk_span(self, shard) -> Optional[Tuple[int, int, int]]:
        """Quantized exchange with error feedback: (offset, length, padded length) of the chunk
        of ``shard``'s result this worker reduces (its ``chunk_residual``); None without."""
        quant = self.sync._quant
        if quant is None or not quant.error_feedback:
            return None
        return quant.chunk_span(shard.numel)

    def state_bytes(self) -> int:
        """Bytes of EDiT state on this rank: anchor + outer optimizer state."""
        return self.outer_state.state_bytes(self.shards)
