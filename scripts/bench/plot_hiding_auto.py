"""The auto run against the grid of fixed settings, over link rates: one table and one plot.

    python scripts/bench/plot_hiding_auto.py [--suffixes _auto_10mbit _auto_20mbit ...]

Reads scripts/bench/results/hiding{suffix}.json (bench_hiding.py --auto, one per rate) and
writes scripts/bench/results/hiding_auto_summary.md and docs/img/hiding_auto.png: per rate the
auto run's tokens/s against the no-communication bound and against the best fixed setting of
the grid, what it chose, and its predicted against its measured exposed wait per sync.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
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
                chose=", ".join(f"{d['format']} tau {d['delay']} (after step {d['step']})" for d in run["decisions"]),
                predicted_ms=run["decisions"][-1]["predicted_exposed"] * 1e3 if run["decisions"] else float("nan"),
                measured_ms=measured * 1e3, load=f"{min(loads):.0f}-{max(loads):.0f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--suffixes", nargs="*", default=DEFAULT)
    args = parser.parse_args()
    rows = [summary(s) for s in args.suffixes]
    lines = ["| link | exchange alone ms | auto chose | auto vs bound | best fixed (vs bound) | auto / best fixed "
             "| exposed per sync: predicted / measured ms | load |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rate']} | {r['alone_ms']:.0f} | {r['chose']} | {r['auto']:.2f} | {r['best']} "
                     f"({r['best_ratio']:.2f}) | **{r['of_best']:.2f}** | {r['predicted_ms']:.1f} / "
                     f"{r['measured_ms']:.1f} | {r['load']} |")
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
        ax.text(i - 0.2, r["auto"] + 0.02, f"{r['of_best']:.2f}\nof best", ha="center", fontsize=7)
    ax.axhline(1.0, color="k", linewidth=0.8, alpha=0.5)
    ax.set_xticks(x)
    ax.set_xticklabels([r["rate"] for r in rows], fontsize=8)
    ax.set_ylabel("tokens/s vs no-communication bound")
    ax.set_ylim(0, 1.45)
    ax.set_title("--local-sgd-auto-overlap against a grid of fixed (tau, F, format), 2 workers x 2 ranks, H=8\n"
                 "network namespaces, one repetition per mode, machine load "
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
