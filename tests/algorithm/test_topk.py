"""The top-k codec of the sparse exchange (megatron_edit.algorithm.topk) against an independent
decoder of its bytes and an independent choice of what is kept, both written here from the
format's description: indices (ceil(log2 chunk) bits each, ascending per chunk), then the values'
codes (q + 2^(bits-1); fp32: the floats), each stream little-endian, least significant bit
first, padded to 4 bytes; then one fp32 scale per chunk. Kept: per chunk the k = ceil(density x
chunk) entries of largest magnitude, the lower index among equal ones."""

import math
import struct

import pytest
import torch

from megatron_edit.algorithm import topk

BITS = {"fp32": 32, "int8": 8, "int4": 4, "int2": 2}
MAX = {"int8": 127, "int4": 7, "int2": 1}


def _bits(data: bytes, start_bit: int, count: int) -> int:
    """``count`` bits of ``data`` from bit ``start_bit`` (LSB-first), read one at a time."""
    value = 0
    for i in range(count):
        bit = start_bit + i
        value |= ((data[bit // 8] >> (bit % 8)) & 1) << i
    return value


def _f32(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def independent_decode(data: bytes, numel: int, density: float, chunk: int, dtype: str):
    """(Python floats of the decoded tensor, [[kept indices] per chunk]) from the bytes alone."""
    chunks = math.ceil(numel / chunk)
    k = min(chunk, max(1, math.ceil(round(density * chunk, 9))))
    ib = max(1, math.ceil(math.log2(chunk))) if chunk > 1 else 1
    vb = BITS[dtype]
    index_bytes = math.ceil(chunks * k * ib / 8 / 4) * 4
    value_bytes = math.ceil(chunks * k * vb / 8 / 4) * 4
    assert len(data) == index_bytes + value_bytes + (4 * chunks if dtype != "fp32" else 0)
    scales = struct.unpack(f"<{chunks}f", data[index_bytes + value_bytes:]) if dtype != "fp32" else None
    out = [0.0] * (chunks * chunk)
    kept = []
    for c in range(chunks):
        indices = []
        for j in range(k):
            entry = c * k + j
            index = _bits(data, entry * ib, ib)
            if dtype == "fp32":
                value = struct.unpack("<f", data[index_bytes + 4 * entry : index_bytes + 4 * entry + 4])[0]
            else:
                code = _bits(data[index_bytes:], entry * vb, vb)
                value = _f32((code - 2 ** (vb - 1)) * scales[c])  # an fp32 product
            out[c * chunk + index] = value
            indices.append(index)
        kept.append(indices)
    # padding bits are zero
    assert _bits(data, chunks * k * ib, index_bytes * 8 - chunks * k * ib) == 0
    return out[:numel], kept


def independent_keep(x, chunk: int, k: int):
    """Per chunk, the kept indices: largest magnitude first, the lower index among equal ones."""
    values = list(x) + [0.0] * (-len(x) % chunk)
    out = []
    for c in range(len(values) // chunk):
        part = values[c * chunk : (c + 1) * chunk]
        order = sorted(range(chunk), key=lambda i: (-abs(part[i]), i))
        out.append(sorted(order[:k]))
    return out


def _bytes(t: torch.Tensor) -> bytes:
    return bytes(t.tolist())


@pytest.mark.parametrize("dtype", ["fp32", "int8", "int4", "int2"])
@pytest.mark.parametrize("numel,chunk,density", [(1, 8, 0.5), (37, 8, 0.25), (64, 16, 0.1), (300, 128, 0.02),
                                                 (100, 7, 0.3), (70, 64, 1.0)])
def test_decode_equals_an_independent_decoder_and_keeps_the_top_k_of_each_chunk(dtype, numel, chunk, density):
    """Chunk boundaries (a partial last chunk, chunks not a power of two: 7 elements in 3 bits),
    index packing across bytes, every value format; the kept indices are the top-k of each chunk
    and the values within half a quantum of the originals (fp32: exact)."""
    g = torch.Generator().manual_seed(numel * 31 + chunk)
    x = torch.randn(numel, generator=g)
    data = topk.encode(x, density, chunk, dtype)
    assert data.dtype == torch.uint8 and data.numel() == topk.encoded_bytes(numel, density, chunk, dtype)
    expected, kept = independent_decode(_bytes(data), numel, density, chunk, dtype)
    got = topk.decode(data, numel, density, chunk, dtype)
    assert got.tolist() == expected  # bit for bit: both multiply the same code by the same fp32 scale
    k = topk.keep_count(chunk, density)
    assert kept == independent_keep(x.tolist(), chunk, k)
    sent = torch.zeros(numel, dtype=torch.bool)
    for c, indices in enumerate(kept):
        for i in indices:
            if c * chunk + i < numel:
                sent[c * chunk + i] = True
    assert (got[~sent] == 0).all()
    if dtype == "fp32":
        assert torch.equal(got[sent], x[sent])
    elif dtype != "int2":
        for c in range(len(kept)):
            part = slice(c * chunk, min(numel, (c + 1) * chunk))
            quantum = x[part][sent[part]].abs().max() / MAX[dtype]
            assert ((got[part] - x[part])[sent[part]].abs() <= quantum / 2 * 1.0001 + 1e-12).all()
    else:  # the sign of each kept entry, scaled by the mean magnitude of the chunk's kept ones
        for c in range(len(kept)):
            part = slice(c * chunk, min(numel, (c + 1) * chunk))
            mine = x[part][sent[part]]
            scale = mine.abs().mean()
            expect = torch.where(mine.abs() >= scale / 2, torch.sign(mine) * scale, torch.zeros_like(mine))
            assert torch.allclose(got[part][sent[part]], expect, rtol=1e-6, atol=0)


def test_index_bits_are_as_few_as_the_chunk_needs():
    assert [topk.index_bits(c) for c in (2, 3, 4, 5, 8, 9, 4096, 4097, 65536)] == [1, 2, 2, 3, 3, 4, 12, 13, 16]
    lay = topk.layout(4096 * 10, 0.02, 4096, "int2")
    assert (lay.k, lay.chunks, lay.index_bits) == (82, 10, 12)
    # 820 indices x 12 bits, 820 codes x 2 bits, 10 scales; each stream padded to 4 bytes
    assert (lay.index_bytes, lay.value_bytes, lay.scale_bytes) == (1232, 208, 40)
    assert topk.encoded_bytes(4096 * 10, 0.02, 4096, "int2") == 1480


@pytest.mark.parametrize("bits", [1, 2, 3, 4, 7, 8, 12, 13, 16])
def test_pack_bits_round_trips_and_matches_the_bit_reader(bits):
    g = torch.Generator().manual_seed(bits)
    codes = torch.randint(0, 2 ** bits, (53,), generator=g)
    nbytes = math.ceil(53 * bits / 8)
    data = topk.pack_bits(codes, bits, nbytes)
    assert torch.equal(topk.unpack_bits(data, 53, bits), codes)
    raw = _bytes(data)
    assert [_bits(raw, i * bits, bits) for i in range(53)] == codes.tolist()


@pytest.mark.parametrize("dtype", ["fp32", "int8", "int4", "int2"])
def test_a_chunk_with_fewer_non_zeros_than_k_sends_them_and_zeros(dtype):
    """Chunk 0 has 2 non-zeros and k = 4: both are sent (at their places), the other two
    entries sent are zeros (the lowest indices among the zeros) and decode to 0; an all-zero
    chunk has scale 0 and decodes to zeros."""
    x = torch.zeros(24)
    x[5], x[2] = 3.0, -1.5
    x[8:16] = torch.arange(1, 9, dtype=torch.float32)
    data = topk.encode(x, 0.5, 8, dtype)
    got, kept = independent_decode(_bytes(data), 24, 0.5, 8, dtype)
    assert kept[0] == [0, 1, 2, 5] and kept[1] == [4, 5, 6, 7] and kept[2] == [0, 1, 2, 3]
    decoded = topk.decode(data, 24, 0.5, 8, dtype)
    assert decoded.tolist() == got
    assert (decoded[[0, 1, 3, 4, 6, 7]] == 0).all() and (decoded[16:] == 0).all()
    assert decoded[5] > 0 and decoded[2] < 0
    if dtype != "fp32":
        scales = struct.unpack("<3f", _bytes(data)[-12:])
        assert scales[2] == 0.0


def test_ties_keep_the_lower_index_and_encode_is_deterministic():
    x = torch.tensor([1.0, -2.0, 2.0, 1.0, -2.0, 0.5, 2.0, 1.0])
    data = topk.encode(x, 0.5, 8, "int2")
    _, kept = independent_decode(_bytes(data), 8, 0.5, 8, "int2")
    assert kept == [[1, 2, 4, 6]]
    assert torch.equal(data, topk.encode(x.clone(), 0.5, 8, "int2"))
    # one more tie at the boundary: |-2| at 1, 2, 4, 6 and 7 -> 7 is dropped
    x[7] = 2.0
    _, kept = independent_decode(_bytes(topk.encode(x, 0.5, 8, "fp32")), 8, 0.5, 8, "fp32")
    assert kept == [[1, 2, 4, 6]]


@pytest.mark.parametrize("dtype", ["fp32", "int2"])
def test_error_feedback_residual_is_what_was_not_sent_and_the_sum_follows_the_true_sum(dtype):
    """residual = x - decode(encode(x)): where nothing was sent it is x (fp32: exactly what was
    not sent, and 0 where something was); with the residual added to the next input, the sum of
    what was sent over syncs follows the sum of the inputs to within the last residual."""
    g = torch.Generator().manual_seed(3)
    residual = torch.zeros(200)
    sent_total, true_total = torch.zeros(200), torch.zeros(200)
    for _ in range(30):
        x = torch.randn(200, generator=g)
        true_total += x
        corrected = x + residual
        sent = topk.decode(topk.encode(corrected, 0.1, 50, dtype), 200, 0.1, 50, dtype)
        unsent = sent == 0
        residual = corrected - sent
        if dtype == "fp32":
            assert torch.equal(residual[unsent], corrected[unsent]) and (residual[~unsent] == 0).all()
        sent_total += sent
    assert torch.allclose(sent_total + residual, true_total, atol=1e-4)
    # what error feedback keeps does not grow without bound (top-k of the residual-corrected input)
    assert residual.abs().max() < 10 * true_total.abs().max() / math.sqrt(30)
