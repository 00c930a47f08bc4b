"""Which shards a synchronous EDiT sync exchanges: every shard, or one streaming fragment's
(``LocalSGDConfig.fragments``; the math is :mod:`megatron_edit.algorithm.fragments`).

The fragments are made once, when the controller is built, of its bucket groups in forward
order, balanced by size. The sizes are summed over the worker's model-shard and tensor-parallel
groups first (one small all-reduce, on every rank as the controller is built), so every rank of
the worker makes the same fragments; the workers make the same ones because they hold the same
model.

Megatron's buckets are not aligned with layers (a bucket often ends inside one layer and begins
the next), so fragments cannot in general keep layers whole. Instead, a layer whose parameters
fall in two fragments becomes one "layer" per fragment for every per-layer decision (the
penalty's norms, weights, exclusions and statistics, clipping): ``decoder.layers.3`` becomes
``decoder.layers.3@fragment1`` and ``decoder.layers.3@fragment2``. So no layer's norm spans two
fragments, and each sync decides on what it exchanges (:func:`split_layers`). The pieces are
synchronised at different steps, so they are clipped (and judged for anomalies) one by one: a
layer cut into k pieces can be stepped, over one interval, with a pseudo-gradient of norm up to
sqrt(k) times the clip threshold (each piece up to it).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..algorithm import fragments as math_fragments
from ..config import FLAG_NAMES, ConfigError, LocalSGDConfig
from ..exchange.shard import BucketShard
from .shards import ShardLayout


#: The bucket size as megatron-core names it; entry points with a flag for it put theirs in the
#: message (Megatron-LM: ``--ddp-bucket-size``, the main job: ``--bucket-size``).
BUCKET_SIZE = "DistributedDataParallelConfig.bucket_size"


def group_sizes(layout: ShardLayout, worker_groups=None) -> List[float]:
    """Elements of each bucket group (in ``layout.group_order``) summed over the worker's
    model-shard and tensor-parallel groups: the same list on every rank of the worker (one small
    all-reduce when ``worker_groups`` is given; every rank of the worker calls it together)."""
    groups = [layout.group_shards[g] for g in layout.group_order]
    sizes = torch.tensor([float(sum(s.numel for s in g)) for g in groups], dtype=torch.float64,
                         device=groups[0][0].device)
    if worker_groups is not None:
        sizes = worker_groups.sum(sizes)
    return sizes.cpu().tolist()


def partition_sizes(sizes: Sequence[float], count: int, flag_name: str) -> List[List[int]]:
    """The fragments as lists of group indices, of about equal size (a ConfigError naming
    ``flag_name`` when the model has too few bucket groups)."""
    try:
        return math_fragments.partition(sizes, count)
    except math_fragments.FragmentError as e:
        raise ConfigError(
            f"fragments ({flag_name}): {e} on this rank's distributed optimizer; use fewer fragments, or "
            f"smaller buckets ({BUCKET_SIZE}) so that the model has more bucket groups.") from e


def recut(shards: Sequence[BucketShard], unsplit: ShardLayout, parts: Optional[Sequence[Sequence[int]]]) -> List[str]:
    """Cut the layers of ``shards`` (the controller's, in ``unsplit.shards``' order) for the
    fragments ``parts`` (None: one fragment), in place: each shard keeps its tensors and EDiT
    state (anchor, residuals; the outer optimizer's state follows the anchor) and takes the
    segments and layer indices :func:`split_layers` gives. ``unsplit``: the layout before any
    cut (its shards' segments untouched). Returns the new layer names."""
    layout = unsplit if parts is None else split_layers(unsplit, parts)
    assert len(layout.shards) == len(shards), "recut: another optimizer's shards"
    for shard, cut in zip(shards, layout.shards):
        shard.relayer(cut.segments, cut.bucket_layers)
    return list(layout.layer_names)


def frozen_layout(layout: ShardLayout) -> ShardLayout:
    """A copy of ``layout`` whose shards are copies (the same tensors; their segments are not
    changed later by :func:`recut`): what a change of the number of fragments cuts from."""
    copy = {id(s): dataclasses.replace(s, segments=list(s.segments), bucket_layers=set(s.bucket_layers))
            for s in layout.shards}
    return ShardLayout(shards=[copy[id(s)] for s in layout.shards], group_order=list(layout.group_order),
                       group_shards={g: [copy[id(s)] for s in v] for g, v in layout.group_shards.items()},
                       layer_names=list(layout.layer_names))


def split_layers(layout: ShardLayout, parts: Sequence[Sequence[int]]) -> ShardLayout:
    """``layout`` with each layer that falls in several fragments cut into one layer per fragment
    (named ``<layer>@fragment<f>``); new shards (their segments renumbered), the same order."""
    fragment_of = {layout.group_order[g]: f for f, part in enumerate(parts) for g in part}
    holders: Dict[int, set] = {}
    for group, shards in layout.group_shards.items():
        for shard in shards:
            for layer in shard.bucket_layers:
                holders.setdefault(layer, set()).add(fragment_of[group])
    key_of: Dict[Tuple[int, int], str] = {}
    for layer, fragments in holders.items():
        for f in fragments:
            name = layout.layer_names[layer]
            key_of[(layer, f)] = name if len(fragments) == 1 else f"{name}@fragment{f}"
    names = sorted(set(key_of.values()))
    index = {name: i for i, name in enumerate(names)}
    new_of: Dict[int, BucketShard] = {}
    for group, shards in layout.group_shards.items():
        f = fragment_of[group]
        for shard in shards:
            new_of[id(shard)] = dataclasses.replace(
                shard,
                segments=[(s, e, index[key_of[(layer, f)]], counts) for s, e, layer, counts in shard.segments],
                bucket_layers={index[key_of[(layer, f)]] for layer in shard.bucket_layers},
            )
    return ShardLayout(
        shards=[new_of[id(s)] for s in layout.shards],
        group_order=list(layout.group_order),
        group_shards={g: [new_of[id(s)] for s in shards] for g, shards in layout.group_shards.items()},
        layer_names=names,
    )


def cut_fragments(layout: ShardLayout, worker_groups, fragments: int, allowed: Sequence[int]):
    """A controller's layout cut for ``fragments`` streaming fragments (a layer in two of them is
    two layers for the decisions): ``(layout, parts or None, recut)``. ``allowed``: every number of
    fragments ``auto_overlap`` may choose, each checked now (refused at start, not mid-run);
    ``recut``: with more than one, the layout before any cut and the bucket groups' sizes, what a
    change of F cuts from (else None)."""
    parts, recut = None, None
    if max(allowed) > 1 and layout.group_order:
        sizes = group_sizes(layout, worker_groups)
        if len(allowed) > 1:
            for f in allowed:
                partition_sizes(sizes, f, FLAG_NAMES["auto_fragments"])
            recut = (frozen_layout(layout), sizes)
        if fragments > 1:
            parts = partition_sizes(sizes, fragments, FLAG_NAMES["fragments"])
            layout = split_layers(layout, parts)
    return layout, parts, recut


class SyncShards:
    """The shards due for exchange after each step (synchronous EDiT)."""

    def __init__(self, groups: Sequence[Sequence[BucketShard]], config: LocalSGDConfig,
                 parts: Optional[Sequence[Sequence[int]]] = None):
        """``groups``: the shards in bucket groups, in forward order; ``parts``: the fragments as
        lists of group indices (None: one fragment, the whole model)."""
        self.config = config
        self.all: List[BucketShard] = [s for g in groups for s in g]
        self.fragments: List[List[BucketShard]] = (
            [self.all] if parts is None else [[s for g in part for s in groups[g]] for part in parts])
        """The fragments, each a list of shards in group order (one: the whole model)."""

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
