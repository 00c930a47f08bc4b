"""Step-time model: fitted to the namespace measurements, then projected to GPU clusters.

    python scripts/bench/bench_model.py [--measured scripts/bench/results/bandwidth.json] [--interval 128]

Model of one training step of one worker (all times in seconds):

    compute        t_c   (forward t_f, backward t_b ~ 2 t_f)
    exchange       C(X)  = n_b * l + max(n_b * alpha, X / (eta * B))
                   X: bytes one worker's link carries per exchange, B: link rate, eta: the share of
                   it the collective achieves, n_b: buckets (one collective each), l: network
                   latency per collective, alpha: processing cost per collective (CPU work of
                   gloo here, launch/synchronisation of NCCL on GPUs); processing and transfer
                   overlap, so the slower of the two counts.
    synchronous    t_c + max(0, C(X_grad) - o * t_b)          every step; Megatron overlaps the
                                                             gradient reduce with the backward pass
    EDiT step-end  t_c + C(X_pg) / H                          blocking, once per H steps
    EDiT layer-w.  t_c + max(0, C(X_pg) - phi * t_f) / H      the next forward pass hides up to phi*t_f
    A-EDiT         as layer-wise, with H = the measured steps per sync, plus one tiny schedule
                   all-reduce (alpha) per sync; it does not wait for stragglers (below).

Fit: alpha, o, phi minimise the squared relative error of the predicted step time over every
(rate, run) of bench_bandwidth.py, with t_c, t_f and the link bytes X measured there (X from the
interface counters: what gloo really sent), B from the link check (TCP throughput, so eta = 1)
and l = 0 (veth). Check: the error of every point, and leave-one-rate-out (fit on the other
rates, predict the left-out one).

Projection (assumptions, each a flag): one worker = one node of 8 GPUs; a fixed global batch (2M
tokens for 1B, 4M for 7B) split over the GPUs; compute t_c = 6 * P * tokens_per_gpu / (peak *
MFU), t_f = t_c / 3, t_b = 2 t_c / 3; synchronous moves bf16 gradients, EDiT fp32 pseudo-
gradients; per node and exchange X = 2 (N-1)/N * bytes * P (ring all-reduce across N nodes; the
reduce-scatter/all-gather inside the node over NVLink is not counted); alpha = 2 (N-1) * link
latency per bucket of 40M parameters, buckets not pipelined (pessimistic, for both); eta =
--eta; overlap o and phi = --overlap (1: everything that fits under the backward / forward pass
is hidden, generous to synchronous training); stragglers: step times vary with coefficient of
variation --cv, a barrier across n GPUs waits E[max] ~ mean + sd * sqrt(2 ln n): synchronous
pays it every step, EDiT once per H steps (sd of an H-step sum: sqrt(H) sd), A-EDiT never (time-
based sync). Writes scripts/bench/results/model_fit.png, model_projection.png, model.md.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_common import RESULTS_DIR, plot_path, pyplot, table, write_result  # noqa: E402

RUNS = ("synchronous", "EDiT step-end", "EDiT layer-wise", "A-EDiT")
LINKS = {"400 Gbit/s IB/RoCE": (400e9, 5e-6), "100 Gbit/s Ethernet": (100e9, 10e-6),
         "25 Gbit/s Ethernet": (25e9, 20e-6)}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--measured", default=os.path.join(RESULTS_DIR, "bandwidth.json"))
    parser.add_argument("--interval", type=int, default=128, help="H for the projection")
    parser.add_argument("--peak", type=float, default=312e12, help="GPU peak bf16 FLOP/s (A100: 312e12)")
    parser.add_argument("--mfu", type=float, default=0.4)
    parser.add_argument("--batch-1b", type=int, default=2 * 1024 * 1024,
                        help="global batch of the 1B model, tokens per step over all GPUs (fixed: more GPUs = "
                             "fewer tokens each; TinyLlama used 2M)")
    parser.add_argument("--batch-7b", type=int, default=4 * 1024 * 1024,
                        help="global batch of the 7B model (Llama 2: 4M tokens)")
    parser.add_argument("--eta", type=float, default=0.8, help="share of the link rate NCCL achieves")
    parser.add_argument("--alpha", type=float, default=1e-4, help="processing cost per bucket collective (NCCL)")
    parser.add_argument("--overlap", type=float, default=1.0, help="o and phi for the projection")
    parser.add_argument("--cv", type=float, default=0.02, help="coefficient of variation of step times")
    parser.add_argument("--bucket-params", type=float, default=40e6, help="Megatron's bucket size")
    return parser.parse_args()


# ------------------------------------------------------------------ fit
def points(measured):
    """One row per (rate, run): the inputs of the model and the measured step time."""
    rows = []
    for r in measured:
        if not r.get("measured_mbit"):
            continue
        bound = r["modes"]["no-comm bound"]
        t_c, t_f = bound["step_s"], bound.get("forward_s", bound["step_s"] / 3)
        buckets = r.get("buckets", 5)
        for run in RUNS:
            m = r["modes"][run]
            steps_per_worker = sum(m["steps_per_rank"]) / len(m["steps_per_rank"])
            h = r["interval"] if run != "A-EDiT" else steps_per_worker / max(m["syncs"], 1)
            x_step = m["tx_per_worker_step"]
            rows.append(dict(rate=r["rate"], run=run, B=r["measured_mbit"] * 1e6 / 8, t_c=t_c, t_f=t_f, H=h,
                             X=x_step * (1 if run == "synchronous" else h), n_b=buckets, T=m["step_s"]))
    return rows


def predict(p, eta, alpha, o, phi):
    """Predicted step time of each point for arrays of parameters (broadcasting)."""
    cost = np.maximum(p["n_b"] * alpha, p["X"] / (eta * p["B"]))
    t_b = 2 * p["t_f"]
    if p["run"] == "synchronous":
        return p["t_c"] + np.maximum(0, cost - o * t_b)
    if p["run"] == "EDiT step-end":
        return p["t_c"] + cost / p["H"]
    extra = alpha if p["run"] == "A-EDiT" else 0.0
    return p["t_c"] + (np.maximum(0, cost - phi * p["t_f"]) + extra) / p["H"]


GRID = dict(eta=np.array([1.0]), alpha=np.linspace(0, 0.02, 81), o=np.linspace(0, 1, 21),
            phi=np.linspace(0, 3, 31))


def fit(rows):
    eta, alpha, o, phi = np.meshgrid(*GRID.values(), indexing="ij")
    loss = np.zeros_like(eta)
    for p in rows:
        loss += ((predict(p, eta, alpha, o, phi) - p["T"]) / p["T"]) ** 2
    i = np.unravel_index(np.argmin(loss), loss.shape)
    return dict(eta=float(eta[i]), alpha=float(alpha[i]), o=float(o[i]), phi=float(phi[i]))


def evaluate(rows, params):
    return [float(predict(p, **params)) for p in rows]


# ------------------------------------------------------------------ projection
def project(args, params_b: float, batch_tokens: int, gpus: int, link):
    bandwidth, latency = link
    nodes = gpus // 8
    t_c = 6 * params_b * (batch_tokens / gpus) / (args.peak * args.mfu)
    t_f, t_b = t_c / 3, 2 * t_c / 3
    buckets = math.ceil(params_b / args.bucket_params)
    ring = 2 * (nodes - 1) / nodes
    latency_per_collective = 2 * (nodes - 1) * latency
    bps = bandwidth / 8 * args.eta

    def cost(bytes_per_param):
        transfer = ring * bytes_per_param * params_b / bps
        return buckets * latency_per_collective + max(buckets * args.alpha, transfer)

    wait = args.cv * t_c * math.sqrt(2 * math.log(gpus))
    h = args.interval
    times = {
        "synchronous": t_c + max(0.0, cost(2) - args.overlap * t_b) + wait,
        "EDiT step-end": t_c + cost(4) / h + wait / math.sqrt(h),
        "EDiT layer-wise": t_c + max(0.0, cost(4) - args.overlap * t_f) / h + wait / math.sqrt(h),
        "A-EDiT": t_c + (max(0.0, cost(4) - args.overlap * t_f) + latency_per_collective) / h,
    }
    return t_c, times


def _fit_report(args, measured, rows, pred, params):
    """The fit against the measurements (and, with two rates or more, each rate's prediction by
    the fit to the others): (headers, rows, note, the relative errors)."""
    rates = sorted({p["rate"] for p in rows}, key=lambda r: -rows[[p["rate"] for p in rows].index(r)]["B"])
    loo = {}
    for rate in rates if len(rates) > 1 else ():
        train = [p for p in rows if p["rate"] != rate]
        held = [p for p in rows if p["rate"] == rate]
        fitted = fit(train)
        for p, y in zip(held, evaluate(held, fitted)):
            loo[(p["rate"], p["run"])] = y
    fit_rows = []
    for p, y in zip(rows, pred):
        l1 = loo.get((p["rate"], p["run"]))
        fit_rows.append([p["rate"], p["run"], f"{p['T'] * 1e3:.1f}", f"{y * 1e3:.1f}", f"{(y - p['T']) / p['T']:+.0%}",
                         f"{l1 * 1e3:.1f} ({(l1 - p['T']) / p['T']:+.0%})" if l1 is not None else "-"])
    fit_headers = ["link", "run", "measured ms/step", "model ms/step", "error", "leave-rate-out ms (error)"]
    errors = [abs(y - p["T"]) / p["T"] for p, y in zip(rows, pred)]
    loo_errors = [abs(loo[(p["rate"], p["run"])] - p["T"]) / p["T"] for p in rows if (p["rate"], p["run"]) in loo]
    fit_note = (f"fitted: alpha={params['alpha'] * 1e3:.2f} ms of processing per bucket collective (gloo on "
                f"2 shared cores), o={params['o']:.2f} (share of the backward pass that hides the gradient "
                f"reduce), phi={params['phi']:.2f} (forward passes' worth of the exchange the layer-wise sync hides); "
                f"mean |error| {np.mean(errors):.0%}, max {max(errors):.0%}; "
                + (f"leave-one-rate-out mean |error| {np.mean(loo_errors):.0%}, max {max(loo_errors):.0%}. "
                   if loo_errors else "leave-one-rate-out: needs two rates. ")
                + f"Inputs from {os.path.relpath(args.measured)} "
                f"(load averages: " + ", ".join(f"{r['rate']}: {r.get('load', '?')}" for r in measured) + ").")
    return fit_headers, fit_rows, fit_note, errors


GPU_COUNTS = (64, 128, 256, 512, 1024)
"""The projection's cluster sizes (8 GPUs per node = one worker)."""


