"""The sparse exchange of pseudo-gradients (SparseLoCo, arXiv 2508.15706): every worker sends the
top-k entries of each chunk of its pseudo-gradient (indices and low-bit values,
:mod:`megatron_edit.algorithm.topk`), with error feedback.

The workers keep different entries, so their payloads cannot be summed on the wire: per shard,

1. every worker adds its residual to its (weighted) pseudo-gradient, encodes it
   (:func:`~megatron_edit.algorithm.topk.encode`; the same size on every worker) and keeps
   what was not sent as its next residual;
2. one all-gather brings every worker's payload to every worker;
3. every worker decodes the W payloads and adds them in fp32 in worker order (divided by W for
   the plain mean): the same bytes in the same order everywhere, so replicas stay bitwise
   identical.

Each rank sends (W - 1) payloads (a ring all-gather), against 2 (W - 1) / W x 4 bytes per
element for the fp32 all-reduce: at density 2% with int2 values and chunks of 4096 a payload is
0.036 bytes per element, 0.009x fp32's bytes with 2 workers and 0.018x with 4. The all-gather's
bytes grow with W and the dense int4 exchange's (:mod:`.quantized`) do not, so from some W on
(29 for those settings: :func:`~megatron_edit.algorithm.wire.dense_int4_cheaper_from`) the
dense int4 exchange sends fewer bytes; such a setting is refused (:class:`SparseExchange`), never
switched silently. A shard smaller than a chunk is one chunk; a shard for which the payloads
are still more than the fp32 all-reduce (a few elements) is exchanged in fp32 instead
(:meth:`SparseExchange.pays_off`), as the quantized exchange does.

Error feedback (``LocalSGDConfig.error_feedback``, on by default with top-k): ``shard.residual``
holds what this worker did not send (the entries not kept, and what rounding changed in those
kept); there is no second quantization, so ``shard.chunk_residual`` stays unused. Layers every
worker is excluded from (the penalty skips their outer step) send nothing and keep their
residuals. At a change of format (``auto_overlap``) the residual is carried over, in either
direction (the same elements, the same meaning: :mod:`megatron_edit.algorithm.residual`); a
quantized exchange's chunk residual is folded into it first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

import torch

from ..algorithm import topk, wire
from ..algorithm.residual import fold_into
from ..config import FLAG_NAMES, ConfigError
from .groups import all_reduce_bytes, mean_divisor
from .shard import BucketShard


def check_sparse_workers(workers: int, density: float, chunk: int, dtype: str) -> None:
    """Refuse ``workers`` from which the dense int4 exchange sends fewer bytes than the top-k
    all-gather at these settings (never switched silently)."""
    cheaper = wire.dense_int4_cheaper_from(density, chunk, dtype)
    if workers >= cheaper:
        raise ConfigError(
            f"{FLAG_NAMES['exchange_topk_density']} {density} with {FLAG_NAMES['exchange_dtype']} {dtype} "
            f"and {FLAG_NAMES['exchange_topk_chunk']} {chunk}: an all-gather of {workers} workers' payloads "
            f"sends more bytes than the dense int4 exchange, which is cheaper from {cheaper} workers on; "
            f"use {FLAG_NAMES['exchange_dtype']} int4 without {FLAG_NAMES['exchange_topk_density']}, "
            "or a lower density.")


@dataclass
class _Stage:
    """A shard's all-gather in flight."""

    handle: object
    gathered: torch.Tensor
    payload_bytes: int


