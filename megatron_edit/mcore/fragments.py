"""Which shards a synchronous EDiT sync exchanges: every shard, or one streaming fragment's
(``LocalSGDConfig.fragments``; the math is :mod:`megatron_edit.algorithm.fragments`).

The fragments are made once, when the controller is built, of its bucket groups in forward
order; they are closed over layers when a per-layer decision is taken (the penalty, clipping,
GTA's weights), so a layer's norm never spans two fragments. The sizes they are balanced by are
summed over the worker's model-shard and tensor-parallel groups first (one small all-reduce,
on every rank as the controller is built), so every rank of the worker makes the same fragments;
the workers make the same ones because they hold the same model.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch

from ..algorithm import fragments as math_fragments
from ..config import FLAG_NAMES, ConfigError, LocalSGDConfig
from ..exchange.shard import BucketShard


class SyncShards:
    """The shards due for exchange after each step (synchronous EDiT)."""

    def __init__(self, groups: Sequence[Sequence[BucketShard]], config: LocalSGDConfig, closed: bool,
                 worker_groups=None):
        """``groups``: the shards in bucket groups, in forward order. ``closed``: the fragments
        must be closed over layers. ``worker_groups``: sums the sizes inside the worker."""
        self.config = config
        self.all: List[BucketShard] = [s for g in groups for s in g]
        self.fragments: List[List[BucketShard]] = [self.all]
        """The fragments, each a list of shards in group order (one: the whole model)."""
        count = config.fragments
        if count == 1 or not groups:
            return
        sizes = torch.tensor([float(sum(s.numel for s in g)) for g in groups], dtype=torch.float64,
                             device=groups[0][0].device)
        if worker_groups is not None:
            sizes = worker_groups.sum(sizes)
        sizes = sizes.cpu()
        layers = [set().union(*(s.bucket_layers for s in g)) for g in groups]
        try:
            parts = math_fragments.partition(sizes.tolist(), layers, count, closed)
        except math_fragments.FragmentError as e:
            raise ConfigError(
                f"fragments ({FLAG_NAMES['fragments']}): {e} on this rank's distributed optimizer; use fewer "
                "fragments, or smaller buckets (--ddp-bucket-size) so that the model has more "
                "bucket groups.") from e
        self.fragments = [[s for g in part for s in groups[g]] for part in parts]

    def fragment_due(self, step: int) -> Optional[int]:
        """The fragment synchronised after ``step`` on the grid (None: no sync there); without
        fragments, 0 at each sync step."""
        c = self.config
        return math_fragments.fragment_due(step, c.local_sgd_warmup_steps, c.local_sgd_sync_interval,
                                           c.fragments)

    def due(self, step: int, last_step: Optional[int]):
        """(fragment index or None, shards) of the sync after ``step``, or None when no sync is
        due: every shard at the run's last step (``last_step``), else the fragment due there."""
        c = self.config
        if step == last_step and step > c.local_sgd_warmup_steps:
            return None, self.all  # the run's last step: end with one model on every worker
        f = self.fragment_due(step)
        if f is None:
            return None
        return (f, self.fragments[f]) if c.fragments > 1 else (None, self.all)

    def steps_since(self, step: int, fragment: Optional[int], last_sync_step: int) -> int:
        """Steps each exchanged shard trained locally since its previous sync: a fragment's
        interval (H, or less for its first sync), else since the last sync of any shard."""
        c = self.config
        if fragment is None:
            return step - last_sync_step
        return min(c.local_sgd_sync_interval, step - c.local_sgd_warmup_steps)


def closed_over_layers(config: LocalSGDConfig, gta_reducer: str) -> bool:
    """Whether fragments must keep each layer whole: a per-layer decision is taken."""
    return bool(config.skip_anomaly or config.pseudo_gradnorm_reduce or config.clip_pseudo_grad is not None
                or config.use_step_weight or gta_reducer == "gta")
