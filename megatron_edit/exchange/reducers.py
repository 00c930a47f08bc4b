"""The reducers of an outer sync: how one shard's pseudo-gradient becomes the sync group's.

Every reducer has the same three steps, which a sync may spread over time (layer-wise mode runs
them while the forward pass computes):

* :meth:`Reducer.launch` takes the shard and this worker's pseudo-gradient Delta (scratch: it is
  reduced in place), applies what the worker does before sending (its weights, GTA's
  sparsification) and starts the first collective; it returns the shard's *flight*, the
  reducer's own record of what is in flight;
* :meth:`Reducer.advance` starts the next collective once the previous one is in (a no-op for a
  one-collective reducer, or when it already ran);
* :meth:`Reducer.finish` waits for the last one and returns the reduced pseudo-gradient.

A flight holds the handles and buffers of one shard at one sync; nothing of it lives in the
:class:`~megatron_edit.exchange.shard.BucketShard`, which keeps only what persists (the anchor,
error feedback's residuals). The reducers:

* :class:`MeanReducer`: one all-reduce of the (weighted) Delta: the plain mean (the sum, divided
  here or left to the outer step) or the penalty's / A-EDiT's weighted sum;
* :class:`GTAReducer`: sparsify, the sign consensus, then the agreeing entries and who kept
  them (:mod:`megatron_edit.algorithm.gta`);
* :class:`QuantizedReducer`: the quantized all-to-all, then the all-gather of the requantized
  result (:mod:`.quantized`);
* :class:`SparseReducer`: the all-gather of every worker's top-k payload, summed in worker
  order (:mod:`.sparse`).

A sync builds its reducers once, with that sync's weights, and picks one per shard
(:func:`choose`, the only place where GTA, the exchange's format and a shard's size choose); a
delayed outer step (launch at one step, finish later) or streamed fragments drive the same
interface.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import torch

from ..algorithm import gta, outer
from ..algorithm.residual import fold_into
from ..config import GTAConfig, LocalSGDConfig
from .groups import mean_divisor
from .quantized import QuantizedExchange
from .shard import BucketShard
from .sparse import SparseExchange


def weigh(shard: BucketShard, delta: torch.Tensor, own_weights: Optional[torch.Tensor]) -> None:
    """In place: this worker's weight of each layer (None: the plain mean, nothing to do)."""
    if own_weights is not None:
        shard.scale_layers(delta, own_weights)


class Reducer:
    """One way to reduce a shard's pseudo-gradient across the sync group (see the module)."""

    def launch(self, shard: BucketShard, delta: torch.Tensor, keep: Sequence[Tuple[int, int]] = ()):
        """Start the exchange of ``delta`` (reduced in place); ``keep``: the shard's ranges of
        layers every worker is excluded from. Returns the flight."""
        raise NotImplementedError

    def advance(self, flight) -> None:
        """Start the next collective of ``flight`` if the previous one is in."""

    def finish(self, flight) -> torch.Tensor:
        """Wait for ``flight``'s collectives; the reduced pseudo-gradient (``delta``)."""
        raise NotImplementedError


@dataclass
class _MeanFlight:
    delta: torch.Tensor
    handle: object


class MeanReducer(Reducer):
    """One all-reduce of each worker's Delta, weighted by ``own_weights`` (None: unweighted).

    ``divide``: divide the sum by the workers here (the plain mean); False for a weighted sum
    (already the mean) or when the outer step divides (one pass less)."""

    def __init__(self, sync_group, own_weights: Optional[torch.Tensor], divide: bool):
        self.sync_group = sync_group
        self.own_weights = own_weights
        self.divide = divide

    def launch(self, shard, delta, keep=()) -> _MeanFlight:
        weigh(shard, delta, self.own_weights)
        # an error-feedback residual left by another format (auto_overlap): sent once, in fp32
        shard.residual = fold_into(delta, shard.residual, keep)
        return _MeanFlight(delta, self.sync_group.all_reduce_sum(delta, async_op=True))

    def finish(self, flight: _MeanFlight) -> torch.Tensor:
        flight.handle.wait()
        if self.divide:
            outer.mean_from_sum(flight.delta, mean_divisor(self.sync_group))
        return flight.delta


