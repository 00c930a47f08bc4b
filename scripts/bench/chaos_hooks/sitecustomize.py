"""Fault injection for scripts/bench/bench_chaos.py: on PYTHONPATH of every process of a chaos
run (``MEGATRON_EDIT_CHAOS_DIR`` set), it wraps functions of the package and torchft as
their modules are imported; a trigger is a file in that folder, taken by the first process
that renames it (one event, one process):

* ``exchange-<worker>``: the next exchange of that worker (``FaultTolerantSyncGroup.all_reduce_sum``)
  SIGKILLs the rank that takes it, inside the exchange (torchrun then ends the job's others);
* ``heal-<worker>``: the next heal transfer of that worker's rank 1 (torchft's
  ``HTTPTransport.recv_checkpoint``) raises once (its other ranks' transfers succeed);
* ``hold-<worker>``: while it exists, that worker's ranks wait before each quorum
  (``FaultTolerantSyncGroup.begin``); each rank's quorum writes ``begun-<worker>-<pid>`` first
  (a test holds the others until a relaunched job is in its join round);
* ``hold-relaunch-<worker>``: while it exists, the ranks of a relaunched job of that worker (the
  supervisor's second start of it, or later) wait before their torchft Manager starts (so no
  quorum of the others waits for them; the start gate comes after), each writing
  ``starting-<worker>-<pid>`` first (a slow relaunch);
* ``hold-end-<worker>``: while it exists, that worker's ranks wait at their end before recording
  it in the supervisor's store (``torchft_round.record_end``, after the run's last sync and the
  job's own end), each writing ``ending-<worker>-<pid>`` first;
* ``slow-<worker>``: while it exists, each of that worker's ranks sleeps the milliseconds the
  file holds (a number; empty: 100) after each of its optimizer steps (``LocalSGD.end_step``):
  a straggler (A-EDiT gives it fewer steps per interval); not taken, every rank of the worker reads it;
* at each rank's end (``torchft_round.record_end``) the digest of its model is also written to
  ``end-w<worker>-r<rank>-<pid>``, read by the bench apart from the supervisor's own check.

Nothing here without the variable: the bench's processes only."""

import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time

CHAOS = os.environ.get("MEGATRON_EDIT_CHAOS_DIR")


def _take(name: str) -> bool:
    """Whether this process takes trigger ``name`` (an atomic rename: one taker)."""
    path = os.path.join(CHAOS, name)
    try:
        os.rename(path, f"{path}.taken-{os.getpid()}")
        return True
    except OSError:
        return False


def _replica_id():
    """This rank's worker: its --local-sgd-replica-id (the main job's ranks carry it)."""
    argv = sys.argv
    return next((argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--local-sgd-replica-id"), None)


def _patch_group(module) -> None:
    group = module.FaultTolerantSyncGroup
    reduce = group.all_reduce_sum

    def all_reduce_sum(self, tensor, async_op=True):
        if _take(f"exchange-{self.replica_id}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return reduce(self, tensor, async_op)

    group.all_reduce_sum = all_reduce_sum
    begin = group.begin

    def held_begin(self, contributed=True, *args, **kwargs):
        open(os.path.join(CHAOS, f"begun-{self.replica_id}-{os.getpid()}"), "w").close()
        while os.path.exists(os.path.join(CHAOS, f"hold-{self.replica_id}")):
            time.sleep(0.1)
        return begin(self, contributed, *args, **kwargs)

    group.begin = held_begin
    start_manager = module.start_manager

    def held_start_manager(*args, replica_id, **kwargs):
        if _relaunched():  # held before its Manager heartbeats: the others' quorums do not wait for it
            _held(f"hold-relaunch-{replica_id}", f"starting-{replica_id}-{os.getpid()}")
        return start_manager(*args, replica_id=replica_id, **kwargs)

    module.start_manager = held_start_manager


def _relaunched() -> bool:
    """This job is the supervisor's second start of its worker, or a later one."""
    return int(os.environ.get("MEGATRON_EDIT_JOB", "0.0.1").rsplit(".", 1)[1]) > 1


def _patch_transport(module) -> None:
    transport = module.HTTPTransport
    receive = transport.recv_checkpoint

    def recv_checkpoint(self, *args, **kwargs):
        worker, rank = _replica_id(), os.environ.get("RANK")
        if rank == "1" and worker is not None and _take(f"heal-{worker}"):
            raise ConnectionError("injected by bench_chaos: rank 1's heal transfer failed")
        return receive(self, *args, **kwargs)

    transport.recv_checkpoint = recv_checkpoint


def _held(name: str, announce: str) -> None:
    """Write ``announce``, then wait while trigger ``name`` exists."""
    open(os.path.join(CHAOS, announce), "w").close()
    while os.path.exists(os.path.join(CHAOS, name)):
        time.sleep(0.1)


def _patch_round(module) -> None:
    record = module.record_end

    def record_end(gate, replica_id, rank, world_size, digest):
        _held(f"hold-end-{replica_id}", f"ending-{replica_id}-{os.getpid()}")
        with open(os.path.join(CHAOS, f"end-w{replica_id}-r{rank}-{os.getpid()}"), "w") as f:
            f.write(digest)
        return record(gate, replica_id, rank, world_size, digest)

    module.record_end = record_end


def _patch_controller(module) -> None:
    controller = module.LocalSGD
    end_step = controller.end_step

    def slowed_end_step(self):
        worker = _replica_id()
        try:
            with open(os.path.join(CHAOS, f"slow-{worker}")) as f:
                time.sleep(float(f.read().strip() or 100) / 1e3)
        except OSError:  # (not armed, or removed: full speed)
            pass
        return end_step(self)

    controller.end_step = slowed_end_step


PATCHES = {"megatron_edit.exchange.fault_tolerant": _patch_group, "torchft.checkpointing.http_transport": _patch_transport,
           "megatron_edit.mcore.torchft_round": _patch_round, "megatron_edit.mcore.controller": _patch_controller}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs a patch right after its module has been executed."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


if CHAOS:
    sys.meta_path.insert(0, _AfterImport())
