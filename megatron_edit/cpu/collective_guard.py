"""A debug check of asynchronous collectives on the CPU (issue 62): a buffer freed, resized or
written while a collective still uses it trips at once, with the launch's and the offender's stack.

Set ``MEGATRON_EDIT_COLLECTIVE_GUARD=1`` before :func:`megatron_edit.cpu.adapter.activate` (the
tests' multi-rank harness can set it for every job); the adapter then adds these patches to its
registry, and :func:`~megatron_edit.cpu.adapter.deactivate` takes them out again.

Why: with NCCL on a GPU, a collective's tensors are protected by the caching allocator's stream
bookkeeping (``record_stream``): memory freed while the collective runs is reused only once the
collective's stream is past it. gloo on the CPU has nothing of the kind. Its work holds a
reference to each tensor, which keeps a tensor alive, but not its memory when the storage is
resized to 0 (``untyped_storage().resize_(0)``, what Megatron-FSDP's bucket allocator does to free
a bucket): the collective then writes into freed heap memory, a crash some time later. And a
Python write into a buffer whose collective has not been waited for is a race on any device.

What is checked, for every collective issued through a ``ProcessGroup`` method (which is where
every ``torch.distributed`` call, coalesced or not, ends up):

* **resize**: ``UntypedStorage.resize_`` (``TypedStorage._resize_`` and ``Tensor.storage().resize_``
  go through it) of a storage that a collective launched and not yet waited for uses:
  :class:`CollectiveHazard` at the resize, naming the collective and where it was launched.
* **at the wait**: every tensor of the collective still has the storage it had at the launch (the
  same address and size), and every tensor it only reads (the input of an all-gather, a
  reduce-scatter, a send) still holds the bytes it held at the launch (a checksum of them).

A synchronous collective is checked the same way (its wait is inside the call). The cost: a checksum of
every input (its elements summed as integers) at the launch and at the wait, a dictionary
lookup per resize; a collective never waited for stays remembered, its tensors alive, until
:func:`reset` (the adapter's deactivate). A debug mode, for tests and loops, not for a long run.
"""

from __future__ import annotations

import os
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

ENV = "MEGATRON_EDIT_COLLECTIVE_GUARD"
"""The environment variable that turns the guard on (``1``)."""


class CollectiveHazard(RuntimeError):
    """A buffer of a collective in flight was freed, resized or written."""


# The ProcessGroup methods and, for each, which positional arguments the collective only reads
# (None: every tensor is read and written, as in an all-reduce or a broadcast).
_READ_ONLY_ARGS: Dict[str, Optional[Tuple[int, ...]]] = {
    "allreduce": None, "allreduce_coalesced": None, "broadcast": None, "reduce": None,
    "allgather": (1,), "allgather_coalesced": (1,), "_allgather_base": (1,),
    "allgather_into_tensor_coalesced": (1,), "all_gather_single": (1,), "all_gather_single_coalesced": (1,),
    "reduce_scatter": (1,), "_reduce_scatter_base": (1,), "reduce_scatter_single": (1,),
    "reduce_scatter_single_coalesced": (1,), "reduce_scatter_tensor_coalesced": (1,),
    "alltoall_base": (1,), "all_to_all_single": (1,), "alltoall": (1,),
    "gather": (1,), "scatter": (1,), "send": (0,), "recv": None,
}


@dataclass
class _Buffer:
    tensor: torch.Tensor
    read_only: bool
    address: int
    nbytes: int
    checksum: Optional[int]


@dataclass
class _Launch:
    op: str
    work: object
    buffers: List[_Buffer]
    stack: traceback.StackSummary

    @property
    def where(self) -> str:
        return _where(self.stack)


_lock = threading.Lock()
_launches: Dict[int, _Launch] = {}          # id(work) -> its launch (the work kept alive here)
_by_storage: Dict[int, List[int]] = {}      # storage address -> ids of works using it


def _tensors(value, out: List[torch.Tensor]) -> List[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, out)
    return out


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _checksum(tensor: torch.Tensor) -> Optional[int]:
    """A checksum of the tensor's bytes: its elements read as integers of their size, summed
    (position-weighted by a second sum of every other element), without a copy: a CRC of a numpy view
    would make the storage unresizable, and Megatron-FSDP resizes its buckets."""
    if tensor.device.type != "cpu" or tensor.numel() == 0:
        return None
    flat = tensor.detach().reshape(-1).view(_SAME_SIZE_INT[tensor.element_size()])
    return hash((int(flat.sum(dtype=torch.int64)), int(flat[::2].sum(dtype=torch.int64))))


def _buffer(tensor: torch.Tensor, read_only: bool) -> _Buffer:
    storage = tensor.untyped_storage()
    return _Buffer(tensor, read_only, storage.data_ptr(), storage.nbytes(),
                   _checksum(tensor) if read_only else None)


