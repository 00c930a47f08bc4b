"""GTA ("generalized task arithmetic") reduction of pseudo-gradients, as pure functions.

Instead of the (weighted) mean, each worker may sparsify its pseudo-gradient Delta_i; the
entries whose sign agrees with the majority are kept; the kept entries are averaged:

1. sparsify: keep a ``density`` fraction of each parameter shard's entries, by ``magnitude``
   (largest |Delta|), ``random``, or ``rescaled_random`` (random, kept entries / density).
   The sparsified tensor is the one that is synchronised (the reference implementation rebound a
   local variable, so with density < 1 nothing was synchronised and replicas diverged).
2. consensus sign per entry: ``sum``: sign(sum_i w_i Delta_i); ``count``: sign(sum_i sign
   Delta_i); None: no consensus (every nonzero entry is kept).
3. merge: sum_i w_i kept_i, divided (``normalize``) by sum_i w_i [kept_i != 0], the weight of
   the workers that kept the entry (0 where none did).

Masks travel compactly with ``int8_mask``: the count consensus as int8 sums of signs, and the
"who kept this entry" mask as one bit per worker in the smallest integer type that holds every
worker's bit (uint8 up to 8 workers), whose all-reduce SUM is a bitwise OR; each rank decodes
the denominator with the (globally known) weights. Traffic per bucket, relative to the plain
mean's one fp32 all-reduce: see :func:`traffic_ratio`.
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Tuple

import torch

Segment = Tuple[int, int, int, bool]  # (start, end, layer, counts_in_norm)


def sparsify(
    delta: torch.Tensor,
    segments: Iterable[Segment],
    density: float,
    method: Optional[str],
    generator: Optional[torch.Generator] = None,
) -> torch.Tensor:
    """In place: keep a ``density`` fraction of each segment (one parameter's shard)."""
    if method is None or density >= 1.0:
        return delta
    for s, e, _, _ in segments:
        part = delta[s:e]
        n = e - s
        if n == 0:
            continue
        if method == "magnitude":
            k = max(1, math.ceil(density * n))
            if k < n:
                keep = torch.zeros(n, dtype=torch.bool, device=part.device)
                keep[part.abs().topk(k, sorted=False).indices] = True
                part.masked_fill_(~keep, 0.0)
        else:
            keep = torch.rand(n, generator=generator, device="cpu").to(part.device) < density
            part.masked_fill_(~keep, 0.0)
            if method == "rescaled_random":
                part.div_(density)
    return delta


def consensus_message(delta: torch.Tensor, method: str, int8: bool) -> torch.Tensor:
    """What a worker contributes to the consensus all-reduce (``delta`` already weighted for
    ``sum``): the weighted Delta itself, or its signs (int8 when compact)."""
    if method == "sum":
        return delta.clone()
    signs = torch.sign(delta)
    return signs.to(torch.int8) if int8 else signs


def agree(delta: torch.Tensor, reduced_consensus: Optional[torch.Tensor]) -> torch.Tensor:
    """In place: zero the entries of ``delta`` whose sign differs from the consensus."""
    if reduced_consensus is None:
        return delta
    majority = torch.sign(reduced_consensus.to(delta.dtype))
    return delta.masked_fill_(torch.sign(delta) != majority, 0.0)


def mask_dtype(workers: int) -> torch.dtype:
    """Smallest integer type with one bit per worker that gloo and NCCL can all-reduce (gloo
    has no int16); bit sums never carry."""
    for dtype, bits in ((torch.uint8, 8), (torch.int32, 31), (torch.int64, 63)):
        if workers <= bits:
            return dtype
    raise ValueError(f"int8_mask supports at most 63 workers, got {workers}")


def encode_mask_bits(kept: torch.Tensor, worker: int, workers: int) -> torch.Tensor:
    """Bit ``worker`` set where this worker kept an entry; summing over workers is an OR."""
    return (kept != 0).to(mask_dtype(workers)) * (1 << worker)


def decode_denominator(
    bits: torch.Tensor, segments: Iterable[Segment], weights: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """sum_i w_i[layer] * bit_i, per segment, from the OR of every worker's bits."""
    out.zero_()
    wide = bits.to(torch.int64)
    for s, e, layer, _ in segments:
        for worker in range(weights.shape[0]):
            w = float(weights[worker, layer])
            if w != 0.0:
                out[s:e] += ((wide[s:e] >> worker) & 1).to(out.dtype) * w
    return out


def merge(numerator: torch.Tensor, denominator: Optional[torch.Tensor]) -> torch.Tensor:
    """In place: the normalized mean of the kept entries (0 where no worker kept one)."""
    if denominator is None:
        return numerator
    kept = denominator > 0
    numerator.div_(torch.where(kept, denominator, torch.ones_like(denominator)))
    return numerator.masked_fill_(~kept, 0.0)


def traffic_ratio(consensus: Optional[str], normalize: bool, int8_mask: bool) -> float:
    """Bytes sent per bucket relative to the plain mean (one fp32 all-reduce of the shard)."""
    mask = 0.25 if int8_mask else 1.0  # up to 8 workers: one byte per entry
    ratio = 1.0  # the weighted kept entries
    if consensus == "sum":
        ratio += 1.0
    elif consensus == "count":
        ratio += 0.25 if int8_mask else 1.0
    if normalize:
        ratio += mask
    return ratio
