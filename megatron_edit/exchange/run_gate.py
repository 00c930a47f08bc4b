"""The supervisor's store (``python -m megatron_edit.supervise``, the main job): where a torchft run's
workers meet at its start (:func:`start_gate`: the first sync holds every worker), say that they
have passed the run's last sync (:meth:`RunEnd.passed`) and what model they end with
(:func:`record_end`; the supervisor checks that there is one, :func:`models_at_the_end`). A TCP
store of the supervisor, named to every job it starts by :data:`START_GATE_ENV`.

A worker that comes after another has passed the run's last sync (a relaunch slower than the
others' last interval, a worker left out of the last sync) could only train alone from there and
end with another model: it stops, on every rank, with one line (:class:`RunAlreadyOver`), at the
start gate or at the sync it comes to, and the supervisor does not relaunch it."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Callable, Optional

from .job_processes import JOB_ENV


START_GATE_ENV = "MEGATRON_EDIT_FT_START_GATE"
"""Set by a supervisor (``python -m megatron_edit.supervise``, the main job) for every worker job
it starts: ``host:port:workers:timeout_s``, a TCP store of the supervisor where a run's first
sync waits for all its workers (:func:`start_gate`)."""


def start_gate_value(host: str, port: int, workers: int, timeout: float) -> str:
    """The value of :data:`START_GATE_ENV` for a store at ``host:port``."""
    return f"{host}:{port}:{workers}:{timeout:g}"


def _parse_gate(value: str):
    try:
        host, port, workers, timeout = value.rsplit(":", 3)
        return host, int(port), int(workers), float(timeout)
    except ValueError:
        raise RuntimeError(f"megatron_edit: {START_GATE_ENV}={value!r} is not host:port:workers:timeout_s "
                           "(the supervisor sets it; unset it to start without the gate).") from None


def _store(value: str, timeout: float):
    """A client of the supervisor's store named by ``value`` (:data:`START_GATE_ENV`'s)."""
    import torch.distributed as dist

    host, port, _, _ = _parse_gate(value)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout))


def supervised_workers(value: Optional[str]) -> Optional[int]:
    """The number of workers of a supervised run (``value``: :data:`START_GATE_ENV`'s); None
    without a supervisor."""
    return _parse_gate(value)[2] if value else None


def _end_key(replica_id: int, rank) -> str:
    return f"end/{replica_id}/{rank}"


class RunAlreadyOver(RuntimeError):
    """This worker comes (to the start gate, or to a sync) after another worker has passed the
    run's last sync without it: it could only train alone from there, and would end with another
    model. Raised on every rank of the worker at once; the message is one line (entry points
    print it once, from rank 0, exit code 1: :func:`megatron_edit.arguments.end_rank`)."""

    one_line = True


def _last_sync_key(replica_id: int) -> str:
    return f"last_sync/{replica_id}"


def past_the_last_sync(store, workers: int) -> list:
    """The workers (of ``workers``) that have passed the run's last sync (:meth:`RunEnd.passed`)
    or recorded their end (:func:`record_end`), in the supervisor's ``store``."""
    return [w for w in range(workers)
            if store.check([_last_sync_key(w)]) or store.check([_end_key(w, "ranks")])]


class RunEnd:
    """One rank's part in the run's end under the supervisor (``value``: :data:`START_GATE_ENV`'s):
    its worker says when it has passed the run's last sync (:meth:`passed`), and stops where a
    round shows that the others passed it without this worker (:meth:`stop_if_left_behind`)."""

    def __init__(self, value: str, replica_id: int):
        self.value, self.replica_id, self.workers = value, replica_id, supervised_workers(value)
        self.stopped = False
        """This worker stopped at :meth:`stop_if_left_behind` (it records no end: :func:`record_end`)."""
        self._store = None

    def store(self):
        if self._store is None:
            self._store = _store(self.value, 30.0)
        return self._store

    def passed(self, step: int) -> None:
        """This worker has passed the run's last sync (after step ``step``: committed, or given
        up): every rank says so at once, before anything else of the job's end (a validation, a
        checkpoint, :func:`record_end` at its exit). One key per worker: whichever of its ranks
        writes it first, it counts for the whole worker."""
        self.store().set(_last_sync_key(self.replica_id), str(step))

    def stop_if_left_behind(self, group, where: str) -> None:
        """After a round's quorum (``group``: this rank's
        :class:`~megatron_edit.exchange.fault_tolerant.FaultTolerantSyncGroup`; ``where``: the round,
        in words): where some worker has passed the run's last sync and is not in this round (this
        worker's relaunch came after it, or this worker was left out of it), this worker could only
        train alone from here and end with another model: :class:`RunAlreadyOver`, on every rank of
        it (they agree in one small all-reduce, whatever each read of the store)."""
        gone = lambda: [w for w in past_the_last_sync(self.store(), self.workers)  # noqa: E731
                        if w not in group.in_quorum]
        if group.worker_min_max([float(bool(gone()))])[1][0] == 0:
            return
        self.stopped = True
        raise RunAlreadyOver(
            f"megatron_edit: worker {self.replica_id} came to {where} after worker(s) {gone()} had passed the run's "
            "last sync without it: it could only train alone from here and end with another model, so it stops (not "
            "relaunched; the run exits 1).")


def record_end(value: Optional[str], replica_id: int, rank: int, world_size: int, digest: str) -> None:
    """At a worker job's end, rank ``rank`` of worker ``replica_id`` tells the supervisor's store
    (``value``: :data:`START_GATE_ENV`'s) the digest of the model it ends with (its shards), so
    that the supervisor can check that every worker ended with one model
    (:func:`models_at_the_end`). Nothing without ``value``."""
    if not value:
        return
    store = _store(value, 30.0)
    store.set(_end_key(replica_id, rank), digest)
    if rank == 0:
        store.set(_end_key(replica_id, "ranks"), str(world_size))


def models_at_the_end(store, workers: int) -> dict:
    """What :func:`record_end` left in ``store``: replica id -> the digests of its ranks, in rank
    order (workers whose job recorded no end are left out)."""
    ended = {}
    for w in range(workers):
        if store.check([_end_key(w, "ranks")]):
            ranks = int(store.get(_end_key(w, "ranks")))
            ended[w] = tuple(store.get(_end_key(w, r)).decode() if store.check([_end_key(w, r)]) else None
                             for r in range(ranks))
    return ended


def _too_late(store, workers: int, replica_id: int) -> tuple:
    """(the other workers that recorded their end, the workers that have passed the run's last sync)."""
    return ([w for w in range(workers) if w != replica_id and store.check([_end_key(w, "ranks")])],
            past_the_last_sync(store, workers))


def start_gate(value: Optional[str], replica_id: int, rank: int,
               agree: Optional[Callable[[bool], bool]] = None) -> None:
    """A run starts with all its workers: rank ``rank`` of worker ``replica_id`` marks itself
    arrived in the supervisor's store (``value``: :data:`START_GATE_ENV`'s) and waits until rank
    ``rank`` of every worker has, once in the run (a relaunched worker finds them all there and
    goes on at once). Call it after this rank's Manager is up and before its first quorum: the
    first quorum then holds every worker (torchft's Lighthouse forms a quorum once every
    heartbeating worker asks for it). Nothing without ``value``. After ``timeout_s`` without all
    of them: one line naming the missing workers.

    A worker that arrives after the run's end, or after some worker has passed the run's last
    sync, does not start (:class:`RunAlreadyOver`). ``agree(late)``: whether any rank of this
    worker found it late (a small all-reduce inside the worker; every rank calls it here), so
    that all its ranks stop, or none, even while another worker's ranks are recording it."""
    if not value:
        return
    _, _, workers, timeout = _parse_gate(value)
    if not 0 <= replica_id < workers:
        raise RuntimeError(
            f"megatron_edit: --local-sgd-replica-id {replica_id} is not one of the supervisor's {workers} "
            f"workers (0 .. {workers - 1}).")
    store = _store(value, max(timeout, 1.0))
    if (agree or bool)(any(_too_late(store, workers, replica_id))):
        ended, passed = _too_late(store, workers, replica_id)  # (what one rank found, every rank finds now)
        if ended:
            raise RunAlreadyOver(
                f"megatron_edit: worker {replica_id} arrives after the run's end (worker(s) {ended} ended it): it "
                "would train the run alone from its own start, so it does not start.")
        raise RunAlreadyOver(
            f"megatron_edit: worker {replica_id} arrives after the run's last sync (worker(s) {passed} passed it): it "
            "would train the run alone from its own start, so it does not start.")
    keys = [f"start/{rank}/{w}" for w in range(workers)]
    store.set(keys[replica_id], "1")
    try:
        store.wait(keys, timedelta(seconds=timeout))
    except Exception:  # noqa: BLE001 (TCPStore raises a plain timeout error)
        missing = [w for w, key in enumerate(keys) if not store.check([key])]
        raise RuntimeError(
            f"megatron_edit: the run's first sync waited {timeout:g} s for worker(s) {missing} (rank {rank}) to "
            "start; they did not (their jobs' output says why). Raise the supervisor's --start-timeout-s if "
            "they start slowly.") from None


def record_refusal(line: str) -> None:
    """A rank of a job the supervisor started refuses to run (a bad flag, an unreachable
    Lighthouse; ``line``: what it printed): it says so in the supervisor's store, under its job's
    tag (:data:`~megatron_edit.exchange.job_processes.JOB_ENV`), so the supervisor stops the run
    instead of relaunching the job (torchrun ends with exit code 1 whatever its ranks' codes).
    Nothing outside a supervised job, or when the store cannot be reached."""
    value, tag = os.environ.get(START_GATE_ENV), os.environ.get(JOB_ENV)
    if not value or not tag:
        return
    try:
        _store(value, 10.0).set(f"refused/{tag}", line)
    except Exception:  # noqa: BLE001 (the supervisor gone: nothing to tell; its relaunch limit ends the run)
        pass


def refusal(store, tag: str) -> Optional[str]:
    """What a rank of the job ``tag`` refused to run with (:func:`record_refusal`), or None."""
    key = f"refused/{tag}"
    return store.get(key).decode() if store.check([key]) else None


CLAIM_INTERVAL_S = 2.0
"""How often a job renews its claim on its replica id (:class:`ReplicaClaim`)."""


def claim_key(replica_id: int) -> str:
    return f"claim/{replica_id}"


class ReplicaClaim:
    """A worker's job holds its replica id in the supervisor's store while it lives (its rank 0):
    ``claim/<id>`` holds this job's token and a count that a daemon thread raises every
    ``interval`` seconds with a compare-and-set. Two live jobs with one id are found within
    seconds, whichever starts first: a job that finds the claim still renewed (by another token)
    refuses to start (:meth:`take`), and a job whose renewal finds another token there ends with
    one line (exit code 2). A claim left by a dead job stops being renewed; the supervisor
    deletes it when it ends the job (:func:`release_claim`)."""

    def __init__(self, store, replica_id: int, interval: float = CLAIM_INTERVAL_S):
        import socket
        import uuid

        self.store, self.replica_id, self.interval = store, replica_id, interval
        self.key = claim_key(replica_id)
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.value = ""
        self.stopped = None

    def _other(self, value: str) -> str:
        holder = value.split(" ")[0]
        return (f"megatron_edit: another job holds --local-sgd-replica-id {self.replica_id} ({holder}) and is alive: "
                "every worker needs its own id (a relaunched worker keeps its dead predecessor's).")

    def take(self) -> None:
        """Claim the id (raises RuntimeError naming it while another live job holds it: its claim
        was renewed within three intervals), then renew it in a daemon thread."""
        import threading
        import time

        found = self.store.compare_set(self.key, "", f"{self.token} 0").decode()
        if found != f"{self.token} 0":  # a claim is there: live if it is renewed meanwhile
            time.sleep(3 * self.interval)
            now = self.store.compare_set(self.key, found, f"{self.token} 0").decode()
            if now != f"{self.token} 0":
                raise RuntimeError(self._other(now))
        self.value = f"{self.token} 0"
        self.stopped = threading.Event()
        threading.Thread(target=self._renew, name="megatron_edit-replica-claim", daemon=True).start()

    def _renew(self) -> None:
        import sys

        count = 0
        while not self.stopped.wait(self.interval):
            count += 1
            try:
                now = self.store.compare_set(self.key, self.value, f"{self.token} {count}").decode()
            except Exception:  # noqa: BLE001 (the supervisor gone: nothing left to guard)
                return
            if now != f"{self.token} {count}":
                sys.stderr.write(self._other(now) + "\n")
                sys.stderr.flush()
                os._exit(2)
            self.value = now

    def stop(self) -> None:
        if self.stopped is not None:
            self.stopped.set()


def claim_replica_id(value: Optional[str], replica_id: int) -> Optional[ReplicaClaim]:
    """Rank 0 of a supervised worker's job: take its replica id (:class:`ReplicaClaim`) in the
    supervisor's store (``value``: :data:`START_GATE_ENV`'s); None without a supervisor."""
    if not value:
        return None
    claim = ReplicaClaim(_store(value, 30.0), replica_id)
    claim.take()
    return claim


def release_claim(store, replica_id: int) -> None:
    """The supervisor has ended worker ``replica_id``'s job: its claim goes with it."""
    store.delete_key(claim_key(replica_id))