def _stack(skip: int = 2) -> traceback.StackSummary:
    """The caller's stack (12 frames), its source lines read only when a hazard prints it."""
    frame = sys._getframe(skip)
    stack = traceback.StackSummary.extract(traceback.walk_stack(frame), limit=12, lookup_lines=False)
    stack.reverse()
    return stack


def _where(stack: traceback.StackSummary) -> str:
    return "".join(stack.format())


def _launched(op: str, args: tuple, work) -> None:
    read_only = _READ_ONLY_ARGS[op]
    tensors = [(tensor, read_only is not None and index in read_only)
               for index, arg in enumerate(args) for tensor in _tensors(arg, [])]
    # An input that shares its storage with an output (Megatron's in-place all-gather and
    # reduce-scatter: the shard is a view of the bucket) changes by the collective itself.
    written = {tensor.untyped_storage().data_ptr() for tensor, reads in tensors if not reads}
    buffers = [_buffer(tensor, reads and tensor.untyped_storage().data_ptr() not in written)
               for tensor, reads in tensors]
    launch = _Launch(op, work, buffers, _stack(3))
    with _lock:
        _launches[id(work)] = launch
        for buffer in buffers:
            if buffer.nbytes:
                _by_storage.setdefault(buffer.address, []).append(id(work))


def _check_at_wait(launch: _Launch) -> None:
    for buffer in launch.buffers:
        storage = buffer.tensor.untyped_storage()
        if (storage.data_ptr(), storage.nbytes()) != (buffer.address, buffer.nbytes):
            raise CollectiveHazard(
                f"{launch.op}: a buffer's storage changed while the collective was in flight "
                f"({buffer.nbytes} bytes at {buffer.address:#x} -> {storage.nbytes()} at "
                f"{storage.data_ptr():#x}); launched at\n{launch.where}")
        if buffer.checksum is not None and _checksum(buffer.tensor) != buffer.checksum:
            raise CollectiveHazard(
                f"{launch.op}: an input was written while the collective was in flight "
                f"({buffer.tensor.numel()} elements of {buffer.tensor.dtype}); launched at\n{launch.where}")


def _forget(work_id: int) -> Optional[_Launch]:
    with _lock:
        launch = _launches.pop(work_id, None)
        if launch is not None:
            for buffer in launch.buffers:
                users = _by_storage.get(buffer.address)
                if users and work_id in users:
                    users.remove(work_id)
                    if not users:
                        del _by_storage[buffer.address]
    return launch


def _wrap_collective(op: str):
    def wrap(original):
        def collective(self, *args, **kwargs):
            work = original(self, *args, **kwargs)
            if work is not None:
                _launched(op, args, work)
            return work

        return collective

    return wrap


def _wrap_wait(original):
    def wait(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        launch = _forget(id(self))
        if launch is not None:
            _check_at_wait(launch)
        return result

    return wait


def _wrap_resize(original):
    def resize_(self, size):
        if size != self.nbytes():
            with _lock:
                users = [_launches[i] for i in _by_storage.get(self.data_ptr(), ())]
            if users:
                launch = users[0]
                raise CollectiveHazard(
                    f"a storage of {self.nbytes()} bytes at {self.data_ptr():#x} resized to {size} "
                    f"while {launch.op} (not waited for; completed: {launch.work.is_completed()}) "
                    f"uses it: gloo would write into freed memory. Resized at\n{_where(_stack(2))}"
                    f"launched at\n{launch.where}")
        return original(self, size)

    return resize_


def in_flight() -> int:
    """How many collectives are launched and not yet waited for (a test's check)."""
    with _lock:
        return len(_launches)


def reset() -> None:
    """Forget every launch (the adapter's deactivate)."""
    with _lock:
        _launches.clear()
        _by_storage.clear()


def enabled() -> bool:
    return os.environ.get(ENV, "") == "1"


def declare_guard(registry, versions) -> None:
    """Add the guard's wraps to ``registry`` (the CPU adapter's)."""
    from ..mcore.wrap_registry import Patch

    for op in _READ_ONLY_ARGS:
        if hasattr(dist.ProcessGroup, op):
            registry.add(Patch(f"cpu-guard-{op}", f"torch.distributed:ProcessGroup.{op}", _wrap_collective(op),
                               versions, (), "debug: remember a collective's buffers until its wait"))
    registry.add(Patch("cpu-guard-wait", "torch.distributed.distributed_c10d:Work.wait", _wrap_wait, versions, (),
                       "debug: check a collective's buffers at its wait"))
    registry.add(Patch("cpu-guard-resize", "torch:UntypedStorage.resize_", _wrap_resize, versions, (),
                       "debug: no storage of a collective in flight is resized"))
