"""The step-time model of a sync on a link, and the choice of delay, fragments and format from it.

Streaming DiLoCo (arXiv 2501.18512) hides the outer exchange behind inner steps: the delay tau
(``--local-sgd-outer-step-delay``) launches each exchange tau steps before it is applied, and
F fragments (``--local-sgd-fragments``) send 1/F of the model every H/F steps. Which tau and F
hide an exchange depends on the link; this module predicts it from four numbers (the time of
one inner step, the model's size, the number of workers and the link rate) so that a user can
read the choice before a run (``python -m megatron_edit.plan``). It is the step-time model of
``scripts/bench/bench_model.py`` (fitted there to the network-namespace measurements), reduced
to what the choice needs.

The model, for one worker (seconds):

* the exchange of the whole model in a format:
  ``C = buckets * rounds * latency + X / link_rate``, ``X`` the bytes one worker sends
  (:mod:`megatron_edit.algorithm.wire`, the package's one wire model: a ring all-reduce, or the
  quantized exchange's reduce-scatter + all-gather, carries ``2 (W - 1) / W`` of the payload,
  scales included; the top-k exchange's all-gather the ``W - 1`` other workers' payloads,
  indices included), ``rounds`` the messages in a row of one collective;
* no delay (tau = 0, the layer-wise sync): the next forward pass hides up to ``forward_share *
  t`` of it, the rest is exposed once per H steps;
* delay tau with F fragments: each fragment's exchange (C / F) runs behind tau inner steps,
  ``F * max(0, C / F - tau * t)`` is exposed per H steps;
* the fraction of the no-communication bound: ``t / (t + exposed per H / H)``.

The choice (:func:`choose`): the formats are tried most precise first (fp32, bf16, fp8, int8,
int4, then the top-k formats by the bits they send per element, most first:
:func:`precision_order`; whatever the user allows); for a format, no
delay if the forward pass hides the exchange with the margin, else the fewest fragments F (a
divisor of H) for which the smallest covering delay ``tau = ceil(margin * C / (F t))``
satisfies ``tau < H / F`` and ``tau <= max_delay``.
The cap ``max_delay`` (default H/2) is the largest delay whose cost in loss was measured
(+0.65% at tau = H/2; see the delayed outer step's concept page); fragments exist to stay under
it. When no format can be hidden, the setting with the fastest predicted step is taken (ties:
fewer fragments, then the more precise format) and the result says it is not hidden.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

from . import wire
from .formats import DENSE as FORMATS  # most precise first: the order in which formats are tried
from .formats import TOPK_CHUNK, topk_format  # noqa: F401 (TOPK_CHUNK: re-exported for the planner)
from .formats import precision_order  # noqa: F401 (the one order of the formats; re-exported)
from .schedule import delay_limit


def format_flags(name: str) -> str:
    """The job's flags for an exchange format."""
    sparse = topk_format(name)
    if sparse is None:
        return f"--local-sgd-exchange-dtype {name}"
    return f"--local-sgd-exchange-dtype {sparse[1]} --local-sgd-exchange-topk-density {sparse[0]:g}"


def wire_bytes(params: int, name: str, workers: int, block: int = 256) -> int:
    """Bytes one worker sends in one exchange of ``params`` elements in format ``name``
    (:func:`megatron_edit.algorithm.wire.wire_bytes`: a dense format's ring all-reduce or
    reduce-scatter + all-gather, ``2 (W - 1) / W`` of its payload, the top-k exchange's
    all-gather the ``W - 1`` other workers' payloads)."""
    return wire.wire_bytes(params, name, workers, block, TOPK_CHUNK)


def exposed_seconds(exchange_s: float, step_s: float, delay: int, fragments: int = 1,
                    forward_share: float = 1 / 3) -> float:
    """Seconds of the exchange not hidden by compute, per H steps (one full exchange)."""
    if delay == 0:
        return max(0.0, exchange_s - forward_share * step_s)
    return fragments * max(0.0, exchange_s / fragments - delay * step_s)


