"""What a sync's record says (issue 59; schema :data:`SCHEMA`, every field in :data:`FIELDS` and
docs/reference/sync-record.md): one rank's part of it, the worker's record from the parts of
its ranks, and a record's figures as scalars (:func:`scalars`, for TensorBoard / W&B).

A record is a worker's, and a worker is many ranks (its distributed optimizer's shards x tensor
x pipeline ranks; a MoE model's dense and expert optimizers on each). What one rank alone knows,
the bytes it sent across workers, its seconds in EDiT code and its waits, its share of the
error-feedback residual and of the exchange's error, a heal it received, is its *part*
(:func:`rank_part`, one per optimizer of the rank). What one pipeline stage's optimizer agreed
over its layers (their norms, clipping and exclusions: the same on every rank of its model-shard
and tensor-parallel groups) is added by one rank of it, its *representative*. :func:`combine`
makes the worker's figures from all the parts: bytes and rank-seconds add up, the seconds and
waits the worker shows are its slowest rank's, norms add in squares, the layers pool. What every
rank of the worker holds the same (the step, who took part, the commit, the settings in force)
is taken from one rank's report (:func:`agreed`).

Pure: numbers, lists and reports in, JSON-ready dicts out (no torch import: tensors are read
with ``tolist``). Who publishes a part, where, and who writes the record is
:mod:`megatron_edit.mcore.sync_record`'s.
"""

from __future__ import annotations

import math
import statistics
import time
import uuid
from typing import Dict, List, Optional, Sequence

SCHEMA = 1
"""The record's schema version (the ``schema`` field): raised when a field changes meaning or
goes; a field added keeps it."""

RUN_ID_ENV = "MEGATRON_EDIT_RUN_ID"
"""The run id every record of a run carries, when set (the supervisor sets it for every worker's
job); else the job agrees on one in its store (:mod:`megatron_edit.mcore.sync_record`)."""

FIELDS = (
    "schema", "kind", "run_id", "worker", "sync", "step", "time", "backend", "mode",
    "participants", "trained", "committed", "exchanged", "final", "last_sync",
    "bytes_sent", "bytes_received", "exchange_seconds", "exchange_seconds_sum", "exposed_wait_seconds",
    "arrival_wait_seconds", "record_seconds",
    "delay", "fragment", "fragments", "exchange_dtype", "topk_density", "auto_overlap", "outer_lr",
    "layer_norms", "pseudo_grad_norm", "excluded", "residual_norm", "residual_ratio", "exchange_error_norm",
    "worker_steps", "events", "ranks", "missing_ranks",
)
"""Every field of a record, in the order written (documented in docs/reference/sync-record.md)."""


def new_run_id() -> str:
    """A fresh run id: the start time and a random suffix (``20250101-120000-1a2b3c4d``)."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + uuid.uuid4().hex[:8]


def _round(value: Optional[float], digits: int = 6) -> Optional[float]:
    """``value`` to ``digits`` significant digits; None for None, NaN and infinities (JSON has none)."""
    if value is None or not math.isfinite(float(value)):
        return None
    return float(f"{float(value):.{digits}g}")


def _square(norm) -> Optional[float]:
    """The square of a 0-dim tensor or number (None: None)."""
    return None if norm is None else float(norm) ** 2


def rank_part(report, trained: Sequence[bool], participants: Sequence[int], representative: bool,
              arrival_wait: Optional[float], heal: Optional[dict], began: Optional[float] = None) -> dict:
    """This rank's part of the sync of ``report`` (one optimizer's): ``trained`` / ``participants``:
    per worker of the sync (in its order), whether it trained and its id; ``representative``: this
    rank adds its stage's layers (see the module); ``arrival_wait``: seconds it waited for the
    other workers to arrive (None: not measured); ``heal``: what this rank received when it healed
    at this round (``from_worker``, ``bytes``, ``seconds``), or None; ``began``: the
    ``time.perf_counter()`` at which the rank began its part of the record (its time in the
    record, up to this part, is ``record``)."""
    part = dict(bytes=int(report.payload_bytes), seconds=float(report.seconds),
                exposed=float(report.exposed_wait_seconds if report.delay else report.seconds),
                arrival=arrival_wait, heal=heal, error_sq=_square(report.quantization_error),
                residual_sq=_square(getattr(report, "residual_norm", None)))
    if representative and report.norms is not None:
        part["layers"] = _layers(report, trained, participants)
    part["record"] = None if began is None else time.perf_counter() - began
    return part


def _layers(report, trained: Sequence[bool], participants: Sequence[int]) -> dict:
    """The representative's part: this worker's norm of each layer the sync held, how many of
    them were clipped and skipped, and every worker's exclusions (with why)."""
    norms = report.norms.tolist()  # [workers][layers], on the host
    held = report.layers.tolist() if getattr(report, "layers", None) is not None else [True] * len(norms[0])
    index = [i for i, h in enumerate(held) if h]
    own = [norms[report.worker][i] for i in index]
    clip = report.clip_coef.tolist() if report.clip_coef is not None else None
    skipped = report.skipped.tolist() if report.skipped is not None else None
    excluded = {}
    for w, row in enumerate(report.excluded.tolist() if report.excluded is not None else ()):
        layers = [i for i in index if row[i]]
        if not layers:
            continue
        non_finite = sum(1 for i in layers if not math.isfinite(norms[w][i]))
        not_trained = 0 if trained[w] else len(layers) - non_finite
        excluded[str(participants[w])] = dict(layers=len(layers), anomalous=len(layers) - non_finite - not_trained,
                                              non_finite=non_finite, not_trained=not_trained)
    return dict(norms=own, clipped=sum(1 for i in index if clip is not None and clip[i] < 1),
                skipped=sum(1 for i in index if skipped is not None and skipped[i]), excluded=excluded)


