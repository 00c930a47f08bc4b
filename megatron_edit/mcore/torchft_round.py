"""One torchft round per sync for every EDiT controller of a process (``--local-sgd-sync-backend
torchft``; the backend of each controller: :mod:`.fault_tolerant`).

A MoE model with expert parallelism has two distributed optimizers in each process, the dense
one and the experts', stepped one after the other by Megatron's ``ChainedOptimizer``; each has
its EDiT controller. They share this rank's torchft Manager, and each sync of theirs is one
round (:class:`TorchftRound`): torchft pairs rounds by their order only, so a round per
controller would pair one worker's expert round with another's dense round as soon as one of
them missed one (a straggler past the Lighthouse's join timeout, a slow start after a heal).

* The quorum is taken at the first controller's sync (:meth:`TorchftRound.begin`; a worker
  behind the others heals there, every controller's state at once); the later ones join it.
* A controller whose exchange is in before a later one's sync has begun (step-end and
  layer-wise syncs: the dense optimizer steps first) leaves its outer step to the round
  (:meth:`TorchftRound.defer`); the commit comes after the last controller's exchange, every
  started controller's exchange finished in their order, and then the deferred outer steps
  run: each writes its model itself and gathers it inside the worker (Megatron copied and
  gathered that optimizer's parameters of before the sync already). A delayed sync's launch
  opens the round (both controllers launch after the same step) and its first apply commits it.
* The join is one round too, once every controller exists (:meth:`TorchftRound.join`), its
  collectives in the order the others' sync runs them.
* A-EDiT: the expert controller follows the dense one's plan (no collective of its own), and
  a skipped sync is one round, closed once the last controller has skipped it too.
* The run's last sync is retried until it commits (:meth:`TorchftRound.settle_last_sync`), a
  new quorum each time among the workers still there, for a bounded time. Under the supervisor,
  a worker past it says so at once, and one that the others passed it without stops (:class:`RunEnd`).
* ``auto_overlap`` on EDiT's grid: the measurements ride on the round's first all-gather
  (:mod:`.auto_overlap_ft`). One controller is a round of one: the same calls, nothing deferred.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import time
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..exchange.fault_tolerant import FaultTolerantSyncGroup
from ..exchange.run_gate import START_GATE_ENV, RunEnd, record_end, supervised_workers
from .async_sync import exchanged
from .auto_overlap_ft import dispatch, ride
from .process_state import PROCESS
from .worker_layout import is_expert_optimizer

STATE_KEY = "megatron_edit"
"""The torchft state key under which a healing peer's same rank receives every controller's state."""
COUNTERS = ("step", "last_sync_step", "last_step", "plan", "budget_steps", "global_progress", "fragments")
"""What a controller's heal state holds of its worker's own (its steps and progress; A-EDiT's
plan and its fragments' counts): one peer's for every rank of the healing worker."""
LAST_SYNC_TRIES = 5
"""How often the run's last sync is tried again when it does not commit (within
:func:`last_sync_seconds` too)."""
logger = logging.getLogger(__name__)


def last_sync_seconds(sync_timeout: Optional[float]) -> float:
    """How long the run's last sync is tried again: twice the sync timeout (a peer that died
    inside the exchange is out of the Lighthouse's quorum well before), 10 minutes without one."""
    return 600.0 if sync_timeout is None else 2.0 * sync_timeout


