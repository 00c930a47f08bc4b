"""megatron_edit.algorithm.gta on hand-computed inputs."""

import pytest
import torch

from megatron_edit.algorithm import gta

SEGS = [(0, 4, 0, True), (4, 6, 1, True)]


def test_magnitude_keeps_the_largest_entries_of_each_parameter_shard():
    d = torch.tensor([0.1, -0.4, 0.3, -0.2, 5.0, 0.5, 9.0])  # entry 6: padding, outside segments
    gta.sparsify(d, SEGS, 0.5, "magnitude")
    assert d.tolist() == pytest.approx([0.0, -0.4, 0.3, 0.0, 5.0, 0.0, 9.0])


def test_random_and_rescaled_random_use_the_generator_and_rescale():
    base = torch.arange(1.0, 201.0)
    segs = [(0, 120, 0, True), (120, 200, 1, True)]
    a = gta.sparsify(base.clone(), segs, 0.25, "random", torch.Generator().manual_seed(3))
    b = gta.sparsify(base.clone(), segs, 0.25, "random", torch.Generator().manual_seed(3))
    c = gta.sparsify(base.clone(), segs, 0.25, "rescaled_random", torch.Generator().manual_seed(3))
    assert torch.equal(a, b) and 20 < int((a != 0).sum()) < 80  # about a quarter kept
    assert torch.equal(c, a * 4)  # same mask, kept entries / density
    assert torch.equal(gta.sparsify(base.clone(), segs, 1.0, "random"), base)


def test_consensus_and_agreement():
    w0 = torch.tensor([1.0, -2.0, 3.0, 0.0])
    w1 = torch.tensor([-3.0, -1.0, 1.0, 2.0])
    w2 = torch.tensor([-1.0, 1.0, 0.5, 0.0])
    s = sum(gta.consensus_message(w, "sum", False) for w in (w0, w1, w2))  # [-3, -2, 4.5, 2]
    c = sum(gta.consensus_message(w, "count", True).to(torch.int32) for w in (w0, w1, w2))  # [-1, -1, 3, 1]
    assert gta.consensus_message(w0, "count", True).dtype == torch.int8
    assert gta.agree(w0.clone(), s).tolist() == [0.0, -2.0, 3.0, 0.0]
    assert gta.agree(w1.clone(), c).tolist() == [-3.0, -1.0, 1.0, 2.0]
    assert gta.agree(w2.clone(), s).tolist() == [-1.0, 0.0, 0.5, 0.0]
    assert gta.agree(w2.clone(), None).tolist() == w2.tolist()


def test_mask_bits_round_trip_to_the_weighted_denominator():
    kept = [torch.tensor([1.0, 0.0, 2.0, 0.0, 1.0, 1.0]), torch.tensor([0.0, 0.0, 3.0, 1.0, 0.0, 1.0]),
            torch.tensor([5.0, 0.0, 0.0, 1.0, 1.0, 0.0])]
    bits = sum(gta.encode_mask_bits(k, w, 3) for w, k in enumerate(kept))
    assert bits.dtype == torch.uint8 and bits.tolist() == [5, 0, 3, 6, 5, 3]
    weights = torch.tensor([[0.5, 0.2], [0.3, 0.3], [0.2, 0.5]], dtype=torch.float64)
    den = gta.decode_denominator(bits, SEGS, weights, torch.empty(6))
    assert den.tolist() == pytest.approx([0.7, 0.0, 0.8, 0.5, 0.7, 0.5])
    assert gta.mask_dtype(8) == torch.uint8 and gta.mask_dtype(9) == torch.int32
    assert gta.encode_mask_bits(torch.ones(1), 7, 8).tolist() == [128]


def test_merge_normalizes_by_the_weight_of_the_workers_that_kept_an_entry():
    num = torch.tensor([1.0, 0.0, 3.0])
    assert gta.merge(num.clone(), torch.tensor([0.5, 0.0, 1.0])).tolist() == [2.0, 0.0, 3.0]
    assert gta.merge(num.clone(), None).tolist() == [1.0, 0.0, 3.0]


def test_traffic_relative_to_the_plain_mean():
    assert gta.traffic_ratio(None, False, False) == 1.0
    assert gta.traffic_ratio(None, True, True) == 1.25
    assert gta.traffic_ratio("count", True, True) == 1.5
    assert gta.traffic_ratio("sum", True, True) == 2.25
    assert gta.traffic_ratio("sum", True, False) == 3.0
