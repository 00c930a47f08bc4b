"""The exchange's codecs (megatron_edit.algorithm.quantize) against an independent decoder of
their bytes, written here from the format's description (element bytes, then one fp32 scale per
block; int4 two per byte, low nibble first, stored as q + 8; fp8 as e4m3fn)."""

import math
import struct

import pytest
import torch

from megatron_edit.algorithm import quantize

MAX = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}


def _fp8_e4m3fn(byte: int) -> float:
    """One float8 e4m3fn byte: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities,
    S.1111.111 is NaN; exponent 0 is subnormal."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0x0F, byte & 0x07
    if exp == 0x0F and man == 0x07:
        return float("nan")
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def independent_decode(data: bytes, numel: int, dtype: str, block: int):
    """Python floats, from the bytes alone."""
    if dtype == "fp32":
        return list(struct.unpack(f"<{numel}f", data[: 4 * numel]))
    if dtype == "bf16":
        return [struct.unpack("<f", b"\x00\x00" + data[2 * i : 2 * i + 2])[0] for i in range(numel)]
    padded = math.ceil(numel / block) * block
    bits = 4 if dtype == "int4" else 8
    body = padded * bits // 8
    body_aligned = -(-body // 4) * 4
    blocks = padded // block
    scales = struct.unpack(f"<{blocks}f", data[body_aligned : body_aligned + 4 * blocks])
    values = []
    for i in range(padded):
        if dtype == "int4":
            byte = data[i // 2]
            q = (byte & 0x0F) if i % 2 == 0 else (byte >> 4)
            v = q - 8
        elif dtype == "int8":
            v = struct.unpack("<b", data[i : i + 1])[0]
        else:
            v = _fp8_e4m3fn(data[i])
        values.append(v * scales[i // block])
    return values[:numel]


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.tolist())


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp8", "int8", "int4"])
@pytest.mark.parametrize("numel,block", [(1, 8), (37, 8), (64, 16), (257, 256)])
def test_decode_equals_an_independent_decoder_of_the_bytes(dtype, numel, block):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)) * 3
    data = quantize.encode(x, dtype, block)
    assert data.dtype == torch.uint8 and data.numel() == quantize.encoded_bytes(numel, dtype, block)
    ours = quantize.decode(data, numel, dtype, block)
    theirs = torch.tensor(independent_decode(_bytes(data), numel, dtype, block), dtype=torch.float32)
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_integer_formats_round_to_within_half_a_quantum(dtype):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    got = quantize.decode(quantize.encode(x, dtype, 32), 1000, dtype, 32)
    scale = torch.cat([x, x.new_zeros(24)]).view(-1, 32).abs().amax(1).repeat_interleave(32)[:1000] / MAX[dtype]
    assert torch.all((got - x).abs() <= scale / 2 * (1 + 1e-6))
    assert torch.equal(quantize.quantum(x, dtype, 32), scale)
    # each block's largest magnitude is represented exactly (it sets the scale)
    blocks = torch.cat([x, x.new_zeros(24)]).view(-1, 32)
    idx = blocks.abs().argmax(1) + torch.arange(blocks.shape[0]) * 32
    idx = idx[idx < 1000]
    assert torch.allclose(got[idx], x[idx], rtol=1e-6, atol=0)


def test_int4_nibble_order_is_low_first_stored_as_q_plus_8():
    x = torch.tensor([1.0, -7.0, 7.0, 0.0])  # amax 7: scale 1, q = x
    data = quantize.encode(x, "int4", 4)
    assert data[0].item() == (1 + 8) | ((-7 + 8) << 4)
    assert data[1].item() == (7 + 8) | ((0 + 8) << 4)
    assert struct.unpack("<f", _bytes(data[4:8]))[0] == 1.0  # body padded to 4 bytes, then the scale


@pytest.mark.parametrize("dtype", ["fp8", "int8", "int4"])
def test_zero_and_subnormal_blocks(dtype):
    zeros = torch.zeros(16)
    data = quantize.encode(zeros, dtype, 8)
    assert torch.equal(quantize.decode(data, 16, dtype, 8), zeros)  # scale 0, exact zeros
    tiny = torch.tensor([1e-40, -3e-41, 0.0, 2e-45] * 4)  # fp32 subnormals
    got = quantize.decode(quantize.encode(tiny, dtype, 8), 16, dtype, 8)
    assert torch.isfinite(got).all()
    assert torch.all((got - tiny).abs() <= tiny.abs().max())  # no blow-up, sign kept where it is large
    assert got[0] > 0 and got[1] <= 0


@pytest.mark.parametrize("dtype", ["fp8", "int8", "int4"])
def test_a_non_finite_value_spoils_only_its_own_block(dtype):
    """The encoder's contract: NaN / Inf are kept out by the caller (the sync stops or excludes
    the worker before encoding, see test_outer_sync). If one slipped through, it would not reach
    other blocks."""
    x = torch.randn(24, generator=torch.Generator().manual_seed(2))
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[9] = bad
        got = quantize.decode(quantize.encode(y, dtype, 8), 24, dtype, 8)
        clean = quantize.decode(quantize.encode(x, dtype, 8), 24, dtype, 8)
        assert torch.equal(got[:8], clean[:8]) and torch.equal(got[16:], clean[16:])
        assert not torch.isfinite(got[8:16]).all()


@pytest.mark.parametrize("dtype", ["fp32", "int8", "int4"])
@pytest.mark.parametrize("numel,parts,block", [(300, 8, 38), (1000, 3, 256), (7, 4, 2), (0, 2, 8)])
def test_split_sizes_cover_the_tensor_in_whole_blocks(dtype, numel, parts, block):
    sizes = quantize.split_sizes(numel, parts, dtype, block)
    assert len(sizes) == parts and sum(sizes) == numel
    unit = block if quantize.has_scales(dtype) else 1
    filled = [s for s in sizes if s]
    assert all(s % unit == 0 for s in filled[:-1])  # only the last filled chunk may be short