def agreed(report, participants: Sequence[int], trained: Sequence[bool], topk_density: Optional[float]) -> dict:
    """The fields every rank of the worker holds the same at the sync of ``report`` (one rank's
    report, any of its optimizers')."""
    steps = report.worker_steps.tolist() if report.worker_steps is not None else None
    return dict(
        step=int(report.step), mode=report.mode, participants=list(participants),
        trained=[w for w, t in zip(participants, trained) if t], committed=bool(report.committed),
        exchanged=not report.skipped_sync, final=bool(report.final),
        delay=int(report.delay), fragment=report.fragment, fragments=int(report.fragments),
        exchange_dtype=report.exchange_dtype, topk_density=topk_density, auto_overlap=bool(report.auto_overlap),
        outer_lr=_round(report.outer_lr), worker_steps=None if steps is None else [int(s) for s in steps])


def combine(parts_by_rank: Dict[int, List[dict]]) -> dict:
    """The worker's figures from its ranks' parts (each rank: one part per optimizer), see the
    module; the heal (if any) as an ``events`` entry."""
    ranks = list(parts_by_rank.values())
    every = [p for parts in ranks for p in parts]
    seconds = [sum(p["seconds"] for p in parts) for parts in ranks]
    exposed = [sum(p["exposed"] for p in parts) for parts in ranks]
    arrivals = [p["arrival"] for p in every if p["arrival"] is not None]
    recorded = [sum(p.get("record") or 0.0 for p in parts) for parts in ranks]
    sent = sum(p["bytes"] for p in every)
    out = dict(bytes_sent=sent, bytes_received=sent, exchange_seconds=_round(max(seconds, default=0.0)),
               exchange_seconds_sum=_round(sum(seconds)), exposed_wait_seconds=_round(max(exposed, default=0.0)),
               arrival_wait_seconds=_round(max(arrivals)) if arrivals else None,
               record_seconds=_round(max(recorded, default=0.0)))
    out.update(_layer_figures([p["layers"] for p in every if p.get("layers") is not None]))
    residual = [p["residual_sq"] for p in every if p["residual_sq"] is not None]
    out["residual_norm"] = _round(math.sqrt(sum(residual))) if residual else None
    pseudo = out["pseudo_grad_norm"]
    out["residual_ratio"] = (_round(math.sqrt(sum(residual)) / pseudo)
                             if residual and pseudo else None)
    error = [p["error_sq"] for p in every if p["error_sq"] is not None]
    out["exchange_error_norm"] = _round(math.sqrt(sum(error))) if error else None
    heals = [p["heal"] for p in every if p.get("heal")]
    out["events"] = [dict(event="heal", from_workers=sorted({h["from_worker"] for h in heals
                                                             if h.get("from_worker") is not None}),
                          ranks=len(heals), bytes=sum(h["bytes"] for h in heals),
                          seconds=_round(max(h["seconds"] for h in heals)))] if heals else []
    return out


