"""Encode + decode time per sync of the sparse (top-k) exchange beside the dense int8 / int4
ones: what a rank computes at a sync, not what it sends (bench_sparse_bytes.py counts that).

    python scripts/bench/bench_codec_time.py [--numel 1048576 16777216] [--workers 2 4]
                                             [--device cpu|cuda] [--repeats 5]

One process, one thread (a rank's setting on CPU). For each shard length and W, the script runs
the exchanges' own code (:class:`megatron_edit.exchange.quantized.QuantizedExchange`,
:class:`megatron_edit.exchange.sparse.SparseExchange`, error feedback on) on one rank's shard,
with a loopback group in place of the W-worker group: its all-to-all and all-gather copy this
rank's bytes into every worker's slot, so the rank decodes W payloads of the real size, as it
would from W workers. What is timed is a sync's whole codec work per rank: the residual, the
encode, the decode of what was sent (the new residual), the decode and fp32 sum of the W
payloads (int8 / int4: also the reduce-scatter's requantization); the copies standing in for the
collectives are timed apart and left out. The table gives the median over ``--repeats`` syncs
after one warm-up, in ms, and per element, and the ratio to the int8 exchange's in the same run.
Writes scripts/bench/results/codec_time.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import bench_common as bc  # noqa: E402

from megatron_edit.exchange.quantized import QuantizedExchange  # noqa: E402
from megatron_edit.exchange.shard import BucketShard  # noqa: E402
from megatron_edit.exchange.sparse import SparseExchange  # noqa: E402

FORMS = [("int8", None, "int8"), ("int4", None, "int4"),
         ("top-k 1% int2", 0.01, "int2"), ("top-k 3% int2", 0.03, "int2"), ("top-k 3% int8", 0.03, "int8")]
CHUNK, BLOCK = 4096, 256


class _Done:
    def wait(self):
        return None


class LoopbackGroup:
    """A sync group of ``size`` workers seen from rank 0, in one process: every collective
    returns this rank's bytes in every worker's slot. Time spent copying is kept in
    ``copy_s`` (the stand-in for the wire, left out of the codec time)."""

    def __init__(self, size: int):
        self.size = size
        self.rank = 0
        self.copy_s = 0.0

    def _timed(self, fn):
        start = time.perf_counter()
        fn()
        self.copy_s += time.perf_counter() - start
        return _Done()

    def all_to_all(self, out, inp, async_op=False):
        return self._timed(lambda: out.copy_(inp))

    def all_gather_into(self, out, inp, async_op=False):
        return self._timed(lambda: out.view(self.size, -1).copy_(inp.view(1, -1).expand(self.size, -1)))


def _sync(exchange, shard, delta):
    if isinstance(exchange, SparseExchange):
        stage = exchange.launch(shard, delta)
        exchange.finish(stage, delta, mean=True)
    else:
        stage = exchange.launch(shard, delta)
        exchange.finish(shard, stage, delta, mean=True)


def time_form(numel: int, workers: int, density, dtype: str, device: str, repeats: int) -> float:
    """Median codec seconds per sync for one rank's shard of ``numel`` elements."""
    group = LoopbackGroup(workers)
    if density is None:
        exchange = QuantizedExchange(group, dtype, BLOCK, error_feedback=True)
    else:
        exchange = SparseExchange(group, density, CHUNK, dtype, error_feedback=True)
    shard = BucketShard(numel=numel, mains=[], local_ranges=[], segments=[], device=torch.device(device))
    generator = torch.Generator(device="cpu").manual_seed(numel + workers)
    source = torch.randn(numel, generator=generator).to(device)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        delta = source.clone()
        group.copy_s = 0.0
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        _sync(exchange, shard, delta)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start - group.copy_s)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", nargs="+", type=int, default=[1 << 20, 1 << 24])
    parser.add_argument("--workers", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device; run with --device cpu")
    load = " ".join(open("/proc/loadavg").read().split()[:3]) if os.path.exists("/proc/loadavg") else "n/a"
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU, one thread"
    rows = ["| shard elements | W | form | ms per sync | ns per element | vs int8 |", "|---|---|---|---|---|---|"]
    for numel in args.numel:
        for workers in args.workers:
            seconds = {label: time_form(numel, workers, d, dtype, args.device, args.repeats)
                       for label, d, dtype in FORMS}
            for label, s in seconds.items():
                rows.append(f"| {numel:,} | {workers} | {label} | {1e3 * s:.1f} | {1e9 * s / numel:.1f} "
                            f"| {s / seconds['int8']:.2f} |")
    text = "\n".join(rows) + (f"\n\nEncode + decode per rank and sync, {device_name}, median of {args.repeats} syncs "
                              f"after a warm-up; error feedback on; chunk {CHUNK} (top-k), block {BLOCK} (int8/int4). "
                              f"Load before the run: {load}.\n")
    print(text)
    bc.write_result("codec_time.md", text)


if __name__ == "__main__":
    main()
