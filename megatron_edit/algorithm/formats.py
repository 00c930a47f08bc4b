"""The exchange's formats, named once: the dense formats (:mod:`.quantize`), the top-k exchange's
value formats and its largest chunk (:mod:`.topk`), and the names of the top-k exchange's
formats (``topk<density>-<values>``), and the one order of precision over all of them
(:func:`precision_order`). Plain values, importable without torch: the configuration checks its
flags with them before torch is imported. What each format sends: :mod:`.wire`."""

from __future__ import annotations

import re
from typing import Iterable, List, Optional, Tuple

DENSE = ("fp32", "bf16", "fp8", "int8", "int4")
"""The dense exchange formats, most precise first (in order of size)."""

TOPK_VALUES = ("fp32", "int8", "int4", "int2")
"""The formats of the values the top-k exchange keeps."""

TOPK_MAX_CHUNK = 1 << 16
"""The largest top-k chunk: its indices take 16 bits."""

TOPK_CHUNK = 4096
"""The top-k exchange's chunk by default (``--local-sgd-exchange-topk-chunk``)."""

TOPK_VALUE_BITS = {"fp32": 32, "int8": 8, "int4": 4, "int2": 2}
"""Bits of one kept value of the top-k exchange, per value format."""


def index_bits(chunk: int) -> int:
    """Bits of an index inside a top-k chunk of ``chunk`` elements (at least 1)."""
    return max(1, (chunk - 1).bit_length())


def topk_format(name: str) -> Optional[Tuple[float, str]]:
    """A top-k format's ``(density, values)``: ``topk<density>-<values>``, e.g. ``topk0.02-int2``
    (``--local-sgd-exchange-topk-density 0.02 --local-sgd-exchange-dtype int2``); None for a
    dense format. Raises ValueError for a name that is neither, naming what to write (int2, a
    value format of the top-k exchange only: ``topk0.02-int2``)."""
    if name in DENSE:
        return None
    match = re.fullmatch(r"topk([0-9.eE+-]+)-([a-z0-9]+)", name)
    density = None
    if match:
        try:
            density = float(match.group(1))
        except ValueError:
            density = None
    if match is None or density is None or not 0.0 < density <= 1.0 or match.group(2) not in TOPK_VALUES:
        hint = (f" ({name} is a value format of the top-k exchange only, not a dense one: write "
                f"topk<density>-{name}, e.g. topk0.02-{name})" if name in TOPK_VALUES else "")
        raise ValueError(f"unknown exchange format {name!r}{hint}: one of {', '.join(DENSE)}, or "
                         f"topk<density>-<values> with density in (0, 1] and values one of "
                         f"{', '.join(TOPK_VALUES)} (e.g. topk0.02-int2)")
    return density, match.group(2)


def format_name(dtype: str, topk_density: Optional[float] = None) -> str:
    """The format's name from its flags (``--local-sgd-exchange-dtype``,
    ``--local-sgd-exchange-topk-density``): ``dtype`` for a dense exchange, else
    ``topk<density>-<dtype>`` (the inverse of :func:`topk_format`)."""
    return dtype if topk_density is None else f"topk{topk_density:g}-{dtype}"


def precision_order(names: Iterable[str], chunk: int = TOPK_CHUNK) -> List[str]:
    """Most precise first, the order in which the automatic overlap and the planner try formats:
    the dense formats in :data:`DENSE`'s order, then the top-k formats by the bits they send per
    element of the pseudo-gradient, most first: ``density x (index bits + value bits)`` (chunks of
    ``chunk``; a chunk's scale and padding aside), i.e. more entries kept or more bits per kept
    value is more precise; equal bits: the higher density first."""
    names = list(names)
    dense = sorted((f for f in names if topk_format(f) is None), key=DENSE.index)

    def bits(name):
        density, values = topk_format(name)
        return -density * (index_bits(chunk) + TOPK_VALUE_BITS[values]), -density, name

    return dense + sorted((f for f in names if topk_format(f) is not None), key=bits)
