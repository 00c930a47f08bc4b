"""Megatron's persistent checkpoint writer (``--async-save --use-persistent-ckpt-worker``) on CPU.

megatron-core starts the writer as a *spawned* process (``PersistentAsyncCaller.async_loop``), a
fresh interpreter where the CPU adapter is not active; its first line selects a CUDA device
(``torch.cuda.set_device(rank % torch.cuda.device_count())``), which on a machine without a GPU
divides by zero, and its preload of each save waits for the GPU (``torch.cuda.synchronize``);
the training ranks then wait forever for a writer that died. The adapter
starts :func:`async_loop_on_cpu` instead (a function of this module, so the spawned process
imports it by name): it makes the writer's device selection and waits inert, as the adapter does in the
training ranks, and runs megatron-core's own loop. The tensors it writes are already on the CPU.
"""

from __future__ import annotations


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
