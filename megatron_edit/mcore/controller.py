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
(the *how*). It is attached to Megatron by :mod:`megatron_edit.mcore.core_wraps` and reads only the
objects it is given (the optimizer, its buckets and the process groups they carry), never
``parallel_state``.

Two ways to run a sync, same numbers:

* ``layerwise``: after the optimizer step of a sync step every bucket is marked pending; when
  Megatron starts a bucket group's parameter all-gather for the next forward pass
  (``overlap_param_gather``), the group's exchange is completed and its outer step applied,
  then the all-gather runs.
* ``step_end``: all exchanges run, blocking, right after the inner optimizer update and before
  Megatron copies main params into the model and gathers them.

Which shards a sync exchanges (all, or one streaming fragment's, ``LocalSGDConfig.fragments``)
is :class:`~megatron_edit.mcore.fragments.SyncShards`; a delayed outer step's launch and apply
(``outer_step_delay``) are :mod:`~megatron_edit.mcore.delayed`'s (A-EDiT's: :mod:`.async_delayed`).

A-EDiT's schedule (when each worker syncs next, from the measured speeds) is
:class:`~megatron_edit.mcore.async_plan.AsyncPlan`; what a sync asks of it, and which streaming
fragment an A-EDiT sync exchanges, :mod:`.async_sync`. Parts of the controller kept apart (it
inherits them): the state a checkpoint or a heal carries (:mod:`.controller_state`), the run's
length and progress (:mod:`.controller_progress`), the settings ``auto_overlap`` changes
(:mod:`.controller_settings`). This module is long because it is one state machine: the step
count, warmup, when each sync is due and the layer-wise hooks read and write the same counters.
"""

from __future__ import annotations

import logging
import time
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist

from ..algorithm import schedule
from ..config import GTAConfig, LocalSGDConfig, OuterOptimizerConfig
from ..exchange.arrival import Arrivals, short_timeout_warning
from ..exchange.groups import WorkerGroups, default_store
from ..exchange.outer_state import OuterState
from ..exchange.outer_sync import OuterSync
from ..exchange.report import SyncReport
from . import async_sync
from .async_delayed import delayed_outer_step
from .async_plan import AsyncPlan
from .auto_overlap_async import AutoOverlap, auto_overlap_for
from .controller_progress import RunProgress
from .controller_settings import ControllerSettings
from .controller_state import ControllerState
from .expert_bias import ExpertBiases
from .fragments import SyncShards, cut_fragments
from .fsdp import fsdp_model_of
from .process_state import PROCESS
from .shards import build_layout
from .sync_backend import backend_for
from .worker_layout import WorkerLayout

logger = logging.getLogger(__name__)


class LocalSGD(ControllerState, RunProgress, ControllerSettings):
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
        agrees on its schedule over it once per sync (and ``auto_overlap`` on its measurements)."""
        self.auto: Optional[AutoOverlap] = None
        """Settings from the measured link (``auto_overlap``; :mod:`.auto_overlap`, A-EDiT's :mod:`.auto_overlap_async`), or None."""
        if local_sgd_config.auto_overlap:
            self.auto = auto_overlap_for(self, local_sgd_config)
            local_sgd_config = self.auto.initial_config()
        self.config = local_sgd_config
        """The settings in force (with ``auto_overlap``: the delay and format it chose)."""
        self.outer_config = outer_optim_config
        self.gta_config = gta_config or GTAConfig()
        self.schedule_group = schedule_group
        # The run's last optimizer step when known (set_train_iters; Megatron-LM: --train-iters
        # or --train-samples, less --iterations-to-skip; EDiT only): the run ends with a sync
        # there even off the warmup + k H grid (the workers end with one model); a layer-wise
        # sync due there has no next forward pass to complete in, so it completes at once and
        # the parameters are gathered inside the worker.
        self.last_step: Optional[int] = None
        self.steps_done = 0
        self.reports: List[SyncReport] = []
        self.record = None  # the per-sync record's feed (.sync_record; the runtime sets it), or None
        self._last_sync_step = self.config.local_sgd_warmup_steps
        self._step_progress = 1.0
        self.global_progress = 0.0
        """Synchronous iterations of global progress: 1 per warmup step, ``last_step_progress``
        per local step; with A-EDiT equal on every worker at each sync (worker-steps / workers)."""
        self.progress_jump = 0.0
        """Synchronous iterations by which a heal (torchft: this worker became a peer's replica)
        moved :attr:`global_progress`: the learning-rate schedule's next step takes them too
        (:meth:`take_progress_jump`), so a relaunched worker's schedule is where the others' is."""
        self._in_step = False
        self._synced_in_step = False
        self._length_said = False  # warned (once) when the run's length is unknown
        self._identical_after: dict = {}
        """Fragment (0 without fragments) -> the step count after which a sync last made its
        shards identical on every worker (:attr:`identical_fragments`)."""

        self.fsdp = fsdp_model_of(optimizer)
        """The Megatron-FSDP model this optimizer steps (:mod:`.fsdp`), or None (DDP)."""
        if self.fsdp is None:
            buckets = build_layout(optimizer)
            self.layout = WorkerLayout.of(optimizer, buckets.group_order[0] if buckets.group_order else None)
        else:  # its main-weight shards, in the same shard abstraction
            buckets, self.layout = self.fsdp.layouts(optimizer)
        """Where this optimizer sits among the workers (derived once, passed down)."""
        self.num_workers = self.layout.num_workers
        inter = self.layout.sync_group
        self.backend = backend_for(self, optimizer, inter, self.num_workers)
        """The sync backend this controller drives (:mod:`.sync_backend`)."""
        self.sync_group = self.backend.sync_group
        if self.auto is not None:
            self.auto.check_workers(self.num_workers)
        self.arrivals = self._arrivals(inter) if self.num_workers > 1 else None
        self.async_plan = AsyncPlan(self.config, self.sync_group, schedule_group, rider=self.auto)
        """A-EDiT's schedule (unused by synchronous EDiT)."""
        self.async_fragments = async_sync.AsyncFragments()  # A-EDiT: which fragment each sync exchanges
        self.worker_groups = WorkerGroups(shard_group=self.layout.shard_group, tp_group=self.layout.tp_group)
        allowed = self.auto.fragments if self.auto is not None else (self.config.fragments,)
        buckets, parts, self._recut = cut_fragments(buckets, self.worker_groups, self.config.fragments, allowed)
        """``_recut``: ``auto_overlap`` choosing the fragments: the layout before any cut and the
        bucket groups' sizes, what a change of F cuts from (:meth:`_use_fragments`); else None."""
        self.shards = buckets.shards
        self.group_order = buckets.group_order
        self.group_shards = buckets.group_shards
        self.layer_names = buckets.layer_names
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
        self.sync_shards = SyncShards(self.sync.groups, self.config, parts)  # all, or a streaming fragment's
        self.delayed = delayed_outer_step(self)  # tau > 0: on EDiT's grid or A-EDiT's syncs (.async_delayed)
        # MoE routers' expert biases, averaged over the workers at each sync (.expert_bias), or None
        self.expert_biases = ExpertBiases.of(optimizer, self.layout.expert, self.sync_group)
        self.sync.commit_gate = self.backend.commit_gate  # (torchft: applied only where committed)

    def _arrivals(self, inter) -> Arrivals:
        """The sync group's arrival checks, in the job's store (see :mod:`..exchange.arrival`)."""
        key = PROCESS.next_controller_key()  # controllers are built in the same order on every rank
        timeout = self.config.sync_timeout
        if timeout is None:
            timeout = dist.default_pg_timeout.total_seconds()
        ranks = dist.get_process_group_ranks(inter)
        job = (dist.get_process_group_ranks(self.schedule_group) if self.schedule_group is not None
               else range(dist.get_world_size()))  # every rank arrives at every sync
        warning = short_timeout_warning(timeout)
        if warning and dist.get_rank() == 0 and warning not in PROCESS.warned:
            PROCESS.warned.add(warning)  # once, not once per controller (MoE builds two)
            logger.warning(warning)
        return Arrivals(default_store(), f"megatron_edit/arrive/{key}", ranks,
                        ranks.index(dist.get_rank()), timeout, report_every=min(60.0, timeout / 4),
                        job_ranks=job)

    # ------------------------------------------------------------------ state
    @property
    def outer_optimizer(self) -> Optional[torch.optim.Optimizer]:
        return self.outer_state.optimizer

    @property
    def ewma(self):
        """The anomaly detector's running statistics (per worker and layer)."""
        return self.sync.decisions.ewma

    def capture_anchor(self) -> None:
        """Anchor := the current main params (at the end of warmup); outer state starts empty."""
        self.outer_state.capture(self.shards)
        self.restart_async_schedule()
        self.mark_identical(range(self.config.fragments))  # warmup kept every worker equal

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
            return self.async_plan.due(steps_done)
        return self.sync_shards.due(steps_done, self.last_step) is not None

    def begin_step(self) -> None:
        """Before the inner optimizer update of step ``steps_done + 1``."""
        self.backend.ensure_joined()
        if self.finished:
            raise RuntimeError(
                "megatron_edit: this A-EDiT run has used its budget and ended with its final sync "
                f"after {self.steps_done} steps of this worker; stop training (check "
                "LocalSGD.finished after each step; Megatron-LM stops by itself)."
            )
        self.flush()  # a layer-wise sync must be complete before main params change again
        if self.auto is not None:  # after a sync: agree on the measurements, maybe new settings
            self.auto.after_sync()
        warm = self.steps_done >= self.config.local_sgd_warmup_steps
        if not self.outer_state.captured and warm:
            self.capture_anchor()
        if warm and not self._length_said:
            self._length_said = True
            if self.last_step is None and not self.config.use_async and dist.get_rank() == 0:
                logger.warning("megatron_edit: the run's length is unknown (call megatron_edit.set_train_iters("
                               "optimizer, n) before training): it may end between syncs, each worker with "
                               "its own model.")
        if self.config.use_async and not self.async_plan.clock_started and warm:
            # Without warmup the first interval's clock starts inside step 1 (its forward and
            # backward are not timed): only the first plan is slightly optimistic.
            self.async_plan.start_clock(self.steps_done)
        self._in_step = True
        self._synced_in_step = False
        self._step_progress = self.progress_scale

    def after_inner_update(self) -> None:
        """Inner update done, main params not yet copied into the model (step-end sync point)."""
        if self.delayed is not None:  # a delayed outer step applies here in both sync modes
            return self.delayed.after_inner_update(self.steps_done + 1) if self._in_step else None
        if self._in_step and self.config.sync_mode == "step_end" and self._sync_due(self.steps_done + 1):
            if self.start_sync(self.steps_done + 1):
                self.complete_at_step_end()
            self._synced_in_step = True

    def end_step(self) -> None:
        """After the optimizer step: count it, and schedule the layer-wise sync if due."""
        self._in_step = False
        self.steps_done += 1
        if self.auto is not None:
            self.auto.step_ended()
        self.global_progress += self._step_progress
        self._snap_progress()  # step-end: the sync ran inside this step
        if self.config.use_async and self.steps_done == self.config.local_sgd_warmup_steps:
            self.async_plan.start_clock(self.steps_done)
        if self.delayed is not None:  # launches the exchange of the sync due tau steps later
            return self.delayed.end_step(self.steps_done)
        if not self._sync_due(self.steps_done):
            if self._synced_in_step:  # A-EDiT: a step-end sync inside this step planned the next
                self.backend.settle_last_sync()
            return
        if self.config.sync_mode == "step_end":
            assert self._synced_in_step, "step-end sync did not run inside the optimizer step"
        elif self.start_sync(self.steps_done):
            self.sync.mark_pending()
            if self.fsdp is not None:  # the step's prefetch reads the weights the sync changes: wait for it first
                self.fsdp.wait_stale_gathers()
            final = self.finished or (not self.config.use_async and self.steps_done == self.last_step) or (
                self.auto is not None and self.auto.completes_now)  # auto overlap: a timed sync, a heal's delay
            if self.backend.waits_for_others:  # a later optimizer's exchange first
                self.backend.defer(self.complete_now if final else self.flush)
            else:
                if self.backend.gates_outer_step:  # the commit gates every group's outer step: no overlap yet
                    self.flush()
                if final:
                    self.complete_now()
                elif self.fsdp is not None:  # the step prefetched its first bucket before the sync
                    self.fsdp.drop_stale_gathers()
        self.backend.settle_last_sync()  # torchft: the run's last sync again until it commits
        self._snap_progress()

    def sync_again(self) -> None:
        """The sync after this step once more, completed now (the backend's retry of the run's last
        sync, which did not commit: the same progress against the same anchor). Where a later
        optimizer of the process syncs in the same round, the outer step waits for its commit."""
        if self.start_sync(self.steps_done):
            self.sync.mark_pending()
            if self.backend.waits_for_others:
                self.backend.defer(self.complete_now)
            else:
                self.complete_now()

    def complete_at_step_end(self) -> None:
        """Complete the sync just begun, between the inner update and Megatron's own main -> model
        copy (which writes the model). Over torchft, where a later optimizer of this process
        syncs in the same round (a MoE model's dense optimizer steps before the experts'), the
        exchange is launched now and the outer step waits for the round's commit, after the
        experts' exchange: it then writes the model itself and gathers it inside the worker
        (Megatron has copied and gathered the parameters of before the sync by then)."""
        if self.backend.waits_for_others:
            self.sync.launch(self.sync.members)
            self.backend.defer(self._apply_deferred)
        else:
            self.sync.complete(self.sync.members, write_model=False)

    def _apply_deferred(self) -> None:
        self.sync.complete(self.sync.members, write_model=True)
        self.gather_params_in_worker()

    def complete_now(self) -> None:
        """Complete a pending layer-wise sync now and all-gather the parameters inside the worker
        (what the next forward pass would do): the run ends here."""
        self.flush()
        self.gather_params_in_worker()

    def gather_params_in_worker(self) -> None:
        """All-gather every bucket group's parameters inside the worker now (a collective over
        the worker's ranks, at the same point on each). Megatron-FSDP keeps only shards: what
        was gathered before the sync is dropped, and the next forward pass gathers the rest."""
        if self.fsdp is not None:
            return self.fsdp.drop_stale_gathers()
        for group in self.group_order:
            if group.param_gather_handle is not None:
                group.param_gather_handle.wait()
                group.param_gather_handle = None
            group.start_param_sync(force_sync=True)

    def start_sync(self, step: int, due=None, delay: int = 0) -> bool:
        """Begin the sync due after ``step``; False when A-EDiT skips it (no exchange). ``due``:
        (fragment, shards) to exchange (default: what :attr:`sync_shards` says is due there);
        ``delay``: launched now, applied after ``step``."""
        # A-EDiT's interval ends at this worker's arrival: waiting for the others is not training
        # time (counted, a fast worker would look as slow as the slowest and never get more steps).
        arrived = self.async_plan.clock() if self.config.use_async else None
        if self.arrivals is not None:  # before the sync's first collective: name a missing worker
            self.arrivals.wait(step - delay)  # where this worker is (a delayed sync: its launch)
        before = None if self.config.use_async else self.steps_done  # (EDiT's grid: where this sync began)
        healed = self.backend.begin(step)  # torchft: this sync's quorum (a worker behind heals here)
        began = time.perf_counter()  # the sync's own time starts here (the waits above are the arrival's)
        if healed is not None:  # it was behind: now in the others' sync
            if before is not None:  # EDiT's grid: at its place in the sync it began, at the others' step
                self.keep_place_in_sync(healed - (step - before))
            step = healed
            due = self.sync_shards.due(step, None if delay else self.last_step)
        bytes_at_start = self.sync_group.counters.payload_bytes
        planned = async_sync.begin(self, step, delay, arrived) if self.config.use_async else None
        if planned is not None:  # A-EDiT: the schedule, agreed (delayed: at the launch)
            step, delay, steps_since, fragment, members = planned.where
        else:
            fragment, members = due or self.sync_shards.due(step, self.last_step)
            steps_since = self.sync_shards.steps_since(step, fragment, self._last_sync_step)
        started = self.sync.start(step, steps_since, bytes_at_start=bytes_at_start, delay=delay, fragment=fragment,
                                  members=members, began=began, probe_link=self.auto is not None and self.auto.probes,
                                  **({} if planned is None else planned.sync_args))
        if planned is not None and planned.skip:
            self.backend.close_skipped()
        if self.expert_biases is not None and not delay:  # (a delayed sync's at its apply)
            self.expert_biases.average(step)
        return started

    def _on_sync_done(self, report: SyncReport) -> None:
        if self.config.use_async:  # (torchft: a failed round counts no fragment)
            self.async_fragments.settled(report.committed)
        if not report.skipped_sync and report.committed:  # keep counting from the last applied one
            self._last_sync_step = report.step - (report.delay if self.config.use_async else 0)  # (its launch)
            if self.backend.dynamic and self.config.use_async:  # its steps reached the anchor
                self.async_plan.applied()
            c = self.config
            # A delayed merge that keeps local progress leaves the workers different by design; a
            # blocking sync or an alpha-0 merge makes them equal.
            if not report.delay or not c.merge_keeps_local:
                synced = range(c.fragments) if report.fragment is None else (report.fragment,)
                for f in synced:
                    self._identical_after[f] = report.step
        if self.auto is not None:
            self.auto.sync_done(report)
        self.reports.append(report)
        if self.record is not None:
            self.record(report, self.last_step)
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

    def chunk_span(self, shard) -> Optional[Tuple[int, int, int]]:
        """Quantized exchange with error feedback: (offset, length, padded length) of the chunk
        of ``shard``'s result this worker reduces (its ``chunk_residual``); the sparse exchange
        with error feedback, or fp32 in an ``auto_overlap`` run with it: an empty span (no chunk); None without."""
        quant = self.sync.quantized or self.sync.sparse
        if quant is None or not quant.error_feedback:
            # auto_overlap with error feedback in fp32: the residuals a later format carries on are saved (empty span)
            run_wide = self.auto is not None and self.auto.user.error_feedback and self.num_workers > 1
            return (0, 0, 0) if run_wide and quant is None else None
        return quant.chunk_span(shard.numel)

    def state_bytes(self) -> int:
        """Bytes of EDiT state on this rank: anchor + outer optimizer state."""
        return self.outer_state.state_bytes(self.shards)
