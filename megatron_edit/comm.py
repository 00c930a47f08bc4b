"""The collectives of EDiT's outer step, over a process group that is passed in.

The sync group holds, for one shard of the model, the rank of every worker that owns that shard
(Megatron's inter-distributed-optimizer-instance group). This module is the only place that
talks to ``torch.distributed`` for EDiT, and it counts what it sends, so tests and logs can
check that nothing crosses the sync group between syncs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist


class _Done:
    """Handle of an operation that needed no communication."""

    def wait(self) -> bool:
        return True


@dataclass
class CommCounters:
    """What crossed the sync group from this rank."""

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
        self.counters.payload_bytes += tensor.numel() * tensor.element_size()
        handle = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=async_op)
        return handle if async_op else _Done()
