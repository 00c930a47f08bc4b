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
after ``timeout`` seconds it raises :class:`SyncTimeout` naming them and the step. The keys of a
sync are ``<prefix>/<sync index>/<rank>``; the sync index is the count of syncs this object has
seen, the same on every worker, so keys of different syncs never mix. Each rank deletes its own
key of two syncs before (every peer has read it by then).
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Callable, List, Optional, Sequence

logger = logging.getLogger(__name__)


class SyncTimeout(TimeoutError):
    """A worker did not arrive at a sync within ``LocalSGDConfig.sync_timeout`` seconds."""


class Arrivals:
    """Arrival checks of one sync group (see the module docstring).

    ``store``: a ``torch.distributed`` Store (``set``, ``check``, ``wait``, ``delete_key``);
    ``ranks``: the sync group's global ranks, in worker order; ``me``: this rank's index in it
    (its worker). ``clock`` and ``wait_for(keys, seconds)`` (wait until the keys exist or the
    seconds have passed) are injectable for tests.
    """

    def __init__(self, store, prefix: str, ranks: Sequence[int], me: int, timeout: float,
                 report_every: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 wait_for: Optional[Callable[[List[str], float], None]] = None):
        self.store = store
        self.prefix = prefix
        self.ranks = list(ranks)
        self.me = me
        self.timeout = float(timeout)
        self.report_every = float(report_every)
        self.clock = clock
        self.wait_for = wait_for or self._store_wait
        self.index = 0
        self.last_wait = 0.0
        """Seconds this rank waited at the latest sync for the other workers to arrive."""

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

    def wait(self, step: int) -> float:
        """Announce this worker at the next sync (after its step ``step``) and wait for the
        others; returns the seconds waited, or raises :class:`SyncTimeout`."""
        index, self.index = self.index, self.index + 1
        self.store.set(self._key(index, self.ranks[self.me]), str(step))
        start = self.clock()
        missing: List[int] = [w for w in range(len(self.ranks)) if w != self.me]
        next_report = self.report_every
        while True:
            missing = [w for w in missing if not self.store.check([self._key(index, self.ranks[w])])]
            waited = self.clock() - start
            if not missing:
                break
            if waited >= self.timeout:
                raise SyncTimeout(
                    f"megatron_edit: worker {self.me} waited {waited:.0f} s at the sync after its step "
                    f"{step} (sync {index + 1}) for {_workers(missing)} (global rank"
                    f"{'s' if len(missing) > 1 else ''} {', '.join(str(self.ranks[w]) for w in missing)}), "
                    f"longer than --local-sgd-sync-timeout ({self.timeout:g} s): that worker is hung, dead or "
                    "far slower than planned. The job stops here; resume from the last checkpoint (raise "
                    "--local-sgd-sync-timeout if the worker is only slow)."
                )
            if waited >= next_report:
                logger.warning("megatron_edit: worker %d has waited %.0f s at the sync after its step %d for %s",
                               self.me, waited, step, _workers(missing))
                next_report += self.report_every
            keys = [self._key(index, self.ranks[w]) for w in missing]
            self.wait_for(keys, max(min(next_report, self.timeout) - waited, 0.001))
        if index >= 2:
            self.store.delete_key(self._key(index - 2, self.ranks[self.me]))
        self.last_wait = waited
        return waited


def _workers(indices: Sequence[int]) -> str:
    return ("worker " if len(indices) == 1 else "workers ") + ", ".join(map(str, indices))
