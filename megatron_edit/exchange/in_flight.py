"""What one outer sync holds while it runs: its decisions and, per shard, the exchange in flight.

A :class:`SyncInProgress` is created when a sync starts and dropped when it ends (or stops on a
non-finite pseudo-gradient), with everything in it: the penalty's decisions, the clip factors,
and one :class:`ShardInFlight` per shard (its Delta, the reducer chosen for it, that reducer's
flight). The :class:`~megatron_edit.exchange.shard.BucketShard` keeps only what outlives a sync.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .reducers import Reducer
from .shard import BucketShard


@dataclass
class ShardInFlight:
    """One shard at one sync: its Delta (this worker's, then the reduced one), the reducer
    chosen for it, that reducer's flight (None: not launched, or finished)."""

    reducer: Optional[Reducer] = None
    delta: Optional[torch.Tensor] = None
    flight: Optional[object] = None
    exchanged: bool = False
    pending: bool = False
    """Layer-wise: the outer step waits for the shard's group's parameter gather."""
    launch_params: Optional[torch.Tensor] = None
    """The ``keep_local`` merge of a delayed outer step: the main params at the launch."""


@dataclass
class SyncInProgress:
    """One sync from :meth:`~megatron_edit.exchange.outer_sync.OuterSync.start` to its end."""

    step: int
    steps_since_last: int
    bytes_at_start: int
    seconds: float = 0.0
    weights: Optional[torch.Tensor] = None  # [W, L] float64 CPU, None: plain mean
    own_weights: Optional[torch.Tensor] = None  # [L]
    norms: Optional[torch.Tensor] = None
    excluded: Optional[torch.Tensor] = None
    skipped: Optional[torch.Tensor] = None  # [L] bool
    clip_coef: Dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> 0-dim, on device
    worker_steps: Optional[torch.Tensor] = None  # A-EDiT: [W] (the final sync with fragments: [W, L])
    worker_seconds: Optional[torch.Tensor] = None
    worker_idle: Optional[torch.Tensor] = None
    final: bool = False
    skipped_sync: bool = False
    divisor: int = 1
    """What the reduced Delta still has to be divided by in the outer step (the plain mean's
    division, left to the fused step where that saves a pass)."""
    delay: int = 0
    """Delayed outer step: the steps between the launch (after step ``step - delay``) and the
    apply (after step ``step``); the flights own every buffer their collectives use until then."""
    exposed_wait: float = 0.0
    """Delayed outer step: host seconds spent waiting for the exchange at its completion."""
    launch_wait: Optional[float] = None
    """Delayed outer step, a sync ``auto_overlap`` times: host seconds from the sync's start to
    the end of its exchange, waited for right after the launch (None: not waited for there)."""
    exchange_seconds: float = 0.0
    """Of ``seconds``, those inside the reducers' launch and finish: the codec and the wire (the
    rest is the sync's own work in any format: the penalty's decisions, the pseudo-gradients,
    the outer step)."""
    probe_link: bool = False
    """The link's probes (``OuterSync.start``): one all-reduce before the exchange, two after it."""
    met: bool = False
    """The probes' all-reduce before the exchange's first launch is done (the workers' skew)."""
    latency: Optional[float] = None
    """Seconds of an all-reduce of one element over the sync group after it (None: not probed)."""
    rate_probe: Optional[float] = None
    """Seconds of an all-reduce of ``link_probe.rate_probe_numel`` elements after that one."""
    committed: Optional[bool] = None
    """Whether the sync is applied (``OuterSync.commit_gate``; None: not asked yet)."""
    members: List[BucketShard] = field(default_factory=list)
    """The shards this sync exchanges, in group order: all, or one streaming fragment's."""
    fragment: Optional[int] = None
    """Streaming fragments: the index of the fragment synchronised (None: the whole model)."""
    layers: Optional[torch.Tensor] = None
    """Streaming fragments: [L] bool, the layers the members hold (None: every layer)."""
    shards: Dict[int, ShardInFlight] = field(default_factory=dict)  # id(shard) -> its record

    def saved_meta(self, committed: Optional[bool]) -> dict:
        """What a delayed sync's apply needs besides each shard's reduced Delta, for a checkpoint
        taken while it is in flight (:meth:`from_saved`)."""
        return dict(step=self.step, steps_since_last=self.steps_since_last, delay=self.delay,
                    fragment=self.fragment, divisor=self.divisor,
                    skipped=None if self.skipped is None else self.skipped.tolist(),
                    keep=any(self.of(s).launch_params is not None for s in self.members), committed=committed)

    @classmethod
    def from_saved(cls, meta: dict, members: Sequence[BucketShard], deltas, launch, bytes_at_start: int):
        """The sync of :meth:`saved_meta` again, exchanged (``deltas``: the reduced ones;
        ``launch``: each member's launch params or None), waiting for its apply."""
        sync = cls(meta["step"], meta["steps_since_last"], bytes_at_start, delay=meta["delay"],
                   fragment=meta["fragment"], divisor=meta["divisor"], members=list(members),
                   committed=meta.get("committed"))  # torchft: decided when it was saved
        if meta["skipped"] is not None:
            sync.skipped = torch.tensor(meta["skipped"], dtype=torch.bool)
        for shard, delta, params in zip(members, deltas, launch):
            record = sync.of(shard)
            record.delta, record.exchanged, record.launch_params = delta, True, params
        return sync

    def of(self, shard: BucketShard) -> ShardInFlight:
        """The shard's record at this sync."""
        record = self.shards.get(id(shard))
        if record is None:
            record = self.shards[id(shard)] = ShardInFlight()
        return record

    def done(self, shard: BucketShard) -> None:
        """The shard's outer step is applied: nothing of it is in flight or pending."""
        self.shards[id(shard)] = ShardInFlight(reducer=self.of(shard).reducer)

    @property
    def pending(self) -> bool:
        return any(record.pending for record in self.shards.values())

    def skipped_ranges(self, shard: BucketShard) -> List[Tuple[int, int]]:
        """The shard's ranges of layers every worker is excluded from at this sync (their outer
        step is skipped; error feedback keeps its residuals there)."""
        if self.skipped is None or not bool(self.skipped.any()):
            return []
        return [(s, e) for s, e, layer, _ in shard.segments if self.skipped[layer]]
