"""The anchor of every shard and the outer optimizer that steps it (arXiv 2412.07210, Sec. 3).

The anchor is the shard's value at the last sync; the outer optimizer (any ``torch.optim``
class, by default Nesterov SGD) steps it with the reduced pseudo-gradient as its gradient, and
every worker restarts from it. Both are sharded like the main parameters: this rank keeps its
shard of each bucket, 2 x 4 bytes x params / shard size with momentum SGD.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from ..algorithm import outer
from ..config import OuterOptimizerConfig
from .shard import BucketShard


class OuterState:
    """Anchors and outer-optimizer state of one optimizer's shards.

    ``state_device``: where the state lives (None: with the shard; ``cpu`` for
    ``cpu_offload``, pinned when CUDA is present)."""

    def __init__(self, config: OuterOptimizerConfig, state_device: Optional[torch.device] = None):
        self.config = config
        self.state_device = state_device
        self.optimizer: Optional[torch.optim.Optimizer] = None

    @property
    def captured(self) -> bool:
        return self.optimizer is not None

    @property
    def lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer is not None else 0.0

    @torch.no_grad()
    def capture(self, shards: Sequence[BucketShard]) -> None:
        """Anchor := the current main params; the outer optimizer starts with empty state."""
        anchors = []
        for shard in shards:
            device = self.state_device or shard.device
            pin = device.type == "cpu" and torch.cuda.is_available()
            anchor = torch.empty(shard.numel, dtype=torch.float32, device=device, pin_memory=pin)
            if device == shard.device:
                shard.read_current(anchor)
            else:
                anchor.copy_(shard.read_current(torch.empty(shard.numel, device=shard.device)))
            shard.anchor = anchor
            anchors.append(anchor)
        self.optimizer = self.config.optimizer_class(anchors, **self.config.outer_optim_kwargs)

    @torch.no_grad()
    def step(self, shard: BucketShard, delta: torch.Tensor, skipped: List[Tuple[int, int]]) -> None:
        """Outer step of one shard with its reduced pseudo-gradient ``delta``; the ranges in
        ``skipped`` (layers every worker was excluded from) keep their anchor and state."""
        saved = self._save_segments(shard, skipped)
        grad = delta.to(shard.anchor.device, non_blocking=True)
        outer.outer_step(self.optimizer, [shard.anchor], [grad])
        self._restore_segments(shard, saved)

    def _state_tensors(self, shard: BucketShard) -> List[torch.Tensor]:
        return [
            v for v in self.optimizer.state.get(shard.anchor, {}).values()
            if torch.is_tensor(v) and v.shape == shard.anchor.shape
        ]

    def _save_segments(self, shard: BucketShard, ranges) -> list:
        """Anchor and outer-state values of skipped layers, to undo the outer step there."""
        if not ranges:
            return []
        tensors = [shard.anchor] + self._state_tensors(shard)
        return [(t, s, e, t[s:e].clone()) for t in tensors for s, e in ranges]

    def _restore_segments(self, shard: BucketShard, saved: list) -> None:
        for t, s, e, values in saved:
            t[s:e].copy_(values)
        # State created by this very step (e.g. the first momentum buffer) starts at zero there.
        if saved:
            saved_ids = {id(t) for t, *_ in saved}
            for v in self._state_tensors(shard):
                if id(v) not in saved_ids:
                    for _, s, e, _ in saved:
                        v[s:e].zero_()

    def state_bytes(self, shards: Sequence[BucketShard]) -> int:
        """Bytes of anchors and outer-optimizer state on this rank."""
        total = sum(s.anchor.numel() * s.anchor.element_size() for s in shards if s.anchor is not None)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for v in state.values():
                    if torch.is_tensor(v) and v.dim() > 0:
                        total += v.numel() * v.element_size()
        return total
