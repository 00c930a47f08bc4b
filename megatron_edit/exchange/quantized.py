"""The quantized exchange of pseudo-gradients: reduce-scatter of quantized chunks, then
all-gather of the quantized result (as torchft's quantized all-reduce), with error feedback.

Summing quantized values would overflow (and each worker's blocks have their own scales), so a
quantized exchange is not an all-reduce. Per shard, with W workers and the shard cut into W
chunks (whole blocks, :func:`~megatron_edit.algorithm.quantize.split_sizes`):

1. every worker quantizes its (weighted) pseudo-gradient chunk by chunk and sends chunk c to
   worker c (one all-to-all);
2. worker c decodes the W versions of its chunk, adds them in fp32 in worker order (divides by W
   for the plain mean), quantizes the result and all-gathers it (one all-gather);
3. every worker decodes the same bytes: replicas stay bitwise identical.

Each worker sends 2 (W - 1) / W times the quantized shard, against 2 (W - 1) / W times the fp32
shard for a ring all-reduce: int8 moves 0.254x the bytes of fp32, int4 0.129x (block 256).

Chunk sizes: every chunk is padded to whole blocks and carries one fp32 scale per block. A
shard of S elements over W workers gives chunks of m = ceil(S / W) elements, each cut into
n = ceil(m / block) blocks of ceil(m / n) elements rounded up to even (int4 packs two per
byte; :meth:`QuantizedExchange.block_for`): the configured size, or a little less, so that a
chunk is padded by under 2 n elements. A stage then sends ``W x (ceil(p x bits / 32) x 4 + 4 n)``
bytes (p: the padded chunk, under m + 2 n elements) against ``4 S`` for fp32, and both stages
together at most ``(bits / 32 + 3 / (2 block)) x (1 + W / S) + 2 W / S`` times the
fp32 ring all-reduce, for every S and W (:meth:`QuantizedExchange.payload_ratio`; int8 with
block 256: 0.254x once S / W is a multiple of 256). Blocks of the configured size would pad a
chunk to whole blocks of it: a chunk just over one block (int8, W = 4, S = 1026) sent two, 0.507x
fp32, and a block that spanned the whole shard sent up to W blocks for a few elements. A shard
for which the quantized exchange still sends more than the fp32 bytes (a few elements per
worker) is exchanged in fp32 instead (:meth:`QuantizedExchange.pays_off`).

Layers every worker is excluded from (the penalty skips their outer step) keep their error-
feedback residuals: nothing is sent for them and what was carried is carried on.

Error feedback (``exchange_error_feedback``): what step 1 dropped from this worker's pseudo-
gradient is added to its next one (``shard.residual``), and what step 2 dropped from the chunk
this worker owns is added to that chunk's next result (``shard.chunk_residual``), so the sum of
the applied updates over syncs follows the sum of the true ones within one quantum. At a change
of format (``auto_overlap``) the residual is carried over and the chunk residual folded into it
(:meth:`QuantizedExchange.fold_chunk_residuals`; the rule: :mod:`megatron_edit.algorithm.residual`);
without error feedback a residual found is sent once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ..algorithm import quantize, wire
from ..algorithm.residual import fold_chunk_residual, fold_into
from .groups import all_reduce_bytes, mean_divisor
from .shard import BucketShard


@dataclass
class _Stage:
    """A shard's exchange in flight: which collective, and the buffers it writes."""

    second: bool
    handle: object
    received: torch.Tensor
    sizes: List[int]
    chunk_bytes: int


