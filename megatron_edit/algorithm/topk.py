"""Top-k sparsification of pseudo-gradients with low-bit values, for the exchange (SparseLoCo,
arXiv 2508.15706): the codec (what an exchange sends with it: :mod:`.wire`).

Pure functions. A flat fp32 tensor of ``numel`` elements is cut into chunks of ``chunk``
elements (the last one padded with zeros); in each chunk the ``k = ceil(density x chunk)``
entries of largest magnitude are kept (among equal magnitudes the lower index: a stable sort, so
ties are decided the same way everywhere), and each is sent as its index inside the chunk and
its value:

* an index takes ``index_bits(chunk) = ceil(log2 chunk)`` bits (12 for 4096), so chunks are at
  most :data:`MAX_CHUNK` elements (16 bits);
* a value is ``fp32`` (32 bits, exact) or an integer code of ``int8``, ``int4`` or ``int2``
  with one fp32 scale per chunk. int8 / int4: ``q = round(v / scale)``, ``scale = amax / 127``
  (``/ 7``), as :mod:`.quantize` does for the dense formats. int2: ``q`` in {-1, 0, 1},
  ``scale`` = the mean magnitude of the chunk's kept non-zero values: the kept values are the
  chunk's largest, so they are close in magnitude and a signed scale-sized step is their best
  2-bit stand-in (the L2-best scale of a sign); an entry under half of it (a zero kept in a chunk
  with fewer non-zeros than k) decodes to 0. The code stored is ``q + 2^(bits-1)`` (offset
  binary; int4's is :mod:`.quantize`'s).

A chunk's payload never depends on the values (k entries always: a chunk with fewer non-zeros
sends zeros), so every worker's payload has the same size and one all-gather carries them all.

Layout of :func:`encode` (one ``uint8`` tensor; bit streams are little-endian, least
significant bit first, entry ``j`` of chunk ``c`` at position ``c k + j``):

1. the indices, ``chunks x k`` entries of ``index_bits`` bits, ascending inside each chunk,
   padded with zero bits to a multiple of 4 bytes;
2. the values' codes, ``chunks x k`` entries of ``value_bits`` bits (fp32: the floats' bytes),
   padded to a multiple of 4 bytes;
3. the fp32 scales, one per chunk (not for fp32 values).

Error feedback is the caller's: ``residual = x - decode(encode(x))`` (what was not sent, and
what rounding changed in what was). NaN / Inf must be excluded by the caller, as for the dense
formats (a sync refuses them before anything is encoded).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .formats import TOPK_MAX_CHUNK as MAX_CHUNK  # the largest chunk: its indices take 16 bits
from .formats import TOPK_VALUE_BITS as _BITS
from .formats import index_bits  # noqa: F401 (re-exported: bits of an index inside a chunk)
from .formats import TOPK_VALUES as VALUE_DTYPES  # the formats of the kept values

_MAX = {"int8": 127.0, "int4": 7.0, "int2": 1.0}


def value_bits(dtype: str) -> int:
    return _BITS[dtype]


def keep_count(chunk: int, density: float) -> int:
    """k: entries kept per chunk, ``ceil(density x chunk)`` (at least 1, at most the chunk)."""
    # round() first: 0.02 x 4096 is 81.92, but 0.03 x 100 is 3.0000000000000004 in binary.
    return max(1, min(chunk, math.ceil(round(density * chunk, 9))))


def _pad4(n: int) -> int:
    return -(-n // 4) * 4


@dataclass(frozen=True)
class Layout:
    """Where :func:`encode` puts what, for one tensor."""

    chunk: int
    k: int
    chunks: int
    index_bits: int
    value_bits: int
    index_bytes: int
    value_bytes: int
    scale_bytes: int

    @property
    def total(self) -> int:
        return self.index_bytes + self.value_bytes + self.scale_bytes


def layout(numel: int, density: float, chunk: int, dtype: str) -> Layout:
    """The :class:`Layout` of ``numel`` elements in chunks of ``chunk`` (the caller chooses it;
    an exchange uses ``min(chunk, numel)`` for a shard smaller than a chunk)."""
    chunks = -(-numel // chunk) if numel else 0
    k = keep_count(chunk, density)
    ib, vb = index_bits(chunk), value_bits(dtype)
    return Layout(chunk, k, chunks, ib, vb, _pad4(-(-chunks * k * ib // 8)), _pad4(-(-chunks * k * vb // 8)),
                  4 * chunks if dtype in _MAX else 0)


def encoded_bytes(numel: int, density: float, chunk: int, dtype: str) -> int:
    """Bytes of :func:`encode` for ``numel`` elements, indices and scales included."""
    return layout(numel, density, chunk, dtype).total


# ------------------------------------------------------------------ bit packing
def pack_bits(codes: torch.Tensor, bits: int, nbytes: int) -> torch.Tensor:
    """``codes`` (integers in [0, 2^bits), bits <= 16) as a little-endian bit stream of
    ``nbytes`` bytes (the bits after the last code are 0)."""
    assert 1 <= bits <= 16
    out = torch.zeros(nbytes + 3, dtype=torch.int64, device=codes.device)
    if codes.numel():
        pos = torch.arange(codes.numel(), device=codes.device, dtype=torch.int64) * bits
        word = codes.reshape(-1).to(torch.int64) << (pos & 7)  # at most 23 bits: 3 bytes
        byte = pos >> 3
        # The codes' bits never overlap, so adding the bytes is OR-ing them (and exact).
        for i in range(3):
            out.index_add_(0, byte + i, (word >> (8 * i)) & 0xFF)
    return out[:nbytes].to(torch.uint8)


def unpack_bits(data: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """The ``count`` codes of :func:`pack_bits` (int64)."""
    pos = torch.arange(count, device=data.device, dtype=torch.int64) * bits
    padded = torch.cat([data.to(torch.int64), data.new_zeros(3, dtype=torch.int64)])
    byte = pos >> 3
    word = padded[byte] | (padded[byte + 1] << 8) | (padded[byte + 2] << 16)
    return (word >> (pos & 7)) & ((1 << bits) - 1)


# ------------------------------------------------------------------ the codec
def select(x: torch.Tensor, chunk: int, k: int) -> torch.Tensor:
    """``[chunks, k]`` indices inside each chunk of the kept entries of ``x`` (largest
    magnitude, the lower index among equal ones), ascending."""
    lay_chunks = -(-x.numel() // chunk)
    padded = torch.zeros(lay_chunks * chunk, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    order = padded.view(lay_chunks, chunk).abs().sort(dim=1, descending=True, stable=True).indices
    return order[:, :k].sort(dim=1).values


def encode(x: torch.Tensor, density: float, chunk: int, dtype: str) -> torch.Tensor:
    """``x`` (flat fp32, finite) -> one uint8 tensor of :func:`encoded_bytes` bytes."""
    lay = layout(x.numel(), density, chunk, dtype)
    if not lay.chunks:
        return torch.zeros(0, dtype=torch.uint8, device=x.device)
    index = select(x, chunk, lay.k)
    padded = torch.zeros(lay.chunks * chunk, dtype=torch.float32, device=x.device)
    padded[: x.numel()] = x
    kept = padded.view(lay.chunks, chunk).gather(1, index)
    parts = [pack_bits(index, lay.index_bits, lay.index_bytes)]
    if dtype == "fp32":
        parts.append(kept.reshape(-1).contiguous().view(torch.uint8))
    else:
        mag = kept.abs()
        if dtype == "int2":
            count = (mag > 0).sum(dim=1, keepdim=True)
            scale = mag.sum(dim=1, keepdim=True) / count.clamp(min=1)
        else:
            scale = mag.amax(dim=1, keepdim=True) / _MAX[dtype]
        # A chunk of zeros keeps scale 0; its codes are 0's and decode to 0.
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        q = torch.round(kept / safe).clamp_(-_MAX[dtype], _MAX[dtype]).to(torch.int64)
        parts.append(pack_bits(q + (1 << (lay.value_bits - 1)), lay.value_bits, lay.value_bytes))
        parts.append(scale.reshape(-1).contiguous().view(torch.uint8))
    return torch.cat(parts)


def decode(data: torch.Tensor, numel: int, density: float, chunk: int, dtype: str) -> torch.Tensor:
    """The inverse of :func:`encode`: a flat fp32 tensor of ``numel`` elements (zeros where
    nothing was sent)."""
    lay = layout(numel, density, chunk, dtype)
    out = torch.zeros(lay.chunks * chunk, dtype=torch.float32, device=data.device)
    if not lay.chunks:
        return out
    count = lay.chunks * lay.k
    index = unpack_bits(data[: lay.index_bytes], count, lay.index_bits).view(lay.chunks, lay.k)
    body = data[lay.index_bytes : lay.index_bytes + lay.value_bytes]
    if dtype == "fp32":
        values = body[: 4 * count].view(torch.float32).view(lay.chunks, lay.k)
    else:
        codes = unpack_bits(body, count, lay.value_bits) - (1 << (lay.value_bits - 1))
        start = lay.index_bytes + lay.value_bytes
        scale = data[start : start + lay.scale_bytes].view(torch.float32).view(lay.chunks, 1)
        values = codes.to(torch.float32).view(lay.chunks, lay.k) * scale
    out.view(lay.chunks, chunk).scatter_(1, index, values)
    return out[:numel]
