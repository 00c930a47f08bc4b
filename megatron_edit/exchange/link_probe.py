"""The link's probes at a sync the automatic overlap times (``OuterSync.start(probe_link=True)``):
blocking all-reduces over the sync group, timed. Before the exchange's first launch one of a
single element takes the workers' skew (the exchange's time then starts with every worker
there); once the exchange is in, one of a single element times the latency and one of
:func:`rate_probe_numel` elements the latency and the bytes: the link's rate
(:meth:`~megatron_edit.mcore.auto_overlap.AutoOverlap._measure`)."""

from __future__ import annotations

import time
from typing import Tuple

import torch

RATE_PROBE = 1 << 18
"""fp32 elements of the all-reduce that probes the link's rate at a timed sync, at most (1 MiB:
84 ms at 100 Mbit/s between two workers, ~1 ms between two GPUs of a node): fewer where the
rank's pseudo-gradient is smaller (:func:`rate_probe_numel`)."""


def rate_probe_numel(numel: int) -> int:
    """Elements of the rate probe for a rank whose shards hold ``numel``: no more than a dense
    exchange of them sends."""
    return max(1, min(RATE_PROBE, numel))


def all_reduce_seconds(sync_group, device, numel: int = 1) -> float:
    """Seconds of one blocking all-reduce of ``numel`` fp32 zeros over ``sync_group``."""
    zeros = torch.zeros(numel, dtype=torch.float32, device=device)
    t0 = time.perf_counter()
    sync_group.all_reduce_sum(zeros, async_op=False)
    zeros[:1].item()  # (on a GPU: the all-reduce is in)
    return time.perf_counter() - t0


def probe(sync_group, device, numel: int) -> Tuple[float, float]:
    """(seconds of an all-reduce of one element, then of :func:`rate_probe_numel` elements for a
    rank whose shards hold ``numel``)."""
    return all_reduce_seconds(sync_group, device), all_reduce_seconds(sync_group, device, rate_probe_numel(numel))
