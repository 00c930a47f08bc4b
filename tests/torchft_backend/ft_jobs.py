"""Fault-tolerant runs for the tests: a torchft Lighthouse in the test process and several
*jobs*, each its own ``torch.distributed`` world (the harness of :mod:`dist`, one file store per
job), started side by side so that one can be SIGKILLed and another started in its place.

``Job(fn, world_size, *args, **kwargs)`` starts ``fn(rank, world_size, *args, **kwargs)`` on
``world_size`` gloo ranks (fresh processes from :mod:`dist`'s forkserver); :meth:`Job.results`
waits for their return values (raising with the failing rank's traceback, or after a timeout),
:meth:`Job.kill` SIGKILLs every rank. Every test ends what it starts (``with jobs(...)``).

Inside a rank, :func:`job_store_address` gives the job's TCP store for torchft's Manager (rank 0
opens it on a port the OS picks and publishes it in the job's file store: no port is guessed)
and :func:`gate` waits until every worker has reached the same point (files in a directory).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import queue
import shutil
import tempfile
import time

import dist

_OPEN_STORES = []  # the TCP stores rank 0 of a job hosts (alive as long as the rank)


def lighthouse(min_replicas: int = 1, heartbeat_timeout_ms: int = 3000, join_timeout_ms: int = 200):
    """A torchft Lighthouse in this process, on a port the OS picks; ``.address()``, ``.shutdown()``."""
    from torchft._torchft import LighthouseServer

    return LighthouseServer(bind="127.0.0.1:0", min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            heartbeat_timeout_ms=heartbeat_timeout_ms)


class Job:
    """One worker's job: ``world_size`` ranks of ``fn`` in their own world (see the module)."""

    def __init__(self, fn, world_size: int, *args, timeout: float = 300, **kwargs):
        self.world_size = world_size
        self.timeout = timeout
        ctx = dist._context()
        self.queue = ctx.Queue()
        self.store_dir = tempfile.mkdtemp(prefix="megatron_edit_ftjob_")
        store = self.store = os.path.join(self.store_dir, "store")
        self.procs = [
            ctx.Process(target=dist._worker, args=(rank, world_size, store, timeout, "cpu", fn, args, kwargs,
                                                   self.queue), name=f"job-rank{rank}", daemon=True)
            for rank in range(world_size)
        ]
        for proc in self.procs:
            proc.start()
        self.deadline = time.monotonic() + timeout
        self._values = {}

    def results(self) -> list:
        """The ranks' return values in rank order (raises :class:`dist.RankError`)."""
        while not self.poll():
            pass
        return [self._values[r] for r in range(self.world_size)]

    def poll(self, wait: float = 0.5) -> bool:
        """Whether every rank has reported, after waiting up to ``wait`` seconds for one more
        (raises :class:`dist.RankError` when a rank failed or died, or at the timeout)."""
        if len(self._values) == self.world_size:
            return True
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise dist.RankError(f"timeout after {self.timeout}s; ranks "
                                 f"{sorted(set(range(self.world_size)) - set(self._values))} did not finish")
        try:
            rank, ok, payload = self.queue.get(timeout=min(remaining, wait))
        except queue.Empty:
            for rank, proc in enumerate(self.procs):
                if rank not in self._values and proc.exitcode not in (None, 0):
                    raise dist.RankError(dist._died(rank, proc, self.store))
            return False
        if not ok:
            raise dist.RankError(dist._failures(rank, payload, self.queue, self.procs, self.store, self._values))
        self._values[rank] = pickle.loads(payload)
        return len(self._values) == self.world_size


    @property
    def pids(self):
        return [p.pid for p in self.procs]

    def kill(self) -> None:
        """SIGKILL every rank still running and every process they started (Megatron's checkpoint
        writers: a node's death ends them all), and reap the ranks."""
        import signal

        for pid in _descendants([p.pid for p in self.procs if p.is_alive()]):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        dist._kill(self.procs)

    def close(self) -> None:
        self.kill()
        self.queue.close()
        shutil.rmtree(self.store_dir, ignore_errors=True)


def all_results(jobs) -> list:
    """Every job's :meth:`Job.results`, in order; raises as soon as any job fails (a job that
    failed is not left waiting behind another that waits for it)."""
    pending = list(jobs)
    while pending:
        pending = [job for job in pending if not job.poll(wait=0.2)]
    return [job.results() for job in jobs]


def _descendants(pids) -> list:
    """Every process below ``pids`` (Linux /proc; elsewhere none)."""
    children = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], list(pids)
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


@contextlib.contextmanager
def jobs_and_lighthouse(**lighthouse_kwargs):
    """``(lighthouse, start)``: ``start(fn, world_size, *args, **kwargs)`` starts a :class:`Job`;
    every job is killed and the Lighthouse shut down on exit."""
    server = lighthouse(**lighthouse_kwargs)
    started = []

    def start(fn, world_size, *args, **kwargs):
        job = Job(fn, world_size, *args, **kwargs)
        started.append(job)
        return job

    try:
        yield server, start
    finally:
        for job in started:
            job.close()
        server.shutdown()


def job_store_address():
    """(host, port) of a TCP store of this job for torchft's Manager (call on every rank)."""
    import torch.distributed as tdist

    files = tdist.distributed_c10d._get_default_store()
    if tdist.get_rank() == 0:
        store = tdist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        _OPEN_STORES.append(store)
        files.set("ft_job_store_port", str(store.port))
    return "127.0.0.1", int(files.get("ft_job_store_port").decode())


