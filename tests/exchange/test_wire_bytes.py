"""The one wire model (megatron_edit.algorithm.wire), which the planner and the automatic overlap
predict from, against what the exchanges send: every format, over fake collectives that count
each rank's bytes on the wire."""

import pytest
import torch

from fake_groups import FakeWorld, run_workers
from megatron_edit.algorithm import wire
from megatron_edit.algorithm.formats import topk_format
from megatron_edit.algorithm.overlap_plan import wire_bytes as planner_bytes
from megatron_edit.exchange.quantized import QuantizedExchange
from megatron_edit.exchange.shard import BucketShard
from megatron_edit.exchange.sparse import SparseExchange

FORMATS = ["fp32", "bf16", "fp8", "int8", "int4", "topk0.02-int2", "topk0.03-int4", "topk0.02-int8", "topk0.02-fp32"]
BLOCK, CHUNK = 256, 4096


def _exchange(group, name):
    sparse = topk_format(name)
    if sparse is not None:
        return SparseExchange(group, sparse[0], CHUNK, sparse[1], error_feedback=True)
    return QuantizedExchange(group, name, BLOCK, error_feedback=True)


def _send(worker, world, name, numel):
    """One exchange of a ``numel`` shard in ``name``, as the reducers run it: the format where
    it pays off, else the fp32 all-reduce. The bytes this rank sent."""
    group = world.group(worker)
    delta = torch.randn(numel, generator=torch.Generator().manual_seed(worker))
    shard = BucketShard(numel=numel, mains=[torch.zeros(numel)], local_ranges=[(0, numel)],
                        segments=[(0, numel, 0, True)], bucket_layers={0})
    exchange = None if name == "fp32" else _exchange(group, name)
    if exchange is None or not exchange.pays_off(numel):
        group.all_reduce_sum(delta, async_op=False)
    elif isinstance(exchange, SparseExchange):
        exchange.finish(exchange.launch(shard, delta), delta, mean=True)
    else:
        exchange.finish(shard, exchange.launch(shard, delta), delta, mean=True)
    return group.counters.payload_bytes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [2, 3, 4])
def test_the_planners_bytes_are_what_the_exchanges_send(workers):
    """For every format, shard sizes that fill no whole block or chunk, and a shard of a few
    elements (sent in fp32): the bytes counted on the wire are the model's, which the planner
    (python -m megatron_edit.plan) uses for a whole model."""
    for numel in (5, 5_003, 70_001):
        for name in FORMATS:
            world = FakeWorld(workers)
            sent = run_workers(world, _send, world, name, numel)
            assert sent == [wire.wire_bytes(numel, name, workers, BLOCK, CHUNK)] * workers, (name, numel)
            assert planner_bytes(numel, name, workers, BLOCK) == sent[0], (name, numel)
