"""Block-wise quantization of pseudo-gradients for the exchange, with error feedback.

Pure functions. A flat fp32 tensor is cut into blocks of ``block`` elements; each block gets one
fp32 scale (its largest magnitude over the format's largest value) and its elements are stored
in the format's bits:

=========  =========================================  =====================================
dtype      element                                    bytes per element (block 256)
=========  =========================================  =====================================
``fp32``   (no quantization)                          4
``bf16``   bfloat16, no scale                         2
``fp8``    float8 e4m3 of x / scale (scale = amax/448) 1 + 4/256
``int8``   round(x / scale), scale = amax / 127        1 + 4/256
``int4``   round(x / scale), scale = amax / 7, two     0.5 + 4/256
           per byte
=========  =========================================  =====================================

A quantized tensor travels as one ``uint8`` tensor: the element bytes, then the scales' bytes,
so one collective carries both. :func:`encode` and :func:`decode` are exact inverses of each
other's layout; ``decode(encode(x))`` is x up to the format's rounding (at most half a quantum,
scale / 2, per element for the integer formats).

Error feedback (what quantization dropped, added to the next pseudo-gradient) is the caller's:
``residual = x - decode(encode(x))``.
"""

from __future__ import annotations

import math
from typing import Tuple

import torch

from .formats import DENSE as DTYPES  # noqa: F401 (the exchange formats, in order of size)

_MAX = {"fp8": 448.0, "int8": 127.0, "int4": 7.0}


def has_scales(dtype: str) -> bool:
    return dtype in _MAX


def element_bits(dtype: str) -> int:
    return {"fp32": 32, "bf16": 16, "fp8": 8, "int8": 8, "int4": 4}[dtype]


def padded_length(numel: int, dtype: str, block: int) -> int:
    """Elements after padding to whole blocks (and whole bytes for int4)."""
    if not has_scales(dtype):
        return numel
    return math.ceil(numel / block) * block if numel else 0


def _body_bytes(n: int, dtype: str) -> int:
    """Element bytes of ``n`` (padded) elements, rounded up to 4 so the fp32 scales that follow
    (and the next chunk, in a buffer of several) stay aligned."""
    body = n * element_bits(dtype) // 8
    return -(-body // 4) * 4 if has_scales(dtype) else body


def encoded_bytes(numel: int, dtype: str, block: int) -> int:
    """Bytes of :func:`encode` for ``numel`` elements."""
    n = padded_length(numel, dtype, block)
    return _body_bytes(n, dtype) + (4 * (n // block) if has_scales(dtype) else 0)


def encode(x: torch.Tensor, dtype: str, block: int) -> torch.Tensor:
    """``x`` (flat fp32) -> one uint8 tensor of :func:`encoded_bytes` bytes."""
    if dtype == "fp32":
        return x.contiguous().view(torch.uint8)
    if dtype == "bf16":
        return x.to(torch.bfloat16).view(torch.uint8)
    n = padded_length(x.numel(), dtype, block)
    blocks = torch.zeros(n, dtype=torch.float32, device=x.device)
    blocks[: x.numel()] = x
    blocks = blocks.view(-1, block)
    amax = blocks.abs().amax(dim=1, keepdim=True)
    # A block of zeros (or of non-finite values, which the caller should have excluded) keeps
    # scale 0 / nan; its elements decode to 0 / nan.
    scale = amax / _MAX[dtype]
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    scaled = blocks / safe
    if dtype == "fp8":
        body = scaled.to(torch.float8_e4m3fn).view(torch.uint8).view(-1)
    else:
        q = torch.round(scaled).clamp_(-_MAX[dtype], _MAX[dtype]).to(torch.int8)
        if dtype == "int8":
            body = q.view(torch.uint8).view(-1)
        else:  # int4: q + 8 in [1, 15], two per byte (low nibble first)
            nib = (q.view(-1) + 8).to(torch.uint8)
            body = nib[0::2] | (nib[1::2] << 4)
    pad = body.new_zeros(_body_bytes(n, dtype) - body.numel())
    return torch.cat([body, pad, scale.view(-1).contiguous().view(torch.uint8)])


def decode(data: torch.Tensor, numel: int, dtype: str, block: int) -> torch.Tensor:
    """The inverse of :func:`encode`: a flat fp32 tensor of ``numel`` elements."""
    if dtype == "fp32":
        return data.view(torch.float32)[:numel]
    if dtype == "bf16":
        return data.view(torch.bfloat16).to(torch.float32)[:numel]
    n = padded_length(numel, dtype, block)
    body_bytes = _body_bytes(n, dtype)
    body = data[: n * element_bits(dtype) // 8]
    scale = data[body_bytes : body_bytes + 4 * (n // block)].view(torch.float32).view(-1, 1)
    if dtype == "fp8":
        values = body.view(torch.float8_e4m3fn).to(torch.float32)
    elif dtype == "int8":
        values = body.view(torch.int8).to(torch.float32)
    else:
        values = torch.empty(n, dtype=torch.float32, device=data.device)
        values[0::2] = (body & 0x0F).to(torch.float32) - 8
        values[1::2] = (body >> 4).to(torch.float32) - 8
    return (values.view(-1, block) * scale).view(-1)[:numel]


def quantum(x: torch.Tensor, dtype: str, block: int) -> torch.Tensor:
    """Per element, the step between two representable values of its block (integer formats:
    the scale); what one rounding can lose is half of it."""
    n = padded_length(x.numel(), dtype, block)
    blocks = torch.zeros(n, dtype=torch.float32, device=x.device)
    blocks[: x.numel()] = x.abs()
    scale = blocks.view(-1, block).amax(dim=1, keepdim=True) / _MAX[dtype]
    return scale.expand(-1, block).reshape(-1)[: x.numel()]


def split_sizes(numel: int, parts: int, dtype: str, block: int) -> Tuple[int, ...]:
    """Elements of each of ``parts`` chunks of a ``numel`` tensor, each a whole number of
    blocks (the last may be shorter), for a reduce-scatter of quantized chunks."""
    unit = block if has_scales(dtype) else 1
    per = math.ceil(math.ceil(numel / unit) / parts) * unit if numel else 0
    sizes, left = [], numel
    for _ in range(parts):
        sizes.append(min(per, left))
        left -= sizes[-1]
    return tuple(sizes)
