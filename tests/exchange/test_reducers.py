"""megatron_edit.exchange.reducers on known inputs, through fake collectives: each reducer's
launch / advance / finish, the collectives each step issues, and the exact reduced values."""

import pytest
import torch

from fake_groups import FakeWorld, run_workers
from megatron_edit.config import GTAConfig
from megatron_edit.exchange.quantized import QuantizedExchange
from megatron_edit.exchange.reducers import GTAReducer, MeanReducer, QuantizedReducer
from megatron_edit.exchange.shard import BucketShard


def _shard(numel, segments):
    return BucketShard(numel=numel, mains=[], local_ranges=[], segments=segments)


def _reduce(world, make, deltas, segments):
    """Every worker: launch its Delta, advance, finish; the result and the collectives issued
    after each step."""
    def fn(worker):
        shard = _shard(len(deltas[worker]), segments)
        reducer = make(world.group(worker))
        flight = reducer.launch(shard, torch.tensor(deltas[worker]))
        steps = [[name for name, _ in world.log[worker]]]
        reducer.advance(flight)
        reducer.advance(flight)  # a second advance starts nothing more
        steps.append([name for name, _ in world.log[worker]])
        result = reducer.finish(flight)
        steps.append([name for name, _ in world.log[worker]])
        return result, steps

    return run_workers(world, fn)


@pytest.mark.timeout(60)
def test_mean_reducer_plain_mean_sum_and_weighted_sum():
    deltas = [[1.0, -2.0, 4.0, 0.5], [2.0, 2.0, -1.0, 0.5], [0.0, 3.0, 3.0, 2.0]]
    segments = [(0, 2, 0, True), (2, 4, 1, True)]
    world = FakeWorld(3)
    out = _reduce(world, lambda g: MeanReducer(g, None, divide=True), deltas, segments)
    for result, steps in out:
        assert torch.equal(result, torch.tensor([1.0, 1.0, 2.0, 1.0]))
        assert steps == [["all_reduce_sum"]] * 3
    world = FakeWorld(3)
    out = _reduce(world, lambda g: MeanReducer(g, None, divide=False), deltas, segments)
    assert all(torch.equal(r, torch.tensor([3.0, 3.0, 6.0, 3.0])) for r, _ in out)  # the sum, divided later
    # weighted sum (the penalty's): worker w's layer l times weights[w, l], no division
    weights = torch.tensor([[0.5, 0.25], [0.25, 0.5], [0.25, 0.25]], dtype=torch.float64)
    world = FakeWorld(3)
    out = _reduce(world, lambda g: MeanReducer(g, weights[g.rank], divide=False), deltas, segments)
    expected = torch.tensor([0.5 + 0.5 + 0.0, -1.0 + 0.5 + 0.75, 1.0 - 0.5 + 0.75, 0.125 + 0.25 + 0.5])
    assert all(torch.equal(r, expected) for r, _ in out)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("int8_mask", [False, True])
def test_gta_reducer_keeps_the_agreeing_entries_and_divides_by_who_kept_them(int8_mask):
    """Consensus ``sum``: the sign of the weighted sum; each worker keeps its entries of that
    sign; the kept entries' weighted sum over the weight of the workers that kept each."""
    deltas = [[2.0, -2.0, 4.0, 1.0], [4.0, 4.0, -4.0, 0.0], [-4.0, 4.0, 4.0, 0.0]]
    weights = torch.tensor([[0.5], [0.25], [0.25]], dtype=torch.float64)
    config = GTAConfig(reducer="gta", consensus_method="sum", normalize=True, int8_mask=int8_mask)
    world = FakeWorld(3)
    out = _reduce(world, lambda g: GTAReducer(g, config, weights, step=1, shard_rank=0), deltas, [(0, 4, 0, True)])
    # weighted: [1, -1, 2, .5], [1, 1, -1, 0], [-1, 1, 1, 0]; their sum [1, 1, 2, .5] is positive
    # everywhere: kept [1, 0, 2, .5], [1, 1, 0, 0], [0, 1, 1, 0]
    expected = torch.tensor([2.0, 2.0, 3.0, 0.5]) / torch.tensor([0.75, 0.5, 0.75, 0.5])
    for result, steps in out:
        assert torch.equal(result, expected)
        # phase 1 (the consensus) at launch; phase 2 (entries and mask) at advance
        assert steps == [["all_reduce_sum"], ["all_reduce_sum"] * 3, ["all_reduce_sum"] * 3]


@pytest.mark.timeout(60)
def test_gta_reducer_without_consensus_is_one_phase():
    deltas = [[1.0, 0.0], [3.0, 2.0]]
    weights = torch.tensor([[0.5], [0.5]], dtype=torch.float64)
    config = GTAConfig(reducer="gta", normalize=False)
    world = FakeWorld(2)
    out = _reduce(world, lambda g: GTAReducer(g, config, weights, step=1, shard_rank=0), deltas, [(0, 2, 0, True)])
    for result, steps in out:
        assert torch.equal(result, torch.tensor([2.0, 1.0]))  # the weighted sum
        assert steps == [["all_reduce_sum"]] * 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("weighted", [False, True], ids=["mean", "weighted-sum"])
def test_quantized_reducer_is_exact_on_values_on_the_int8_grid(weighted):
    """Two workers, 8 elements, blocks of 4 (one chunk each): every block's amax is 127 (or
    63.5 weighted by 1/2), so every value is on the grid and both roundings are exact; the
    result is the mean, the same bytes on both workers, and error feedback keeps nothing."""
    deltas = [[127.0, 2.0, -4.0, 6.0, 10.0, 20.0, 30.0, 127.0], [127.0, 0.0, 0.0, 2.0, 30.0, 20.0, 10.0, 127.0]]
    half = torch.tensor([0.5], dtype=torch.float64)
    exchanges = {}

    def make(g):
        exchange = QuantizedExchange(g, "int8", 4, error_feedback=True)
        assert exchange.pays_off(8)
        exchanges[g.rank] = exchange
        return QuantizedReducer(exchange, half if weighted else None, mean=not weighted)

    world = FakeWorld(2)
    out = _reduce(world, make, deltas, [(0, 8, 0, True)])
    expected = torch.tensor([127.0, 1.0, -2.0, 4.0, 20.0, 20.0, 20.0, 127.0])
    for result, steps in out:
        assert torch.equal(result, expected)
        assert steps == [["all_to_all"], ["all_to_all", "all_gather_into"], ["all_to_all", "all_gather_into"]]
    for exchange in exchanges.values():
        assert float(exchange.take_error_norm()) == 0.0
