"""The token bucket (tc's tbf) that scripts/bench/netns_cluster.sh puts on each end of every
link: its rate, as tc writes it ("10mbit"), and its burst. Light (no torch): the benchmarks and
the plotting scripts share it."""

from __future__ import annotations

import re


def rate_bits(rate: str) -> int:
    """Bits per second of a tc rate ("10mbit", "500kbit", "1gbit", "64bit")."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.lower())
    if m is None:
        raise ValueError(f"not a tc rate: {rate!r} (e.g. 10mbit)")
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)])


def burst_bytes(bits: int) -> int:
    """netns_cluster.sh's burst at ``bits`` per second: a millisecond of the rate, at least
    one 64 KiB GSO segment plus headers (66,000 bytes)."""
    return max(66000, bits // 8 // 1000)


def burst_seconds(rate: str) -> float:
    """Link time a full bucket saves: its burst crosses at once."""
    bits = rate_bits(rate)
    return burst_bytes(bits) / (bits / 8)