def _projection(args):
    """Each run's efficiency on 1B and 7B models over :data:`LINKS` and :data:`GPU_COUNTS`:
    (headers, rows, note, {(size, link, run): efficiency per GPU count})."""
    proj_rows, curves = [], {}
    sizes = (("1B", 1e9, args.batch_1b), ("7B", 7e9, args.batch_7b))
    for (size_name, size, batch), (link_name, link) in itertools.product(sizes, LINKS.items()):
        for gpus in GPU_COUNTS:
            t_c, times = project(args, size, batch, gpus, link)
            for run, t in times.items():
                curves.setdefault((size_name, link_name, run), []).append(t_c / t)
            if gpus in (64, 256, 1024):
                proj_rows.append([size_name, link_name, gpus, f"{t_c:.2f}"]
                                 + [f"{t_c / times[r]:.0%}" for r in RUNS]
                                 + [f"{times['synchronous'] / times['A-EDiT']:.2f}x"])
    proj_headers = (["model", "inter-node link", "GPUs", "compute s/step"] + [f"{r} eff." for r in RUNS]
                    + ["A-EDiT vs sync"])
    proj_note = (f"efficiency = compute time / step time (tokens/s relative to no communication). H={args.interval}; "
                 f"8 GPUs per node = one worker; global batch {args.batch_1b:,} (1B) / {args.batch_7b:,} (7B) tokens "
                 f"per step split over the GPUs, at {args.peak / 1e12:.0f} TFLOP/s x MFU {args.mfu}; eta {args.eta}; "
                 f"overlap {args.overlap}; step-time cv {args.cv}; "
                 "bf16 gradients (2 B/param) for synchronous, fp32 pseudo-gradients (4 B/param) for EDiT.")
    return proj_headers, proj_rows, proj_note, curves