def _layer_figures(parts: List[dict]) -> dict:
    """The layers of every stage and optimizer of the worker, pooled: this worker's norms
    (summary), its pseudo-gradient's norm, clipped and skipped layers, every worker's exclusions."""
    norms = [n for part in parts for n in part["norms"]]
    if not parts:
        return dict(layer_norms=None, pseudo_grad_norm=None, excluded=[])
    finite = [n for n in norms if math.isfinite(n)]
    summary = dict(layers=len(norms), min=_round(min(finite, default=None)),
                   median=_round(statistics.median(finite)) if finite else None,
                   max=_round(max(finite, default=None)), non_finite=len(norms) - len(finite),
                   clipped=sum(p["clipped"] for p in parts), skipped=sum(p["skipped"] for p in parts))
    excluded: Dict[int, dict] = {}
    for part in parts:
        for worker, why in part["excluded"].items():
            total = excluded.setdefault(int(worker), dict(worker=int(worker), layers=0, anomalous=0,
                                                          non_finite=0, not_trained=0))
            for key, value in why.items():
                total[key] += value
    return dict(layer_norms=summary, pseudo_grad_norm=_round(math.sqrt(sum(n * n for n in finite))),
                excluded=[excluded[w] for w in sorted(excluded)])


def membership_events(before: Optional[Sequence[int]], now: Optional[Sequence[int]]) -> List[dict]:
    """The workers that left and joined the sync since this worker's previous record (None: no
    previous record, nothing to compare): a killed worker shows as ``left``, a relaunched or new
    one as ``joined``."""
    if before is None or now is None:  # (None now: not known at this sync)
        return []
    left, joined = sorted(set(before) - set(now)), sorted(set(now) - set(before))
    return ([dict(event="left", workers=left)] if left else []) + ([dict(event="joined", workers=joined)]
                                                                    if joined else [])


SCALAR_PREFIX = "local-sgd-record/"
"""The prefix of a record's scalars (:func:`scalars`) in TensorBoard / W&B."""


def scalars(record: dict) -> Dict[str, float]:
    """A record's worker-level figures as numbers (TensorBoard / W&B tags under
    :data:`SCALAR_PREFIX`, written at the record's ``step``): the worker, bytes sent and received
    across workers, the participants and trained workers (counts), committed and exchanged (1 or
    0), the exchange's seconds (slowest rank), the exposed and arrival waits, the residual ratio,
    the workers excluded (count), ranks missing (count), a heal's bytes and seconds (0: none), the
    settings in force (delay, fragments, top-k density) and A-EDiT's steps per participant
    (``worker-steps/<worker>``). A field that is null is left out (TensorBoard has no null: a
    dense exchange has no ``topk-density``, one worker no ``arrival-wait-seconds``). A ``join``
    record (not one of the run's syncs) gives its worker and heal only."""
    heals = [e for e in record["events"] if e["event"] == "heal"]
    out = {"worker": record["worker"], "heal-bytes": sum(e["bytes"] for e in heals),
           "heal-seconds": max((e["seconds"] or 0.0 for e in heals), default=0.0)}
    if record["kind"] == "sync":
        out.update({
            "bytes-sent": record["bytes_sent"], "bytes-received": record["bytes_received"],
            "participants": _count(record["participants"]), "trained": _count(record["trained"]),
            "committed": record["committed"], "exchanged": record["exchanged"],
            "exchange-seconds": record["exchange_seconds"], "exposed-wait-seconds": record["exposed_wait_seconds"],
            "arrival-wait-seconds": record["arrival_wait_seconds"], "residual-ratio": record["residual_ratio"],
            "excluded-workers": len(record["excluded"]), "missing-ranks": len(record["missing_ranks"]),
            "delay": record["delay"], "fragments": record["fragments"], "topk-density": record["topk_density"]})
        if record["worker_steps"] is not None:
            out.update({f"worker-steps/{w}": s for w, s in zip(record["participants"] or (), record["worker_steps"])})
    return {SCALAR_PREFIX + tag: float(value) for tag, value in out.items() if value is not None}


def _count(workers: Optional[Sequence[int]]) -> Optional[int]:
    return None if workers is None else len(workers)
