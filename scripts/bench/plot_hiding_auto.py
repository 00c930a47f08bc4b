"""The auto run against the grid of fixed settings, over link rates: one table and one plot.

    python scripts/bench/plot_hiding_auto.py [--suffixes _auto_10mbit _auto_20mbit ...]

Reads scripts/bench/results/hiding{suffix}.json (bench_hiding.py --auto, one per rate) and
writes scripts/bench/results/hiding_auto_summary.md and docs/img/hiding_auto.png: per rate the
auto run's tokens/s against the no-communication bound and against the best fixed setting of
the grid, what it chose, and its predicted against its measured exposed wait per sync; with
--confirm, the auto run against that best setting measured again in rounds of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
sys.path.insert(0, os.path.join(HERE, "..", ".."))  # megatron_edit's step-time model
sys.path.insert(0, HERE)
import tbf  # noqa: E402  (netns_cluster.sh's token bucket)
DEFAULT = ["_auto_10mbit", "_auto_20mbit", "_auto_27mbit", "_auto_50mbit", "_auto_100mbit", "_auto_27to10mbit"]


def summary(suffix: str) -> dict:
    with open(os.path.join(RESULTS, f"hiding{suffix}.json")) as f:
        data = json.load(f)
    stats = data["stats"]
    fixed = {n: s for n, s in stats.items() if not n.startswith("bound") and n != "EDiT auto"}
    best = max(fixed, key=lambda n: fixed[n]["tokens_per_s"])
    auto = stats["EDiT auto"]
    run = data["runs"]["EDiT auto"][0]
    delayed = any(run["delay"])
    measured = statistics.median((run["exposed_wait"] if delayed else run["edit_seconds"]) or [0.0])
    loads = [float(x.split()[0]) for s in stats.values() for x in s["loads"]]
    return dict(rate=suffix.replace("_auto_", "").replace("to", " -> ").replace("mbit", " Mbit/s"),
                alone_ms=data["alone"][0] * 1e3, auto=auto["ratio"], best=best, best_ratio=fixed[best]["ratio"],
                of_best=auto["tokens_per_s"] / fixed[best]["tokens_per_s"],
                chose=", ".join(f"{d['format']} tau {d['delay']} F={d.get('fragments', 1)} (after step {d['step']})"
                                for d in run["decisions"]),
                loss=(auto["loss"] / fixed[best]["loss"] - 1) * 100 if "loss" in auto and "loss" in fixed[best]
                else float("nan"),
                repeats=len(data["runs"]["EDiT auto"]),
                rank=1 + sum(f["tokens_per_s"] > auto["tokens_per_s"] for f in fixed.values()), grid=len(fixed),
                of_best_all=[a / b for a, b in zip(auto["tokens_per_s_all"], fixed[best]["tokens_per_s_all"])],
                predicted_ms=run["decisions"][-1]["predicted_exposed"] * 1e3 if run["decisions"] else float("nan"),
                measured_ms=measured * 1e3, load=f"{min(loads):.0f}-{max(loads):.0f}", **confirmed(data))


def confirmed(data: dict) -> dict:
    """bench_hiding.py --confirm: the auto run over the grid's best fixed setting in the
    confirmation rounds (each round's ratio; their median), and the setting re-measured."""
    c = data.get("confirm")
    if not c:
        return dict(confirmed=None, confirmed_all=[])
    runs = c["runs"]
    pairs = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(runs["EDiT auto"], runs[c["best"]])]
    return dict(confirmed=statistics.median(pairs), confirmed_all=pairs)


def mode_setting(name: str):
    """(format, tau, F) of a grid mode's name ("int8 F=2 delay 3", "fp32 layer-wise")."""
    parts = name.split()
    fragments = int(parts[1][2:]) if parts[1].startswith("F=") else 1
    tau = int(parts[-1]) if parts[-2] == "delay" else 0
    return parts[0], tau, fragments


