"""``python -m megatron_edit.plan``: what a link costs EDiT, read before a run.

    python -m megatron_edit.plan --params 1.3e9 --workers 4 --link-mbit 10000 --step-ms 900 \\
        [--sync-interval 64] [--formats fp32,int8,int4,topk0.02-int2]

Prints the exchange time of each allowed format (the dense ones and the top-k exchange's), the
smallest H that hides it (without ``--sync-interval``: the plan for it), the delay
(``--local-sgd-outer-step-delay``),
fragments (``--local-sgd-fragments``) and format (``--local-sgd-exchange-dtype``) that hide it,
the flags that let the job choose while it runs starting from them (``--local-sgd-auto-overlap``),
and the expected fraction of the no-communication bound, from the step-time model of
:mod:`megatron_edit.algorithm.overlap_plan`. Nothing is started; no GPU or Megatron is needed.
"""

from __future__ import annotations

import argparse
import sys

from .algorithm.topk import dense_int4_cheaper_from
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
from .config import delay_limit


def _positive(kind):
    def parse(text):
        try:
            value = kind(float(text)) if kind is int else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number")
        if kind is int and float(text) != value:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
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


MEASURED_LOSS = {  # (H, format): final validation loss vs synchronous training, docs/benchmarks/convergence.md
    (1, "fp32"): "-0.74%", (2, "fp32"): "+3.20%", (4, "fp32"): "+3.56%", (8, "fp32"): "+5.26%",
    (32, "fp32"): "+7.20%", (8, "bf16"): "+5.55%", (8, "int8"): "+5.34%", (8, "int4"): "+4.93%",
    (8, "topk0.03-int2"): "+4.33%", (8, "topk0.01-int2"): "+7.15%", (32, "topk0.03-int2"): "+9.54%",
    (32, "topk0.01-int2"): "+10.98%",
}
"""The loss costs the convergence benchmark measured (a 1.9M-parameter GPT, 2 workers, 800
steps, the penalty on; int8 / int4 / top-k with error feedback; two seeds, bf16 one)."""


def loss_line(interval: int, fmt: str) -> str:
    """What was measured of the loss at ``interval`` and ``fmt``, or the nearest H measured in it."""
    where = "docs/benchmarks/convergence.md: a 1.9M-parameter GPT, 2 workers, 800 steps"
    if (interval, fmt) in MEASURED_LOSS:
        return f"loss: H = {interval} with {fmt} ended {MEASURED_LOSS[interval, fmt]} above synchronous training ({where})"
    measured = sorted(h for h, f in MEASURED_LOSS if f == fmt)
    if not measured:
        return f"loss: not measured for {fmt} ({where} has fp32, bf16, int8, int4, topk0.03-int2, topk0.01-int2)"
    near = min(measured, key=lambda h: (abs(h - interval), h))
    return (f"loss: not measured at H = {interval} with {fmt}; at H = {near} it ended {MEASURED_LOSS[near, fmt]} "
            f"above synchronous training ({where})")


