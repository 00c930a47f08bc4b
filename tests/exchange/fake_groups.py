"""In-process stand-ins for EDiT's collectives: several workers as threads of one process.

``FakeWorld(n)`` hands out one :class:`FakeSyncGroup` per worker (the methods of
:class:`megatron_edit.exchange.groups.SyncGroup`) and a single-rank :class:`FakeWorkerGroups`
(one rank per worker). Every collective is matched across workers by its position in each
worker's call sequence, and the world checks that all workers issued the *same* operation
there (name, shape, dtype): a pipeline that orders its collectives differently on two workers
would deadlock on a real backend, and fails here with the two calls named. A wait that no peer
completes within ``timeout`` seconds raises instead of hanging.

Asynchronous all-reduces behave like a real backend's: the contribution is read when the
operation is launched, and the result is written into the caller's tensor when it waits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from megatron_edit.exchange.groups import CommCounters, all_reduce_bytes


class CollectiveMismatch(RuntimeError):
    """Two workers issued different collectives at the same position (a real deadlock)."""


@dataclass
class _Slot:
    signature: tuple
    contributions: Dict[int, torch.Tensor] = field(default_factory=dict)
    result: Optional[object] = None
    done: threading.Event = field(default_factory=threading.Event)


class FakeWorld:
    def __init__(self, workers: int, timeout: float = 30.0):
        self.workers = workers
        self.timeout = timeout
        self._lock = threading.Lock()
        self._slots: Dict[int, _Slot] = {}
        self.error: Optional[BaseException] = None
        self.log: List[List[tuple]] = [[] for _ in range(workers)]
        """Per worker, every collective it issued: (name, numel)."""

    def group(self, worker: int) -> "FakeSyncGroup":
        return FakeSyncGroup(self, worker)

    def _contribute(self, worker: int, index: int, signature: tuple, tensor: torch.Tensor, reduce):
        with self._lock:
            slot = self._slots.get(index)
            if slot is None:
                slot = self._slots[index] = _Slot(signature)
            elif slot.signature != signature:
                self.error = CollectiveMismatch(
                    f"collective #{index}: worker {worker} issued {signature}, another worker "
                    f"issued {slot.signature}"
                )
                for other in self._slots.values():  # wake every waiting worker
                    other.done.set()
                raise self.error
            slot.contributions[worker] = tensor.detach().clone()
            if len(slot.contributions) == self.workers:
                slot.result = reduce([slot.contributions[w] for w in range(self.workers)])
                slot.done.set()
        return slot

    def _wait(self, slot: _Slot, index: int):
        if not slot.done.wait(self.timeout):
            raise TimeoutError(f"collective #{index} {slot.signature}: not every worker joined")
        if self.error is not None:
            raise self.error
        return slot.result


class _Handle:
    def __init__(self, world, slot, index, tensor, pick=None):
        self.world, self.slot, self.index, self.tensor, self.pick = world, slot, index, tensor, pick

    def wait(self) -> bool:
        result = self.world._wait(self.slot, self.index)
        self.tensor.copy_(self.pick(result) if self.pick else result)
        return True


def _sum(parts):
    out = parts[0].clone()
    for p in parts[1:]:
        out += p
    return out


class FakeSyncGroup:
    """The sync group of one worker (duck-types ``exchange.groups.SyncGroup``)."""

    def __init__(self, world: FakeWorld, worker: int):
        self.world = world
        self.rank = worker
        self.size = world.workers
        self.group = object()
        self.counters = CommCounters()
        self._next = 0

    def _issue(self, name: str, tensor: torch.Tensor, reduce):
        index, self._next = self._next, self._next + 1
        self.world.log[self.rank].append((name, tensor.numel()))
        self.counters.collectives += 1
        return index, self.world._contribute(
            self.rank, index, (name, tuple(tensor.shape), tensor.dtype), tensor, reduce
        )

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = True):
        if self.size == 1:
            return _Done()
        self.counters.payload_bytes += all_reduce_bytes(tensor.numel() * tensor.element_size(), self.size)
        index, slot = self._issue("all_reduce_sum", tensor, _sum)
        handle = _Handle(self.world, slot, index, tensor)
        if not async_op:
            handle.wait()
        return handle

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = True):
        if self.size == 1:
            output.copy_(tensor)
            return _Done()
        self.counters.payload_bytes += (self.size - 1) * tensor.numel() * tensor.element_size() // self.size
        me, size = self.rank, self.size

        def reduce(parts):  # every worker's input, chunked; worker w gets chunk w of each
            return [torch.cat([p.chunk(size)[w] for p in parts]) for w in range(size)]

        index, slot = self._issue("all_to_all", tensor, reduce)
        handle = _Handle(self.world, slot, index, output, pick=lambda result: result[me])
        if not async_op:
            handle.wait()
        return handle

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = True):
        if self.size == 1:
            output.copy_(tensor)
            return _Done()
        self.counters.payload_bytes += (self.size - 1) * tensor.numel() * tensor.element_size()
        index, slot = self._issue("all_gather_into", tensor, torch.cat)
        handle = _Handle(self.world, slot, index, output)
        if not async_op:
            handle.wait()
        return handle

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return tensor.unsqueeze(0).clone()
        self.counters.payload_bytes += tensor.numel() * tensor.element_size() * (self.size - 1)
        index, slot = self._issue("all_gather", tensor, torch.stack)
        return self.world._wait(slot, index).clone()

    def all_reduce_max_everywhere(self, tensor: torch.Tensor, group=None) -> torch.Tensor:
        self.counters.payload_bytes += all_reduce_bytes(tensor.numel() * tensor.element_size(), self.size)
        index, slot = self._issue("all_reduce_max", tensor, lambda parts: torch.stack(parts).amax(0))
        tensor.copy_(self.world._wait(slot, index))
        return tensor


class _Done:
    def wait(self) -> bool:
        return True


class FakeWorkerGroups:
    """A worker of one rank: sums inside the worker are the identity."""

    shard_rank = 0

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


def run_workers(world: FakeWorld, fn, *args):
    """Run ``fn(worker, *args)`` on one thread per worker; return the results in worker order,
    re-raising the first exception."""
    results: List[object] = [None] * world.workers
    errors: List[BaseException] = []

    def target(worker):
        try:
            results[worker] = fn(worker, *args)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=target, args=(w,), daemon=True) for w in range(world.workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(world.timeout * 4)
    if errors:
        raise errors[0]
    if any(t.is_alive() for t in threads):
        raise TimeoutError("a fake worker did not finish")
    return results
