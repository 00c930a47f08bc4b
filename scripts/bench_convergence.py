"""Convergence benchmark: validation loss against tokens, with and without a worker on bad data.

    torchrun --nproc_per_node 4 scripts/bench_convergence.py [--steps 320] [--bad-from 128 --bad-to 192]

The main job's small GPT (2 workers x 2 shards) on the shipped text, same data order, same
inner AdamW and learning-rate schedule, 8 synchronous warmup steps for the local-SGD runs:
  synchronous        ordinary Megatron training (gradients all-reduced every step);
  EDiT H=8, H=32     outer Nesterov SGD 0.7/0.9 with the pseudo-gradient penalty: anomaly
                     elimination (EWMA, warmup --ewma-warmup syncs, threshold 3), norm-softmax
                     weights, per-layer clipping at --clip;
  DiLoCo-style H=32  the same outer optimizer, plain mean of the pseudo-gradients, no penalty;
and each again with worker 1 fed bad data (uniformly random tokens) for steps
[--bad-from, --bad-to). Validation loss (the mean of the workers' losses on the same held-out
samples) at steps 8 + k * --eval-every, right after a sync of every H (replicas identical). Writes
bench-results/convergence.{png,md,json}.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.distributed as dist

import bench_common as bc

WARMUP = 8  # synchronous steps before local SGD starts


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", dest="bench_steps", type=int, default=328, help="8 warmup + a multiple of 32")
    parser.add_argument("--eval-every", type=int, default=32,
                        help="validation at steps 8 + k * this (right after a sync): a multiple of every H")
    parser.add_argument("--bad-from", type=int, default=128)
    parser.add_argument("--bad-to", type=int, default=192)
    parser.add_argument("--ewma-warmup", type=int, default=3, help="syncs before anomalies can be excluded")
    parser.add_argument("--ewma-alpha", type=float, default=0.1,
                        help="EWMA rate of the detector (0.02 with 120 warmup syncs in long runs)")
    parser.add_argument("--clip", type=float, default=1.0, help="per-layer clip of the averaged pseudo-gradient")
    parser.add_argument("--runs", nargs="+", default=["synchronous", "EDiT H=8", "EDiT H=32", "DiLoCo H=32"])
    parser.add_argument("--no-bad", action="store_true", help="only the clean runs")
    args = bc.parse_args(parser)
    args.steps = args.bench_steps  # the learning-rate schedule (warmup, cosine decay) spans the run
    if not any(a.startswith("--eval-samples") for a in sys.argv[1:]):
        args.eval_samples = 256  # the main job's 64 is noisy for curves
    return args


def run_args_for(args, name):
    if name == "synchronous":
        return bc.edit_args(args, use_local_sgd=False)
    h = int(name.split("H=")[1])
    penalty = name.startswith("EDiT")
    run_args = bc.edit_args(
        args, use_local_sgd=True, local_sgd_sync_interval=h, local_sgd_warmup_steps=WARMUP,
        local_sgd_skip_anomaly=penalty, local_sgd_pseudo_gradnorm_reduce=penalty,
        local_sgd_clip_pseudo_grad=args.clip if penalty else None,
    )
    if penalty:  # the detector's flags only with the detector (elsewhere they are refused)
        run_args.local_sgd_ewma_warmup_steps = args.ewma_warmup
        run_args.local_sgd_ewma_alpha = args.ewma_alpha
    return run_args


def bad_batch(batch, generator):
    """Uniformly random tokens in place of the text: a well-formed sequence of noise."""
    from megatron_edit.cpu import data

    seq = torch.randint(0, data.VOCAB_SIZE - 1, (batch["tokens"].shape[0], batch["tokens"].shape[1] + 1),
                        generator=generator)
    out = dict(batch)
    out["tokens"], out["labels"] = seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
    return out


def mean_over_workers(run_args, ddp, valid_ds) -> float:
    losses = bc.job.gather_per_worker(bc.job.evaluate(run_args, ddp, valid_ds))
    return sum(losses.values()) / len(losses)


def train(args, name, bad, datasets):
    train_ds, valid_ds = datasets
    run_args = run_args_for(args, name)
    run_args.eval_samples = args.eval_samples
    ddp, optimizer, scheduler, controllers = bc.build(run_args)
    it = bc.batches(run_args, train_ds)
    lay = bc.layout(run_args)
    generator = torch.Generator().manual_seed(1000 + lay["dp_rank"])
    # Synchronous EDiT: every worker reaches each evaluation at the same step, so gathering the
    # workers' losses there cannot meet a sync on another worker (never do this with A-EDiT).
    curve = [(0, mean_over_workers(run_args, ddp, valid_ds))]
    excluded = 0
    for step in range(1, args.bench_steps + 1):
        batch = next(it)
        if bad and lay["worker"] == 1 and args.bad_from <= step - 1 < args.bad_to:
            batch = bad_batch(batch, generator)
        bc.train_step(run_args, ddp, optimizer, scheduler, batch)
        for c in controllers:
            excluded += sum(int(r.excluded.any(dim=1).sum()) for r in c.drain_reports() if r.excluded is not None)
        if step >= WARMUP and (step - WARMUP) % args.eval_every == 0:
            valid = mean_over_workers(run_args, ddp, valid_ds)  # completes a pending layer-wise sync
            for c in controllers:
                excluded += sum(int(r.excluded.any(dim=1).sum()) for r in c.drain_reports() if r.excluded is not None)
            curve.append((step, valid))
    tokens_per_step = lay["dp"] * args.micro_batch_size * args.seq_length
    bc.log0(f"{name:12s} {'bad data' if bad else 'clean':8s} final valid loss {curve[-1][1]:.4f}"
            + (f"  syncs with a worker excluded: {excluded}" if controllers else ""))
    return dict(name=name, bad=bad, curve=[(s * tokens_per_step, l) for s, l in curve], final=curve[-1][1],
                excluded=excluded if controllers else None)


def main():
    args = parse_args()
    if any(args.eval_every % int(n.split("H=")[1]) for n in args.runs if "H=" in n):
        raise SystemExit("--eval-every must be a multiple of every H")
    if (args.bench_steps - WARMUP) % args.eval_every:
        raise SystemExit(f"--steps must be {WARMUP} + a multiple of --eval-every")
    datasets = bc.setup(args, train_samples=(args.bench_steps + 2) * 4 * args.micro_batch_size)
    results = []
    for bad in (False,) if args.no_bad else (False, True):
        for name in args.runs:
            results.append(train(args, name, bad, datasets))
    if dist.get_rank() == 0:
        report(args, results)
    dist.destroy_process_group()


def report(args, results):
    clean = {r["name"]: r for r in results if not r["bad"]}
    bad = {r["name"]: r for r in results if r["bad"]}
    base = clean.get("synchronous", results[0])["final"]
    rows = []
    for name in args.runs:
        c, b = clean.get(name), bad.get(name)
        rows.append([
            name, f"{c['final']:.4f}", f"{c['final'] - base:+.4f}",
            f"{b['final']:.4f}" if b else "-", f"{b['final'] - c['final']:+.4f}" if b else "-",
            "-" if c["excluded"] is None else f"{c['excluded']} / {'-' if not b else b['excluded']}",
        ])
    headers = ["run", "final valid loss (clean)", "vs synchronous", "with bad worker", "damage (bad - clean)",
               "exclusions clean / bad"]
    tokens = results[0]["curve"][-1][0]
    notes = (f"{args.bench_steps} steps ({tokens:,} tokens), 2 workers x 2 shards, 137k-parameter GPT; bad "
             f"data = random tokens on worker 1 for steps {args.bad_from}-{args.bad_to}; EDiT penalty: EWMA "
             f"warmup {args.ewma_warmup} syncs, alpha {args.ewma_alpha}, threshold 3, softmax(-norm) weights, "
             f"clip {args.clip}; "
             "DiLoCo-style: plain mean, same outer Nesterov SGD 0.7/0.9; local-SGD runs start with 8 "
             "synchronous steps; learning rate: 10 warmup steps, cosine decay over the run. Exclusions: "
             "(sync, worker) pairs the anomaly detector "
             "excluded from at least one layer.")
    text = bc.table(headers, rows)
    print(f"\nconvergence (validation loss, lower is better)\n{text}\n{notes}")
    bc.write_result("convergence.md", bc.table(headers, rows, markdown=True) + "\n\n" + notes + "\n")
    bc.write_result("convergence.json", json.dumps(results))

    plt = bc.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.3))
    colors = dict(zip(args.runs, ("k", "tab:blue", "tab:green", "tab:orange", "tab:purple")))
    for r in results:
        xs, ys = zip(*r["curve"])
        ax.plot([x / 1e6 for x in xs], ys, "--" if r["bad"] else "-", color=colors[r["name"]], marker=".",
                label=r["name"] + (" + bad worker" if r["bad"] else ""))
    tok_per_step = results[0]["curve"][1][0] / WARMUP
    ax.axvspan(args.bad_from * tok_per_step / 1e6, args.bad_to * tok_per_step / 1e6, color="red", alpha=0.08,
               label="worker 1 on random tokens")
    ax.set_xlabel("tokens (millions, all workers)")
    ax.set_ylabel("validation loss")
    ax.set_ylim(top=min(6.0, max(max(l for _, l in r["curve"][1:]) for r in results) + 0.1))
    ax.set_title("Small GPT on the shipped text, 2 workers", fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="upper right")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(bc.plot_path("convergence.png"), dpi=110)
    print(f"wrote {bc.plot_path('convergence.png')}")


if __name__ == "__main__":
    main()