@dataclass
class _GTAFlight:
    shard: BucketShard
    delta: torch.Tensor
    consensus: Optional[torch.Tensor] = None
    """Phase 1: the consensus message in flight (reduced in place)."""
    consensus_handle: object = None
    mask: Optional[torch.Tensor] = None
    """Phase 2: who kept each entry (``normalize``), reduced in place beside the entries."""
    merge_handles: List[object] = field(default_factory=list)
    merging: bool = False
    """Whether phase 2 has started."""


class GTAReducer(Reducer):
    """GTA (:mod:`megatron_edit.algorithm.gta`): phase 1 the sign consensus (if any), phase 2
    the agreeing entries and their mask. ``weights``: the sync's [W, L] weights (never None:
    GTA starts from explicit weights); ``step``, ``shard_rank``: seed random sparsification
    per (sync, worker, shard), reproducibly and resumably."""

    def __init__(self, sync_group, config: GTAConfig, weights: torch.Tensor, step: int, shard_rank: int):
        self.sync_group = sync_group
        self.config = config
        self.weights = weights
        self.own_weights = weights[sync_group.rank]
        self.step = step
        self.shard_rank = shard_rank

    def launch(self, shard, delta, keep=()) -> _GTAFlight:
        """Phase 1: sparsify, weight, start the consensus all-reduce (if any)."""
        g = self.config
        generator = None
        if g.sparsification_method in ("random", "rescaled_random"):
            ids = getattr(self.sync_group, "replica_ids", None)  # torchft: the worker's id, not its place
            worker = ids[self.sync_group.rank] if ids is not None else self.sync_group.rank
            seed = self.step * 1_000_003 + worker * 10_007 + self.shard_rank * 101 + shard.index
            generator = torch.Generator().manual_seed(seed)
        gta.sparsify(delta, shard.sparsifiable_segments(), g.density, g.sparsification_method, generator)
        shard.scale_layers(delta, self.own_weights)
        flight = _GTAFlight(shard, delta)
        if g.consensus_method is None:
            self._merge_launch(flight)
            return flight
        flight.consensus = gta.consensus_message(delta, g.consensus_method, g.int8_mask)
        flight.consensus_handle = self.sync_group.all_reduce_sum(flight.consensus, async_op=True)
        return flight

    def _merge_launch(self, flight: _GTAFlight) -> None:
        """Phase 2: keep the agreeing entries; all-reduce them and who kept them."""
        g, delta = self.config, flight.delta
        gta.agree(delta, flight.consensus)
        flight.consensus, flight.consensus_handle, flight.merging = None, None, True
        if g.normalize:
            # The mask must be read before the in-place all-reduce of the entries starts.
            if g.int8_mask:
                flight.mask = gta.encode_mask_bits(delta, self.sync_group.rank, self.sync_group.size)
            else:
                flight.mask = (delta != 0).to(torch.float32)
                flight.shard.scale_layers(flight.mask, self.own_weights)
        flight.merge_handles = [self.sync_group.all_reduce_sum(delta, async_op=True)]
        if flight.mask is not None:
            flight.merge_handles.append(self.sync_group.all_reduce_sum(flight.mask, async_op=True))

    def advance(self, flight: _GTAFlight) -> None:
        """Once the consensus (phase 1) is in, start phase 2."""
        if not flight.merging:
            flight.consensus_handle.wait()
            self._merge_launch(flight)

    def finish(self, flight: _GTAFlight) -> torch.Tensor:
        self.advance(flight)
        for handle in flight.merge_handles:
            handle.wait()
        denominator = flight.mask
        if self.config.normalize and self.config.int8_mask:
            denominator = gta.decode_denominator(flight.mask, flight.shard.segments, self.weights,
                                                 torch.empty_like(flight.delta))
        return gta.merge(flight.delta, denominator)


@dataclass
class _QuantizedFlight:
    shard: BucketShard
    delta: torch.Tensor
    keep: Sequence[Tuple[int, int]]
    stage: object
    """The :class:`~megatron_edit.exchange.quantized.QuantizedExchange` stage in flight."""