def _copy(tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if tensor is None else tensor.clone()


class TorchftRound:
    """The torchft Manager of this rank and its rounds, shared by the process's EDiT controllers
    (one, or the dense and the expert one of a MoE model with expert parallelism): one quorum,
    one commit and one heal per sync for all of them (see the module)."""

    def __init__(self, group: FaultTolerantSyncGroup, expected: int):
        self.group = group
        self.expected = expected
        """The controllers this process builds (2: a MoE model's dense and expert optimizers)."""
        self.members: List[object] = []
        """The controllers' backends (:class:`~megatron_edit.mcore.fault_tolerant.TorchftBackend`), in
        the order they are built and stepped."""
        self.started: List[object] = []
        """The members whose sync of the open round has begun (empty: no round open)."""
        self.deferred: List[Callable[[], None]] = []
        """What members whose exchange was in before the last one's do after the commit."""
        self.step: Optional[int] = None
        """The sync step of the open round (its first member's)."""
        self.healed_sync_step: Optional[int] = None
        """The others' sync step this worker healed into at the open round's quorum (None: no heal)."""
        self.joined = False
        self.closed = False
        self._healed_counters: Optional[dict] = None
        """The counters of the peer this rank healed from at the open round's quorum."""
        self.residuals_before: dict = {}
        """Each started member's error-feedback residuals from before the open round (:meth:`begin`)."""
        self.last_sync_lost = False
        """The run's last sync did not commit (:meth:`settle_last_sync` tries it again)."""
        self.joining = False
        """The round in progress is this worker's join (:meth:`join`; not one of the run's syncs)."""
        self._heal: Optional[dict] = None
        """What this rank received when it healed at the open round's quorum, and how long the
        quorum took (None: it did not heal): :attr:`last_heal`."""
        self.quorum_seconds: Optional[float] = None
        """How long the latest round's quorum took on this rank (the wait for the last worker to
        ask for it, and a heal's transfer; the sync record's arrival wait)."""
        gate = os.environ.get(START_GATE_ENV)
        self.run_end = RunEnd(gate, group.replica_id) if gate else None
        """Under the supervisor: this worker's word on the run's last sync (:class:`RunEnd`)."""
        group.register_state(STATE_KEY, self._load, self._save)
        group.start_digest = self._start_digest
        self._rank_and_size = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)  # (now)
        atexit.register(self.record_end)

    def record_end(self) -> None:
        """At this process's end: the digest of the model its controllers end with (each
        shard's main parameters) in the supervisor's store, where it checks that every worker
        ended with one model (:func:`~megatron_edit.exchange.run_gate.models_at_the_end`)."""
        gate = os.environ.get(START_GATE_ENV)
        if not gate or not self.members or not self.joined or (self.run_end and self.run_end.stopped):
            return  # (a worker that stopped before its join, or after the run's last sync, trained nothing of it)
        digest = hashlib.sha256()
        for member in self.members:
            for shard in member.controller.shards:
                current = shard.read_current(torch.empty(shard.numel, dtype=torch.float32, device=shard.device))
                digest.update(current.cpu().numpy().tobytes())
        record_end(gate, self.group.replica_id, *self._rank_and_size, digest.hexdigest()[:16])

    # ------------------------------------------------------------------ one round
    def begin(self, member, step: int, contributed: bool) -> None:
        """``member``'s sync: the first one opens the round (the quorum; this worker may heal
        there), the others join it."""
        if member in self.started:
            raise RuntimeError(f"megatron_edit: an EDiT optimizer began the torchft round of step {self.step} twice.")
        if not self.started:
            self.step, self.healed_sync_step, self._heal = step, None, None
            start = time.monotonic()
            self.group.begin(contributed, *ride(self.members))  # (auto_overlap's measurements, where they ride)
            dispatch(self.members, getattr(self.group, "ridden", None))  # (after a heal: its state's)
            if self.run_end is not None:  # a worker that the others passed the run's last sync without stops here
                where = "its join" if self.joining else f"its sync after step {step}"
                self.run_end.stop_if_left_behind(self.group, where)
            self.quorum_seconds = time.monotonic() - start
            if self._heal is not None:  # (the quorum and the heal's transfer and load)
                self._heal["seconds"] = self.quorum_seconds
            if self.group.caught_up:
                self._counters_from_one_source()
        else:  # every controller of the process syncs after the same steps (one config)
            expected = self.step if self.healed_sync_step is None else self.healed_sync_step
            if step != expected:
                raise RuntimeError(
                    f"megatron_edit: an EDiT optimizer's sync after step {step} met the torchft round of the sync "
                    f"after step {expected}: the process's optimizers must sync after the same steps.")
        self.started.append(member)
        if self.group.layout_changed:  # who reduces which chunk changed: restart those residuals
            for shard in member.controller.shards:
                shard.chunk_residual = None
        # What a round that does not commit gives back: the exchange rewrites the error-feedback
        # residuals in place (this interval's error), but the worker keeps its progress since the
        # last committed sync, so the next exchange sends it again against the same anchor: the
        # error of the last committed one is what it still owes (a copy per shard while open).
        self.residuals_before[member] = [
            (_copy(shard.residual), _copy(shard.chunk_residual)) for shard in member.controller.shards]

    @property
    def waits_for_others(self) -> bool:
        """The member that has just begun is not the process's last in this round: its outer
        step waits for the round's commit, after the later members' exchanges."""
        return 0 < len(self.started) < len(self.members)

    def defer(self, action: Callable[[], None]) -> None:
        """Run ``action`` (a member's outer step) right after the round's commit."""
        self.deferred.append(action)

    def commit(self) -> bool:
        """Every started member's exchange in (in their order), then one commit for all: whether
        their outer steps are applied (the round is committed and some worker trained since the
        last sync). A failed round gives their error-feedback residuals back as they were before it
        (the worker sends its progress again at the next sync). Then the deferred outer steps run."""
        started, deferred = self.started, self.deferred
        for member in started:
            member.controller.sync.finish_exchange()
        committed = self.group.commit()
        applied = committed and self.group.contributors > 0
        self.started, self.deferred = [], []
        for member in started:
            member.controller.sync.decide(applied)
            before = self.residuals_before.pop(member, None)
            if not committed and before is not None:
                for shard, (residual, chunk_residual) in zip(member.controller.shards, before):
                    shard.residual, shard.chunk_residual = residual, chunk_residual
        c = started[0].controller if started else None
        last = c is not None and (c.sync.final or (c.last_step is not None and self.step >= c.last_step))
        self.last_sync_lost = not committed and last
        if committed and c is not None and self.run_end is not None:
            at = self.step if self.healed_sync_step is None else self.healed_sync_step  # (a join healed into it)
            if c.sync.final or (c.last_step is not None and at >= c.last_step):
                self.run_end.passed(at)  # the run's last sync: said before anything else of the job's end
        if not committed and not last and started and dist.get_rank() == 0:  # one line per worker
            error = self.group.manager.errored()
            logger.warning(
                "megatron_edit: worker %s did not commit the sync after step %d (%d worker(s) in it, "
                "--local-sgd-min-replicas %d%s): it keeps its local progress for the next sync.",
                c.config.replica_id, self.step, self.group.size, c.config.min_replicas,
                f"; {str(error).splitlines()[0][:200]}" if error is not None and str(error) else "")
        for action in deferred:
            action()
        return applied

    def settle_last_sync(self) -> None:
        """After the run's last sync (every member's end of it; acts once the round is closed):
        while it is not committed, every member syncs again in order (:meth:`LocalSGD.sync_again
        <megatron_edit.mcore.controller.LocalSGD.sync_again>`: a new quorum among the workers still
        there, the same progress against the same anchor), up to :data:`LAST_SYNC_TRIES` times
        within :func:`last_sync_seconds` (A-EDiT plans it again among the workers still there: where a
        lost worker's steps leave budget, that sync is not the last, and the workers left train it).
        Still not committed (or delayed on EDiT's grid, not tried again; A-EDiT's last is blocking): one error
        line, and the worker ends with its own model, which the supervisor's end check turns into a failed run."""
        if not self.last_sync_lost or self.started:
            return
        c = self.members[0].controller
        retry = all(m.controller.delayed is None or m.controller.config.use_async for m in self.members)
        deadline = time.monotonic() + last_sync_seconds(c.config.sync_timeout)
        tries = 0
        while retry and self.last_sync_lost and tries < LAST_SYNC_TRIES and time.monotonic() < deadline:
            tries += 1
            if dist.get_rank() == 0:
                logger.warning("megatron_edit: worker %s did not commit the run's last sync (after step %d, %d "
                               "worker(s) in it): trying it again (%d of %d).", c.config.replica_id, self.step,
                               self.group.size, tries, LAST_SYNC_TRIES)
            for member in self.members:
                member.controller.sync_again()
        if self.last_sync_lost and self.run_end is not None:  # given up: it ends with its own model
            self.run_end.passed(self.step)
        if self.last_sync_lost and dist.get_rank() == 0:
            logger.error(
                "megatron_edit: worker %s did not commit the run's last sync (after step %d%s): it ends with its own "
                "model, not the others'; under the supervisor the run exits 1 (it compares the workers' models at "
                "the end).", c.config.replica_id, self.step,
                f", tried {tries + 1} times" if retry else "; a delayed sync is not tried again")

    def close_skipped(self) -> None:
        """A-EDiT skipped this sync's exchange (every worker decides the same; a MoE model's expert
        optimizer follows the dense one's plan): the round commits with nothing applied, once the
        process's last controller has skipped it too."""
        if self.waits_for_others:
            return
        self.group.commit()
        self.started = []
        self.residuals_before.clear()
        self.last_sync_lost = False  # (a skipped sync is never the run's last)

    # ------------------------------------------------------------------ joining
    def member_built(self, member) -> None:
        """``member``'s controller is built: once every controller the process builds exists,
        they join the others in one round (:meth:`join`)."""
        if len(self.members) >= self.expected and not self.joined:
            self.join()

    def join(self) -> None:
        """The round a worker joins the others with: every controller's anchor at its current
        parameters, then one sync of all with a zero pseudo-gradient (healing from a peer if
        behind), its collectives in the order the others' sync runs them (each controller's
        decisions and launch in turn; a delayed sync's second phases in turn; the last
        controller's exchange finished first, as its commit does). Also run at the first step
        where a process built fewer controllers than expected."""
        self.joined = self.joining = True
        try:
            self._join(list(self.members))
        finally:
            self.joining = False

    def _join(self, members) -> None:
        for member in members:
            member.controller.capture_anchor()
        step = members[0].controller.steps_done
        self.begin(members[0], step, contributed=False)
        healed = self.healed_sync_step
        for member in members[1:]:  # in the others' sync where it healed
            self.begin(member, step if healed is None else healed, contributed=False)
        for member in members:
            c = member.controller
            if healed is not None:  # it applies the others' sync now: it is at its step
                c.enter_healed_sync(healed)
            if c.config.use_async:  # A-EDiT: the others' schedule (the experts follow the dense plan)
                schedule, skip, final, fragment, shards, steps = join_plan(c, self.group)
                if c.sync.start(c.steps_done, 0, steps, schedule.interval_seconds, skip, final=final,
                                fragment=fragment, members=shards):
                    c.sync.launch(c.sync.members)
                continue
            due = c.sync_shards.due(c.steps_done, c.last_step)
            fragment, shards = due if due is not None else (None, None)
            if c.sync.start(c.steps_done, 0, fragment=fragment, members=shards):
                c.sync.launch(c.sync.members)
        if any(m.controller.delayed is not None for m in members):  # the others' launch round
            for member in members:
                if member.controller.sync.in_progress:
                    member.controller.sync.advance()
        if not any(m.controller.sync.in_progress for m in members):  # A-EDiT skipped it: nothing to apply
            self.group.commit()
            self.started = []
            self.residuals_before.clear()
        for member in reversed(members):
            c = member.controller
            if c.sync.in_progress:
                c.sync.complete(c.sync.members, write_model=True)
            # Every slice of the model from the new mains: on every rank of the worker, healed or
            # not (torchft heals rank by rank, each from another worker's same rank).
            c.gather_params_in_worker()
        for member in members:
            member.controller.reports.clear()  # the join is not one of the run's syncs

    # ------------------------------------------------------------------ healing
    def _save(self) -> dict:
        return dict(sync_step=self.step, members=[m.save() for m in self.members],
                    from_worker=self.group.replica_id)  # (the heal's source, in the sync record)

    @property
    def last_heal(self) -> Optional[dict]:
        """What this rank received if its worker healed at the latest round (the sync record's
        heal event): ``from_worker`` (the peer's replica id), ``bytes`` (of the tensors received),
        ``seconds`` (the round's quorum, transfer and load); None: no heal."""
        return dict(self._heal) if self._heal is not None and self.group.healed else None

    def _load(self, state: dict) -> None:
        if len(state["members"]) != len(self.members):
            raise RuntimeError(
                f"megatron_edit: the peer this worker heals from has {len(state['members'])} EDiT optimizer(s) "
                f"and this worker {len(self.members)}: every worker of a torchft run needs the same model and layout.")
        self.healed_sync_step = int(state["sync_step"])
        self._heal = dict(from_worker=state.get("from_worker"), bytes=_tensor_bytes(state), seconds=0.0)
        self._healed_counters = dict(sync_step=state["sync_step"],
                                     members=[{k: part[k] for k in COUNTERS} for part in state["members"]])
        for member, part in zip(self.members, state["members"]):
            member.load(part)

    def _start_digest(self) -> list:
        """What this rank starts from (a fresh run's first round): the sum and the sum of squares
        of every controller's anchors (its parameters where it has none yet), in float64."""
        total, squares = 0.0, 0.0
        for member in self.members:
            for shard in member.controller.shards:
                values = shard.anchor if shard.anchor is not None else shard.read_current(
                    torch.empty(shard.numel, dtype=torch.float32, device=shard.device))
                values = values.double()
                total += float(values.sum())
                squares += float((values * values).sum())
        return [total, squares]

    def _counters_from_one_source(self) -> None:
        """After a heal of the whole worker: every rank takes the counters of the peer its first
        rank healed from. torchft serves rank r from worker (i + r) mod n, and under A-EDiT each
        worker has its own step counts and progress (the shards' state is the same everywhere)."""
        counters = self.group.same_in_worker(self._healed_counters)
        self.healed_sync_step = int(counters["sync_step"])
        for member, mine in zip(self.members, counters["members"]):
            member.load_counters(mine)

    def close(self) -> None:
        """Shut this rank's Manager down (the end of the run; once, whichever member asks)."""
        if not self.closed:
            self.closed = True
            self.group.shutdown()
        if PROCESS.torchft_round is self:
            PROCESS.torchft_round = None


