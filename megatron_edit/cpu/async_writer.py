"""Megatron's checkpoint writers on CPU: the persistent writer of ``--async-save`` and the results
queue of every ``torch_dist`` save.

megatron-core starts the persistent writer (``--async-save --use-persistent-ckpt-worker``) as a
*spawned* process (``PersistentAsyncCaller.async_loop``), a fresh interpreter where the CPU
adapter is not active; its first line selects a CUDA device
(``torch.cuda.set_device(rank % torch.cuda.device_count())``), which on a machine without a GPU
divides by zero, and its preload of each save waits for the GPU (``torch.cuda.synchronize``);
the training ranks then wait forever for a writer that died. The adapter
starts :func:`async_loop_on_cpu` instead (a function of this module, so the spawned process
imports it by name): it makes the writer's device selection and waits inert, as the adapter does in the
training ranks, and runs megatron-core's own loop. The tensors it writes are already on the CPU.

Every ``torch_dist`` save (``FileSystemWriterAsync``) collects its write results in the queue of
a multiprocessing Manager that megatron-core *spawns* at a process's first save (spawned, not
forked, because a fork of a process that has initialised CUDA is unsafe): a fresh interpreter
that imports torch to unpickle the results, 6-7 s per rank on 2 busy cores (a 4-rank save of the
tests' model: 8.5 s, 1.2 s with a fork). Without CUDA that reason is gone: the adapter has the
Manager forked from the rank (:func:`forked_results_queue`), torch already imported: the same
queue, the same writes. It also ends with the rank that started it, even one killed by a signal
(Linux: its parent-death signal), where a spawned one is left behind.
"""

from __future__ import annotations

import functools

from ..mcore.wrap_registry import Patch, PatchRegistry, VersionRange

_STRATEGIES = "megatron.core.dist_checkpointing.strategies."


def async_loop_on_cpu(*args, **kwargs):
    """megatron-core's ``PersistentAsyncCaller.async_loop`` in a process without a GPU."""
    import torch
    from megatron.core.dist_checkpointing.strategies.async_utils import PersistentAsyncCaller

    if torch.cuda.is_available():  # never on a GPU: the adapter refuses to start there
        raise RuntimeError("megatron_edit.cpu.async_writer must never run where CUDA is available")
    torch.cuda.device_count = lambda: 1
    torch.cuda.set_device = lambda device: None
    torch.cuda.current_device = lambda: torch.device("cpu")
    torch.cuda.synchronize = lambda device=None: None  # after the preload's copies to the CPU
    return PersistentAsyncCaller.async_loop(*args, **kwargs)


def die_with_the_parent() -> None:
    """In a process the rank forked: SIGKILL it when the rank's thread that forked it ends
    (prctl PR_SET_PDEATHSIG, Linux; elsewhere nothing). The writer's queue is taken by the
    thread that saves, Megatron's training loop."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def forked_results_queue(get_queue):
    """Wrap megatron-core's getter of the writer's results queue (``get_write_results_queue``;
    ``_get_write_results_queue`` in older releases): the first call makes the queue in a Manager
    forked from this process (see the module's docstring), then megatron-core's getter returns it."""

    @functools.wraps(get_queue)
    def results_queue(*args, **kwargs):
        import multiprocessing
        from multiprocessing.managers import SyncManager

        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if filesystem_async._results_queue is None:
            manager = SyncManager(ctx=multiprocessing.get_context("fork"))
            manager.start(initializer=die_with_the_parent)
            filesystem_async._results_queue = manager.Queue()  # (the queue's proxy keeps the Manager)
        return get_queue(*args, **kwargs)

    return results_queue


def declare_writers(registry: PatchRegistry, versions: VersionRange) -> None:
    """Add the checkpoint writers' patches to ``registry`` (the adapter's)."""
    import megatron.core.dist_checkpointing.strategies.async_utils as async_utils
    import megatron.core.dist_checkpointing.strategies.filesystem_async as filesystem_async

    if hasattr(async_utils, "PersistentAsyncCaller"):
        target = _STRATEGIES + "async_utils:PersistentAsyncCaller.async_loop"
        registry.add(Patch.replacing(f"cpu-{target}", target, staticmethod(async_loop_on_cpu), versions,
                                     "CPU: the spawned checkpoint writer selects no CUDA device"))
    getters = [g for g in ("get_write_results_queue", "_get_write_results_queue") if hasattr(filesystem_async, g)]
    if not getters:  # (the name in newer / older releases)
        raise AttributeError("megatron_edit.cpu.adapter: megatron-core's checkpoint writer has no results "
                             "queue getter (get_write_results_queue); update megatron_edit.cpu.async_writer")
    target = _STRATEGIES + "filesystem_async:" + getters[0]
    registry.add(Patch(f"cpu-{target}", target, forked_results_queue, versions, (),
                       "CPU: the checkpoint writer's results queue in a forked Manager (no torch import)"))
