"""megatron_edit.exchange.shard: one rank's shard of a bucket, on plain tensors."""

import torch

from megatron_edit.exchange.shard import BucketShard, merge_runs


def _shard(**kw):
    fields = dict(numel=6, mains=[], local_ranges=[], segments=[(0, 2, 0, True), (2, 5, 1, True)])
    fields.update(kw)
    return BucketShard(**fields)


def test_scale_layers_zeroes_excluded_segments_even_when_nan():
    shard = _shard()
    t = torch.tensor([1.0, float("nan"), 2.0, 2.0, 2.0, 0.0])
    shard.scale_layers(t, torch.tensor([0.0, 0.25]))
    assert torch.equal(t, torch.tensor([0.0, 0.0, 0.5, 0.5, 0.5, 0.0]))


def test_runs_merge_adjacent_segments_of_one_layer_and_norm_flag():
    segments = [(4, 6, 1, True), (0, 2, 0, True), (2, 4, 0, True), (6, 7, 1, False), (7, 9, 1, False)]
    assert merge_runs(segments) == [(0, 4, 0, True), (4, 6, 1, True), (6, 9, 1, False)]


def test_read_and_write_mains_and_the_model_copy_with_padding_kept_at_zero():
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0, 5.0])
    model = torch.full((8,), 9.0, dtype=torch.bfloat16)
    shard = BucketShard(numel=8, mains=[a, b], local_ranges=[(0, 2), (3, 6)],
                        segments=[(0, 2, 0, True), (3, 6, 1, True)], model=model)
    assert shard.gaps == [(2, 3), (6, 8)]
    current = shard.read_current(torch.full((8,), -1.0))
    assert current.tolist() == [1.0, 2.0, 0.0, 3.0, 4.0, 5.0, 0.0, 0.0]
    values = torch.arange(8, dtype=torch.float32) + 0.5
    values[2] = values[6] = values[7] = 0.0
    shard.write_mains(values)
    assert a.tolist() == [0.5, 1.5] and b.tolist() == [3.5, 4.5, 5.5]
    shard.write_model(values)
    assert model.float().tolist() == values.tolist()