def bound_fraction(step_s: float, exposed_s: float, interval: int) -> float:
    """The predicted tokens/s as a fraction of the no-communication bound."""
    return step_s / (step_s + exposed_s / interval)


@dataclass(frozen=True)
class Choice:
    """One setting and what the model predicts for it."""

    exchange_dtype: str
    outer_step_delay: int
    fragments: int
    exchange_s: float
    """Seconds of one exchange of the whole model in that format."""
    exposed_s: float
    """Seconds not hidden, per H steps."""
    bound_fraction: float
    hidden: bool
    """Whether the exchange is covered with the margin."""

    def line(self) -> str:
        return (f"exchange {self.exchange_dtype}, delay {self.outer_step_delay}, {self.fragments} fragment(s): "
                f"exchange {self.exchange_s * 1e3:.1f} ms, exposed {self.exposed_s * 1e3:.1f} ms per sync "
                f"interval, {self.bound_fraction:.2f} of the no-communication bound"
                + ("" if self.hidden else " (not hidden)"))


def _divisors(n: int):
    return [d for d in range(1, n + 1) if n % d == 0]


def choose(step_s: float, exchange_s: Dict[str, float], interval: int, formats: Optional[Sequence[str]] = None,
           margin: float = 1.2, max_delay: Optional[int] = None, forward_share: float = 1 / 3,
           fragments: Optional[Sequence[int]] = None, chunk: int = TOPK_CHUNK) -> Choice:
    """The delay, fragments and format for an inner step of ``step_s`` seconds and the given
    exchange times per format (the module's docstring gives the rule). Every argument is a
    measurement or a setting that all workers share, so every worker makes the same choice.
    ``fragments``: the numbers of fragments allowed (default: every divisor of H; the runtime
    choice keeps the run's own F). ``chunk``: the top-k exchange's chunk (the order of the top-k
    formats)."""
    if step_s <= 0:
        raise ValueError(f"the step time must be > 0, got {step_s}")
    if interval < 1:
        raise ValueError(f"the sync interval must be >= 1, got {interval}")
    if margin < 1:
        raise ValueError(f"the margin must be >= 1, got {margin}")
    formats = tuple(formats) if formats is not None else tuple(exchange_s)
    if not formats:
        raise ValueError("formats must be some of " + ", ".join(FORMATS) + ", got none")
    for f in formats:
        topk_format(f)  # raises for an unknown one
    missing = [f for f in formats if f not in exchange_s]
    if missing:
        raise ValueError(f"no exchange time for {', '.join(missing)}")
    cap = interval // 2 if max_delay is None else max_delay
    ordered = precision_order(formats, chunk)
    splits = _divisors(interval) if fragments is None else sorted(set(fragments))
    if not splits or any(f < 1 or interval % f for f in splits):
        raise ValueError(f"fragments must divide the sync interval {interval}, got {list(fragments)}")

    def make(fmt, delay, frags, hidden):
        exposed = exposed_seconds(exchange_s[fmt], step_s, delay, frags, forward_share)
        return Choice(fmt, delay, frags, exchange_s[fmt], exposed, bound_fraction(step_s, exposed, interval), hidden)

    for fmt in ordered:
        c = exchange_s[fmt]
        if margin * c <= forward_share * step_s:
            return make(fmt, 0, splits[0], True)
        for frags in splits:
            delay = max(1, math.ceil(margin * c / (frags * step_s)))
            if delay < delay_limit(interval, frags) and delay <= cap:
                return make(fmt, delay, frags, True)
    # Nothing hides it: the fastest predicted step among the allowed settings.
    candidates = [make(fmt, 0, frags, False) for fmt in ordered for frags in splits[:1]]
    for fmt in ordered:
        for frags in splits:
            delay = min(delay_limit(interval, frags) - 1, cap)
            if delay >= 1:
                candidates.append(make(fmt, delay, frags, False))
    return min(candidates, key=lambda ch: (ch.exposed_s, ch.fragments, ordered.index(ch.exchange_dtype)))


