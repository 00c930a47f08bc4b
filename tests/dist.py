"""Multi-rank test harness: run a function on N CPU processes over gloo, with a hard timeout.

``run_ranks(fn, world_size, *args, **kwargs)`` spawns one process per rank. Each sets the usual
torch.distributed environment, limits itself to one thread, activates
:mod:`megatron_edit.cpu_adapter`, joins a gloo process group, runs
``fn(rank, world_size, *args, **kwargs)`` and sends the (picklable) return value back. The parent
returns the values in rank order, or kills every child and raises with the failing rank's
traceback as soon as one rank fails, dies, or the timeout passes, so a hung collective cannot
hang pytest. ``fn`` must be a top-level function (spawn pickles it by reference).
"""

import datetime
import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback


class RankError(RuntimeError):
    """A rank raised, died, or the run timed out; the message carries the child's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, timeout, fn, args, kwargs, results):
    # Runs in the child. Everything is reported through `results` as (rank, ok, payload).
    try:
        os.environ.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_RANK=str(rank),
        )
        import torch

        torch.set_num_threads(1)  # ranks share the machine's few cores
        from megatron_edit import cpu_adapter

        cpu_adapter.activate()
        # The process-group timeout makes a stuck collective fail in the child too.
        torch.distributed.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout)
        )
        try:
            value = fn(rank, world_size, *args, **kwargs)
        finally:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            torch.distributed.destroy_process_group()
        # Plain pickle copies tensor data; torch's shared-memory reduction would need this
        # process alive until the parent unpickles.
        results.put((rank, True, pickle.dumps(value)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))


def _kill(procs):
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=5)


def _failures(rank, payload, results, grace=1.0):
    """The first failure, plus any other rank's failure reported within `grace` seconds.

    The first to arrive is usually the cause; the others are often its echo (a peer's closed
    connection), listed after it.
    """
    lines = [f"rank {rank} failed:\n{payload}"]
    deadline = time.monotonic() + grace
    while (remaining := deadline - time.monotonic()) > 0:
        try:
            other, ok, text = results.get(timeout=remaining)
        except queue.Empty:
            break
        if not ok:
            lines.append(f"rank {other} also failed:\n{text}")
    return "\n".join(lines)


def run_ranks(fn, world_size, *args, timeout=120, **kwargs) -> list:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Returns the ranks' return values in rank order. Raises :class:`RankError` (with the child's
    traceback) if any rank raises or exits without reporting, or after ``timeout`` seconds.
    """
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(rank, world_size, port, timeout, fn, args, kwargs, results),
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
                        raise RankError(
                            f"rank {rank} exited with code {proc.exitcode} without reporting"
                        )
                continue
            if not ok:
                raise RankError(_failures(rank, payload, results))
            values[rank] = pickle.loads(payload)
        for proc in procs:
            proc.join(timeout=max(deadline - time.monotonic(), 1))
    finally:
        _kill(procs)
        results.close()
    return [values[rank] for rank in range(world_size)]
