"""EDiT's sync group over torchft: workers that die, leave and come back without stopping the
others (EDiT, arXiv 2412.07210; torchft's Manager and Lighthouse, as in its DiLoCo).

Each worker is its own job (its own ``torch.distributed`` world); rank r of every worker holds
the same shard and owns one torchft ``Manager`` (all the ranks of a worker share its replica
id). The Managers of rank r form, per sync, a quorum from the workers alive then, over a gloo
group that torchft rebuilds when the quorum changes. :class:`FaultTolerantSyncGroup` has the
methods and counters of :class:`~megatron_edit.exchange.groups.SyncGroup`, so the reducers run
unchanged over it, plus the round a sync is (torchft's contract: the same collectives in the
same order on every member, one commit per round):

* :meth:`FaultTolerantSyncGroup.begin` (``start_quorum``): the workers of this sync; ``size``
  and ``rank`` come from the quorum. A worker behind the others (a fresh job for a dead one)
  heals here from a live peer's same rank (the state registered with :meth:`register_state`).
  Then one small all-gather says which workers these are (:attr:`replica_ids`, in quorum
  order) and which of them trained since the last sync (:attr:`trained`;
  :attr:`contributors` counts them: the mean's divisor, so a just-healed worker's zero
  pseudo-gradient does not dilute it; the penalty excludes it and keeps each worker's
  statistics under its id, :func:`~megatron_edit.algorithm.penalty.detect_anomalies_by_worker`);
* the collectives: ``all_reduce_sum`` is ``Manager.allreduce`` (an error becomes a failed round);
  the others run on the Manager's group and route their errors to ``Manager.report_error`` the
  same way (their output is zeroed: nothing undefined reaches the decisions);
* :meth:`FaultTolerantSyncGroup.commit` (``should_commit``): whether the sync may be applied.
  A worker whose commit fails keeps its local progress; if others committed, its step is behind
  theirs and it heals at the next :meth:`begin`.

**A worker is one unit.** torchft heals, counts steps and votes rank by rank, and an EDiT worker
is a whole job of many ranks (``worker_group``: its ranks, a gloo group of the job). Two small
all-reduces inside the worker make every event of a round happen to all its ranks or to none:

* after the quorum, whether each rank received a heal and at which torchft step each stands: a
  heal is loaded only where every rank of the worker received one (the loads wait until then),
  and a partial heal (one rank's transfer failed) loads nothing anywhere, fails the round on
  every rank and sets every rank's step to the worker's lowest, so the whole worker is behind and
  heals again at the next quorum;
* after the vote, whether every rank committed: a rank whose vote failed (``should_commit``
  raising ``TimeoutError`` when its reply is lost or a peer stalls in it) is "not committed", and
  so is the rest of its worker, whose ranks that had counted the round set their step back (the
  worker heals at the next quorum if others committed).

torchft is an optional dependency (``pip install torchft==0.2.0``): its Manager is started
in :mod:`.torchft_manager`. Its quantized all-reduce (``should_quantize``) is CUDA
only; megatron_edit's own quantized exchange (all-to-all + all-gather) runs over this group.

This module is long because a round is one protocol (the quorum, a worker's ranks acting as one
in its heal and vote, the first all-gather and what rides on it, the commit) read in one place.
"""

from __future__ import annotations

import logging
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from ..config import ConfigError
from .groups import CommCounters, _Done, all_reduce_bytes
from .torchft_manager import start_manager

logger = logging.getLogger(__name__)


class _Guarded:
    """A collective's handle whose error is reported to the Manager (the round then fails)
    instead of raised; ``on_error`` zeroes what the collective would have written."""

    def __init__(self, work, manager, on_error: Callable[[], None]):
        self.work = work
        self.manager = manager
        self.on_error = on_error

    def wait(self) -> bool:
        try:
            self.work.wait()
            return True
        except Exception as error:  # noqa: BLE001 (any failure of a peer: the round is lost)
            self.manager.report_error(error)
            self.on_error()
            return False


