"""Every allowed format's exchange time from one timed sync in the format in force (the automatic
overlap's prediction, :mod:`.auto_overlap`).

An exchange is its codec (this rank's compute: encode, decode, the sums), the latency of its
messages and its bytes over the link's rate
(:func:`~megatron_edit.algorithm.overlap_plan.predict_formats`). The codec of each format is
timed on the rank, on its shards' sizes, against a loopback group
(:func:`~megatron_edit.exchange.codec_clock.codec_seconds`, no collective). The latency and the
rate come from the sync's probes (:mod:`~megatron_edit.exchange.link_probe`: a ring all-reduce
of one element, of up to ``RATE_PROBE`` elements; the torch backend). Without probes (torchft) the
latency is taken as 0 and the rate is what is left of the measured time over its bytes; a
format that sends fewer bytes than the one the rate was last taken from can only raise it: too
few bytes cannot show a rate, and a rate learned in a denser format is kept
(:attr:`FormatTimes.link`).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence, Tuple

from ..algorithm import overlap_plan, wire
from ..exchange.link_probe import rate_probe_numel


class FormatTimes:
    """Predicts ``formats``' codec and wire times from the one measured (see the module)."""

    def __init__(self, formats: Sequence[str], block: int, chunk: int):
        self.formats = tuple(formats)
        self.block, self.chunk = block, chunk
        self.link: Optional[Tuple[int, float]] = None
        """(bytes one rank sent, seconds per byte) of the measurement without probes the rate was
        last taken from."""

    def predict(self, measured: float, fmt: str, numel: int, workers: int, report,
                codec: Dict[str, float], buckets: int) -> Dict[str, float]:
        """``measured``: the codec and wire seconds of a ``numel``-element exchange in ``fmt``
        among ``workers`` (``buckets`` collectives in a row), its sync's ``report`` (its
        probes), ``codec``: each format's codec seconds on this rank."""
        predict: Callable = lambda **kw: overlap_plan.predict_formats(  # noqa: E731
            measured, fmt, numel, self.formats, self.block, workers, self.chunk, codec_s=codec,
            buckets=max(buckets, 1), **kw)
        if report.latency_seconds is not None and report.rate_probe_seconds is not None:
            rounds = max(wire.message_rounds("fp32", workers), 1)
            per_byte = max(report.rate_probe_seconds - report.latency_seconds, 0.0) / wire.all_reduce_bytes(
                4 * rate_probe_numel(numel), workers)
            return predict(latency_s=report.latency_seconds / rounds, per_byte_s=per_byte)[0]
        sent = wire.wire_bytes(numel, fmt, workers, self.block, self.chunk)
        times, per_byte = predict()
        if self.link is not None and sent < self.link[0] and per_byte < self.link[1]:
            return predict(per_byte_s=self.link[1])[0]
        self.link = (sent, per_byte)
        return times