def prediction_rows(suffix: str, burst: bool = True) -> list:
    """The step-time model's exposed wait per sync (megatron_edit.algorithm.overlap_plan, from
    the exchange alone scaled to each format's bytes and the mode's own ordinary step) against
    the measured one, for every grid mode whose wait is not hidden (measured or predicted above
    a tenth of a step): (mode, predicted ms, measured ms, steps of the measured). The model
    counts the link only, not a sync's work on the CPU (the arrival check and the norms'
    all-gather, the codec, the outer step), which a delay does not hide.

    The exchange alone is timed back to back (seven in a row), on a token bucket kept empty;
    in training the link rests for steps between exchanges, and each exchange (each fragment's)
    starts with the bucket full: its burst crosses at once. ``burst`` (the default) takes that
    off each fragment's exchange; ``burst=False`` gives the model the exchange alone as it is.
    A run whose link changes in the window (--rate-change) has no one exchange time: none."""
    from megatron_edit.algorithm import overlap_plan

    with open(os.path.join(RESULTS, f"hiding{suffix}.json")) as f:
        data = json.load(f)
    if data.get("rate_change"):
        return []
    numel = sum(data["runs"]["bound"][0]["shard_numels"])
    full_bucket = tbf.burst_seconds(data["rate"]) if burst else 0.0
    rows = []
    for name, st in data["stats"].items():
        if name.startswith("bound") or name == "EDiT auto" or "base" not in st:
            continue
        fmt, tau, frags = mode_setting(name)
        exchange = overlap_plan.scale_to_formats(data["alone"][0], "fp32", numel, [fmt])[fmt]
        exchange = max(0.0, exchange - frags * full_bucket)
        t = st["base"]
        predicted = overlap_plan.exposed_seconds(exchange, t, tau, frags) / frags
        measured = st.get("exposed_wait", 0.0) if tau else st.get("lw_extra", 0.0)
        if max(predicted, measured) > 0.1 * t:
            rows.append((name, predicted * 1e3, measured * 1e3, measured / t))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suffixes", nargs="*", default=DEFAULT)
    args = parser.parse_args()
    rows = [summary(s) for s in args.suffixes]
    lines = ["| link | exchange alone ms | auto chose (repetition 0) | auto vs bound | best fixed (vs bound) "
             "| auto / best fixed [per repetition] | auto's place in the grid | loss: auto vs best fixed "
             "| confirmed: auto / that setting [per round] "
             "| exposed per sync: predicted / measured ms | load |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        each = ", ".join(f"{x:.2f}" for x in r["of_best_all"])
        conf = ("-" if r["confirmed"] is None else
                f"**{r['confirmed']:.2f}** [" + ", ".join(f"{x:.2f}" for x in r["confirmed_all"]) + "]")
        lines.append(f"| {r['rate']} | {r['alone_ms']:.0f} | {r['chose']} | {r['auto']:.2f} | {r['best']} "
                     f"({r['best_ratio']:.2f}) | **{r['of_best']:.2f}** [{each}] | {r['rank']} of {r['grid'] + 1} "
                     f"| {r['loss']:+.2f}% | {conf} | "
                     f"{r['predicted_ms']:.1f} / {r['measured_ms']:.1f} | {r['load']} |")
    lines += ["", "The model's exposed wait per sync against the measured one, grid modes not hidden "
              "(more than a tenth of a step either way), the exchange alone less the link's full bucket "
              "(prediction_rows):", "",
              "| link | mode | predicted ms | measured ms | measured in steps | error |", "|---|---|---|---|---|---|"]
    errors, raw = [], []
    for suffix, r in zip(args.suffixes, rows):
        for name, pred, meas, steps in prediction_rows(suffix):
            err = (pred - meas) / meas if meas > 0 else float("inf")
            errors.append((abs(err), abs(pred - meas) / (meas / steps) if steps else 0.0))
            lines.append(f"| {r['rate']} | {name} | {pred:.0f} | {meas:.0f} | {steps:.1f} | {err * 100:+.0f}% |")
        raw += [abs(p - m) / m if m > 0 else float("inf") for _, p, m, _ in prediction_rows(suffix, burst=False)]
    if errors:
        lines.append(f"\n{sum(e <= 0.15 for e, _ in errors)} of {len(errors)} within 15%, "
                     f"{sum(e <= 0.15 or d <= 0.25 for e, d in errors)} within 15% or a quarter of a step; "
                     f"median error {statistics.median(e for e, _ in errors) * 100:.0f}%. Without the "
                     f"bucket's burst taken off (the exchange alone as measured): {sum(e <= 0.15 for e in raw)} "
                     f"of {len(raw)} within 15%.")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS, "hiding_auto_summary.md"), "w") as f:
        f.write(text)
    print(text)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    x = list(range(len(rows)))
    ax.bar([i - 0.2 for i in x], [r["auto"] for r in rows], 0.4, label="auto", color="tab:green")
    ax.bar([i + 0.2 for i in x], [r["best_ratio"] for r in rows], 0.4, label="best fixed setting of the grid",
           color="0.6")
    for i, r in enumerate(rows):
        label = f"{r['of_best']:.2f}\nof best" + ("" if r["confirmed"] is None else f"\n({r['confirmed']:.2f}\nconfirmed)")
        ax.text(i - 0.2, r["auto"] + 0.02, label, ha="center", fontsize=7)
    ax.axhline(1.0, color="k", linewidth=0.8, alpha=0.5)
    ax.set_xticks(x)
    ax.set_xticklabels([r["rate"] for r in rows], fontsize=8)
    ax.set_ylabel("tokens/s vs no-communication bound")
    ax.set_ylim(0, 1.45)
    ax.set_title("--local-sgd-auto-overlap against a grid of fixed (tau, F, format), 2 workers x 2 ranks, H=8\n"
                 f"network namespaces, {'/'.join(sorted({str(r['repeats']) for r in rows}))} repetition(s) per mode, "
                 "machine load "
                 f"{min(float(r['load'].split('-')[0]) for r in rows):.0f}-"
                 f"{max(float(r['load'].split('-')[1]) for r in rows):.0f}", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")
    ax.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    out = os.path.join(HERE, "..", "..", "docs", "img", "hiding_auto.png")
    fig.savefig(out, dpi=110)
    print(f"wrote {os.path.join(RESULTS, 'hiding_auto_summary.md')} and {os.path.normpath(out)}")


if __name__ == "__main__":
    main()