class FaultTolerantSyncGroup:
    """Collectives across the workers holding the same shard, over one torchft ``Manager``.

    ``manager``: this rank's Manager (see :meth:`connect`). ``size`` / ``rank``: the workers in
    the current sync and this worker's place among them (set by :meth:`begin`; 1 / 0 before).
    """

    dynamic = True
    """The workers may change from one sync to the next (:meth:`begin` says which)."""

    def __init__(self, manager, replica_id: int = 0, worker_group=None, min_replicas: int = 1):
        self.manager = manager
        self.replica_id = replica_id
        self.min_replicas = min_replicas
        """The fewest workers that trained since the last sync a round may apply (a worker that
        has just joined or healed brings nothing; torchft's own count is of the workers in it)."""
        self.worker_group = worker_group
        """This worker's ranks (a gloo group of its job; None: a worker of one rank), over which
        they agree on each heal and vote (see the module)."""
        self.group = None  # not a torch.distributed group
        self.size = 1
        self.rank = 0
        self.replica_ids = [replica_id]
        """The replica ids of the workers in the current sync, in quorum order (``rank`` is this
        worker's place)."""
        self.trained = torch.ones(1, dtype=torch.bool)
        """[size] bool: which of them (:attr:`replica_ids`) trained since the last sync."""
        self.contributors = 1
        """Workers that trained since the last sync, in the current one (the mean's divisor)."""
        self.start_digest: Optional[Callable[[], List[float]]] = None
        """What this rank holds at a fresh run's start, as a few numbers (None: not checked): at
        the first round of a fresh run the workers compare them instead of sending one worker's
        state to every other (:meth:`_check_same_start`)."""
        self.counters = CommCounters()
        self.healed = False
        """This rank loaded a peer's state at the last :meth:`begin`."""
        self.caught_up = False
        """Every rank of this worker healed to the others' later step at the last :meth:`begin`
        (it was behind them)."""
        self.layout_changed = False
        """The last :meth:`begin` changed ``size`` or ``rank`` (chunked state must be re-planned)."""
        self.partial_heals = 0
        """Rounds whose heal reached some ranks of this worker only (none loaded it; see the module)."""
        self.commit_error: Optional[BaseException] = None
        """Why this rank's last vote failed (None: it did not); its worker did not commit."""
        self._received: List[tuple] = []
        """The heals this rank's quorum received, ``(load, state)``, loaded once the worker agrees."""

    @classmethod
    def connect(cls, *, replica_id: int, lighthouse: str, rank: int, world_size: int, store_addr: str,
                store_port: int, min_replicas: int = 1, timeout: float = 60.0,
                quorum_timeout: float = 1800.0, connect_timeout: float = 60.0,
                worker_group=None) -> "FaultTolerantSyncGroup":
        """One Manager for this rank: ``rank`` / ``world_size`` inside the worker's own job, whose
        TCP store is at ``store_addr:store_port`` (rank 0 hosts the worker's Manager server there);
        ``timeout``: collectives, commit and healing; ``quorum_timeout``: the wait for a sync's
        quorum (a worker waits there for the others' next sync); ``worker_group``: the job's
        ranks (a gloo group; None: a job of one rank)."""
        manager = start_manager(replica_id=replica_id, lighthouse=lighthouse, rank=rank, world_size=world_size,
                                store_addr=store_addr, store_port=store_port, min_replicas=min_replicas,
                                timeout=timeout, quorum_timeout=quorum_timeout, connect_timeout=connect_timeout)
        return cls(manager, replica_id, worker_group, min_replicas)

    def register_state(self, key: str, load: Callable[[object], None], save: Callable[[], object]) -> None:
        """What a peer sends a healing worker under ``key``: ``save()`` runs in this rank's quorum
        thread and its CPU tensors are served by reference until :meth:`commit` (so nothing it
        returns may change before); ``load(state)`` runs in :meth:`begin` on the main thread,
        once every rank of the worker has received its heal (and on none otherwise)."""
        self.manager.register_state_dict_fn(key, lambda state: self._received.append((load, state)), save)

    # ------------------------------------------------------------------ the round
    def begin(self, contributed: bool, rider: Optional[Callable[[], torch.Tensor]] = None) -> None:
        """Start a sync: the quorum (healing this worker from a peer if it is behind), then who
        is in it and which of them trained since the last sync (``contributed``: this worker
        did; a worker that has just healed did not). ``rider``: numbers that ride on that
        all-gather (asked for after the heal); their MAX over every rank of every worker of the
        round is :attr:`ridden` (zeros where the round has failed)."""
        self.healed = self.caught_up = False
        before = (self.size, self.rank)
        counted = self.manager.state_dict()
        self._received = []
        self.manager.start_quorum()
        self._refuse_shared_replica_id()
        self._heal_as_one(counted)
        participants = self.manager.num_participants()
        rank = self.manager.participating_rank()
        self.size, self.rank = max(int(participants), 1), int(rank or 0)
        self.layout_changed = (self.size, self.rank) != before
        mine = torch.tensor([1.0 if contributed and not self.healed else 0.0, float(self.replica_id)],
                            dtype=torch.float64)
        if rider is not None:  # (auto_overlap on EDiT's grid: the last sync's measurements)
            mine = torch.cat([mine, rider()])
        everyone = self.all_gather(mine)  # zeros if the round has failed: nobody trained, no commit
        self.ridden = None if rider is None else everyone[:, 2:].amax(dim=0)
        if self.ridden is not None and self.worker_group is not None:
            dist.all_reduce(self.ridden, op=dist.ReduceOp.MAX, group=self.worker_group)
        self.trained = everyone[:, 0] > 0.5
        self.replica_ids = [int(r) for r in everyone[:, 1].tolist()]
        self.contributors = int(self.trained.sum())
        if self.manager.current_step() == 0 and self.start_digest is not None:  # every worker at a fresh start
            self._check_same_start()

    def _check_same_start(self) -> None:
        """A fresh run's first round (every worker in it at torchft step 0; the Manager's
        ``init_sync`` is off): the workers compare what they start from (:attr:`start_digest`,
        to a relative 1e-6: GPUs of different kinds may sum in another order) instead of one
        worker's state being sent to every other, a transfer of the whole model at every start.
        Workers that start from different weights are refused here, named, on every rank of
        theirs (their models would never meet: each applies the others' mean to its own anchor)."""
        mine = torch.tensor(self.start_digest(), dtype=torch.float64)
        everyone = self.all_gather(mine)  # zeros if the round has failed: compared at the next one
        first = everyone[0]
        apart = [(self.replica_ids[i], row) for i, row in enumerate(everyone)
                 if bool(((row - first).abs() > 1e-6 * first.abs().clamp(min=1.0)).any())]
        _, high = self.worker_min_max([float(bool(apart))])
        if high[0] > 0:
            raise ConfigError(
                f"megatron_edit: the workers of this torchft run start from different weights (worker "
                f"{self.replica_ids[0]}'s differ from worker(s) {[w for w, _ in apart] or 'of another rank'}): their "
                "models would never meet. Start every worker from the same weights: the same --seed and "
                "initialization, or the same checkpoint (--load).")

    def _refuse_shared_replica_id(self) -> None:
        """Two workers of the quorum with one replica id (torchft tells them apart by a random
        suffix, and both would train the same data shard): stop, naming it."""
        ranks, per_worker = self._quorum_ranks()
        shared = sorted({r for r in ranks if ranks.count(r) > 1})
        if shared:
            raise RuntimeError(
                f"megatron_edit: two workers of the sync have --local-sgd-replica-id {shared[0] // per_worker}: "
                "give every worker its own id (a relaunched worker keeps its dead predecessor's).")

    def _quorum_ranks(self) -> tuple:
        """(the quorum's members, each as replica id x ranks per worker + rank; ranks per worker)."""
        pg = self.manager._pg
        return list(getattr(pg, "_global_ranks", None) or ()), max(1, int(getattr(pg, "_group_world_size", None) or 1))

    @property
    def in_quorum(self) -> List[int]:
        """The replica ids in the current quorum (torchft's: known even where the round fails)."""
        ranks, per_worker = self._quorum_ranks()
        return sorted({r // per_worker for r in ranks}) if ranks else list(self.replica_ids)

    def _heal_as_one(self, counted: dict) -> None:
        """After the quorum: load the heal every rank of this worker received, or none (see the
        module). ``counted``: this rank's torchft counters before the quorum."""
        loads, self._received = self._received, []
        step = self.manager.current_step()
        moved = bool(loads) and step != counted["step"]  # a heal to the others' later step
        low, high = self.worker_min_max([float(moved), float(step), float(counted["step"])])
        if low[:2] == high[:2]:  # all or none, at one step
            for load, state in loads:
                load(state)
            self.healed, self.caught_up = bool(loads), moved
            if moved and self._worker_rank() == 0:  # one line per heal
                logger.warning("megatron_edit: worker %d healed from a live worker: it takes the others' state "
                               "after their committed round %d (it was at round %d).", self.replica_id, step,
                               int(counted["step"]))
            return
        self.partial_heals += 1
        self.manager.load_state_dict({**counted, "step": int(low[2])})  # the whole worker behind: it heals again
        error = RuntimeError(
            f"megatron_edit: worker {self.replica_id}'s heal reached some of its ranks only (a transfer failed, or its "
            "ranks stood at different steps): none loaded it; the worker heals again at the next sync.")
        self.manager.report_error(error)
        if self._worker_rank() == 0:
            logger.warning("%s", error)

    def commit(self) -> bool:
        """Whether the sync may be applied: every rank of this worker voted yes and torchft
        committed (a failed collective anywhere in the worker says no). torchft's vote itself may
        fail on one rank (``should_commit`` raising, e.g. ``TimeoutError``, when its reply is
        lost): that is "not committed" for the whole worker (:attr:`commit_error` keeps why), never
        the end of this one, and the ranks that had counted the round set their step back."""
        self.commit_error = None
        counted = self.manager.state_dict()
        if 0 < self.contributors < self.min_replicas:  # (none: a join round, which applies nothing)
            self.manager.report_error(RuntimeError(
                f"only {self.contributors} of its {self.size} workers trained since the last sync"))
        try:
            voted = bool(self.manager.should_commit())
        except (TimeoutError, RuntimeError) as error:  # torchft's client raises plain RuntimeErrors
            voted, self.commit_error = False, error
        low, _ = self.worker_min_max([float(voted)])
        if low[0] < 1:  # the whole worker did not commit: no rank counts the round
            self.manager.load_state_dict(counted)
        return low[0] >= 1

    def worker_min_max(self, values: List[float]) -> tuple:
        """``(min, max)`` of each of ``values`` over this worker's ranks (one small all-reduce)."""
        both = torch.tensor([*values, *(-v for v in values)], dtype=torch.float64)
        if self.worker_group is not None:
            dist.all_reduce(both, op=dist.ReduceOp.MAX, group=self.worker_group)
        n = len(values)
        return [-x for x in both[n:].tolist()], both[:n].tolist()

    def same_in_worker(self, value):
        """``value`` as this worker's first rank has it, on every rank (a small object)."""
        if self.worker_group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.worker_group, 0), group=self.worker_group)
        return box[0]

    def _worker_rank(self) -> int:
        return 0 if self.worker_group is None else dist.get_rank(self.worker_group)

    @property
    def step(self) -> int:
        """Committed syncs (torchft's step: a healing worker takes its peer's)."""
        return int(self.manager.current_step())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # ------------------------------------------------------------------ collectives
    def _guard(self, start: Callable[[], object], on_error: Callable[[], None]):
        if self.manager.errored() is not None:  # the round is lost already: send nothing more
            on_error()
            return _Done()
        try:
            return _Guarded(start(), self.manager, on_error)
        except Exception as error:  # noqa: BLE001
            self.manager.report_error(error)
            on_error()
            return _Done()

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = True):
        """Sum ``tensor`` in place over the workers of this sync; a handle with ``wait()``."""
        if self.size == 1:
            return _Done()
        from torch.distributed import ReduceOp

        self.counters.collectives += 1
        self.counters.payload_bytes += all_reduce_bytes(tensor.numel() * tensor.element_size(), self.size)
        work = self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)
        if not async_op:
            work.wait()
            return _Done()
        return work

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = True):
        """Chunk w of ``tensor`` (equal chunks) to worker w; chunk w of ``output`` from it."""
        if self.size == 1:
            output.copy_(tensor)
            return _Done()
        from torch.distributed.distributed_c10d import AllToAllOptions

        self.counters.collectives += 1
        self.counters.payload_bytes += (self.size - 1) * tensor.numel() * tensor.element_size() // self.size
        handle = self._guard(lambda: self.manager._pg.alltoall_base(output, tensor, [], [], AllToAllOptions()),
                             output.zero_)
        if not async_op:
            handle.wait()
            return _Done()
        return handle

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = True):
        """``output`` := every worker's ``tensor``, concatenated in worker order."""
        if self.size == 1:
            output.copy_(tensor)
            return _Done()
        from torch.distributed.distributed_c10d import AllgatherOptions

        self.counters.collectives += 1
        self.counters.payload_bytes += (self.size - 1) * tensor.numel() * tensor.element_size()
        parts = list(output.view(self.size, -1).unbind(0))
        handle = self._guard(lambda: self.manager._pg.allgather([parts], [tensor.contiguous()], AllgatherOptions()),
                             output.zero_)
        if not async_op:
            handle.wait()
            return _Done()
        return handle

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[workers, *tensor.shape]``: every worker's ``tensor`` (blocking; small tensors); zeros
        when the round has failed."""
        if self.size == 1:
            return tensor.unsqueeze(0).clone()
        out = torch.empty((self.size, *tensor.shape), dtype=tensor.dtype, device=tensor.device)
        self.all_gather_into(out.view(-1), tensor.reshape(-1), async_op=False)
        return out

    def all_reduce_max_everywhere(self, tensor: torch.Tensor, group: Optional[object]) -> torch.Tensor:
        """A-EDiT's schedule message: MAX over every rank of every worker of this sync.
        ``group``: this worker's ranks (None: the job's world, which is this worker). MAX over
        them, then across the workers (one small all-gather; zeros where the round has failed),
        then over them again, so every rank of this worker holds the same figures even where the
        round failed on some of its ranks only (the worker then commits nothing)."""
        local = dist.get_world_size(group) > 1
        if local:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        if self.size > 1:
            tensor = self.all_gather(tensor).amax(dim=0)
            if local:
                dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return tensor


class CountedView:
    """A :class:`FaultTolerantSyncGroup` as one of a process's optimizers sees it (a MoE model's
    dense and expert ones share a rank's Manager; their exchanges interleave within a round):
    the same group and collectives, with counters of its own (each sync reports its own bytes)."""

    _COLLECTIVES = ("all_reduce_sum", "all_to_all", "all_gather_into", "all_gather", "all_reduce_max_everywhere")

    def __init__(self, group: FaultTolerantSyncGroup):
        self._group = group
        self.counters = CommCounters()

    def __getattr__(self, name):  # size, rank, trained, contributors, dynamic, manager, ...
        attr = getattr(self._group, name)
        return self._counted(attr) if name in self._COLLECTIVES else attr

    def _counted(self, collective):
        def counted(*args, **kwargs):
            base = self._group.counters
            before = (base.collectives, base.payload_bytes)
            out = collective(*args, **kwargs)
            self.counters.collectives += base.collectives - before[0]
            self.counters.payload_bytes += base.payload_bytes - before[1]
            return out

        return counted


