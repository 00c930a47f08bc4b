"""``python -m megatron_edit.plan``: what a link costs EDiT, read before a run.

    python -m megatron_edit.plan --params 1.3e9 --workers 4 --link-mbit 100 --step-ms 500 \\
        [--sync-interval 32] [--formats fp32,int4,topk0.02-int2] [--latency-ms 20]

Prints the exchange time of each allowed format (the dense ones and the top-k exchange's
``topk<density>-<values>``, their bytes from :mod:`megatron_edit.algorithm.wire`), the smallest
H that hides it (without ``--sync-interval``: the plan for it; with it, the plan at that H and,
where it is not hidden there, the smallest larger H that hides it), the delay
(``--local-sgd-outer-step-delay``), fragments (``--local-sgd-fragments``) and format
(``--local-sgd-exchange-dtype``) that hide it, the flags that let the job choose while it runs
starting from them (``--local-sgd-auto-overlap``), the expected fraction of the
no-communication bound (the step-time model of :mod:`megatron_edit.algorithm.overlap_plan`),
and what the benchmarks measured of the loss at that H, format and delay. Nothing is started;
no GPU or Megatron is needed.
"""

from __future__ import annotations

import argparse
import math
import sys

from .algorithm.overlap_plan import (
    FORMATS,
    TOPK_CHUNK,
    bound_fraction,
    exposed_seconds,
    format_flags,
    plan,
    smallest_interval,
    topk_format,
)
from .algorithm.formats import TOPK_VALUES
from .algorithm.wire import dense_int4_cheaper_from
from .config import delay_limit

BUCKET_PARAMS = 40_000_000
"""Megatron's default bucket (``DistributedDataParallelConfig.bucket_size``: 40M parameters)."""


def _number(kind, zero_ok=False):
    """An argparse type: a number of ``kind`` > 0 (>= 0 with ``zero_ok``); 1.3e9 is an int."""
    def parse(text):
        try:
            value = kind(float(text)) if kind is int else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number")
        if kind is int and float(text) != value:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
        if value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(f"must be {'>=' if zero_ok else '>'} 0, got {text}")
        return value
    return parse


def _formats(text):
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of distinct formats: "
                                         f"{', '.join(FORMATS)} or topk<density>-<values>, e.g. topk0.02-int2")
    for name in names:
        try:
            topk_format(name)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e))
    return names


_CONVERGENCE = "docs/benchmarks/convergence.md"
MEASURED_LOSS = {  # (H, format): final validation loss against synchronous training
    (1, "fp32"): "-0.74%", (2, "fp32"): "+3.20%", (4, "fp32"): "+3.56%", (8, "fp32"): "+5.26%",
    (32, "fp32"): "+7.20%", (8, "bf16"): "+5.55%", (8, "int8"): "+5.34%", (8, "int4"): "+4.93%",
    (8, "topk0.03-int2"): "+4.33%", (8, "topk0.01-int2"): "+7.15%", (32, "topk0.03-int2"): "+9.54%",
    (32, "topk0.01-int2"): "+10.98%",
}
"""The loss costs the convergence benchmark measured (docs/benchmarks/convergence.md, its first
table and "The sparse exchange's runs": a 1.9M-parameter GPT, 2 workers, 800 steps, the penalty
on; int8 / int4 / top-k with error feedback; two seeds, bf16 one)."""

_DELAYED = "docs/concepts/delayed-outer-step.md#when-to-use-it"
MEASURED_DELAY = {  # (tau, F) at H = 8 with the default merge (lerp, alpha 0.5): against no delay, F = 1
    (1, 1): "+0.75%", (4, 1): "+0.65%", (1, 4): "+0.81%", (0, 4): "-0.45%",
}
"""The delay's and the fragments' loss costs the convergence benchmark measured at H = 8 with
the merge the planner's flags leave in force (docs/concepts/delayed-outer-step.md, "When to use
it": the same GPT and run, two seeds)."""


def loss_line(interval: int, fmt: str) -> str:
    """What was measured of the loss at ``interval`` and ``fmt``; else at the nearest H measured
    with ``fmt`` (a top-k format not measured: the measured densities with its values)."""
    sparse = topk_format(fmt)
    where = (f"{_CONVERGENCE}{'#the-sparse-exchanges-runs' if sparse else ''}: a 1.9M-parameter GPT, 2 workers, "
             "800 steps")
    if (interval, fmt) in MEASURED_LOSS:
        return f"loss: H = {interval} with {fmt} ended {MEASURED_LOSS[interval, fmt]} above synchronous training ({where})"
    alike = [fmt] if any(f == fmt for _, f in MEASURED_LOSS) else sorted(
        {f for _, f in MEASURED_LOSS if sparse and (topk_format(f) or (0, ""))[1] == sparse[1]},
        key=lambda f: -topk_format(f)[0])
    if not alike:
        known = ", ".join(dict.fromkeys(f for _, f in MEASURED_LOSS))
        return f"loss: not measured for {fmt} ({where}, has {known})"
    near = min({h for h, f in MEASURED_LOSS if f in alike}, key=lambda h: (abs(h - interval), h))
    if alike == [fmt]:
        what, found = f"at H = {interval} with {fmt}", f"it ended {MEASURED_LOSS[near, fmt]}"
    else:
        what = f"for {fmt}"
        found = " and ".join(f"{f} {'ended ' * (i == 0)}{MEASURED_LOSS[near, f]}"
                             for i, f in enumerate(f for f in alike if (near, f) in MEASURED_LOSS))
    return f"loss: not measured {what}; at H = {near} {found} above synchronous training ({where})"


