"""Arrival at a sync: a worker that does not come is named, within a set time.

Every collective of a sync waits for the slowest worker. A worker that hangs (a stuck data
loader, a lost link) or runs far slower than A-EDiT planned would otherwise leave the others
blocked in the sync's first collective until the process group's own timeout (30 minutes by
default in torch, 10 in Megatron-LM), which then says nothing about who was missing.

Before a sync's first collective each rank writes one key into the job's key-value store (the
rendezvous store every ``torch.distributed`` job has; no extra connection) and waits until the
ranks of the other workers holding the same shard (its sync group) have written theirs (the
store's own blocking ``wait``, so the last arrival is seen at once, without polling). While it
waits it reports, every ``report_every`` seconds, how long it has waited and for which workers;
after ``timeout`` seconds it raises :class:`SyncTimeout`. The keys of a sync are
``<prefix>/<sync index>/<rank>``; the sync index is the count of syncs this object has seen, the
same on every worker, so keys of different syncs never mix. Each rank deletes its own key of two
syncs before (every peer has read it by then).

Who is named: the ranks of the whole job (``job_ranks``, every rank that arrives at each sync)
whose key is missing when the time is up, with their workers (each rank writes its worker into
the store once, at start). A rank waits only for its own sync group, and a healthy rank of the
stopped worker (held up in the worker's own collectives by the rank that stopped) is as missing
as that one: naming only the sync group's missing rank blamed it while it waited. Every waiting
rank raises, with the same line; :attr:`SyncTimeout.reporter` is True on one of them (the lowest
rank that arrived), so an entry point can print the line once and end the other ranks quietly.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Callable, List, Optional, Sequence

logger = logging.getLogger(__name__)


#: A sync timeout below this many seconds is warned about when the checks are built: a worker a
#: little late (a data loader's hiccup, garbage collection, a checkpoint save) would stop the job.
SHORT_TIMEOUT_S = 5.0


class SyncTimeout(TimeoutError):
    """A worker did not arrive at a sync within ``LocalSGDConfig.sync_timeout`` seconds. The
    message is one line naming the missing ranks and their workers; ``reporter``: whether this
    rank is the one that should print it (the lowest rank of the job that arrived)."""

    def __init__(self, message: str, reporter: bool = True, missing: Sequence[int] = ()):
        super().__init__(message)
        self.reporter = reporter
        self.missing = list(missing)
        """Global ranks of the job that did not arrive."""


class Arrivals:
    """Arrival checks of one sync group (see the module docstring).

    ``store``: a ``torch.distributed`` Store (``set``, ``check``, ``get``, ``wait``,
    ``delete_key``); ``ranks``: the sync group's global ranks, in worker order; ``me``: this
    rank's index in it (its worker); ``job_ranks``: every rank of the job that arrives at each
    sync (default: ``ranks``), checked when the time is up. ``clock`` and
    ``wait_for(keys, seconds)`` (wait until the keys exist or the seconds have passed) are
    injectable for tests.
    """

    def __init__(self, store, prefix: str, ranks: Sequence[int], me: int, timeout: float,
                 report_every: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 wait_for: Optional[Callable[[List[str], float], None]] = None,
                 job_ranks: Optional[Sequence[int]] = None):
        self.store = store
        self.prefix = prefix
        self.ranks = list(ranks)
        self.me = me
        self.job_ranks = sorted(job_ranks) if job_ranks is not None else sorted(self.ranks)
        self.timeout = float(timeout)
        self.report_every = float(report_every)
        self.clock = clock
        self.wait_for = wait_for or self._store_wait
        self.index = 0
        self.last_wait = 0.0
        """Seconds this rank spent at the latest sync's arrival check: waiting for the other
        workers to arrive, and its own announcement and clean-up in the store (what the check
        holds the step, the record's ``arrival_wait_seconds``)."""
        self._warned_close = False
        self.store.set(self._worker_key(self.ranks[me]), str(me))  # read only to name a missing rank

    def _store_wait(self, keys: List[str], seconds: float) -> None:
        """Block in the store until ``keys`` exist or ``seconds`` have passed (then return: the
        caller checks which are still missing)."""
        try:
            self.store.wait(keys, datetime.timedelta(seconds=seconds))
        except RuntimeError as e:  # DistStoreError, or a wrapped store's plain "Wait timeout"
            if "timeout" not in str(e).lower():
                raise  # the store itself failed: not a missing worker

    def _key(self, index: int, rank: int) -> str:
        return f"{self.prefix}/{index}/{rank}"

    def _worker_key(self, rank: int) -> str:
        return f"{self.prefix}/worker/{rank}"

    def _worker_of(self, rank: int) -> Optional[int]:
        if rank in self.ranks:  # this sync group's ranks are in worker order
            return self.ranks.index(rank)
        key = self._worker_key(rank)
        return int(self.store.get(key)) if self.store.check([key]) else None

    def _missing(self, index: int, ranks: Sequence[int]) -> List[int]:
        """Those of ``ranks`` without their key of sync ``index``: halves checked whole (one
        ``check`` of many keys), so a few missing ranks among thousands cost a few checks."""
        if not ranks or self.store.check([self._key(index, r) for r in ranks]):
            return []
        if len(ranks) == 1:
            return list(ranks)
        half = len(ranks) // 2
        return self._missing(index, ranks[:half]) + self._missing(index, ranks[half:])

    def _timeout(self, index: int, step: int, waited: float) -> SyncTimeout:
        """The error when the time is up: the job's ranks that did not arrive, by worker."""
        missing = self._missing(index, self.job_ranks)
        gone = set(missing)
        arrived = [r for r in self.job_ranks if r not in gone]
        by_worker: dict = {}
        for rank in missing:
            by_worker.setdefault(self._worker_of(rank), []).append(rank)
        named = "; ".join(
            f"{'a worker not known' if w is None else f'worker {w}'} (global "
            f"rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})"
            for w, r in sorted(by_worker.items(), key=lambda item: (item[0] is None, item[0] or 0)))
        held = any(len(r) > 1 for r in by_worker.values())
        return SyncTimeout(
            f"megatron_edit: sync {index + 1} (after step {step}): {named} did not arrive within "
            f"--local-sgd-sync-timeout ({self.timeout:g} s; worker {self.me} waited {waited:.0f} s for "
            f"{'them' if len(by_worker) > 1 else 'it'}): hung, dead or far slower than planned"
            + (" (one stopped rank holds up the other ranks of its worker in the worker's collectives)"
               if held else "")
            + ". The job stops here; resume from the last checkpoint (raise --local-sgd-sync-timeout "
            "if the worker is only slow).",
            reporter=bool(arrived) and arrived[0] == self.ranks[self.me],
            missing=missing,
        )

    def wait(self, step: int) -> float:
        """Announce this worker at the next sync (after its step ``step``) and wait for the
        others; returns the seconds waited, or raises :class:`SyncTimeout`."""
        index, self.index = self.index, self.index + 1
        start = self.clock()
        self.store.set(self._key(index, self.ranks[self.me]), str(step))
        missing: List[int] = [w for w in range(len(self.ranks)) if w != self.me]
        next_report = self.report_every
        while True:
            missing = [w for w in missing if not self.store.check([self._key(index, self.ranks[w])])]
            waited = self.clock() - start
            if not missing:
                break
            if waited >= self.timeout:
                raise self._timeout(index, step, waited)
            if waited >= next_report:
                logger.warning("megatron_edit: worker %d has waited %.0f s at the sync after its step %d for %s",
                               self.me, waited, step, _workers(missing))
                next_report += self.report_every
            keys = [self._key(index, self.ranks[w]) for w in missing]
            self.wait_for(keys, max(min(next_report, self.timeout) - waited, 0.001))
        if index >= 2:
            self.store.delete_key(self._key(index - 2, self.ranks[self.me]))
        self.last_wait = self.clock() - start  # all of it: the announcement and the clean-up too
        if waited > self.timeout / 2 and not self._warned_close:
            self._warned_close = True
            logger.warning(
                "megatron_edit: worker %d waited %.1f s for the other workers at sync %d (after step %d), "
                "more than half of --local-sgd-sync-timeout (%g s): a little more and the job stops; "
                "raise the timeout well above the waits this job has.", self.me, waited, index + 1, step,
                self.timeout)
        return waited


def _workers(indices: Sequence[int]) -> str:
    return ("worker " if len(indices) == 1 else "workers ") + ", ".join(map(str, indices))


def short_timeout_warning(timeout: float) -> Optional[str]:
    """The start-up warning for a sync timeout below :data:`SHORT_TIMEOUT_S` (None: no warning)."""
    if timeout >= SHORT_TIMEOUT_S:
        return None
    return (f"megatron_edit: --local-sgd-sync-timeout {timeout:g} s is below {SHORT_TIMEOUT_S:g} s: a "
            "worker only a little late at a sync (a data loader's hiccup, garbage collection, a "
            "checkpoint save) stops the job. Give it well above the longest wait you expect.")