def _tensor_bytes(value) -> int:
    """The bytes of the tensors in ``value`` (nested dicts, lists and tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def join_plan(c, group: FaultTolerantSyncGroup):
    """A-EDiT: controller ``c``'s schedule in the join round (a fresh run: everyone's first
    interval; a worker that joins brings no steps) and what the others' sync exchanges there:
    ``(schedule, skip, final, fragment, members, every worker's steps)``."""
    plan = c.async_plan
    if plan.run_workers is None:  # a fresh run (none healed from knows it)
        plan.start_run(supervised_workers(os.environ.get(START_GATE_ENV)) or group.size)
    device = c.shards[0].device if c.shards else torch.device("cpu")
    schedule, skip, final = plan.plan(c.steps_done, c.last_sync_step, device, joining=True)
    plan.restart_clock()  # its first interval starts with its first step
    c.move_progress(plan.last_sync.global_progress)
    return (schedule, skip, final, *exchanged(c, schedule, skip, final))


def expected_controllers(optimizer) -> int:
    """The EDiT controllers this process builds for the model of ``optimizer`` (the first one
    built): 2 where its model has expert-parallel buffers (a MoE model with expert parallelism:
    Megatron builds the expert optimizer right after this one), else 1."""
    if optimizer is None or is_expert_optimizer(optimizer):
        return 1
    chunks = getattr(optimizer, "model_chunks", None) or []
    return 2 if any(getattr(chunk, "expert_parallel_buffers", None) for chunk in chunks) else 1