def delay_line(interval: int, delay: int, fragments: int) -> str:
    """What was measured of the loss of a delay ``delay`` with ``fragments`` fragments, or what
    was measured at H = 8; empty for neither a delay nor fragments."""
    if delay == 0 and fragments == 1:
        return ""
    if interval == 8 and (delay, fragments) in MEASURED_DELAY:
        return (f"delay: tau = {delay} with {fragments} fragment(s) at H = 8 ended "
                f"{MEASURED_DELAY[delay, fragments]} against no delay ({_DELAYED})")
    measured = ", ".join(f"tau = {tau}{' with 4 fragments' * (f == 4)} {cost}"
                         for (tau, f), cost in MEASURED_DELAY.items())
    return (f"delay: not measured at tau = {delay} with {fragments} fragment(s) (H = {interval}); measured at "
            f"H = 8 with the default merge (lerp, alpha 0.5): {measured} against no delay ({_DELAYED})")


class _OneLineParser(argparse.ArgumentParser):
    """Bad input costs one line (the flag and what is wrong) and exit code 2, no usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m megatron_edit.plan", allow_abbrev=False,
                            description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=_number(int), required=True,
                        help="parameters of the model (each worker exchanges all of them; 1.3e9 is accepted)")
    parser.add_argument("--workers", type=_number(int), required=True, help="EDiT workers (W)")
    parser.add_argument("--link-mbit", type=_number(float), required=True,
                        help="one worker's link rate across workers, Mbit/s (what the exchange achieves)")
    parser.add_argument("--latency-ms", type=_number(float, zero_ok=True), default=0.0,
                        help="the link's latency, ms (default 0): each collective pays it once per message "
                             "in a row (a ring all-reduce 2 (W - 1) times, an all-gather W - 1)")
    parser.add_argument("--buckets", type=_number(int), default=None,
                        help="collectives per exchange of the whole model, each paying the latency (default: "
                             f"Megatron's buckets, one per {BUCKET_PARAMS:,} parameters)")
    parser.add_argument("--step-ms", type=_number(float), required=True, help="one inner step, ms")
    parser.add_argument("--sync-interval", type=_number(int), default=None,
                        help="H: the plan at it, and the smallest larger H that hides the exchange where this one "
                             "does not (default: the smallest H that hides it)")
    parser.add_argument("--max-sync-interval", type=_number(int), default=4096,
                        help="the largest H the search for the smallest one tries (default 4096)")
    parser.add_argument("--formats", type=_formats, default=["fp32"],
                        help="exchange formats allowed, comma-separated (default fp32): "
                             f"{', '.join(FORMATS)}, and the top-k exchange's topk<density>-<values> (values "
                             f"{', '.join(TOPK_VALUES)}; chunks of {TOPK_CHUNK}), e.g. topk0.02-int2; int2 is "
                             "a value format of the top-k exchange only")
    parser.add_argument("--block-size", type=_number(int), default=256,
                        help="--local-sgd-exchange-block-size of the quantized formats")
    parser.add_argument("--margin", type=float, default=1.2, help="cover the exchange this many times (>= 1)")
    parser.add_argument("--max-delay", type=_number(int), default=None,
                        help="largest delay allowed (default H/2, the largest whose loss cost was measured)")
    return parser


def _check(parser, args) -> None:
    """The checks across flags, each a one-line error naming the flag and the fix."""
    if args.margin < 1:
        parser.error(f"--margin must be >= 1, got {args.margin}")
    if args.workers < 2:
        parser.error("--workers must be >= 2: one worker exchanges nothing")
    if args.sync_interval is not None and args.sync_interval > args.max_sync_interval:
        parser.error(f"--sync-interval {args.sync_interval} is above --max-sync-interval "
                     f"{args.max_sync_interval}: raise --max-sync-interval")
    for fmt in args.formats:  # the job refuses these (megatron_edit.exchange.sparse.check_sparse_workers)
        sparse = topk_format(fmt)
        cheaper = None if sparse is None else dense_int4_cheaper_from(sparse[0], TOPK_CHUNK, sparse[1])
        if cheaper is not None and args.workers >= cheaper:
            parser.error(f"--formats {fmt} with --workers {args.workers}: the top-k all-gather of {args.workers} "
                         f"workers' payloads sends more bytes than the dense int4 exchange (cheaper from "
                         f"{cheaper} workers on); allow int4 instead")


def _setting(h, choice) -> str:
    return (f"--local-sgd-sync-interval {h} {format_flags(choice.exchange_dtype)} --local-sgd-outer-step-delay "
            f"{choice.outer_step_delay} --local-sgd-fragments {choice.fragments}")


def _table(args, model, times, h) -> None:
    """Each format's exchange, its fraction of the bound without a delay at H, and the smallest
    H from which it alone is hidden."""
    step_s = args.step_ms / 1e3
    width = max(8, *(len(f) + 2 for f in times))
    print(f"{'format':<{width}}{'exchange ms':>13}{'in steps':>10}{'no delay':>10}{'hidden from H':>15}")
    for fmt, seconds in times.items():
        no_delay = bound_fraction(step_s, exposed_seconds(seconds, step_s, 0), h)
        alone = smallest_interval(**model, formats=[fmt])
        print(f"{fmt:<{width}}{seconds * 1e3:>13.1f}{seconds / step_s:>10.2f}{no_delay:>10.2f}"
              f"{f'> {args.max_sync_interval}' if alone is None else alone[0]:>15}")


def _auto_line(args, h, choice) -> str:
    """The --local-sgd-auto-overlap flags that start from the choice, or why there are none."""
    fragments = sorted(f for f in {1, 2, choice.fragments} if h % f == 0 and delay_limit(h, f) >= 2)
    if choice.fragments not in fragments:  # H / F < 2: no room for a delay, nothing to choose
        return (f"not chosen while the job runs: --local-sgd-auto-overlap needs --local-sgd-sync-interval / "
                f"--local-sgd-fragments >= 2 (room for a delay); H = {h}")
    # The job's first, measured syncs run with the setting it starts with: start from this choice.
    start = _setting(h, choice).split(" ", 2)[2]
    return (f"or chosen while the job runs, starting there: --local-sgd-auto-overlap --local-sgd-auto-formats "
            f"{','.join(args.formats)} --local-sgd-auto-fragments {','.join(map(str, fragments))} {start}")


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(parser, args)
    step_s = args.step_ms / 1e3
    buckets = args.buckets or math.ceil(args.params / BUCKET_PARAMS)
    model = dict(params=args.params, workers=args.workers, link_bits_per_s=args.link_mbit * 1e6, step_s=step_s,
                 block=args.block_size, margin=args.margin, max_delay=args.max_delay,
                 largest=args.max_sync_interval, buckets=buckets, latency_s=args.latency_ms / 1e3)
    smallest = smallest_interval(**model, formats=args.formats)
    link = f"{args.link_mbit:g} Mbit/s" + (f" ({args.latency_ms:g} ms latency)" if args.latency_ms else "")
    if args.sync_interval is None and smallest is None:
        print(f"no H up to {args.max_sync_interval} hides the exchange of {args.params:,} parameters among "
              f"{args.workers} workers at {link} behind {args.step_ms:g} ms steps in "
              f"{', '.join(args.formats)}: allow a smaller format (e.g. --formats topk0.02-int2), raise "
              "--max-sync-interval, or give --sync-interval for the best it can do")
        return 0
    h = args.sync_interval or smallest[0]
    times, choice = plan(args.params, args.workers, model["link_bits_per_s"], step_s, h, args.formats,
                         args.block_size, buckets, model["latency_s"], args.margin, args.max_delay)
    print(f"{args.params:,} parameters, {args.workers} workers, {link}, {args.step_ms:g} ms per inner step, "
          f"H = {h}" + ("" if args.sync_interval else " (the smallest that hides it)"))
    _table(args, model, times, h)
    print("choice: " + choice.line())
    print(f"flags: {_setting(h, choice)}")
    print(loss_line(h, choice.exchange_dtype))
    if delay_line(h, choice.outer_step_delay, choice.fragments):
        print(delay_line(h, choice.outer_step_delay, choice.fragments))
    if args.sync_interval is not None and not choice.hidden:
        larger = smallest_interval(**dict(model, smallest=h + 1), formats=args.formats)
        if larger is None:
            print(f"no H from {h} up to {args.max_sync_interval} hides it in these formats")
        else:
            print(f"the smallest larger H that hides it: {_setting(larger[0], larger[1])} "
                  f"({larger[1].bound_fraction:.2f} of the no-communication bound)")
            print(loss_line(larger[0], larger[1].exchange_dtype))
    print(_auto_line(args, h, choice))
    return 0


if __name__ == "__main__":
    sys.exit(main())
