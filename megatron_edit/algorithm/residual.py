"""Error feedback's residuals across a change of exchange format (``auto_overlap`` with
``exchange_error_feedback``; EDiT, arXiv 2412.07210, with the quantized exchange of
:mod:`megatron_edit.exchange.quantized` and SparseLoCo's top-k exchange, arXiv 2508.15706, of
:mod:`megatron_edit.exchange.sparse`): the rule, as pure tensor functions.

A shard carries up to two residuals:

* ``residual``: what this worker's encoder did not send of its (weighted) pseudo-gradient, in
  fp32, one per element of the shard, in the units the worker sends. Both exchanges have it,
  with the same layout (the shard's elements) and the same meaning (the unsent part of the
  pseudo-gradient), whatever the format: it is **carried over** unchanged, and the next
  exchange adds it to the next pseudo-gradient, in whatever format.
* ``chunk_residual``: the quantized exchange's only: what requantizing the reduced chunk this
  worker owns dropped, in the units of the *result* (after the plain mean's division), laid
  out over that chunk (padded to whole blocks). Which elements a worker owns depends on the
  format (its blocks and padding), and the top-k exchange reduces no chunk: it has no
  well-defined place in another format. At a change of format it is **folded into this
  worker's own residual** (:func:`fold_chunk_residual`): at its chunk's elements, times what
  the next result is divided by (the workers for the plain mean, 1 for a weighted sum), so the
  next result carries what it would have added; nothing is dropped. Its layout restarts
  (zeros) in the new format.

An exchange without error feedback (fp32, or a shard too small for the compressed exchange
to pay off, sent in fp32) adds a residual it finds to the pseudo-gradient it sends, once
(:func:`fold_into`): the fp32 exchange drops nothing, so nothing is left to carry, except
over the layers every worker is excluded from this sync (their outer step is skipped), where
the residual is kept for the next sync, as the compressed exchanges keep it.

Without a change of format nothing here runs: a run that keeps a format equals that fixed
setting's run bit for bit.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch


@torch.no_grad()
def fold_chunk_residual(residual: Optional[torch.Tensor], chunk_residual: torch.Tensor, offset: int, length: int,
                        factor: float, numel: int) -> torch.Tensor:
    """This worker's residual with its owned chunk's residual folded in:
    ``residual[offset : offset + length] += factor * chunk_residual[:length]`` (a residual of
    zeros of ``numel`` elements when there was none). ``factor``: the divisor of the next
    result (the workers for the plain mean, 1 for a weighted sum)."""
    if residual is None:
        residual = torch.zeros(numel, dtype=torch.float32, device=chunk_residual.device)
    if length:
        residual[offset : offset + length].add_(chunk_residual[:length], alpha=factor)
    return residual


@torch.no_grad()
def fold_into(delta: torch.Tensor, residual: Optional[torch.Tensor],
              keep: Sequence[Tuple[int, int]] = ()) -> Optional[torch.Tensor]:
    """An exchange without error feedback: ``delta`` (what this worker sends, in place) gets the
    residual added outside the ranges ``keep`` (layers every worker is excluded from); returns
    what is left to carry: the residual over ``keep`` (zeros elsewhere), or None when nothing is."""
    if residual is None:
        return None
    if not keep:
        delta.add_(residual)
        return None
    left = torch.zeros_like(residual)
    for s, e in keep:
        left[s:e].copy_(residual[s:e])
    delta.add_(residual - left)
    return left
