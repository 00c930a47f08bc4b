"""The error-feedback residual across a change of exchange format (``auto_overlap``;
:mod:`megatron_edit.algorithm.residual`): the worker's residual is carried on, the quantized
exchange's chunk residual folded into it, an exchange without error feedback sends it once;
nothing is dropped."""

import torch

from megatron_edit.algorithm import quantize, topk
from megatron_edit.algorithm.residual import fold_chunk_residual, fold_into


def test_the_chunk_residual_is_folded_into_the_worker_s_residual_times_the_result_s_divisor():
    residual = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    chunk = torch.tensor([0.5, -0.25, 7.0, 7.0])  # padded: two elements beyond the chunk's length
    out = fold_chunk_residual(residual, chunk, offset=3, length=2, factor=2, numel=6)
    assert out is residual and torch.equal(out, torch.tensor([1.0, 2.0, 3.0, 5.0, 4.5, 6.0]))
    # no residual yet (error feedback had never sent this shard): zeros, then the fold
    fresh = fold_chunk_residual(None, chunk, offset=0, length=2, factor=1, numel=4)
    assert torch.equal(fresh, torch.tensor([0.5, -0.25, 0.0, 0.0]))
    # a worker that owns no chunk (an empty span): nothing to fold
    assert torch.equal(fold_chunk_residual(None, chunk[:0], offset=0, length=0, factor=2, numel=3), torch.zeros(3))


def test_a_folded_chunk_residual_reaches_the_next_result_as_it_would_have():
    """Plain mean over W = 2: what the chunk residual r would have added to the next result
    (own chunk + r) equals what the worker adds by sending W r more: (x0 + x1 + 2 r) / 2."""
    x0, x1, r = torch.tensor([0.3, -1.0]), torch.tensor([0.7, 0.5]), torch.tensor([0.25, -0.125])
    kept = (x0 + x1) / 2 + r
    folded = fold_chunk_residual(torch.zeros(2), r, 0, 2, factor=2, numel=2)
    assert torch.equal((x0 + folded + x1) / 2, kept)


def test_an_exchange_without_error_feedback_sends_the_residual_once_except_over_skipped_layers():
    delta, residual = torch.ones(6), torch.arange(6.0)
    assert fold_into(delta, residual) is None and torch.equal(delta, 1 + torch.arange(6.0))
    assert fold_into(delta, None) is None and torch.equal(delta, 1 + torch.arange(6.0))  # none: unchanged
    delta = torch.ones(6)
    left = fold_into(delta, torch.arange(6.0), keep=[(1, 3)])  # layers every worker is excluded from
    assert torch.equal(delta, torch.tensor([1.0, 1.0, 1.0, 4.0, 5.0, 6.0]))
    assert torch.equal(left, torch.tensor([0.0, 1.0, 2.0, 0.0, 0.0, 0.0]))  # carried to the next sync


def test_over_a_change_of_format_the_sum_of_what_is_sent_follows_the_sum_of_the_pseudo_gradients():
    """One worker, int8 (block 8) for two syncs, then top-k 25% with int2 values for two, then
    fp32: with the residual carried over, what was sent in all adds up to what was to be sent,
    to rounding (nothing dropped at either change)."""
    torch.manual_seed(0)
    deltas = [torch.randn(32) for _ in range(5)]
    residual, sent = torch.zeros(32), torch.zeros(32)
    for i, d in enumerate(deltas):
        x = d + residual
        if i < 2:
            got = quantize.decode(quantize.encode(x, "int8", 8), 32, "int8", 8)
        elif i < 4:
            got = topk.decode(topk.encode(x, 0.25, 16, "int2"), 32, 0.25, 16, "int2")
        else:
            got = x.clone()  # fp32: the residual is sent once (fold_into), nothing is left
        residual = x - got
        sent += got
    assert torch.allclose(sent, sum(deltas), atol=1e-5)
    assert residual.abs().max() == 0