def _plot_fit(rows, pred, errors) -> None:
    """model_fit.png: the model's step time against the measured one."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 4.2))
    markers = dict(zip(RUNS, "osD^"))
    for run in RUNS:
        xs = [p["T"] * 1e3 for p in rows if p["run"] == run]
        ys = [y * 1e3 for p, y in zip(rows, pred) if p["run"] == run]
        ax.plot(xs, ys, markers[run], label=run)
    lim = [0, max(max(p["T"] for p in rows), max(pred)) * 1e3 * 1.1]
    ax.plot(lim, lim, "k--", linewidth=0.8)
    ax.set_xlim(lim)
    ax.set_ylim(lim)
    ax.set_xlabel("measured ms/step (namespace cluster)")
    ax.set_ylabel("model ms/step")
    ax.set_title(f"Step-time model fit (mean |error| {np.mean(errors):.0%})", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(plot_path("model_fit.png"), dpi=110)


def _plot_projection(args, curves) -> None:
    """model_projection.png: each run's projected efficiency per link, against the GPU count."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(LINKS), figsize=(11, 3.8), sharey=True)
    colors = dict(zip(RUNS, ("k", "tab:red", "tab:blue", "tab:green")))
    for ax, link_name in zip(axes, LINKS):
        for (size_name, lk, run), ys in curves.items():
            if lk == link_name:
                ax.plot(GPU_COUNTS, ys, "-" if size_name == "1B" else "--", marker=".", color=colors[run],
                        label=f"{run} {size_name}")
        ax.set_xscale("log", base=2)
        ax.set_xticks(GPU_COUNTS)
        ax.set_xticklabels([str(g) for g in GPU_COUNTS])
        ax.set_title(link_name, fontsize=9)
        ax.set_xlabel("GPUs (8 per node = worker)")
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("compute efficiency")
    axes[0].legend(fontsize=6, ncol=2)
    fig.suptitle(f"Projected efficiency, H={args.interval} (solid 1B, dashed 7B); "
                 "assumptions in scripts/bench/bench_model.py",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(plot_path("model_projection.png"), dpi=110)


def main():
    args = parse_args()
    with open(args.measured) as f:
        measured = json.load(f)
    rows = points(measured)
    params = fit(rows)
    pred = evaluate(rows, params)
    fit_headers, fit_rows, fit_note, errors = _fit_report(args, measured, rows, pred, params)
    print("model fitted to the namespace measurements")
    print(table(fit_headers, fit_rows))
    print(fit_note)

    proj_headers, proj_rows, proj_note, curves = _projection(args)
    print("\nprojection")
    print(table(proj_headers, proj_rows))
    print(proj_note)
    write_result("model.md", "Fit\n\n" + table(fit_headers, fit_rows, markdown=True) + "\n\n" + fit_note
                 + "\n\nProjection\n\n" + table(proj_headers, proj_rows, markdown=True) + "\n\n" + proj_note + "\n")
    _plot_fit(rows, pred, errors)
    _plot_projection(args, curves)
    print(f"wrote {plot_path('model_fit.png')}, {plot_path('model_projection.png')}, {plot_path('model.md')}")


if __name__ == "__main__":
    main()
