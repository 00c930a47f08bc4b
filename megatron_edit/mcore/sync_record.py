"""The per-sync record (issue 59; ``LocalSGDConfig.sync_record``, ``--local-sgd-sync-record PATH``):
one JSON line per sync per worker, appended to a file, for a person, a dashboard or a later check
to read what each sync did. What a record says, field by field, is
:mod:`megatron_edit.exchange.record`'s (schema 1; docs/reference/sync-record.md).

**Where it is written.** The process's :class:`SyncRecord` is opened by the runtime when it builds
the first EDiT controller (:class:`~.controller.LocalSGD`) of a config with ``sync_record``, and
hands each controller a :class:`RecordFeed`, built from the parts of the controller it needs
(where it sits among the workers, its sync backend, its arrival checks). The controller calls it
with each sync's report when the sync ends (``_on_sync_done``); the feed never reads the
controller itself. The torchft backend's joins and heals come through the same sync backend
interface (``joining``, ``last_heal``). So every route writes it the same way: Megatron-LM's (the
flag), the main job (its ``--local-sgd-*`` flags become the configs), and the megatron-core API
(``LocalSGDConfig(sync_record=...)``).

**A worker's figures without a collective.** A record is a worker's, and a worker is many ranks:
its bytes are the sum over them, its wait is its slowest rank's. When every controller of a
process has reported a sync, the rank sets one key in the job's store (the rendezvous store the
arrival checks use, :mod:`megatron_edit.exchange.arrival`: one ``set``, nothing waited for)
holding its parts (:func:`~megatron_edit.exchange.record.rank_part`). The worker's first rank
(its lowest global rank) writes the record once every rank's key of that sync is there: it looks
(one ``check``, nothing waited for) whenever a sync of its own ends, so a record is written at
its sync's end or at a later one's, always in order, and the keys read are deleted. Nothing waits
while the run goes on, and nothing crosses workers. Only at the run's end, at the last sync (known
from ``set_train_iters``, Megatron-LM's ``--train-iters``, or A-EDiT's final sync), at
:func:`~megatron_edit.unpatch_megatron_for_local_sgd` and at the process's exit, does the writer
wait for what is missing, for at most :data:`END_WAIT_S` (:data:`EXIT_WAIT_S` at the exit): only
for its own worker's ranks, each of which reaches the same point anyway, and only once every
controller of its process is past the sync, so every collective of the sync has been issued by
the waiting rank and none of theirs can be held by it. A rank whose part is still missing then is
named in the record (``missing_ranks``), never left out in silence. What it costs a rank per
sync: one host read of a few numbers (its bytes, norms, residual), one ``set`` (not the writer, which
keeps its own parts once it knows it writes); the writer one ``check``, one ``multi_get`` and a
``delete_key`` per other rank of its worker, and one line.

**Which ranks make the worker.** Under the torch backend with several workers each rank writes
its worker's id into the store once, when its first controller is built, and a rank reads them
(without waiting) before its first record; with one worker, or under torchft (each worker its
own job), the worker is the job's world.

**A reader in the job.** One rank of the worker may read its worker's records as they are written
(Megatron-LM's logging rank, for its TensorBoard writer: :mod:`megatron_edit.training.record_log`
says why this way): it says so when its :class:`SyncRecord` is built (``reader``; one ``set`` in
the store, before any part of it), the writer looks once, at its first record, and from then on
sets each record it writes in the store too (one ``set``); the reader takes them (:meth:`take`:
one ``check`` per call, a ``get`` and a ``delete_key`` per record, nothing waited for until the
run's end). A reader that is the writer takes them in its process.

**The run id** every record carries: ``$MEGATRON_EDIT_RUN_ID`` where set (the supervisor sets one
for every worker job of a torchft run it starts); else the first rank to ask sets one in the job's
store (``compare_set``: every rank reads the same one), so the workers of a torch-backend job,
which share the store, share it. A torchft worker's job started without the supervisor has its
own store: give every such job the same ``MEGATRON_EDIT_RUN_ID`` (a warning says so).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import time
import weakref
from datetime import timedelta
from typing import Dict, List, Optional, Tuple

import torch.distributed as dist

from ..config import check_record_path
from ..exchange.groups import default_store
from ..exchange.record import FIELDS, RUN_ID_ENV, SCHEMA, agreed, combine, membership_events, new_run_id, rank_part
from .process_state import PROCESS

logger = logging.getLogger(__name__)

END_WAIT_S = 60.0
"""How long the writer waits, at the run's end, for its worker's ranks' parts of the last syncs."""
EXIT_WAIT_S = 5.0
"""How long it waits at the process's exit (the store may be going with the job)."""