class QuantizedReducer(Reducer):
    """The quantized exchange (:class:`~megatron_edit.exchange.quantized.QuantizedExchange`) of
    each worker's weighted Delta. ``mean``: the owner of a chunk divides its sum by the workers
    (the plain mean); False for a weighted sum. Skipped layers (``keep``) carry their error-
    feedback residuals on."""

    def __init__(self, exchange: QuantizedExchange, own_weights: Optional[torch.Tensor], mean: bool):
        self.exchange = exchange
        self.own_weights = own_weights
        self.mean = mean

    def launch(self, shard, delta, keep=()) -> _QuantizedFlight:
        weigh(shard, delta, self.own_weights)
        keep = list(keep)
        return _QuantizedFlight(shard, delta, keep, self.exchange.launch(shard, delta, keep))

    def advance(self, flight: _QuantizedFlight) -> None:
        flight.stage = self.exchange.advance(flight.shard, flight.stage, self.mean, flight.keep)

    def finish(self, flight: _QuantizedFlight) -> torch.Tensor:
        self.exchange.finish(flight.shard, flight.stage, flight.delta, self.mean, flight.keep)
        return flight.delta


@dataclass
class _SparseFlight:
    delta: torch.Tensor
    stage: object
    """The :class:`~megatron_edit.exchange.sparse.SparseExchange` all-gather in flight."""


class SparseReducer(Reducer):
    """The sparse exchange (:class:`~megatron_edit.exchange.sparse.SparseExchange`) of each
    worker's weighted Delta: one all-gather of the top-k payloads. ``mean``: divide the sum by
    the workers (the plain mean); False for a weighted sum. Skipped layers (``keep``) carry their
    error-feedback residuals on."""

    def __init__(self, exchange: SparseExchange, own_weights: Optional[torch.Tensor], mean: bool):
        self.exchange = exchange
        self.own_weights = own_weights
        self.mean = mean

    def launch(self, shard, delta, keep=()) -> _SparseFlight:
        weigh(shard, delta, self.own_weights)
        return _SparseFlight(delta, self.exchange.launch(shard, delta, list(keep)))

    def finish(self, flight: _SparseFlight) -> torch.Tensor:
        self.exchange.finish(flight.stage, flight.delta, self.mean)
        return flight.delta


Protocol = Union[QuantizedExchange, SparseExchange, None]


def exchange_protocol(config: LocalSGDConfig, sync_group, num_workers: int) -> Protocol:
    """The compressed exchange ``config`` asks for (its format): the sparse (top-k) or the quantized
    exchange's protocol, or None for fp32, or when one worker has nobody to exchange with (over
    torchft the workers of a sync may change: a protocol all the same)."""
    if not (num_workers > 1 or getattr(sync_group, "dynamic", False)):
        return None
    if config.exchange_topk_density is not None:
        return SparseExchange(sync_group, config.exchange_topk_density, config.exchange_topk_chunk,
                              config.exchange_dtype, config.error_feedback)
    if config.exchange_dtype != "fp32":
        return QuantizedExchange(sync_group, config.exchange_dtype, config.exchange_block_size,
                                 config.error_feedback)
    return None


def choose(members: Sequence[BucketShard], *, sync_group, protocol: Protocol, gta_config: GTAConfig,
           weights: Optional[torch.Tensor], own_weights: Optional[torch.Tensor], step: int, shard_rank: int,
           defer: bool) -> Tuple[int, List[Reducer]]:
    """The reducer of each of a sync's ``members``, with the sync's weights (None: the plain mean),
    and the divisor left to the outer step. ``defer``: the plain mean's division is left to the
    fused outer step (one pass less). GTA when configured; else the compressed exchange where it
    pays off (tiny shards go in fp32: a few elements per worker weigh less than scales and
    padding), the (weighted) mean elsewhere."""
    defer = weights is None and defer
    divisor = mean_divisor(sync_group) if defer else 1
    gta_on = gta_config.reducer == "gta"
    if gta_on:
        chosen = GTAReducer(sync_group, gta_config, weights, step, shard_rank)
    else:
        chosen = MeanReducer(sync_group, own_weights, divide=weights is None and not defer)
    compressed = None
    if gta_on or protocol is None:
        pass
    elif isinstance(protocol, QuantizedExchange):
        if sync_group.size > 1:
            compressed = QuantizedReducer(protocol, own_weights, mean=weights is None)
    else:
        compressed = SparseReducer(protocol, own_weights, mean=weights is None)
    return divisor, [compressed if compressed is not None and protocol.pays_off(shard.numel) else chosen
                     for shard in members]
