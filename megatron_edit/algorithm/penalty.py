"""EDiT's pseudo-gradient penalty, as pure functions (arXiv 2412.07210, Sec. 3.3).

All decisions are per layer and per worker and take as input the matrix ``norms[w, l]``: the
L2 norm of worker w's pseudo-gradient over the *whole* layer l (every shard and tensor-parallel
slice of it). Every rank of every worker receives the same matrix, so every rank takes the same
decisions, without further communication.

1. Anomaly elimination: an exponentially weighted mean/variance of each (worker, layer) norm;
   after ``warmup`` syncs a z-score above ``threshold`` excludes that worker from the layer's
   average, and the outlier is *not* fed into the statistics (the reference implementation fed
   ``norm + 1e6`` into them, so sigma exploded after the first anomaly and later spikes were
   missed). An anomaly is one worker's: the norm must also be anomalous *relative to the
   workers' median norm* of the layer (its own EWMA statistics too), so a shift that all or
   most workers see (a learning-rate or batch-size change, a resume with another H) is learned
   instead of excluding every worker from then on. A non-finite norm is always excluded, even
   during warmup.
2. Weighted averaging: weights softmax(-norm / T) over the workers not excluded (plain mean over
   them when not weighted). A layer whose workers are all excluded gets no outer step.
3. Clipping: the averaged pseudo-gradient of a layer is scaled by min(1, tau / ||avg||).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch


@dataclass
class EWMAStats:
    """Running statistics of pseudo-gradient norms, one entry per (worker, layer): of the norm
    itself (``mean``, ``var``) and of the norm relative to the workers' median
    (``rel_mean``, ``rel_var``, see :func:`relative_norms`)."""

    mean: torch.Tensor  # float64 [W, L]
    var: torch.Tensor  # float64 [W, L]
    count: torch.Tensor  # int64 [W, L]: syncs that updated the entry
    rel_mean: Optional[torch.Tensor] = None  # float64 [W, L]
    rel_var: Optional[torch.Tensor] = None  # float64 [W, L]

    def __post_init__(self) -> None:
        if self.rel_mean is None:  # statistics saved before the relative ones existed
            self.rel_mean = torch.where(self.count > 0, torch.ones_like(self.mean), torch.zeros_like(self.mean))
            cv2 = self.var / self.mean.pow(2).clamp_min(1e-300)
            self.rel_var = torch.where(self.count > 0, cv2, torch.zeros_like(self.var))

    @classmethod
    def zeros(cls, workers: int, layers: int) -> "EWMAStats":
        z = torch.zeros(workers, layers, dtype=torch.float64)
        return cls(z.clone(), z.clone(), torch.zeros(workers, layers, dtype=torch.int64), z.clone(), z.clone())

    def clone(self) -> "EWMAStats":
        return EWMAStats(self.mean.clone(), self.var.clone(), self.count.clone(),
                         self.rel_mean.clone(), self.rel_var.clone())

    def state_dict(self) -> dict:
        return {"mean": self.mean.clone(), "var": self.var.clone(), "count": self.count.clone(),
                "rel_mean": self.rel_mean.clone(), "rel_var": self.rel_var.clone()}

    def rows(self, index: Sequence[int]) -> "EWMAStats":
        """The statistics of the workers at ``index`` (in that order), a copy."""
        pick = torch.tensor(list(index), dtype=torch.long)
        return EWMAStats(*(t.index_select(0, pick) for t in (self.mean, self.var, self.count, self.rel_mean,
                                                              self.rel_var)))

    def relabel(self, old_layers: Sequence[str], new_layers: Sequence[str]) -> "EWMAStats":
        """The statistics for ``new_layers`` (columns): a layer also in ``old_layers`` keeps its
        column, any other starts afresh (count 0, in its warmup again). A copy."""
        out = EWMAStats.zeros(self.mean.shape[0], len(new_layers))
        where = {name: i for i, name in enumerate(old_layers)}
        for j, name in enumerate(new_layers):
            if name in where:
                for dst, src in zip((out.mean, out.var, out.count, out.rel_mean, out.rel_var),
                                    (self.mean, self.var, self.count, self.rel_mean, self.rel_var)):
                    dst[:, j] = src[:, where[name]]
        return out

    @classmethod
    def stack(cls, rows: Sequence["EWMAStats"]) -> "EWMAStats":
        """One [W, L] statistics of ``rows`` ([1, L] each), in order."""
        return cls(*(torch.cat(parts) for parts in zip(*((r.mean, r.var, r.count, r.rel_mean, r.rel_var)
                                                           for r in rows))))

    @classmethod
    def from_state_dict(cls, state: dict) -> "EWMAStats":
        rel = [state[k].clone() if k in state else None for k in ("rel_mean", "rel_var")]
        return cls(state["mean"].clone(), state["var"].clone(), state["count"].clone(), *rel)


def relative_norms(norms: torch.Tensor) -> torch.Tensor:
    """[W, L]: each worker's norm over the workers' median norm of the layer (the median of the
    finite ones; for an even count the mean of the two middle ones). A lone worker keeps its
    norm. Invariant to a factor every (or most) worker's norm shares."""
    norms = norms.to(torch.float64)
    if norms.shape[0] < 2:
        return norms
    finite = torch.where(torch.isfinite(norms), norms, torch.full_like(norms, float("nan")))
    median = torch.nanquantile(finite, 0.5, dim=0, keepdim=True)
    return norms / median.clamp_min(1e-30)


