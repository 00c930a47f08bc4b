"""What an exchange sends across workers, per format: the package's one wire model.

Bytes one rank sends in one exchange of a shard of ``numel`` elements among W workers, for
every exchange format (:mod:`.formats`: the dense ones by name, the top-k exchange's as
``topk<density>-<values>``):

* fp32: a ring all-reduce, ``2 (W - 1) / W`` of the 4-byte payload (:func:`all_reduce_bytes`,
  also what the collectives' counters add up);
* bf16, fp8, int8, int4: the quantized exchange (:mod:`megatron_edit.exchange.quantized`): an
  all-to-all of W chunks and an all-gather of one, ``2 (W - 1)`` chunks of
  ``ceil(numel / W)`` elements in whole blocks (:func:`quantized_block`: the exchange's own
  rule), scales included;
* top-k: one all-gather of every worker's payload (:mod:`megatron_edit.exchange.sparse`), the
  W - 1 others' through each rank, indices and scales included (:func:`.topk.encoded_bytes`);
* a shard for which a format would send more than fp32 (a few elements) goes in fp32, as the
  exchanges do (their ``pays_off``).

The exchanges cut their buffers with :func:`quantized_block` and :func:`topk_chunk`, the planner
(:mod:`.overlap_plan`) and the automatic overlap predict times from :func:`wire_bytes` and
:func:`payload_bytes`, and ``tests/exchange/test_wire_bytes.py`` counts what the exchanges send
against them. Pure arithmetic; torch is imported by the codecs it reads sizes from.
"""

from __future__ import annotations

from . import quantize, topk
from .formats import topk_format

AT_SCALE = 1 << 24
"""Shard size at which the byte model compares the forms (large shards: the rates per element)."""


def all_reduce_bytes(size: int, workers: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``size`` bytes."""
    return 2 * (workers - 1) * size // workers


def quantized_block(numel: int, workers: int, dtype: str, block: int) -> int:
    """The block size of the quantized exchange for a shard of ``numel`` elements: a worker's
    chunk of m = ceil(numel / workers) elements cut into n = ceil(m / block) equal blocks of
    ceil(m / n) elements, rounded up to even (int4: two per byte), so a chunk is padded by
    under 2 n elements, never by most of a block. The configured (even) size when it divides
    m, else a little less; ``block`` itself for a format without scales."""
    if not quantize.has_scales(dtype):
        return block
    per_worker = -(-numel // workers)
    blocks = max(1, -(-per_worker // block))
    size = max(1, -(-per_worker // blocks))
    return size + (size % 2)


def quantized_chunk_bytes(numel: int, workers: int, dtype: str, block: int) -> int:
    """Bytes of one of the W chunks the quantized exchange sends (the largest, in whole blocks,
    scales included)."""
    size = quantized_block(numel, workers, dtype, block)
    per = max(quantize.split_sizes(numel, workers, dtype, size), default=0)
    return quantize.encoded_bytes(per, dtype, size)


def topk_chunk(numel: int, chunk: int) -> int:
    """The top-k chunk of a shard of ``numel`` elements: ``chunk``, or the whole shard when it
    is smaller (at least 2: an index of one element would take no bits)."""
    return max(2, min(chunk, numel))


def payload_bytes(numel: int, name: str, block: int = 256, chunk: int = 4096) -> int:
    """Bytes of one worker's encoded pseudo-gradient of ``numel`` elements in format ``name``
    (scales, indices and padding included)."""
    if numel < 1:
        raise ValueError(f"numel must be >= 1, got {numel}")
    sparse = topk_format(name)
    if sparse is None:
        return quantize.encoded_bytes(numel, name, block)
    return topk.encoded_bytes(numel, sparse[0], topk_chunk(numel, chunk), sparse[1])


def _sparse_wire_bytes(numel: int, density: float, values: str, workers: int, chunk: int) -> int:
    """The top-k all-gather: the W - 1 other workers' payloads through each rank of a ring."""
    return (workers - 1) * topk.encoded_bytes(numel, density, topk_chunk(numel, chunk), values)


def format_wire_bytes(numel: int, name: str, workers: int, block: int = 256, chunk: int = 4096) -> int:
    """Bytes one rank sends for a shard of ``numel`` elements in format ``name`` itself (no fp32
    fallback: :func:`wire_bytes` takes the smaller)."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    sparse = topk_format(name)
    if sparse is not None:
        return _sparse_wire_bytes(numel, *sparse, workers, chunk)
    if name == "fp32":
        return all_reduce_bytes(4 * numel, workers)
    return 2 * (workers - 1) * quantized_chunk_bytes(numel, workers, name, block)


def wire_bytes(numel: int, name: str, workers: int, block: int = 256, chunk: int = 4096) -> int:
    """Bytes one rank sends in the exchange of a shard of ``numel`` elements among ``workers``
    in format ``name``: the format's, or fp32's where the format would send more."""
    return min(format_wire_bytes(numel, name, workers, block, chunk), all_reduce_bytes(4 * numel, workers))


def message_rounds(name: str, workers: int) -> int:
    """Messages in a row one collective of the exchange waits for (each pays the link's
    latency once): a ring all-reduce 2 (W - 1), the quantized exchange's all-to-all 1 and
    all-gather W - 1, the top-k all-gather W - 1."""
    if workers < 2:
        return 0
    if topk_format(name) is not None:
        return workers - 1
    return 2 * (workers - 1) if name == "fp32" else workers


def dense_int4_cheaper_from(density: float, chunk: int, dtype: str, block: int = 256,
                            numel: int = AT_SCALE, limit: int = 4096) -> int:
    """The smallest number of workers W from which the dense int4 exchange sends fewer bytes
    than the top-k all-gather at ``density`` with ``dtype`` values (whose bytes grow with
    W - 1, the dense exchange's with 2 (W - 1) / W); ``limit`` + 1 if none below ``limit``."""
    for workers in range(2, limit + 1):
        if format_wire_bytes(numel, "int4", workers, block) < _sparse_wire_bytes(numel, density, dtype, workers, chunk):
            return workers
    return limit + 1