_OPEN: "weakref.WeakSet[SyncRecord]" = weakref.WeakSet()
"""The records not closed yet: closed at the process's exit (:func:`_close_at_exit`)."""


class SyncRecord:
    """The per-sync record of one process's EDiT controllers (see the module): their feeds, this
    rank's parts in the job's store and, on the worker's first rank, the file.

    ``store``: the job's store (``set``, ``check``, ``multi_get``, ``wait``, ``delete_key``,
    ``compare_set``); ``worker_is_world``: every rank of the job is this worker's; ``session``:
    the same number on every rank of the job (keys of one record apart from another's)."""

    def __init__(self, path: str, worker: int, backend: str, store, rank: int, world: int, worker_is_world: bool,
                 session: int, end_wait: float = END_WAIT_S, reader: bool = False):
        self.path = check_record_path(path, worker)
        self.worker, self.backend, self.store, self.rank, self.world = worker, backend, store, rank, world
        self.prefix = f"megatron_edit/record/{session}"
        self.end_wait = end_wait
        self.run_id = agreed_run_id(store)
        self.feeds: List[RecordFeed] = []
        self._counts: List[int] = []  # per feed: the syncs it reported (the index of the next)
        self._delivered: Dict[int, Dict[int, tuple]] = {}
        """Sync index -> the feeds that reported it: (agreed fields, part)."""
        self._pending: List[tuple] = []
        """The writer's syncs not written yet, in order: (index, agreed fields, time, its own parts)."""
        self._ranks: Optional[List[int]] = list(range(world)) if worker_is_world else None
        """The worker's global ranks (None: not known yet, see :meth:`_is_writer`)."""
        self._writer: Optional[bool] = None if self._ranks is None else rank == self._ranks[0]
        self._syncs = 0
        self._before: Optional[List[int]] = None  # the previous record's participants (left / joined events)
        self.latest: Optional[dict] = None
        """The last record this rank wrote (a worker's first rank), for a reader in the process."""
        self._fd: Optional[int] = None
        self._closed = False
        self.reader = reader
        """This rank reads its worker's records as they are written (:meth:`take`)."""
        self._handover: Optional[bool] = None
        """The writer: whether another rank of its worker reads its records (None: not looked yet)."""
        self._taken: List[dict] = []
        """A reader that is the writer: the records written and not taken yet."""
        self._in_store: set = set()  # syncs whose parts this rank set in the store
        self._published = 0
        """The syncs this rank published its parts of (the records its reader waits for at the end)."""
        self._next_read = 0
        if reader:
            store.set(self._reader_key(), str(rank))
        if self._ranks is None:
            store.set(self._member_key(rank), str(worker))
        if backend == "torchft" and not os.environ.get(RUN_ID_ENV) and rank == 0:
            logger.warning("megatron_edit: --local-sgd-sync-record under torchft without %s: this worker's job "
                           "names its own run id (%s); give every worker's job the same one (the supervisor "
                           "does).", RUN_ID_ENV, self.run_id)
        _OPEN.add(self)

    @classmethod
    def open(cls, controller, reader: bool = False) -> "SyncRecord":
        """The record of the process whose first controller (with ``sync_record``) is
        ``controller``, in the job's store (a new key space per record: :data:`PROCESS`);
        ``reader``: this rank reads its worker's records (:meth:`take`)."""
        config, layout = controller.config, controller.layout
        torchft = config.sync_backend == "torchft"
        return cls(config.sync_record, config.replica_id if torchft else layout.worker, config.sync_backend,
                   default_store(), dist.get_rank(), dist.get_world_size(),
                   worker_is_world=torchft or layout.num_workers == 1, session=PROCESS.next_record_key(),
                   reader=reader)

    def feed(self, controller) -> "RecordFeed":
        """The feed of one more controller of this process (built before its first sync)."""
        feed = RecordFeed(self, len(self.feeds), controller.layout, controller.backend, controller.arrivals,
                          lambda: controller.config.exchange_topk_density)  # in force (auto_overlap changes it)
        self.feeds.append(feed)
        self._counts.append(0)
        return feed

    # ------------------------------------------------------------------ parts
    def _key(self, index: int, rank: int) -> str:
        return f"{self.prefix}/{self.worker}/{index}/{rank}"

    def _member_key(self, rank: int) -> str:
        return f"{self.prefix}/member/{rank}"

    def _reader_key(self) -> str:
        return f"{self.prefix}/reader/{self.worker}"

    def _read_key(self, index: int) -> str:
        return f"{self.prefix}/read/{self.worker}/{index}"

    def deliver(self, slot: int, fields: dict, part: dict, last: bool) -> None:
        """Feed ``slot`` reported its next sync: ``fields`` (:func:`~..exchange.record.agreed`, and
        ``join``), ``part`` (:func:`~..exchange.record.rank_part`); ``last``: the run's last sync.
        Once every feed has, the rank publishes its parts and the writer writes what it can."""
        if self._closed:
            return
        index, self._counts[slot] = self._counts[slot], self._counts[slot] + 1
        got = self._delivered.setdefault(index, {})
        got[slot] = (fields, part)
        if len(got) < len(self.feeds):
            return
        self._publish(index)
        self.flush(self.end_wait if last else 0.0, forced=last)

    def _publish(self, index: int) -> None:
        got = self._delivered.pop(index)
        slots = [got[s] for s in sorted(got)]
        parts = [part for _, part in slots]
        if self._writer is not True:  # the writer, once known, keeps its own parts (two round trips less)
            self.store.set(self._key(index, self.rank), json.dumps(parts))
            self._in_store.add(index)
        self._published = index + 1
        if self._writer is not False:
            fields = dict(slots[0][0], committed=all(f["committed"] for f, _ in slots))
            self._pending.append((index, fields, time.time(), parts))

    # ------------------------------------------------------------------ the writer
    def flush(self, wait: float, forced: bool = False) -> None:
        """Write every pending record whose parts are all in the store, in order. ``forced``: wait
        up to ``wait`` seconds for the missing ones, then write naming the ranks still missing."""
        deadline = time.monotonic() + wait
        if not self._is_writer(deadline, forced):
            return
        while self._pending:
            index, fields, when, mine = self._pending[0]
            collected = self._collect(index, [r for r in self._ranks if r != self.rank], deadline, forced)
            if collected is None:
                return
            parts, missing = collected
            self._pending.pop(0)
            self._write(index, fields, when, {self.rank: mine, **parts}, missing)

    def _missing(self, keys: List[str], deadline: float, forced: bool) -> Optional[List[str]]:
        """Those of ``keys`` not in the store ([]: all there). Not ``forced``: one ``check``, and None
        while some are missing; ``forced``: they are waited for until ``deadline``, then listed."""
        if not keys or self.store.check(keys):
            return []
        if not forced:
            return None
        remaining = deadline - time.monotonic()
        if remaining > 0:
            try:
                self.store.wait(keys, timedelta(seconds=remaining))
            except RuntimeError as error:  # DistStoreError, or a wrapped store's plain "Wait timeout"
                if "timeout" not in str(error).lower():
                    raise
        return [] if self.store.check(keys) else [k for k in keys if not self.store.check([k])]

    def _is_writer(self, deadline: float, forced: bool) -> bool:
        """Whether this rank is its worker's first (learnt once from the ranks' worker ids in the
        store; False while some are missing, unless ``forced``: then the ranks known)."""
        if self._writer is not None:
            return self._writer
        keys = [self._member_key(r) for r in range(self.world)]
        missing = self._missing(keys, deadline, forced)
        if missing is None:
            return False
        missing = set(missing)
        known = [r for r, k in enumerate(keys) if k not in missing]
        ids = self.store.multi_get([keys[r] for r in known])
        ranks = [r for r, w in zip(known, ids) if int(w) == self.worker]
        writer = ranks[0] == self.rank
        if not writer:
            self._pending.clear()
        if missing:  # (forced) the ranks whose worker is not known are named in every record as missing
            self._ranks = sorted(ranks + [int(k.rpartition("/")[2]) for k in missing])
            return writer
        self._ranks, self._writer = ranks, writer
        return writer

    def _collect(self, index: int, others: List[int], deadline: float, forced: bool
                 ) -> Optional[Tuple[Dict[int, list], List[int]]]:
        """The parts of sync ``index`` of ``others`` and the ranks missing, keys read deleted; None
        while some are missing (not ``forced``)."""
        keys = {r: self._key(index, r) for r in others}
        try:
            gone = self._missing(list(keys.values()), deadline, forced)
            if gone is None:
                return None
            gone = set(gone)
            present = [r for r in others if keys[r] not in gone]
            values = self.store.multi_get([keys[r] for r in present]) if present else []
            for r in present:
                self.store.delete_key(keys[r])
            if index in self._in_store:  # (the writer's own, until it knew it was the writer)
                self._in_store.discard(index)
                self.store.delete_key(self._key(index, self.rank))
        except Exception as error:  # noqa: BLE001 (forced: the store may have gone with the job's end)
            if not forced:
                raise
            logger.warning("megatron_edit: the sync record of worker %d could not read its ranks' parts (%s): "
                           "written with this rank's alone.", self.worker, error)
            return {}, sorted(others)
        return {r: json.loads(v) for r, v in zip(present, values)}, sorted(r for r in others if keys[r] in gone)

    def _write(self, index: int, fields: dict, when: float, parts: Dict[int, list], missing: List[int]) -> None:
        fields = dict(fields)
        kind = "join" if fields.pop("join") else "sync"
        self._syncs += kind == "sync"
        figures = combine(parts)
        events = membership_events(self._before, fields["participants"]) + figures.pop("events")
        self._before = fields["participants"] or self._before
        record = dict(schema=SCHEMA, kind=kind, run_id=self.run_id, worker=self.worker,
                      sync=self._syncs if kind == "sync" else None, time=round(when, 3), backend=self.backend,
                      **fields, **figures, events=events, ranks=len(self._ranks), missing_ranks=missing)
        self.latest = {name: record[name] for name in FIELDS}
        line = json.dumps(self.latest, separators=(",", ":")) + "\n"
        if self._fd is None:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(self._fd, line.encode())  # one write per line: workers appending to one file do not mix
        self._hand_over(index, self.latest)

    # ------------------------------------------------------------------ the reader
    def _hand_over(self, index: int, record: dict) -> None:
        """The writer: ``record`` (of sync ``index``) to its worker's reader, if it has one."""
        if self.reader:
            self._taken.append(record)
            return
        if self._handover is None:  # the reader said so before its first part, which this record holds
            self._handover = self.store.check([self._reader_key()])
        if self._handover:
            self.store.set(self._read_key(index), json.dumps(record))

    def take(self, wait: float = 0.0) -> List[dict]:
        """The reader (:attr:`reader`): its worker's records written since the last call, in
        order, without waiting. ``wait`` (the run's end): up to that long for the records of every
        sync this rank published; a warning names those that still did not come (they are in the
        file)."""
        if not self.reader or self._closed:
            return []
        if wait and self._writer is not False:  # the writer (or not known yet): what it still holds
            self.flush(wait, forced=True)
        taken, self._taken = self._taken, []
        if self._writer:
            return taken
        try:
            if wait and self._next_read < self._published:
                self._missing([self._read_key(i) for i in range(self._next_read, self._published)],
                              time.monotonic() + wait, forced=True)
            while self.store.check([self._read_key(self._next_read)]):
                key = self._read_key(self._next_read)
                taken.append(json.loads(self.store.get(key)))
                self.store.delete_key(key)
                self._next_read += 1
        except Exception as error:  # noqa: BLE001 (the end: the store may have gone with the job)
            if not wait:
                raise
            logger.warning("megatron_edit: rank %d could not read worker %d's sync records (%s).",
                           self.rank, self.worker, error)
        if wait and self._next_read < self._published:
            logger.warning("megatron_edit: rank %d did not get %d of worker %d's sync records (from its sync %d on) "
                           "within %g s: they are in %s only.", self.rank, self._published - self._next_read,
                           self.worker, self._next_read + 1, wait, self.path)
        return taken

    def close(self, wait: Optional[float] = None) -> None:
        """The end: publish what the controllers reported (a sync some of them did not report:
        theirs), write every pending record (waiting up to ``wait``, default :attr:`end_wait`,
        for missing parts) and close the file."""
        if self._closed:
            return
        for index in sorted(self._delivered):
            self._publish(index)
        try:
            self.flush(self.end_wait if wait is None else wait, forced=True)
        finally:
            self._closed = True
            _OPEN.discard(self)
            if self._fd is not None:
                os.close(self._fd)
            if self._pending:  # (the store went before this rank knew its worker's ranks)
                logger.warning("megatron_edit: %d sync record(s) of rank %d not written: its worker's first rank "
                               "could not be told (the job's store is gone).", len(self._pending), self.rank)


