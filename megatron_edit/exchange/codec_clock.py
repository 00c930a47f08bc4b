"""What an exchange costs this rank's own compute: each format's exchange run against a
loopback group, timed (the automatic overlap's codec term:
:func:`~megatron_edit.algorithm.overlap_plan.predict_formats`).

An exchange's time on a link is its codec (encode, decode and the sums, on this rank), the
latency of its messages and its bytes over the link's rate. The first does not depend on the
link: a top-k exchange's on a fast link is mostly codec (on a CPU, 20-100x its bytes' time), so
the time measured in one format, scaled by bytes alone, told nothing of another's.
:func:`codec_seconds` runs the same reducers the sync runs (:mod:`.reducers`: the quantized
exchange's two quantizations, the top-k selection, every worker's payload decoded and summed),
over a :class:`LoopbackGroup` of the sync's number of workers, on a sample of the
pseudo-gradient's size: everything an exchange does here but the wire. No collective, nothing
of the run's state read or written (a throwaway shard, values without the random generator).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Callable, Dict, Sequence

import torch

from ..config import GTAConfig, LocalSGDConfig
from . import reducers
from .groups import CommCounters, _Done

SAMPLE = 1 << 20
"""Elements timed per format at most; a larger pseudo-gradient's codec scales by its size."""


class LoopbackGroup:
    """``size`` workers in one process, each sending what this one (rank 0) sends: the
    collectives copy locally (a sum multiplies), nothing crosses a process. Each worker's part of
    an all-to-all is this rank's; an all-gather gathers this rank's tensor from every worker (the
    quantized exchange's second step then spreads chunk 0's result over every chunk: the same
    work, other numbers)."""

    dynamic = False

    def __init__(self, size: int):
        self.group = None
        self.size = size
        self.rank = 0
        self.contributors = size
        self.counters = CommCounters()

    def all_reduce_sum(self, tensor: torch.Tensor, async_op: bool = True):
        tensor.mul_(self.size)
        return _Done()

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = True):
        output.view(self.size, -1).copy_(tensor.view(self.size, -1)[:1])  # (each sends rank 0 its chunk 0)
        return _Done()

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, async_op: bool = True):
        output.view(self.size, -1).copy_(tensor.reshape(1, -1))
        return _Done()


def _values(n: int, device: torch.device) -> torch.Tensor:
    """``n`` values spread over [-0.5, 0.5) in no order (the golden ratio's multiples), made
    without the random generator (the run's random state stays as it was)."""
    return torch.arange(n, dtype=torch.float64, device=device).mul_(0.6180339887498949).frac_().sub_(0.5).float()


def _exchange_once(config: LocalSGDConfig, workers: int, values: torch.Tensor):
    """One exchange of ``values`` (a copy) among ``workers`` loopback workers in ``config``'s
    format, through the reducer the sync would choose: (its result, the group, the protocol)."""
    group = LoopbackGroup(workers)
    protocol = reducers.exchange_protocol(config, group, workers)
    shard = SimpleNamespace(numel=values.numel(), residual=None, chunk_residual=None)
    _, (reducer,) = reducers.choose([shard], sync_group=group, protocol=protocol, gta_config=GTAConfig(),
                                    weights=None, own_weights=None, step=0, shard_rank=0, defer=False)
    flight = reducer.launch(shard, values.clone())
    reducer.advance(flight)
    return reducer.finish(flight), group, protocol


def codec_seconds(config_for: Callable[[str], LocalSGDConfig], formats: Sequence[str], numels: Sequence[int],
                  workers: int, device, clock: Callable[[], float] = time.perf_counter) -> Dict[str, float]:
    """Seconds this rank computes in one exchange among ``workers`` of shards of ``numels``
    elements in each of ``formats`` (``config_for(format)``: the run's settings in that format),
    its wire left out: each shard's exchange timed in turn (its fixed costs too) until
    :data:`SAMPLE` elements, after one untimed run (allocations, first calls), scaled to all of
    them."""
    device = torch.device(device)
    timed, budget = [], SAMPLE
    for n in numels:  # the first shards, or a first slice of one larger than the sample
        timed.append(max(1, min(n, budget)))
        budget -= timed[-1]
        if budget <= 0:
            break
    scale = sum(numels) / max(sum(timed), 1)
    values = [_values(n, device) for n in timed]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {}
    for fmt in formats:
        config = config_for(fmt)
        _exchange_once(config, workers, values[0])
        sync()
        t0 = clock()
        for v in values:
            _exchange_once(config, workers, v)
        sync()
        times[fmt] = (clock() - t0) * scale
    return times
