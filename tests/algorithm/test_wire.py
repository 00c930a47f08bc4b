"""The exchange's formats by name and what each sends (algorithm/formats.py, algorithm/wire.py);
what the exchanges really send is counted against it in tests/exchange/test_wire_bytes.py."""

import pytest
import torch

from megatron_edit.algorithm import quantize, topk, wire
from megatron_edit.algorithm.formats import topk_format


def test_format_names_and_the_refusal_of_a_dense_int2():
    assert topk_format("topk0.02-int2") == (0.02, "int2") and topk_format("topk1e-3-int4") == (0.001, "int4")
    assert topk_format("int4") is None and topk_format("bf16") is None
    with pytest.raises(ValueError, match=r"int2 is a value format of the top-k exchange only.*topk0\.02-int2"):
        topk_format("int2")
    for bad in ("topk0-int2", "topk2-int2", "topk0.02-bf16", "topkx-int2", "top0.02-int2", "int3"):
        with pytest.raises(ValueError, match="unknown exchange format"):
            topk_format(bad)


def test_payload_bytes_are_what_the_codecs_encode():
    """An actual encode of a tensor has the payload's size, for every format (dense and top-k)."""
    x = torch.randn(10_007, generator=torch.Generator().manual_seed(0))
    for name in ("fp8", "int8", "int4"):
        assert wire.payload_bytes(x.numel(), name, 256) == quantize.encode(x, name, 256).numel(), name
    assert wire.payload_bytes(1000, "fp32") == 4000 and wire.payload_bytes(1000, "bf16") == 2000
    assert wire.payload_bytes(1024, "int8", 256) == 1024 + 4 * 4  # one fp32 scale per block
    for name in ("topk0.02-int2", "topk0.03-int4", "topk0.02-int8", "topk0.02-fp32", "topk1-int2"):
        density, values = topk_format(name)
        assert wire.payload_bytes(x.numel(), name) == topk.encode(x, density, 4096, values).numel(), name
    assert wire.payload_bytes(4096 * 10, "topk0.02-int2") == 1480  # 82 x 10 x (12 + 2) bits + 10 scales
    with pytest.raises(ValueError, match="numel must be >= 1"):
        wire.payload_bytes(0, "fp32")


def test_wire_bytes_per_format_and_workers():
    n = wire.AT_SCALE
    assert wire.wire_bytes(n, "fp32", 4) == 2 * 3 * 4 * n // 4
    assert wire.wire_bytes(n, "bf16", 4) == 2 * 3 * 2 * n // 4
    assert wire.wire_bytes(n, "int8", 4) == 2 * 3 * (n // 4 + 4 * n // 4 // 256)
    assert wire.wire_bytes(n, "topk0.02-int2", 4) == 3 * topk.encoded_bytes(n, 0.02, 4096, "int2")
    # at 2% with int2 values: under two hundredths of fp32 at 2 and 4 workers (indices included)
    for workers in (2, 4):
        assert wire.wire_bytes(n, "topk0.02-int2", workers) / wire.wire_bytes(n, "fp32", workers) <= 0.02
    assert wire.wire_bytes(n, "topk0.02-int2", 2) / wire.wire_bytes(n, "fp32", 2) == pytest.approx(0.009, abs=5e-4)
    # a shard of a few elements: indices, scales and padding outweigh the values; it goes in fp32
    assert wire.format_wire_bytes(5, "int4", 4) > wire.wire_bytes(5, "int4", 4) == wire.wire_bytes(5, "fp32", 4)
    assert wire.wire_bytes(n, "int4", 1) == 0


def test_dense_int4_is_cheaper_from_29_workers_at_two_percent_int2():
    """The all-gather grows with W, the dense int4 exchange's 2 (W - 1) / W does not."""
    n, w = wire.AT_SCALE, wire.dense_int4_cheaper_from(0.02, 4096, "int2")
    assert w == 29
    assert wire.wire_bytes(n, "topk0.02-int2", w) > wire.wire_bytes(n, "int4", w)
    assert wire.wire_bytes(n, "topk0.02-int2", w - 1) <= wire.wire_bytes(n, "int4", w - 1)


def test_messages_in_a_row_per_collective():
    assert [wire.message_rounds(f, 4) for f in ("fp32", "int4", "topk0.02-int2")] == [6, 4, 3]
    assert wire.message_rounds("fp32", 1) == 0
