"""What one outer synchronisation did on one rank: for logs, metrics and tests."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from ..algorithm.quantize import element_bits


@dataclass
class SyncReport:
    """What one outer synchronisation did on this rank."""

    step: int
    """Optimizer steps done when the sync was due."""
    mode: str
    buckets: int
    payload_bytes: int
    """Bytes this rank all-reduced across the sync group (pseudo-gradients and norms)."""
    seconds: float
    """Time this rank spent in EDiT code for the sync (launch, wait, outer step, copies)."""
    workers: int
    trained: Optional[int] = None
    """The workers that trained since the last sync (the mean's divisor) when that can differ
    from ``workers``: the torchft backend, where a worker that has just healed did not; None:
    all of them."""
    steps_since_last: int = 0
    """Inner steps since the previous sync (H for synchronous EDiT)."""
    outer_lr: float = 0.0
    worker: int = 0
    """This rank's worker (its index in the sync group)."""
    layer_names: Optional[List[str]] = None
    norms: Optional[torch.Tensor] = None
    """[workers, layers]: each worker's pseudo-gradient norm per layer (penalty on)."""
    weights: Optional[torch.Tensor] = None
    """[workers, layers]: averaging weights (0 = excluded)."""
    excluded: Optional[torch.Tensor] = None
    """[workers, layers] bool: excluded as anomalous."""
    skipped: Optional[torch.Tensor] = None
    """[layers] bool: every worker excluded, outer step skipped."""
    clip_coef: Optional[torch.Tensor] = None
    """[layers]: clipping factor applied to the averaged pseudo-gradient."""
    skipped_sync: bool = False
    """A-EDiT: all workers together took fewer than min_total_global_steps: no exchange."""
    worker_steps: Optional[torch.Tensor] = None
    """A-EDiT: [workers] steps each worker took since the last real exchange (with streaming
    fragments: of the fragment exchanged; at the final sync, of the fragment synced longest ago)."""
    worker_seconds: Optional[torch.Tensor] = None
    worker_idle: Optional[torch.Tensor] = None
    """A-EDiT: [workers] seconds each worker waited at this sync for the last to arrive."""
    final: bool = False
    """A-EDiT: the run's last sync (its budget is used)."""
    exchange_dtype: str = "fp32"
    """Format of the pseudo-gradients sent (``LocalSGDConfig.exchange_dtype``)."""
    quantization_error: Optional[torch.Tensor] = None
    """Quantized exchange: norm of what quantization changed on this rank (its shard of its
    pseudo-gradient, and the chunk of the result it reduced), error feedback included. Sparse
    (top-k) exchange: norm of what this rank did not send (entries not kept, rounding)."""
    """A-EDiT: [workers] seconds of the latest interval (since the previous planned sync)."""
    delay: int = 0
    """Delayed outer step (``LocalSGDConfig.outer_step_delay``): the exchange was launched after
    step ``step - delay`` and applied after ``step``; 0: a blocking sync."""
    fragment: Optional[int] = None
    """Streaming fragments (``LocalSGDConfig.fragments``): the fragment this sync exchanged;
    None: every shard (no fragments, or the run's last sync)."""
    fragments: int = 1
    """The number of fragments F in force (``LocalSGDConfig.fragments``; ``auto_overlap`` may
    change it between syncs)."""
    exposed_wait_seconds: float = 0.0
    """Delayed outer step: host seconds this rank spent in the exchange's waits when it was
    applied (about 0 when it had finished behind the ``delay`` inner steps). Gloo blocks the
    host there; with NCCL ``Work.wait`` only orders the streams, so this is a lower bound."""
    launch_wait_seconds: Optional[float] = None
    """Delayed outer step, a sync ``LocalSGDConfig.auto_overlap`` times: host seconds from the
    sync's start to the end of its exchange, waited for right after the launch (the apply stays
    ``delay`` steps later, with the same numbers); None: not waited for there."""
    exchange_seconds: float = 0.0
    """Of ``seconds``, host seconds inside the exchange's launch and finish (its codec and wire;
    the rest is the sync's work in any format: the penalty's decisions, the pseudo-gradients,
    the outer step)."""
    latency_seconds: Optional[float] = None
    """A sync ``LocalSGDConfig.auto_overlap`` times (the torch backend): host seconds of one
    blocking all-reduce of one element over the sync group once the exchange was in (the
    link's latency, which the prediction of the other formats needs); None: not probed."""
    rate_probe_seconds: Optional[float] = None
    """The same sync: host seconds of the all-reduce of ``link_probe.rate_probe_numel`` fp32 elements
    after that one (the latency and the bytes: the link's rate); None: not probed."""
    auto_overlap: bool = False
    """The delay, format and fragments were chosen by ``LocalSGDConfig.auto_overlap``: the
    scalars carry the settings in force at every sync (delay 0 too) and the exposed wait."""
    committed: bool = True
    """False: the sync was exchanged but not applied (the torchft backend: a worker of it
    failed, or none had trained); the workers keep their local progress."""
    layers: Optional[torch.Tensor] = None
    """Streaming fragments: [layers] bool, the layers this sync held (None: every layer)."""
    residual_norm: Optional[torch.Tensor] = None
    """Error feedback with the sync record on (``LocalSGDConfig.sync_record``): the norm of this
    rank's error-feedback residuals after the sync (of the shards it exchanged); None otherwise."""

    def scalars(self) -> Dict[str, float]:
        """Flat name -> value, for Megatron's console line and TensorBoard / W&B writers."""
        out = {
            "local-sgd/sync-seconds": self.seconds,
            "local-sgd/sync-bytes": float(self.payload_bytes),
            "local-sgd/steps-since-last-sync": float(self.steps_since_last),
            "local-sgd/outer-lr": self.outer_lr,
            "local-sgd/workers": float(self.workers),
        }
        if self.norms is not None:
            own = self.norms[self.worker]
            out["local-sgd/pseudo-grad-norm"] = float(own.pow(2).sum().sqrt())
            out["local-sgd/pseudo-grad-norm-max-layer"] = float(own.max())
        if self.weights is not None:
            out["local-sgd/weight-min"] = float(self.weights.min())
            out["local-sgd/weight-own-mean"] = float(self.weights[self.worker].mean())
        if self.excluded is not None:
            out["local-sgd/excluded"] = float(self.excluded.sum())
            out["local-sgd/excluded-workers"] = float(self.excluded.any(dim=1).sum())
        if self.skipped is not None:
            out["local-sgd/skipped-layers"] = float(self.skipped.sum())
        if self.clip_coef is not None:
            out["local-sgd/clip-coef-min"] = float(self.clip_coef.min())
            out["local-sgd/clipped-layers"] = float((self.clip_coef < 1).sum())
        if self.quantization_error is not None:
            out["local-sgd/quantization-error"] = float(self.quantization_error)
        if self.worker_steps is not None:
            out["local-sgd/skipped-sync"] = float(self.skipped_sync)
            out["local-sgd/worker-steps-min"] = float(self.worker_steps.min())
            out["local-sgd/worker-steps-max"] = float(self.worker_steps.max())
        if self.delay or self.auto_overlap:
            out["local-sgd/outer-step-delay"] = float(self.delay)
            # without a delay the sync's whole time is exposed
            out["local-sgd/exposed-wait-seconds"] = self.exposed_wait_seconds if self.delay else self.seconds
        if self.auto_overlap:
            out["local-sgd/exchange-bits"] = float(element_bits(self.exchange_dtype))
            out["local-sgd/fragments"] = float(self.fragments)
        if self.fragment is not None:
            out["local-sgd/fragment"] = float(self.fragment)
        if self.worker_idle is not None:
            out["local-sgd/idle-seconds-max"] = float(self.worker_idle.max())
            out["local-sgd/final-sync"] = float(self.final)
        return out


def report_of(sync, config, sync_group, layer_names, outer_lr: float, exchange_error) -> SyncReport:
    """The report of a sync that ended (``sync``: its :class:`~.in_flight.SyncInProgress`),
    on this rank of ``sync_group``; ``exchange_error``: what the quantized or sparse exchange
    changed (None: exact)."""
    clip = None
    if config.clip_pseudo_grad is not None and not sync.skipped_sync:
        # Stacked on the device; read on the host only when a log asks (SyncReport.scalars).
        # A layer outside this sync's fragment is not clipped here: 1.
        one = next(iter(sync.clip_coef.values())).new_ones(()) if sync.clip_coef else torch.ones(())
        clip = torch.stack([sync.clip_coef.get(i, one) for i in range(len(layer_names))])
    report = SyncReport(
        step=sync.step,
        mode=config.sync_mode,
        buckets=len(sync.members),
        fragment=sync.fragment,
        fragments=config.fragments,
        payload_bytes=sync_group.counters.payload_bytes - sync.bytes_at_start,
        seconds=sync.seconds,
        workers=sync_group.size,
        trained=getattr(sync_group, "contributors", None) if getattr(sync_group, "dynamic", False) else None,
        steps_since_last=sync.steps_since_last,
        outer_lr=outer_lr,
        worker=sync_group.rank,
        layer_names=layer_names,
        norms=sync.norms,
        weights=sync.weights,
        excluded=sync.excluded,
        skipped=sync.skipped,
        clip_coef=clip,
        skipped_sync=sync.skipped_sync,
        worker_steps=sync.worker_steps if sync.worker_steps is None or sync.worker_steps.dim() == 1
        else sync.worker_steps.amax(dim=1),  # (per layer: A-EDiT's final sync with fragments)
        worker_seconds=sync.worker_seconds,
        worker_idle=sync.worker_idle,
        final=sync.final,
        exchange_dtype=config.exchange_dtype,
        quantization_error=exchange_error,
        delay=sync.delay,
        exposed_wait_seconds=sync.exposed_wait,
        launch_wait_seconds=sync.launch_wait,
        exchange_seconds=sync.exchange_seconds,
        latency_seconds=sync.latency,
        rate_probe_seconds=sync.rate_probe,
        committed=sync.committed is not False,
        layers=sync.layers,
        residual_norm=_residual_norm(sync.members) if config.sync_record is not None and config.error_feedback
        else None,
    )
    return report


def _residual_norm(shards) -> Optional[torch.Tensor]:
    """The norm of the error-feedback residuals of ``shards`` (their own and the chunk they
    reduce), on their device (read on the host by the record only); None: no residual yet."""
    squares = [r.double().pow(2).sum() for s in shards for r in (s.residual, s.chunk_residual) if r is not None]
    return torch.stack(squares).sum().sqrt() if squares else None
