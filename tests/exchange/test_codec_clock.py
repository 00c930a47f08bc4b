"""Each format's codec timed against a loopback group (exchange/codec_clock.py)."""

import dataclasses

import pytest
import torch

from megatron_edit.algorithm.formats import topk_format
from megatron_edit.config import LocalSGDConfig
from megatron_edit.exchange.codec_clock import _exchange_once, _values, codec_seconds

FORMATS = ("fp32", "bf16", "int8", "int4", "topk0.02-int2", "topk0.1-int4")


def _config(fmt):
    sparse = topk_format(fmt)
    return dataclasses.replace(LocalSGDConfig(), exchange_dtype=fmt if sparse is None else sparse[1],
                               exchange_topk_density=None if sparse is None else sparse[0])


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_loopback_exchange_is_the_real_one_with_every_worker_sending_the_same(fmt):
    """Every worker of the loopback group sends this rank's payload, through the reducer the sync
    runs (reducers.choose): fp32's mean of W equal pseudo-gradients is the pseudo-gradient, the
    top-k exchange's is its own payload decoded, the quantized exchange's chunk 0 (the one this
    rank reduces) its quantization."""
    from megatron_edit.algorithm import quantize, topk

    values = _values(10_000, torch.device("cpu"))
    mean, _, protocol = _exchange_once(_config(fmt), 3, values)
    sparse = topk_format(fmt)
    if fmt == "fp32":
        assert torch.allclose(mean, values)
    elif sparse is not None:
        chunk = protocol.chunk_for(values.numel())
        sent = topk.decode(topk.encode(values, sparse[0], chunk, sparse[1]), values.numel(), sparse[0], chunk,
                           sparse[1])
        assert torch.allclose(mean, sent, atol=1e-6)
    else:
        sizes, offsets, per, _, block = protocol._chunks(values.numel())
        own = values[: sizes[0]]
        once = quantize.decode(quantize.encode(own, fmt, block), sizes[0], fmt, block)
        # the owner's sum of 3 equal chunks, divided, then quantized again for the all-gather
        assert (mean[: sizes[0]] - own).norm() <= 2 * (once - own).norm() + 1e-6
        assert (mean[: sizes[0]] - own).norm() > 0


def test_codec_seconds_times_every_format_on_the_shards_sizes_and_leaves_the_random_state_alone():
    """Each shard's exchange in turn, up to SAMPLE elements, scaled to all of them."""
    from megatron_edit.exchange import codec_clock

    state = torch.random.get_rng_state()
    ticks = iter(range(1000))
    clock = lambda: float(next(ticks))  # noqa: E731 (one tick per timed format)
    assert codec_seconds(_config, FORMATS, [4 << 20], 2, "cpu", clock=clock) == {f: 4.0 for f in FORMATS}
    assert codec_seconds(_config, FORMATS[:2], [1 << 19, 1 << 19, 1 << 20], 2, "cpu", clock=clock) == {
        f: 2.0 for f in FORMATS[:2]}  # the first two shards timed: half of the elements
    assert torch.equal(state, torch.random.get_rng_state())
    real = codec_seconds(_config, FORMATS, [1 << 14, 1 << 12], 2, torch.device("cpu"))
    assert set(real) == set(FORMATS) and all(t > 0 for t in real.values())
    assert codec_clock.SAMPLE == 1 << 20
