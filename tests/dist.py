"""Multi-rank test harness: run a function on N CPU processes over gloo, with a hard timeout.

``run_ranks(fn, world_size, *args, **kwargs)`` starts one process per rank. Each sets the usual
torch.distributed environment, limits itself to one thread, activates
:mod:`megatron_edit.cpu.adapter`, joins a gloo process group, runs
``fn(rank, world_size, *args, **kwargs)`` and sends the (picklable) return value back. The parent
returns the values in rank order, or kills every child and raises with the failing rank's
traceback as soon as one rank fails, dies, or the timeout passes, so a hung collective cannot
hang pytest. ``fn`` must be a top-level function (it is pickled by reference).

Ranks are fresh interpreters, never forks of the pytest process (whose torch may be patched by
an in-process test). By default they are forked from multiprocessing's forkserver, a clean
process that has imported torch and megatron.core once: that saves each rank the 3-5 s CPU import
(4 ranks on 2 cores: about 16-20 s per run with "spawn", 1-2 s with the forkserver after the
first). Set MEGATRON_EDIT_TEST_START_METHOD=spawn to start every rank from scratch instead.
"""

import datetime
import faulthandler
import multiprocessing
import os
import pickle
import queue
import shutil
import tempfile
import time
import traceback

START_METHOD = os.environ.get("MEGATRON_EDIT_TEST_START_METHOD", "forkserver")
# Imported once by the forkserver; a name that fails to import is skipped by multiprocessing.
_PRELOAD = [
    "torch",
    "megatron.core.distributed",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.pipeline_parallel",
    "megatron_edit.cpu.adapter",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # (the adapter wraps its writer's queue)
]


class RankError(RuntimeError):
    """A rank raised, died, or the run timed out; the message carries the child's traceback."""


def _worker(rank, world_size, store_path, timeout, device, fn, args, kwargs, results):
    # Runs in the child. Everything is reported through `results` as (rank, ok, payload).
    message = None
    # A rank killed by a fatal signal (a C++ abort or a segfault in gloo) leaves the Python stack
    # of every thread in its own file, which the parent puts into the error (the rank's stderr
    # is the forkserver's, which pytest does not capture for this test).
    global _FAULT_FILE
    _FAULT_FILE = open(_fault_path(store_path, rank), "w")
    faulthandler.enable(file=_FAULT_FILE, all_threads=True)
    try:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
        import torch

        torch.set_num_threads(1)  # ranks share the machine's few cores
        if device == "cuda":  # the GPU lane: real CUDA, NCCL, one process per GPU
            torch.cuda.set_device(rank % torch.cuda.device_count())
            backend = "nccl"
        else:
            from megatron_edit.cpu import adapter as cpu_adapter

            # (with the check of asynchronous collectives: conftest.py sets it for every process)
            cpu_adapter.activate()
            backend = "gloo"
        # The process-group timeout makes a stuck collective fail in the child too.
        # A file store: no TCP port to pick, so no race with other jobs on a busy machine.
        torch.distributed.init_process_group(
            backend, init_method=f"file://{store_path}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout),
        )
        value = fn(rank, world_size, *args, **kwargs)
        # Plain pickle copies tensor data; torch's shared-memory reduction would need this
        # process alive until the parent unpickles.
        message = (rank, True, pickle.dumps(value))
    except BaseException:
        # Report before tearing down the process group: that makes the peers fail too, and the
        # parent should hear the cause first, not its echo.
        results.put((rank, False, traceback.format_exc()))
    try:
        _cleanup()
    except BaseException:
        if message is not None:
            message = (rank, False, traceback.format_exc())
    if message is not None:
        results.put(message)


_FAULT_FILE = None


def _fault_path(store_path, rank):
    return f"{store_path}.rank{rank}.fault"


def _died(rank, proc, store_path):
    """One line for a rank that exited without reporting, with the stacks it left if a fatal
    signal killed it."""
    line = f"rank {rank} exited with code {proc.exitcode} without reporting"
    try:
        with open(_fault_path(store_path, rank)) as f:
            stacks = f.read().strip()
    except OSError:
        stacks = ""
    return f"{line}; its stacks:\n{stacks}" if stacks else line


def _cleanup():
    import sys

    import torch

    if "megatron.core.parallel_state" in sys.modules:
        sys.modules["megatron.core.parallel_state"].destroy_model_parallel()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _context():
    ctx = multiprocessing.get_context(START_METHOD)
    if START_METHOD == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)  # takes effect when the server first starts
    return ctx


def _kill(procs):
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5)


def _failures(rank, payload, results, procs, store_path, finished=(), grace=10.0):
    """The first failure, plus every other rank's failure reported within `grace` seconds, and
    the exit code of any rank that died without reporting.

    The first to arrive is usually the cause; the others are often its echo (a peer's closed
    connection), listed after it. Not always: a rank's report goes through its queue's feeder
    thread, which a loaded machine may delay past a peer's echo, and a rank killed by a signal
    reports nothing; so the parent waits for every rank that has not finished, or `grace`.
    """
    lines = [f"rank {rank} failed:\n{payload}"]
    heard = {rank, *finished}
    deadline = time.monotonic() + grace
    while len(heard) < len(procs) and (remaining := deadline - time.monotonic()) > 0:
        try:
            other, ok, text = results.get(timeout=min(remaining, 0.5))
        except queue.Empty:
            if all(proc.exitcode is not None for r, proc in enumerate(procs) if r not in heard):
                break
            continue
        heard.add(other)
        if not ok:
            lines.append(f"rank {other} also failed:\n{text}")
    for other, proc in enumerate(procs):
        if other not in heard and proc.exitcode not in (None, 0):
            lines.append(_died(other, proc, store_path))
    return "\n".join(lines)


def run_ranks(fn, world_size, *args, timeout=120, device="cpu", **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    ``device="cuda"``: no CPU adapter, NCCL, rank r on GPU r (the GPU lane, tests/cuda).
    Returns the ranks' return values in rank order. Raises :class:`RankError` (with the child's
    traceback, or its signal and the fault handler's report) if any rank raises or exits without
    reporting, or after ``timeout`` seconds. A job runs once: the native crash that runs used to
    repeat (torch's gloo status race, issue 62) is gone under the CPU adapter
    (:mod:`megatron_edit.cpu.gloo_threads`), so a crash now is a defect to find, never rerun.
    """
    ctx = _context()
    results = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="megatron_edit_store_")
    store_path = os.path.join(store_dir, "store")
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, store_path, timeout, device, fn, args, kwargs, results),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    values = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise RankError(f"timeout after {timeout}s; ranks {missing} did not finish")
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                for rank, proc in enumerate(procs):
                    if rank not in values and proc.exitcode not in (None, 0):
                        raise RankError(_died(rank, proc, store_path))
                continue
            if not ok:
                raise RankError(_failures(rank, payload, results, procs, store_path, values))
            values[rank] = pickle.loads(payload)
        for proc in procs:
            proc.join(timeout=max(deadline - time.monotonic(), 1))
    finally:
        _kill(procs)
        results.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    return [values[rank] for rank in range(world_size)]
