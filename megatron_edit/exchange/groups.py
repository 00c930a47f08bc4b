"""The collectives of EDiT's outer step, over a process group that is passed in.

The sync group holds, for one shard of the model, the rank of every worker that owns that shard
(Megatron's inter-distributed-optimizer-instance group). This module is the only place that
talks to ``torch.distributed`` for EDiT, and it counts what it sends, so tests and logs can
check that nothing crosses the sync group between syncs.

Bytes are counted as what this rank puts on the wire with the usual ring algorithms, for a
group of W ranks: an all-reduce of S bytes sends 2 (W - 1) / W x S, an all-gather of S bytes
per rank (W - 1) x S, an all-to-all of S bytes (W - 1) / W x S. (Two workers: an all-reduce
sends its tensor once.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from ..algorithm.wire import all_reduce_bytes  # noqa: F401 (re-exported: the counters' and the model's rule)


class _Done:
    """Handle of an operation that needed no communication."""

    def wait(self) -> bool:
        return True


@dataclass
class CommCounters:
    """What crossed the sync group from this rank (bytes on the wire, see the module)."""

    collectives: int = 0
    payload_bytes: int = 0

    def reset(self) -> None:
        self.collectives = 0
        self.payload_bytes = 0


class SyncGroup:
    """Collectives across the workers holding the same shard.

    ``group=None`` means a single worker: every reduction is the identity and nothing is sent.
    (It never means the default world group.)
    """

    def __init__(self, group: Optional[dist.ProcessGroup]):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.counters = CommCounters()

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = True):
        """Sum ``tensor`` in place over the workers; returns a handle with ``wait()``."""
        if self.size == 1:
            return _Done()
        self.counters.collectives += 1
        self.counters.payload_bytes += all_reduce_bytes(tensor.numel() * tensor.element_size(), self.size)
        handle = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return handle if async_op else _Done()

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = True):
        """Chunk w of ``tensor`` (equal chunks) to worker w; chunk w of ``output`` from it."""
        if self.size == 1:
            output.copy_(tensor)
            return _Done()
        self.counters.collectives += 1
        self.counters.payload_bytes += (self.size - 1) * tensor.numel() * tensor.element_size() // self.size
        handle = dist.all_to_all_single(output, tensor, group=self.group, async_op=async_op)
        return handle if async_op else _Done()

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = True):
        """``output`` := every worker's ``tensor``, concatenated in worker order."""
        if self.size == 1:
            output.copy_(tensor)
            return _Done()
        self.counters.collectives += 1
        self.counters.payload_bytes += (self.size - 1) * tensor.numel() * tensor.element_size()
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        handle = gather(output, tensor, group=self.group, async_op=async_op)
        return handle if async_op else _Done()

    def all_reduce_max_everywhere(self, tensor: torch.Tensor, group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        """MAX over ``group`` (every rank of every worker; None = the default group), blocking,
        counted as traffic across workers. Used once per A-EDiT sync for the schedule."""
        ranks = dist.get_world_size(group)
        if ranks == 1:
            return tensor
        self.counters.collectives += 1
        self.counters.payload_bytes += all_reduce_bytes(tensor.numel() * tensor.element_size(), ranks)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """``[workers, *tensor.shape]``: every worker's ``tensor`` (blocking; small tensors)."""
        if self.size == 1:
            return tensor.unsqueeze(0).clone()
        self.counters.collectives += 1
        self.counters.payload_bytes += tensor.numel() * tensor.element_size() * (self.size - 1)
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.stack(parts)


def mean_divisor(sync_group) -> int:
    """What the plain mean divides the sum by: the workers in the sync, or, over a group whose
    workers change (:mod:`.fault_tolerant`), those that trained since the last sync (a worker
    that has just joined sends zeros and is not counted)."""
    return max(1, getattr(sync_group, "contributors", sync_group.size))


def average_over_workers(tensors, sync_group) -> None:
    """Each of ``tensors`` (small, float32) := its mean over the workers, in place: one blocking
    all-reduce of them all over the sync group, counted as sync traffic. Every worker ends with
    the same bits (one reduced sum, divided by the same count)."""
    tensors = list(tensors)
    if not tensors or sync_group.size == 1:
        return
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    sync_group.all_reduce_sum(flat, async_op=False)
    flat /= mean_divisor(sync_group)
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()


def group_within(group: dist.ProcessGroup, within: dist.ProcessGroup) -> dist.ProcessGroup:
    """The ranks of ``group`` that are also in ``within``, as a process group of their own (e.g.
    a worker's part of a group that spans every worker). A collective over the default group
    (``all_gather_object``, then one ``new_group`` per distinct part, in the same order on every
    rank): every rank must call it at the same point, with its own two groups."""
    mine = sorted(set(dist.get_process_group_ranks(group)) & set(dist.get_process_group_ranks(within)))
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    found = None
    for ranks in sorted({tuple(r) for r in everyone}):
        built = dist.new_group(list(ranks))
        if list(ranks) == mine:
            found = built
    return found


def default_store():
    """The job's key-value store (the one ``torch.distributed`` rendezvoused through): EDiT's
    arrival checks (:mod:`.arrival`) write their keys there."""
    return dist.distributed_c10d._get_default_store()


class WorkerGroups:
    """Collectives inside one worker: over its model-shard group and its tensor-parallel group.

    A layer's norm on a worker sums the squares of every shard (model-shard group) and every
    tensor-parallel slice (tensor-parallel group) of it; nothing here crosses workers.
    """

    def __init__(self, shard_group: Optional[dist.ProcessGroup], tp_group: Optional[dist.ProcessGroup]):
        self.groups = [
            g for g in (shard_group, tp_group) if g is not None and dist.get_world_size(g) > 1
        ]
        self.shard_rank = 0 if shard_group is None else dist.get_rank(shard_group)

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        for group in self.groups:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group)
        return tensor