class _OneLineParser(argparse.ArgumentParser):
    """Bad input costs one line (the flag and what is wrong) and exit code 2, no usage block."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog="python -m megatron_edit.plan", allow_abbrev=False,
                                     description=__doc__.split("\n\n")[0].split(": ", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", type=_positive(int), required=True,
                        help="parameters of the model (each worker exchanges all of them; 1.3e9 is accepted)")
    parser.add_argument("--workers", type=_positive(int), required=True, help="EDiT workers (W)")
    parser.add_argument("--link-mbit", type=_positive(float), required=True,
                        help="one worker's link rate across workers, Mbit/s (what the exchange achieves)")
    parser.add_argument("--step-ms", type=_positive(float), required=True, help="one inner step, ms")
    parser.add_argument("--sync-interval", type=_positive(int), default=None,
                        help="H (default: the smallest H that hides the exchange)")
    parser.add_argument("--formats", type=_formats, default=["fp32"],
                        help="exchange formats allowed, comma-separated (default fp32): fp32, bf16, fp8, int8, "
                             f"int4, and the top-k exchange's topk<density>-<values> (values fp32, int8, int4 "
                             f"or int2; chunks of {TOPK_CHUNK}), e.g. topk0.02-int2")
    parser.add_argument("--block-size", type=_positive(int), default=256,
                        help="--local-sgd-exchange-block-size of the quantized formats")
    parser.add_argument("--margin", type=float, default=1.2, help="cover the exchange this many times (>= 1)")
    parser.add_argument("--max-delay", type=_positive(int), default=None,
                        help="largest delay allowed (default H/2, the largest whose loss cost was measured)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.margin < 1:
        parser.error(f"--margin must be >= 1, got {args.margin}")
    if args.workers < 2:
        parser.error("--workers must be >= 2: one worker exchanges nothing")
    for fmt in args.formats:  # the job refuses these (megatron_edit.exchange.sparse.check_sparse_workers)
        sparse = topk_format(fmt)
        cheaper = None if sparse is None else dense_int4_cheaper_from(sparse[0], TOPK_CHUNK, sparse[1])
        if cheaper is not None and args.workers >= cheaper:
            parser.error(f"--formats {fmt} with --workers {args.workers}: the top-k all-gather of {args.workers} "
                         f"workers' payloads sends more bytes than the dense int4 exchange (cheaper from "
                         f"{cheaper} workers on); allow int4 instead")
    step_s = args.step_ms / 1e3
    link = args.link_mbit * 1e6
    smallest = smallest_interval(args.params, args.workers, link, step_s, args.formats, args.block_size,
                                 margin=args.margin, max_delay=args.max_delay)
    if args.sync_interval is None and smallest is None:
        print(f"no H up to 4096 hides the exchange of {args.params:,} parameters among {args.workers} workers at "
              f"{args.link_mbit:g} Mbit/s behind {args.step_ms:g} ms steps in {', '.join(args.formats)}: allow "
              "a smaller format (e.g. --formats topk0.02-int2) or give --sync-interval for the best it can do")
        return 0
    h = args.sync_interval or smallest[0]
    times, choice = plan(args.params, args.workers, link, step_s, h, args.formats, args.block_size,
                         margin=args.margin, max_delay=args.max_delay)
    print(f"{args.params:,} parameters, {args.workers} workers, {args.link_mbit:g} Mbit/s, "
          f"{args.step_ms:g} ms per inner step, H = {h}" + ("" if args.sync_interval else " (the smallest that hides it)"))
    width = max(8, *(len(f) + 2 for f in times))
    print(f"{'format':<{width}}{'exchange ms':>13}{'in steps':>10}{'no delay':>10}{'hidden from H':>15}")
    for fmt, seconds in times.items():
        no_delay = bound_fraction(step_s, exposed_seconds(seconds, step_s, 0), h)
        alone = smallest_interval(args.params, args.workers, link, step_s, [fmt], args.block_size,
                                  margin=args.margin, max_delay=args.max_delay)
        print(f"{fmt:<{width}}{seconds * 1e3:>13.1f}{seconds / step_s:>10.2f}{no_delay:>10.2f}"
              f"{'> 4096' if alone is None else alone[0]:>15}")
    print("choice: " + choice.line())
    start = (f"{format_flags(choice.exchange_dtype)} "
             f"--local-sgd-outer-step-delay {choice.outer_step_delay} --local-sgd-fragments {choice.fragments}")
    print(f"flags: --local-sgd-sync-interval {h} {start}")
    print(loss_line(h, choice.exchange_dtype))
    if args.sync_interval is not None and not choice.hidden:
        if smallest is None:
            print("no H up to 4096 hides it in these formats")
        else:
            print(f"hidden from H = {smallest[0]} on: --local-sgd-sync-interval {smallest[0]} "
                  f"{format_flags(smallest[1].exchange_dtype)} --local-sgd-outer-step-delay "
                  f"{smallest[1].outer_step_delay} --local-sgd-fragments {smallest[1].fragments} "
                  f"({smallest[1].bound_fraction:.2f} of the no-communication bound)")
    # The job can choose while it runs (--local-sgd-auto-overlap), best started from this choice:
    # its first, measured syncs run with the setting it starts with.
    sparse = [f for f in args.formats if topk_format(f) is not None]
    if sparse:
        print(f"not chosen while the job runs: --local-sgd-auto-overlap takes the dense formats only "
              f"({', '.join(FORMATS)}), not {', '.join(sparse)}")
        return 0
    fragments = sorted(f for f in {1, 2, choice.fragments} if h % f == 0 and delay_limit(h, f) >= 2)
    if choice.fragments not in fragments:  # H / F < 2: no room for a delay, nothing to choose
        print(f"not chosen while the job runs: --local-sgd-auto-overlap needs --local-sgd-sync-interval / "
              f"--local-sgd-fragments >= 2 (room for a delay); H = {h}")
        return 0
    print(f"or chosen while the job runs, starting there: --local-sgd-auto-overlap --local-sgd-auto-formats "
          f"{','.join(args.formats)} --local-sgd-auto-fragments {','.join(map(str, fragments))} {start}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