class QuantizedExchange:
    def __init__(self, sync_group, dtype: str, block: int, error_feedback: bool):
        self.sync_group = sync_group
        self.dtype = dtype
        self.block = block
        self.error_feedback = error_feedback
        self.error_sq = 0.0
        """Squared norm of what quantization changed in this rank's last sync (a device 0-dim
        tensor while a sync runs; see :meth:`take_error_norm`)."""

    def block_for(self, numel: int) -> int:
        """The block size used for a shard of ``numel`` elements
        (:func:`~megatron_edit.algorithm.wire.quantized_block`: the configured (even) size when
        it divides a worker's chunk, else a little less; see the module docstring)."""
        return wire.quantized_block(numel, self.sync_group.size, self.dtype, self.block)

    def _chunks(self, numel: int):
        workers, block = self.sync_group.size, self.block_for(numel)
        sizes = list(quantize.split_sizes(numel, workers, self.dtype, block))
        per = max(sizes) if sizes else 0  # whole blocks (split_sizes)
        chunk_bytes = quantize.encoded_bytes(per, self.dtype, block)
        offsets = [sum(sizes[:w]) for w in range(workers)]
        return sizes, offsets, per, chunk_bytes, block

    def chunk_span(self, numel: int):
        """(offset, length, padded length) of the chunk of a ``numel`` shard this worker reduces."""
        sizes, offsets, per, _, _ = self._chunks(numel)
        me = self.sync_group.rank
        return offsets[me], sizes[me], per

    def _encode_padded(self, values: torch.Tensor, per: int, block: int) -> torch.Tensor:
        if values.numel() < per:
            values = torch.cat([values, values.new_zeros(per - values.numel())])
        return quantize.encode(values, self.dtype, block)

    def _decode(self, data: torch.Tensor, numel: int, per: int, block: int) -> torch.Tensor:
        return quantize.decode(data, per, self.dtype, block)[:numel]

    def _add_error(self, before: torch.Tensor, after: torch.Tensor) -> None:
        err = (before - after).pow(2).sum()
        self.error_sq = err if isinstance(self.error_sq, float) else self.error_sq + err

    def take_error_norm(self) -> Optional[torch.Tensor]:
        """The quantization error norm of the sync just finished (a 0-dim tensor on the device:
        nothing waits for it), then reset."""
        value, self.error_sq = self.error_sq, 0.0
        return value.sqrt() if torch.is_tensor(value) else None

    @staticmethod
    def _carry(values: torch.Tensor, residual: torch.Tensor, keep: Sequence[Tuple[int, int]]):
        """For the ranges in ``keep`` (a skipped layer's, in ``values``' coordinates): send 0
        there and return the residual's values, to be put back after it is recomputed."""
        saved = []
        for s, e in keep:
            values[s:e].zero_()
            saved.append((s, e, residual[s:e].clone()))
        return saved

    @staticmethod
    def _restore(residual: torch.Tensor, saved) -> None:
        for s, e, values in saved:
            residual[s:e].copy_(values)

    @torch.no_grad()
    def launch(self, shard: BucketShard, delta: torch.Tensor, keep: Sequence[Tuple[int, int]] = ()) -> _Stage:
        """Step 1: quantize ``delta`` (+ the residual) chunk by chunk, start the all-to-all; the
        stage in flight. ``keep``: ranges of skipped layers, whose residual is carried on
        unchanged."""
        sizes, offsets, per, chunk_bytes, block = self._chunks(shard.numel)
        saved = []
        if self.error_feedback:
            if shard.residual is None:
                shard.residual = torch.zeros_like(delta)
            delta.add_(shard.residual)
            saved = self._carry(delta, shard.residual, keep)
        else:  # a residual left by another format (auto_overlap): sent once
            shard.residual = fold_into(delta, shard.residual, keep)
        parts = [self._encode_padded(delta[o : o + n], per, block) for o, n in zip(offsets, sizes)]
        send = torch.cat(parts)
        sent = torch.cat([self._decode(p, n, per, block) for p, n in zip(parts, sizes)])
        self._add_error(delta, sent)
        if self.error_feedback:
            torch.sub(delta, sent, out=shard.residual)
            self._restore(shard.residual, saved)
        received = torch.empty_like(send)
        handle = self.sync_group.all_to_all(received, send, async_op=True)
        return _Stage(False, handle, received, sizes, chunk_bytes)

    @torch.no_grad()
    def advance(self, shard: BucketShard, stage: _Stage, mean: bool, keep: Sequence[Tuple[int, int]] = ()) -> _Stage:
        """Step 2 once step 1 (``stage``) is in: reduce the owned chunk in fp32, requantize,
        start the all-gather; the stage now in flight (``stage`` itself if step 2 has begun)."""
        if stage.second:
            return stage
        stage.handle.wait()
        workers, me = self.sync_group.size, self.sync_group.rank
        sizes, offsets, per, chunk_bytes, block = self._chunks(shard.numel)
        own = torch.zeros(sizes[me], dtype=torch.float32, device=stage.received.device)
        for w in range(workers):  # worker order: the same sum wherever it is computed
            own += self._decode(stage.received[w * chunk_bytes : (w + 1) * chunk_bytes], sizes[me], per, block)
        if mean:
            own /= mean_divisor(self.sync_group)
        saved = []
        if self.error_feedback:
            if shard.chunk_residual is None:
                shard.chunk_residual = torch.zeros(per, dtype=torch.float32, device=own.device)
            own += shard.chunk_residual[: own.numel()]
            start, end = offsets[me], offsets[me] + sizes[me]  # keep's ranges, in chunk coordinates
            mine = [(max(s, start) - start, min(e, end) - start) for s, e in keep if s < end and e > start]
            saved = self._carry(own, shard.chunk_residual, mine)
        data = self._encode_padded(own, per, block)
        sent = self._decode(data, own.numel(), per, block)
        self._add_error(own, sent)
        if self.error_feedback:
            torch.sub(own, sent, out=shard.chunk_residual[: own.numel()])
            self._restore(shard.chunk_residual, saved)
        gathered = torch.empty(workers * chunk_bytes, dtype=torch.uint8, device=data.device)
        handle = self.sync_group.all_gather_into(gathered, data, async_op=True)
        return _Stage(True, handle, gathered, sizes, chunk_bytes)

    @torch.no_grad()
    def finish(self, shard: BucketShard, stage: _Stage, delta: torch.Tensor, mean: bool,
               keep: Sequence[Tuple[int, int]] = ()) -> None:
        """Wait for both steps; ``delta`` := the decoded result (the same bytes everywhere)."""
        stage = self.advance(shard, stage, mean, keep)
        stage.handle.wait()
        sizes, offsets, per, chunk_bytes, block = self._chunks(shard.numel)
        for w, (o, n) in enumerate(zip(offsets, sizes)):
            if n:
                delta[o : o + n] = self._decode(stage.received[w * chunk_bytes : (w + 1) * chunk_bytes], n, per, block)

    @torch.no_grad()
    def fold_chunk_residuals(self, shards: Sequence[BucketShard], factor: float) -> None:
        """This exchange's format gives way to another (``auto_overlap``, between syncs): each
        shard's chunk residual, laid out over the chunk this worker owns in this format, is
        folded into its own residual (times ``factor``, what the next result is divided by),
        then restarts (:func:`~megatron_edit.algorithm.residual.fold_chunk_residual`)."""
        for shard in shards:
            if shard.chunk_residual is not None:
                offset, length, _ = self.chunk_span(shard.numel)
                shard.residual = fold_chunk_residual(shard.residual, shard.chunk_residual, offset, length, factor,
                                                     shard.numel)
                shard.chunk_residual = None

    def pays_off(self, numel: int) -> bool:
        """Whether a shard of ``numel`` elements is worth quantizing: it sends no more bytes
        than fp32. Smaller shards (a few elements per worker, where the scales and padding
        weigh more than the elements) are exchanged in fp32, exactly, by the caller."""
        return self.payload_ratio(numel) <= 1.0

    def payload_ratio(self, numel: int = 1 << 20) -> float:
        """Bytes this rank sends per sync for a shard of ``numel`` elements, relative to an fp32
        ring all-reduce of it (both stages, scales and padding included)."""
        workers = self.sync_group.size
        if workers == 1:
            return 0.0
        *_, chunk_bytes, _ = self._chunks(numel)
        quantized = 2 * (workers - 1) * chunk_bytes  # all-to-all of W chunks + all-gather of one
        return quantized / all_reduce_bytes(4 * numel, workers)
