"""``python -m megatron_edit.plan``: what a link costs EDiT, read before a run.

    python -m megatron_edit.plan --params 1.3e9 --workers 4 --link-mbit 10000 --step-ms 900 \\
        --sync-interval 64 [--formats fp32,int8,int4]

Prints the exchange time of each allowed format, the delay (``--local-sgd-outer-step-delay``),
fragments (``--local-sgd-fragments``) and format (``--local-sgd-exchange-dtype``) that hide it,
the flags that let the job choose while it runs starting from them (``--local-sgd-auto-overlap``),
and the expected fraction of the no-communication bound, from the step-time model of
:mod:`megatron_edit.algorithm.overlap_plan`. Nothing is started; no GPU or Megatron is needed.
"""

from __future__ import annotations

import argparse
import sys

from .algorithm.overlap_plan import FORMATS, exposed_seconds, bound_fraction, plan
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
    bad = [n for n in names if n not in FORMATS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"{text!r}: a comma-separated list of {', '.join(FORMATS)}")
    return names


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
    parser.add_argument("--sync-interval", type=_positive(int), required=True, help="H")
    parser.add_argument("--formats", type=_formats, default=["fp32"],
                        help="exchange formats allowed, comma-separated (default fp32)")
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
    step_s = args.step_ms / 1e3
    times, choice = plan(args.params, args.workers, args.link_mbit * 1e6, step_s, args.sync_interval,
                         args.formats, args.block_size, margin=args.margin, max_delay=args.max_delay)
    h = args.sync_interval
    print(f"{args.params:,} parameters, {args.workers} workers, {args.link_mbit:g} Mbit/s, "
          f"{args.step_ms:g} ms per inner step, H = {h}")
    print(f"{'format':<8}{'exchange ms':>13}{'in steps':>10}{'no delay':>10}")
    for fmt, seconds in times.items():
        no_delay = bound_fraction(step_s, exposed_seconds(seconds, step_s, 0), h)
        print(f"{fmt:<8}{seconds * 1e3:>13.1f}{seconds / step_s:>10.2f}{no_delay:>10.2f}")
    print("choice: " + choice.line())
    start = (f"--local-sgd-exchange-dtype {choice.exchange_dtype} "
             f"--local-sgd-outer-step-delay {choice.outer_step_delay} --local-sgd-fragments {choice.fragments}")
    print(f"flags: {start}")
    # The job can choose while it runs (--local-sgd-auto-overlap), best started from this choice:
    # its first, measured syncs run with the setting it starts with.
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