class SparseExchange:
    def __init__(self, sync_group, density: float, chunk: int, dtype: str, error_feedback: bool):
        self.sync_group = sync_group
        self.density = density
        self.chunk = chunk
        self.dtype = dtype
        self.error_feedback = error_feedback
        self.error_sq = 0.0
        """Squared norm of what was not sent in this rank's last sync (a device 0-dim tensor
        while a sync runs; see :meth:`take_error_norm`)."""
        self.cheaper_from = wire.dense_int4_cheaper_from(density, chunk, dtype)
        """Workers from which the dense int4 exchange sends fewer bytes (refused from there on)."""
        check_sparse_workers(sync_group.size, density, chunk, dtype)

    def chunk_for(self, numel: int) -> int:
        """The chunk of a shard of ``numel`` elements: the configured one, or the whole shard
        when it is smaller (:func:`~megatron_edit.algorithm.wire.topk_chunk`)."""
        return wire.topk_chunk(numel, self.chunk)

    def payload_bytes(self, numel: int) -> int:
        return topk.encoded_bytes(numel, self.density, self.chunk_for(numel), self.dtype)

    def chunk_span(self, numel: int) -> Tuple[int, int, int]:
        """No chunk of the result is reduced (and requantized) by one worker: an empty span (the
        checkpoint's result residual is then all zeros)."""
        return 0, 0, 0

    def _encode(self, values: torch.Tensor) -> torch.Tensor:
        return topk.encode(values, self.density, self.chunk_for(values.numel()), self.dtype)

    def _decode(self, data: torch.Tensor, numel: int) -> torch.Tensor:
        return topk.decode(data, numel, self.density, self.chunk_for(numel), self.dtype)

    def _add_error(self, before: torch.Tensor, after: torch.Tensor) -> None:
        err = (before - after).pow(2).sum()
        self.error_sq = err if isinstance(self.error_sq, float) else self.error_sq + err

    def take_error_norm(self) -> Optional[torch.Tensor]:
        """The norm of what was not sent in the sync just finished (a 0-dim tensor on the
        device: nothing waits for it), then reset."""
        value, self.error_sq = self.error_sq, 0.0
        return value.sqrt() if torch.is_tensor(value) else None

    @torch.no_grad()
    def launch(self, shard: BucketShard, delta: torch.Tensor, keep: Sequence[Tuple[int, int]] = ()) -> _Stage:
        """Steps 1 and 2: encode ``delta`` (+ the residual), keep what was not sent, start the
        all-gather. ``keep``: ranges of skipped layers, whose residual is carried on unchanged."""
        if getattr(self.sync_group, "dynamic", False) and self.sync_group.size >= self.cheaper_from:
            check_sparse_workers(self.sync_group.size, self.density, self.chunk, self.dtype)  # torchft: it grew
        saved = []
        if self.error_feedback:
            if shard.residual is None:
                shard.residual = torch.zeros_like(delta)
            delta.add_(shard.residual)
        else:  # a residual left by another format (auto_overlap): sent once
            shard.residual = fold_into(delta, shard.residual, keep)
        for s, e in keep:  # nothing is sent for a skipped layer; its residual stays as it was
            delta[s:e].zero_()
            if self.error_feedback:
                saved.append((s, e, shard.residual[s:e].clone()))
        payload = self._encode(delta)
        sent = self._decode(payload, delta.numel())
        self._add_error(delta, sent)
        if self.error_feedback:
            torch.sub(delta, sent, out=shard.residual)
            for s, e, values in saved:
                shard.residual[s:e].copy_(values)
        gathered = torch.empty(self.sync_group.size * payload.numel(), dtype=torch.uint8, device=payload.device)
        handle = self.sync_group.all_gather_into(gathered, payload, async_op=True)
        return _Stage(handle, gathered, payload.numel())

    @torch.no_grad()
    def finish(self, stage: _Stage, delta: torch.Tensor, mean: bool) -> None:
        """Step 3: ``delta`` := the sum of every worker's decoded payload in worker order (the
        mean: divided by the workers that trained since the last sync, :func:`.groups.mean_divisor`);
        the same bytes everywhere."""
        stage.handle.wait()
        workers, size = self.sync_group.size, stage.payload_bytes
        delta.zero_()
        for w in range(workers):  # worker order: the same sum wherever it is computed
            delta += self._decode(stage.gathered[w * size : (w + 1) * size], delta.numel())
        if mean:
            delta /= mean_divisor(self.sync_group)

    def pays_off(self, numel: int) -> bool:
        """Whether a shard of ``numel`` elements is worth sparsifying: it sends no more bytes
        than fp32. Smaller shards (a few elements, where indices and scales weigh more than
        the values) are exchanged in fp32, exactly, by the caller."""
        return self.payload_ratio(numel) <= 1.0

    def payload_ratio(self, numel: int = 1 << 20) -> float:
        """Bytes this rank sends per sync for a shard of ``numel`` elements, relative to an fp32
        ring all-reduce of it (indices, scales and padding included)."""
        workers = self.sync_group.size
        if workers == 1:
            return 0.0
        return (workers - 1) * self.payload_bytes(numel) / all_reduce_bytes(4 * numel, workers)