def _z(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor) -> torch.Tensor:
    # std floored at 1e-6 * |mean| so constant values do not make every later wiggle an anomaly
    std = var.clamp_min(0).sqrt().maximum(1e-6 * mean.abs() + 1e-12)
    return (x - mean) / std


def _ewma(x, mean, var, count, update, alpha):
    first = update & (count == 0)
    later = update & (count > 0)
    diff = x - mean
    new_mean = torch.where(first, x, torch.where(later, mean + alpha * diff, mean))
    new_var = torch.where(first, torch.zeros_like(x), torch.where(later, (1 - alpha) * (var + alpha * diff * diff), var))
    return new_mean, new_var


def detect_anomalies(
    norms: torch.Tensor, stats: EWMAStats, alpha: float, warmup: int, threshold: float,
    layers: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, EWMAStats]:
    """Returns (excluded [W, L] bool, updated statistics); ``stats`` is not modified.

    A worker is excluded from a layer when its norm is anomalous against its own history
    (z > threshold) *and* so is its norm relative to the other workers'
    (:func:`relative_norms`, z > threshold): a shift all or most workers share (a learning-rate
    change, a resume with another H) is not one worker's anomaly, and neither is a rise of one
    worker's relative norm because another worker's fell. Statistics are warm after ``warmup``
    updates, and never before two (one value has no spread). Excluded entries keep their
    previous statistics; a non-finite norm is always excluded. ``layers`` ([L] bool, streaming
    fragments): only those layers were synchronised; the others are neither excluded nor
    counted (their norms are not this sync's).
    """
    raw = norms.to(torch.float64)
    rel = relative_norms(raw)
    finite = torch.isfinite(raw) & torch.isfinite(rel)
    warmed = stats.count >= max(warmup, 2)
    anomalous = (_z(raw, stats.mean, stats.var) > threshold) & (_z(rel, stats.rel_mean, stats.rel_var) > threshold)
    excluded = ~finite | (warmed & anomalous)
    if layers is not None:
        excluded &= layers.to(torch.bool)

    update = ~excluded if layers is None else ~excluded & layers.to(torch.bool)
    new = stats.clone()
    new.mean, new.var = _ewma(raw, stats.mean, stats.var, stats.count, update, alpha)
    new.rel_mean, new.rel_var = _ewma(rel, stats.rel_mean, stats.rel_var, stats.count, update, alpha)
    new.count = stats.count + update.to(torch.int64)
    return excluded, new


def detect_anomalies_by_worker(
    norms: torch.Tensor, ledger: Dict[int, EWMAStats], members: Sequence[int], trained: torch.Tensor,
    alpha: float, warmup: int, threshold: float, layers: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, Dict[int, EWMAStats]]:
    """:func:`detect_anomalies` over workers that change from one sync to the next (the torchft
    backend): ``norms`` [W, L] of the sync's workers, ``members`` their ids (in ``norms``' order),
    ``trained`` [W] bool which of them trained since the last sync. Each worker's statistics
    follow its id, not its place in the sync: ``ledger`` maps an id to its [1, L] statistics
    (a worker not in it starts from zeros). Returns (excluded [W, L], the new ledger; ``ledger``
    is not modified). A worker that did not train (it has just joined or healed: its
    pseudo-gradient is zero) is excluded everywhere, neither counted in the others' relative
    norms nor updated."""
    workers, layer_count = norms.shape
    if len(members) != workers or trained.shape != (workers,):
        raise ValueError(f"{workers} workers' norms, {len(members)} members, trained {tuple(trained.shape)}")
    present = [w for w in range(workers) if bool(trained[w])]
    excluded = torch.ones(workers, layer_count, dtype=torch.bool)
    new_ledger = dict(ledger)
    if not present:
        return excluded, new_ledger
    zero = EWMAStats.zeros(1, layer_count)
    stats = EWMAStats.stack([ledger.get(members[w], zero) for w in present])
    index = torch.tensor(present, dtype=torch.long)
    sub, updated = detect_anomalies(norms.index_select(0, index), stats, alpha, warmup, threshold, layers)
    excluded[index] = sub
    for row, w in enumerate(present):
        new_ledger[members[w]] = updated.rows([row])
    return excluded, new_ledger


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