class RecordFeed:
    """One controller's feed of the :class:`SyncRecord`: called with each sync's report."""

    def __init__(self, record: SyncRecord, slot: int, layout, backend, arrivals, topk_density):
        """``topk_density``: a function giving the top-k density in force (None: dense)."""
        self.record, self.slot, self.backend, self.arrivals, self.topk_density = (
            record, slot, backend, arrivals, topk_density)
        self.representative = layout.intra_rank == 0 and (layout.tp_group is None or dist.get_rank(layout.tp_group) == 0)
        """The first rank of this optimizer's model-shard and tensor-parallel groups: it adds the
        layers of its pipeline stage (every rank of them holds the same figures)."""

    def __call__(self, report, last_step: Optional[int]) -> None:
        """The sync of ``report`` ended on this rank; ``last_step``: the run's last step if known."""
        began = time.perf_counter()
        group = self.backend.sync_group
        ids = list(getattr(group, "replica_ids", None) or range(report.workers))
        trained = getattr(group, "trained", None)  # the torchft backend: who trained since the last sync
        trained = [bool(t) for t in trained.tolist()] if trained is not None else [True] * len(ids)
        fields = agreed(report, ids, trained, self.topk_density())
        if len(set(ids)) < len(ids):  # torchft: the round failed before its workers could say who they are
            fields["participants"] = fields["trained"] = None
        fields["join"] = bool(self.backend.joining)
        heal = self.backend.last_heal if self.slot == 0 else None  # (one round per process)
        wait = self.backend.arrival_wait if self.arrivals is None else self.arrivals.last_wait
        part = rank_part(report, trained, ids, self.representative, wait, heal, began)
        last = bool(report.final) or (last_step is not None and report.step >= last_step)
        fields["last_sync"] = last
        self.record.deliver(self.slot, fields, part, last)


def agreed_run_id(store) -> str:
    """``$MEGATRON_EDIT_RUN_ID``, else the one the job's ranks agree on in ``store`` (the first to
    ask sets it; see the module)."""
    given = os.environ.get(RUN_ID_ENV)
    if given:
        return given
    value = store.compare_set("megatron_edit/record/run_id", "", new_run_id())
    return value.decode() if isinstance(value, bytes) else str(value)


@atexit.register
def _close_at_exit() -> None:
    for record in list(_OPEN):
        try:
            record.close(EXIT_WAIT_S)
        except Exception as error:  # noqa: BLE001 (the interpreter is ending: say it, do not raise)
            logger.warning("megatron_edit: the sync record of rank %d could not be finished at exit: %s",
                           record.rank, error)