def gate(directory: str, name: str, expected: int, timeout: float = 120.0) -> None:
    """Mark ``name`` arrived in ``directory`` and wait until ``expected`` names have."""
    os.makedirs(directory, exist_ok=True)
    open(os.path.join(directory, name), "w").close()
    end = time.monotonic() + timeout
    while len(os.listdir(directory)) < expected:
        if time.monotonic() > end:
            raise TimeoutError(f"gate {directory}: {sorted(os.listdir(directory))} after {timeout}s")
        time.sleep(0.05)


def wait_file(path: str, timeout: float = 300.0, jobs=()) -> None:
    """Wait until ``path`` exists (a job's signal to another; TimeoutError after ``timeout``);
    a rank of ``jobs`` (the test process's jobs) that fails meanwhile raises its traceback, and
    a job that ends without writing it raises at once."""
    def written() -> bool:
        if os.path.exists(path):
            return True
        if any(job.poll(wait=0.0) for job in jobs) and not os.path.exists(path):
            raise AssertionError(f"a job ended without writing {path}")
        return False

    until(written, path, timeout=timeout)


def first_round_together(directory: str, name: str, expected: int) -> None:
    """Inside a job's rank: its first sync round waits at :func:`gate` until ``expected`` ranks
    have reached theirs (their Managers heartbeating, so that torchft's Lighthouse puts every
    worker in the first quorum instead of the first ``min_replicas`` to ask)."""
    from megatron_edit.exchange.fault_tolerant import FaultTolerantSyncGroup

    begin, first = FaultTolerantSyncGroup.begin, [True]

    def together(self, contributed, *args, **kwargs):
        if first[0]:
            first[0] = False
            gate(directory, name, expected, timeout=300.0)
        return begin(self, contributed, *args, **kwargs)

    FaultTolerantSyncGroup.begin = together


def lighthouse_status(address: str) -> tuple:
    """(the current quorum id, how many live workers have asked for the next quorum), read from
    the torchft Lighthouse's ``/status`` page at ``address``."""
    import re
    import urllib.request

    with urllib.request.urlopen(address.rstrip("/") + "/status", timeout=10) as reply:
        text = reply.read().decode()
    quorum = re.search(r"Current quorum_id: (\d+)", text)
    asking = re.search(r"\[(\d+)/\d+ participants healthy\]", text)
    if quorum is None or asking is None:
        raise AssertionError(f"the Lighthouse's /status page changed its form: {text[:500]!r}")
    return int(quorum.group(1)), int(asking.group(1))


def announce_quorum_requests(marker: str, lighthouse: str, count: int = 1) -> None:
    """Inside a job's rank: once each of its first ``count`` quorum requests has reached the
    Lighthouse (its ``/status`` shows a live worker asking, or a newer quorum), write ``marker``
    (``{n}`` in it: the request's number, from 1). The test's other jobs wait for the marker
    before they ask for their own next quorum. (Written before asking, it raced them: torchft's
    Lighthouse forms a quorum at once when every member of the last one asks, its "fast
    quorum", without a worker whose request has not arrived yet; that worker then waited for the
    next one, which the test's gates held back: a CI run hung there for 300 s.)"""
    import threading

    from torchft.manager import Manager

    start, made = Manager.start_quorum, [0]

    def announced(self, *args, **kwargs):
        made[0] += 1
        if made[0] <= count:  # watched from a thread: the request blocks until its quorum forms
            path, (before, _) = marker.format(n=made[0]), lighthouse_status(lighthouse)

            def arrived() -> bool:
                quorum, asking = lighthouse_status(lighthouse)
                return quorum > before or asking >= 1

            def watch():
                until(arrived, f"{path}'s quorum request at the Lighthouse", timeout=120.0)
                open(path, "w").close()

            threading.Thread(target=watch, daemon=True).start()
        return start(self, *args, **kwargs)

    Manager.start_quorum = announced


def events(ctl: str, worker: int, rank: int) -> list:
    """The JSON lines rank ``rank`` of worker ``worker``'s jobs logged in ``ctl``
    (``w<worker>-r<rank>-<pid>.jsonl``, one file per job), each with its job's ``pid``."""
    import glob
    import json

    lines = []
    for path in sorted(glob.glob(os.path.join(ctl, f"w{worker}-r{rank}-*.jsonl"))):
        pid = int(path.rsplit("-", 1)[1].split(".")[0])
        with open(path) as f:
            lines += [dict(json.loads(line), pid=pid) for line in f if line.endswith("}\n")]
    return lines


def until(predicate, what: str, jobs=(), timeout: float = 300.0) -> None:
    """Wait for ``predicate``; a rank of ``jobs`` that fails meanwhile raises its traceback."""
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise TimeoutError(f"waited {timeout}s for {what}")
        for job in jobs:
            job.poll(wait=0.0)
        time.sleep(0.1)


def fail_round(fail_at: int) -> None:
    """In a job's rank: the round of its ``fail_at``-th commit (the join round's is the first)
    fails here (an error reported to its Manager), so on the whole worker (a worker is one unit)."""
    from megatron_edit.exchange.fault_tolerant import FaultTolerantSyncGroup

    commit, calls = FaultTolerantSyncGroup.commit, [0]

    def failing(self):
        calls[0] += 1
        if calls[0] == fail_at:
            self.manager.report_error(RuntimeError("injected: this rank's round failed"))
        return commit(self)

    FaultTolerantSyncGroup.commit = failing


def fail_first_heal_transfer() -> None:
    """In a job's rank: its first heal transfer fails (a partial heal where the worker's other
    ranks receive theirs: none of them loads it)."""
    from torchft.checkpointing import HTTPTransport

    receive, failed = HTTPTransport.recv_checkpoint, []

    def fails_once(self, *args, **kwargs):
        if not failed:
            failed.append(True)
            raise ConnectionError("injected: this rank's heal transfer failed")
        return receive(self, *args, **kwargs)

    HTTPTransport.recv_checkpoint = fails_once
