"""EDiT's pseudo-gradient penalty, as pure functions (arXiv 2412.07210, Sec. 3.3).

All decisions are per layer and per worker and take as input the matrix ``norms[w, l]``: the
L2 norm of worker w's pseudo-gradient over the *whole* layer l (every shard and tensor-parallel
slice of it). Every rank of every worker receives the same matrix, so every rank takes the same
decisions, without further communication.

1. Anomaly elimination: an exponentially weighted mean/variance of each (worker, layer) norm;
   after ``warmup`` syncs a z-score above ``threshold`` excludes that worker from the layer's
   average, and the outlier is *not* fed into the statistics (the reference implementation fed
   ``norm + 1e6`` into them, so sigma exploded after the first anomaly and later spikes were
   missed). A non-finite norm is always excluded, even during warmup.
2. Weighted averaging: weights softmax(-norm / T) over the workers not excluded (plain mean over
   them when not weighted). A layer whose workers are all excluded gets no outer step.
3. Clipping: the averaged pseudo-gradient of a layer is scaled by min(1, tau / ||avg||).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch


@dataclass
class EWMAStats:
    """Running statistics of pseudo-gradient norms, one entry per (worker, layer)."""

    mean: torch.Tensor  # float64 [W, L]
    var: torch.Tensor  # float64 [W, L]
    count: torch.Tensor  # int64 [W, L]: syncs that updated the entry

    @classmethod
    def zeros(cls, workers: int, layers: int) -> "EWMAStats":
        z = torch.zeros(workers, layers, dtype=torch.float64)
        return cls(z.clone(), z.clone(), torch.zeros(workers, layers, dtype=torch.int64))

    def clone(self) -> "EWMAStats":
        return EWMAStats(self.mean.clone(), self.var.clone(), self.count.clone())

    def state_dict(self) -> dict:
        return {"mean": self.mean.clone(), "var": self.var.clone(), "count": self.count.clone()}

    @classmethod
    def from_state_dict(cls, state: dict) -> "EWMAStats":
        return cls(state["mean"].clone(), state["var"].clone(), state["count"].clone())


def detect_anomalies(
    norms: torch.Tensor, stats: EWMAStats, alpha: float, warmup: int, threshold: float
) -> Tuple[torch.Tensor, EWMAStats]:
    """Returns (excluded [W, L] bool, updated statistics); ``stats`` is not modified.

    z = (norm - mean) / std, with std floored at 1e-6 * |mean| so constant norms do not make
    every later wiggle an anomaly. Excluded entries keep their previous statistics.
    """
    norms = norms.to(torch.float64)
    finite = torch.isfinite(norms)
    std = stats.var.clamp_min(0).sqrt().maximum(1e-6 * stats.mean.abs() + 1e-12)
    z = (norms - stats.mean) / std
    warmed = stats.count >= warmup
    excluded = ~finite | (warmed & (z > threshold))

    update = ~excluded
    first = update & (stats.count == 0)
    later = update & (stats.count > 0)
    diff = norms - stats.mean
    new = stats.clone()
    new.mean = torch.where(first, norms, torch.where(later, stats.mean + alpha * diff, stats.mean))
    new.var = torch.where(
        first,
        torch.zeros_like(norms),
        torch.where(later, (1 - alpha) * (stats.var + alpha * diff * diff), stats.var),
    )
    new.count = stats.count + update.to(torch.int64)
    return excluded, new


def averaging_weights(
    norms: torch.Tensor,
    excluded: Optional[torch.Tensor],
    weighted: bool,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-layer weights of the workers, ``[W, L]`` float64, each column summing to 1 (or to 0
    where every worker is excluded).

    ``weighted``: softmax(-norm / temperature) over the workers not excluded; otherwise the
    plain mean over them. A non-finite norm of a worker that is not excluded poisons its layer
    (that is what happens without anomaly elimination).
    """
    norms = norms.to(torch.float64)
    if excluded is None:
        excluded = torch.zeros_like(norms, dtype=torch.bool)
    keep = ~excluded
    if weighted:
        logits = torch.where(keep, -norms / temperature, torch.full_like(norms, float("-inf")))
        # A column with every worker excluded would be all -inf: softmax -> NaN; make it 0.
        any_kept = keep.any(dim=0, keepdim=True)
        logits = torch.where(any_kept, logits, torch.zeros_like(logits))
        weights = torch.softmax(logits, dim=0)
        return torch.where(any_kept, weights, torch.zeros_like(weights))
    counts = keep.sum(dim=0, keepdim=True).to(torch.float64)
    return torch.where(keep, 1.0 / counts.clamp_min(1), torch.zeros_like(norms))


def skipped_layers(excluded: Optional[torch.Tensor], layers: int) -> torch.Tensor:
    """[L] bool: layers whose outer step is skipped because every worker was excluded."""
    if excluded is None:
        return torch.zeros(layers, dtype=torch.bool)
    return excluded.all(dim=0)


def clip_coefficients(avg_norms: torch.Tensor, max_norm: Optional[float]) -> torch.Tensor:
    """[L] float64: min(1, max_norm / ||averaged pseudo-gradient of the layer||)."""
    avg_norms = avg_norms.to(torch.float64)
    if max_norm is None:
        return torch.ones_like(avg_norms)
    return torch.clamp(max_norm / (avg_norms + 1e-12), max=1.0)