def keep_fragments(previous: Choice, new: Choice, step_s: float, exchange_s: Dict[str, float], interval: int,
                   keep_margin: float = 1.0, max_delay: Optional[int] = None) -> Choice:
    """A re-decision's choice with hysteresis on the fragments: where ``new`` takes the format in
    force (``previous``'s) with *more* fragments, and the settings in force still cover the
    exchange with ``keep_margin`` (``keep_margin * C <= F * tau * t``, below the margin a choice
    needs), the settings in force are kept. Fewer fragments are taken as soon as the rule picks
    them. At the edge between one fragment with a delay at the cap and two with a smaller one, a
    step time that moves by a few per cent flipped F at every re-decision (measured at 20 Mbit/s:
    59 and 69 ms steps in one run); a change of F re-cuts the layers and restarts their
    statistics and the fragment schedule, and more fragments cost loss. Else ``new``."""
    cap = interval // 2 if max_delay is None else max_delay
    if new.exchange_dtype != previous.exchange_dtype or new.fragments <= previous.fragments \
            or previous.exchange_dtype not in exchange_s:
        return new
    frags, delay, c = previous.fragments, previous.outer_step_delay, exchange_s[previous.exchange_dtype]
    if not (1 <= delay <= cap and delay < delay_limit(interval, frags) and keep_margin * c <= frags * delay * step_s):
        return new
    exposed = exposed_seconds(c, step_s, delay, frags)
    return Choice(previous.exchange_dtype, delay, frags, c, exposed, bound_fraction(step_s, exposed, interval), True)


def plan(params: int, workers: int, link_bits_per_s: float, step_s: float, interval: int,
         formats: Sequence[str] = ("fp32",), block: int = 256, buckets: int = 1, latency_s: float = 0.0,
         margin: float = 1.2, max_delay: Optional[int] = None) -> Tuple[Dict[str, float], Choice]:
    """The exchange time of each format and the choice, from the model's size and the link."""
    times = format_seconds(params, workers, link_bits_per_s, formats, block, buckets, latency_s)
    return times, choose(step_s, times, interval, formats, margin, max_delay)


def format_seconds(params: int, workers: int, link_bits_per_s: float, formats: Sequence[str], block: int = 256,
                   buckets: int = 1, latency_s: float = 0.0) -> Dict[str, float]:
    """Seconds of one exchange of the whole model in each format: its bytes
    (:func:`wire_bytes`) over the link, and ``latency_s`` (one message's time on the link) for
    each message in a row of each of ``buckets`` collectives
    (:func:`megatron_edit.algorithm.wire.message_rounds`). Nothing with one worker."""
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    if link_bits_per_s <= 0:
        raise ValueError(f"the link rate must be > 0, got {link_bits_per_s}")
    if buckets < 1 or latency_s < 0:
        raise ValueError(f"buckets must be >= 1 and the latency >= 0, got {buckets} and {latency_s}")
    return {fmt: buckets * wire.message_rounds(fmt, workers) * latency_s
            + wire_bytes(params, fmt, workers, block) * 8 / link_bits_per_s for fmt in formats}


def smallest_interval(params: int, workers: int, link_bits_per_s: float, step_s: float,
                      formats: Sequence[str], block: int = 256, margin: float = 1.2,
                      max_delay: Optional[int] = None, smallest: int = 1, largest: int = 4096,
                      buckets: int = 1, latency_s: float = 0.0) -> Optional[Tuple[int, Choice]]:
    """The smallest H from ``smallest`` up to ``largest`` for which :func:`choose` hides the
    exchange, with its choice; None when none does. ``max_delay`` None: H/2 for each H."""
    times = format_seconds(params, workers, link_bits_per_s, formats, block, buckets, latency_s)
    for interval in range(max(1, smallest), largest + 1):
        choice = choose(step_s, times, interval, formats, margin, max_delay)
        if choice.hidden:
            return interval, choice
    return None


