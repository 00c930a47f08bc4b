"""The decisions of one outer sync, taken from every worker's per-layer pseudo-gradient norms
(EDiT, arXiv 2412.07210, Sec. 3.2), the same on every rank of every worker: which workers are
excluded from which layers (anomaly elimination over the running statistics), each worker's
weight per layer (norm-weighted averaging; A-EDiT's step weights; GTA's explicit mean), which
layers skip their outer step, and whether a non-finite pseudo-gradient stops the run. The math
is :mod:`megatron_edit.algorithm.penalty`'s; this module holds the running statistics between
syncs and applies the configuration's choices. :class:`~.outer_sync.OuterSync` gathers the norms
and exchanges by the result.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from ..algorithm import asynchronous, penalty
from ..config import LocalSGDConfig


class NonFinitePseudoGradient(FloatingPointError):
    """A worker's pseudo-gradient holds NaN or Inf and the penalty's anomaly elimination is off
    (it would have excluded the worker): the sync stops before anything is exchanged, so the
    value never reaches the anchor. Raised on every rank of every worker at the same sync."""


@dataclass
class Decision:
    """What one sync does with the workers' pseudo-gradients."""

    weights: Optional[torch.Tensor]
    """[workers, layers] float64 weights (None: the plain mean)."""
    excluded: Optional[torch.Tensor]
    """[workers, layers] bool: excluded from the layer (None: nobody)."""
    skipped: List[bool]
    """Per layer: no outer step (every worker excluded)."""


class SyncDecisions:
    """The penalty's running statistics and the rule that turns one sync's norms into its
    :class:`Decision`."""

    def __init__(self, config: LocalSGDConfig, gta: bool, workers: int, layers: int):
        self.penalty = config.skip_anomaly or config.pseudo_gradnorm_reduce
        self.gta = gta
        self.ewma = penalty.EWMAStats.zeros(workers, layers)
        self.ewma_by_worker: Dict[int, penalty.EWMAStats] = {}
        """Over a group whose workers change (torchft): each worker's statistics under its replica
        id (``ewma`` is then unused)."""

    def relabel(self, old_names: Sequence[str], new_names: Sequence[str]) -> None:
        """The layers were cut anew: a layer cut differently starts its statistics afresh."""
        assert not self.ewma_by_worker, "relabel_layers: per-replica statistics (torchft) are not relabelled"
        self.ewma = self.ewma.relabel(old_names, new_names)

    def take(self, config: LocalSGDConfig, norms: torch.Tensor, sync_group, in_sync, worker_steps,
             layer_names: Sequence[str], step: int) -> Decision:
        """The decision from ``norms`` ([workers, layers], every worker's, on the host).
        ``in_sync``: the layers this sync holds (a fragment's; None: all); ``worker_steps``:
        A-EDiT's steps per worker (step weights; [W] or, per layer, [W, L])."""
        c = config
        excluded = None
        trained = getattr(sync_group, "trained", None)  # a group whose workers change (torchft)
        if c.skip_anomaly and trained is not None:
            excluded, self.ewma_by_worker = penalty.detect_anomalies_by_worker(
                norms, self.ewma_by_worker, sync_group.replica_ids, trained, c.ewma_alpha, c.ewma_warmup_steps,
                c.ewma_threshold, in_sync)
        elif c.skip_anomaly:
            excluded, self.ewma = penalty.detect_anomalies(
                norms, self.ewma, c.ewma_alpha, c.ewma_warmup_steps, c.ewma_threshold, in_sync)
        elif self.penalty and trained is not None:  # a worker that did not train has no weight
            excluded = (~trained).unsqueeze(1).expand_as(norms).clone()
        refuse_non_finite(norms, excluded, layer_names, step, sync_group.rank)
        weights = None
        if self.penalty:
            temperature = c.weight_softmax_temperature if c.weight_softmax_temperature is not None else 1.0
            weights = penalty.averaging_weights(norms, excluded, c.pseudo_gradnorm_reduce, temperature)
        elif self.gta or c.use_step_weight:  # explicit weights: start from the mean
            W, L = sync_group.size, len(layer_names)
            # the mean of those that trained (torchft: one that has just joined weighs 0)
            present = torch.ones(W, dtype=torch.bool) if trained is None else trained
            share = present.to(torch.float64) / max(1, int(present.sum()))
            weights = share.unsqueeze(1).expand(W, L).clone()
        if weights is not None and c.use_step_weight:
            mask = excluded if excluded is not None else torch.zeros_like(weights, dtype=torch.bool)
            weights = asynchronous.blend_step_weights(weights, worker_steps, mask, c.step_weight_ratio)
        return Decision(weights, excluded, penalty.skipped_layers(excluded, len(layer_names)))


def refuse_non_finite(norms: torch.Tensor, excluded: Optional[torch.Tensor], layer_names: Sequence[str],
                      step: int, me: int) -> None:
    """Stop (the same decision on every rank) when a worker's pseudo-gradient is NaN / Inf in a
    layer it is not excluded from; nothing has been exchanged yet."""
    bad = ~torch.isfinite(norms)
    if excluded is not None:
        bad &= ~excluded
    if not bool(bad.any()):
        return
    workers = sorted({int(w) for w in bad.nonzero()[:, 0]})
    layers = [layer_names[int(i)] for i in bad.any(dim=0).nonzero()[:, 0]]
    raise NonFinitePseudoGradient(
        f"megatron_edit: the pseudo-gradient of worker{'s' if len(workers) > 1 else ''} "
        f"{', '.join(map(str, workers))} is not finite (NaN or Inf) at the sync after step "
        f"{step} (this is worker {me}; layers {layers[:4]}{' ...' if len(layers) > 4 else ''}). "
        "The run stops before the exchange, so the anchor is still finite: resume from the last "
        "checkpoint; with --local-sgd-skip-anomaly (LocalSGDConfig.skip_anomaly) such a worker "
        "is excluded from the sync instead."
    )