def predict_formats(measured_s: float, measured_format: str, numel: int, formats: Sequence[str],
                    block: int = 256, workers: int = 2, chunk: int = TOPK_CHUNK,
                    codec_s: Optional[Dict[str, float]] = None, latency_s: float = 0.0, buckets: int = 1,
                    per_byte_s: Optional[float] = None) -> Tuple[Dict[str, float], float]:
    """Each format's exchange time from one measured in ``measured_format`` (the same link), and
    the link's seconds per byte this measurement shows. The model is :func:`format_seconds`' with
    this rank's compute added: ``codec_s[f]`` (the format's encode, decode and sums, timed
    locally; None: 0) + ``buckets * message_rounds(f) * latency_s`` (``latency_s``: one
    message's time, measured; ``buckets``: the exchange's collectives in a row of one format's)
    + the bytes one rank sends for a ``numel``-element pseudo-gradient among ``workers``
    (:func:`megatron_edit.algorithm.wire.wire_bytes`, the one wire model; ``chunk``: the top-k
    exchange's) times the seconds per byte: ``per_byte_s`` where the caller knows it (probed),
    else what of the measured time is left once its codec and latency are taken off, over its
    bytes (never below 0). The measured format's time is the measured one. With neither codec
    nor latency the times scale with the bytes (:func:`scale_to_formats`)."""
    w, n = max(workers, 2), max(numel, 1)  # one worker sends nothing: the ratio of two
    codec = codec_s or {}

    def fixed(fmt: str) -> float:
        return codec.get(fmt, 0.0) + buckets * wire.message_rounds(fmt, w) * latency_s

    per_byte = per_byte_s
    if per_byte is None:
        per_byte = max(measured_s - fixed(measured_format), 0.0) / wire.wire_bytes(n, measured_format, w, block, chunk)
    times = {fmt: fixed(fmt) + wire.wire_bytes(n, fmt, w, block, chunk) * per_byte for fmt in formats}
    if measured_format in times:
        times[measured_format] = measured_s
    return times, per_byte


def scale_to_formats(measured_s: float, measured_format: str, numel: int, formats: Sequence[str],
                     block: int = 256, workers: int = 2, chunk: int = TOPK_CHUNK) -> Dict[str, float]:
    """Each format's exchange time from one measured in ``measured_format``, scaled by the bytes
    one rank sends (:func:`predict_formats` without codec or latency: the top-k all-gather's
    W - 1 payloads against a dense format's 2 (W - 1) / W)."""
    return predict_formats(measured_s, measured_format, numel, formats, block, workers, chunk)[0]


@dataclass(frozen=True)
class Measurement:
    """What one rank measured by a sync; the runtime's agreement takes the fastest step and
    the slowest exchange and exposed wait over every rank (:func:`agreed`)."""

    step_s: float
    """The inner step's time (a median since the last sync)."""
    exchange_s: Dict[str, float]
    """The whole exchange's time in each allowed format."""
    exposed_s: float
    """The wait the last sync exposed (not hidden by compute)."""
    fresh: bool = False
    """Whether the last sync measured the exchange (``exchange_s`` is from it, not an earlier
    sync): a timed sync, or a delayed one that waited more than half a step for it."""

    def pack(self, formats: Sequence[str]) -> list:
        """The numbers one all-reduce of MAX agrees on (the step time negated: its minimum;
        ``fresh`` as 0 or 1: whether any rank measured)."""
        return [-self.step_s, self.exposed_s] + [self.exchange_s[f] for f in formats] + [float(self.fresh)]


def agreed(maxed: Sequence[float], formats: Sequence[str]) -> Measurement:
    """The :class:`Measurement` every rank holds after the all-reduce of MAX of
    :meth:`Measurement.pack`: a fast worker's step (the exchange must be hidden behind its
    steps, or it waits), the slowest rank's exchange, and whether any rank measured it."""
    n = len(formats)
    return Measurement(-float(maxed[0]), {f: float(v) for f, v in zip(formats, maxed[2:2 + n])}, float(maxed[1]),
                       fresh=bool(maxed[2 + n]))


def exposure_grew(exposed_s: float, predicted_s: float, step_s: float) -> bool:
    """Whether a sync's exposed wait calls for a new measurement: more than half an inner step
    above the prediction and more than 1.5 times it (noise of a step does not)."""
    return exposed_s > predicted_s + 0.5 * step_s and exposed_s > 1.5 * predicted_s
