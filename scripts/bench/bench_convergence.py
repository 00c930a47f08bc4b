"""Convergence benchmark: EDiT, A-EDiT, DiLoCo-style averaging and the quantized exchange
against synchronous training, at equal tokens, over several seeds.

    torchrun --nproc_per_node 2 scripts/bench/bench_convergence.py                 # the benchmark
    torchrun --nproc_per_node 2 scripts/bench/bench_convergence.py --report-only   # tables and plots again

The model: a megatron-core GPT of 4 layers, hidden 192 (1.9M parameters) on the shipped
byte-level text, sequences of 128 tokens, 2 workers x 1 rank (each process is one worker: the
convergence of EDiT does not depend on how a worker is sharded, which the tests check bit for
bit), 4 sequences per worker and step (1,024 tokens per step), 800 steps (0.82M tokens, half a
pass over the training split), AdamW at 3e-3 (64 warmup steps, cosine to 3e-4). Local SGD
starts after the first 64 steps (synchronous warmup, ``--edit-warmup``). The default runs (8
specs x 2 seeds) should take about 1-1.5 h on 2 quiet cores (estimated from the single
runs' times; not run as one list); README's table adds the studies.

A run is named by a spec, ``kind[:key=value,...]``:

  sync                       ordinary synchronous training (gradients all-reduced every step)
  edit:H=8                   EDiT: layer-wise sync every H steps with the pseudo-gradient penalty
                             (anomaly elimination, norm-softmax weights; no clipping)
  diloco:H=8                 DiLoCo-style: plain mean of the pseudo-gradients, no penalty
  aedit:H=8,slow=2           A-EDiT, worker 1 ``slow`` x slower: a simulated clock (worker 0
                             advances 1 per step, worker 1 ``slow``), a sync every H time units,
                             the global budget of the synchronous run (steps x workers)

  keys: H, W (warmup steps), lr, m, nesterov (outer SGD; default: the package's),
        dtype (fp32 bf16 fp8 int8 int4 int2), ef (1: error feedback, 0: none; default: on with
        topk only), topk (the sparse exchange's density, --local-sgd-exchange-topk-density),
        chunk (its --local-sgd-exchange-topk-chunk), clip (EDiT's clip),
        steps (run length; the learning-rate schedule spans it), slow (A-EDiT),
        experts (a MoE model: that many routed experts per layer, top-2, sequential experts,
        the alltoall dispatcher; expert parallelism 1: each worker holds every expert),
        mbs (sequences per worker and step; more tokens at the same steps),
        tau, alpha (the delayed outer step: --local-sgd-outer-step-delay, --local-sgd-outer-merge-alpha,
        default 0.5;
        with alpha > 0 the workers differ between syncs' merges, so only the final loss, after
        the run's last, blocking sync, compares one model), rule (keep: the keep_local merge,
        --local-sgd-outer-merge-rule keep_local), F (streaming fragments, --local-sgd-fragments;
        the workers differ between syncs, as with alpha > 0)

Every run validates on the same held-out samples (``--eval-samples``, spread over all ranks) at
steps W + k x ``--eval-every`` (right after a sync: the workers hold identical models; A-EDiT:
after the first sync past each multiple of that many global steps) and at its end. Losses do not
depend on the machine's load (same data, same order, deterministic kernels, a simulated clock
for A-EDiT); wall times do. Each finished run is appended to ``scripts/bench/results/<--out>.json`` at
once: a crashed or interrupted benchmark resumes where it stopped (``--fresh`` starts over).
Writes ``<--out>.md`` (the table) and ``<--out>.png`` (loss against tokens and wall time).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Dict, List

import torch
import torch.distributed as dist

import bench_common as bc
import megatron_edit as me

# The benchmark's model and run, where the main job's flags (bench_common) default otherwise.
BENCH_DEFAULTS = dict(layers=4, hidden=192, heads=4, seq_length=128, micro_batch_size=4, lr=3e-3,
                      lr_warmup_steps=64, eval_samples=256)
MAIN_RUNS = ["sync", "edit:H=4", "edit:H=8", "edit:H=32", "diloco:H=8", "aedit:H=8,slow=2"]
QUANT_RUNS = ["edit:H=8,dtype=int8,ef=1", "edit:H=8,dtype=int4,ef=1"]
VALID_SEED = 1234  # the held-out samples' order: one validation set for every seed
KINDS = ("sync", "edit", "diloco", "aedit")
KEYS = {"H": int, "W": int, "lr": float, "m": float, "nesterov": int, "dtype": str, "ef": int,
        "clip": float, "steps": int, "slow": float, "mbs": int, "tau": int, "alpha": float, "rule": str, "F": int,
        "experts": int, "topk": float, "chunk": int}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=MAIN_RUNS + QUANT_RUNS, help="run specs (see above)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1234, 2345],
                        help="seeds (model initialisation and data order); every run at every seed")
    parser.add_argument("--bench-steps", type=int, default=800, help="steps per run (spec key steps= overrides)")
    parser.add_argument("--edit-warmup", type=int, default=64, help="synchronous steps before local SGD (W)")
    parser.add_argument("--eval-every", type=int, default=128,
                        help="validation every this many steps after warmup (EDiT: the least common multiple "
                             "of this and H)")
    parser.add_argument("--outer", default="lr=1,m=0",
                        help="outer SGD of every local-SGD run that sets neither lr nor m in its spec "
                             "('' for the package's default)")
    parser.add_argument("--out", default="convergence", help="scripts/bench/results/<out>.{json,md,png}")
    parser.add_argument("--title", default=None, help="plot title")
    parser.add_argument("--fresh", action="store_true", help="ignore the runs already in <out>.json")
    parser.add_argument("--report-only", action="store_true", help="no training: table and plots from <out>.json")
    argv = sys.argv[1:] if argv is None else argv
    args = bc.parse_args(parser, argv)
    for key, value in BENCH_DEFAULTS.items():  # the benchmark's model unless a flag says otherwise
        if not any(a == "--" + key.replace("_", "-") or a.startswith("--" + key.replace("_", "-") + "=")
                   for a in argv):
            setattr(args, key, value)
    return args


# --------------------------------------------------------------------------------------------
# Run specs


def parse_spec(spec: str) -> dict:
    kind, _, rest = spec.partition(":")
    if kind not in KINDS:
        raise SystemExit(f"run {spec!r}: kind must be one of {KINDS}")
    out = {"kind": kind}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        if key not in KEYS:
            raise SystemExit(f"run {spec!r}: unknown key {key!r} (known: {', '.join(KEYS)})")
        out[key] = KEYS[key](value)
    if kind != "sync":
        out.setdefault("H", 8)
    return out


def label(spec: str) -> str:
    """A readable name: 'EDiT H=8, int8 + EF', 'DiLoCo-style H=8, outer lr 1 m 0'."""
    s = parse_spec(spec)
    if s["kind"] == "sync":
        text = "synchronous"
    else:
        text = {"edit": "EDiT", "diloco": "DiLoCo-style", "aedit": "A-EDiT"}[s["kind"]] + f" H={s['H']}"
    extra = []
    if "topk" in s:
        extra.append(f"top-k {s['topk']:.0%} {s.get('dtype', 'fp32')}" + (" + EF" if s.get("ef", 1) else ""))
    elif "dtype" in s:
        extra.append(s["dtype"] + (" + EF" if s.get("ef") else ""))
    if "lr" in s or "m" in s:
        extra.append(f"outer lr {s.get('lr', '-'):g} m {s.get('m', '-'):g}" if "lr" in s and "m" in s else
                     f"outer {'lr ' + format(s['lr'], 'g') if 'lr' in s else 'm ' + format(s['m'], 'g')}")
    if s.get("nesterov") == 0:
        extra.append("no Nesterov")
    if "W" in s:
        extra.append(f"W={s['W']}")
    if "clip" in s:
        extra.append(f"clip {s['clip']:g}")
    if s["kind"] == "aedit":
        extra.append(f"worker 1 at 1/{s.get('slow', 2):g} speed")
    if "steps" in s:
        extra.append(f"{s['steps']} steps")
    if "mbs" in s:
        extra.append(f"{s['mbs']} sequences per worker step")
    if "tau" in s:
        merge = "keep_local" if s.get("rule") == "keep" else f"merge alpha {s.get('alpha', 0.5):g}"
        extra.append(f"delay {s['tau']}, {merge}")
    if "F" in s:
        extra.append(f"{s['F']} fragments")
    if "experts" in s:
        extra.append(f"MoE {s['experts']} experts top-2")
    return text + (", " + ", ".join(extra) if extra else "")


def run_args_for(args, spec: str, seed: int):
    s = parse_spec(spec)
    if s["kind"] != "sync" and "lr" not in s and "m" not in s:
        s.update({k: v for k, v in parse_spec("edit:" + args.outer).items() if k in ("lr", "m", "nesterov")})
    steps = s.get("steps", args.bench_steps)
    common = dict(seed=seed, steps=steps, micro_batch_size=s.get("mbs", args.micro_batch_size),
                  num_experts=s.get("experts"), expert_model_parallel_size=1)
    if s["kind"] == "sync":
        return bc.edit_args(args, use_local_sgd=False, **common), s
    penalty = s["kind"] in ("edit", "aedit")
    run_args = bc.edit_args(
        args, use_local_sgd=True, local_sgd_sync_interval=s["H"], local_sgd_warmup_steps=s.get("W", args.edit_warmup),
        local_sgd_skip_anomaly=penalty, local_sgd_pseudo_gradnorm_reduce=penalty,
        local_sgd_clip_pseudo_grad=s.get("clip"), local_sgd_exchange_dtype=s.get("dtype", "fp32"),
        local_sgd_exchange_error_feedback=bool(s["ef"]) if "ef" in s else None,
        local_sgd_exchange_topk_density=s.get("topk"), local_sgd_exchange_topk_chunk=s.get("chunk", 4096),
        outer_optimizer_lr=s.get("lr"), outer_optimizer_momentum=s.get("m"),
        outer_optimizer_nesterov=(False if s.get("m") == 0 else None) if "nesterov" not in s else bool(s["nesterov"]),
        local_sgd_outer_step_delay=s.get("tau", 0), local_sgd_outer_merge_alpha=s.get("alpha"),
        local_sgd_outer_merge_rule="keep_local" if s.get("rule") == "keep" else None,
        local_sgd_fragments=s.get("F", 1),
        **common,
    )
    if penalty:
        # The detector may exclude after 8 syncs (not the default 120: a run of this length
        # has 200 syncs at H=8, 48 at H=32), with a matching EWMA rate.
        run_args.local_sgd_ewma_warmup_steps, run_args.local_sgd_ewma_alpha = 8, 0.1
    if s["kind"] == "aedit":
        # A time unit is one step of worker 0: a sync every H units, never skipped.
        run_args.local_sgd_async, run_args.local_sgd_sync_time = True, float(s["H"])
        run_args.local_sgd_min_total_global_steps = 0
    if run_args.local_sgd_warmup_steps + (0 if s["kind"] == "aedit" else s["H"]) > steps:
        raise SystemExit(f"run {spec!r}: warmup + H beyond {steps} steps")
    return run_args, s


# --------------------------------------------------------------------------------------------
# Training


def evaluate_all_ranks(args, ddp, valid_ds) -> float:
    """Validation loss on the held-out samples, shared over every rank. Only where every worker
    holds the same model (synchronous training; EDiT right after a sync)."""
    losses = bc.main_job_model.validation_losses(args, ddp, valid_ds, dist.get_rank(), dist.get_world_size())
    total = torch.tensor([sum(losses), len(losses)], dtype=torch.float64)
    dist.all_reduce(total)
    return (total[0] / total[1]).item()


def build_datasets(args, seed: int, steps: int):
    """Training samples for ``steps`` steps of every rank (data order from ``seed``) and the
    held-out samples (the same for every seed)."""
    from megatron_edit.cpu import data

    prefix = os.path.join(args.data_dir, "stdlib_docs")
    samples = (steps + 2) * dist.get_world_size() * args.micro_batch_size
    train_ds, _, _ = data.build_gpt_datasets(prefix, args.seq_length, (samples, 1, 0), seed)
    _, valid_ds, _ = data.build_gpt_datasets(prefix, args.seq_length, (1, args.eval_samples, 0), VALID_SEED)
    return train_ds, valid_ds


def train(args, spec: str, seed: int, datasets) -> dict:
    run_args, s = run_args_for(args, spec, seed)
    train_ds, valid_ds = datasets
    ddp, optimizer, scheduler, controllers = bc.build(run_args)
    c = controllers[0] if controllers else None
    lay = bc.layout(run_args)
    it = bc.batches(run_args, train_ds)
    steps, workers = run_args.steps, run_args.workers
    tokens_per_worker_step = lay["worker_size"] * run_args.micro_batch_size * run_args.seq_length
    shard_numel = sum(b.grad_data.numel() // lay["worker_size"] for buf in ddp.buffers for b in buf.buckets)
    warmup = run_args.local_sgd_warmup_steps if c else 0
    if c is not None:  # EDiT ends with a (blocking) sync, one model on every worker; A-EDiT's
        me.set_train_iters(optimizer, steps)  # budget: steps x workers worker-steps
        now = [0.0]
        cost = 1.0 if lay["worker"] == 0 else s.get("slow", 2.0)
        c.clock = lambda: now[0]
    curve, bytes_sent, syncs, train_seconds = [], 0, 0, 0.0
    global_steps, next_eval = 0, (warmup or 0) * workers
    # EDiT validates right after a sync (the workers' models are identical there).
    eval_every = math.lcm(args.eval_every, s["H"]) if s["kind"] in ("edit", "diloco") else args.eval_every

    def record(step_of_worker0: int, worker_steps: int):
        curve.append(dict(step=step_of_worker0, tokens=worker_steps * tokens_per_worker_step,
                          seconds=bc.max_over_ranks(train_seconds), loss=evaluate_all_ranks(run_args, ddp, valid_ds)))
        bc.log0(f"  {spec} seed {seed}: step {step_of_worker0:5d}, {curve[-1]['tokens'] / 1e6:6.3f}M tokens, "
                f"{curve[-1]['seconds']:7.1f} s: valid {curve[-1]['loss']:.4f}")

    record(0, 0)
    step = 0
    while True:
        step += 1
        if s["kind"] == "aedit":
            if c.finished:
                break
        elif step > steps:
            break
        t0 = time.perf_counter()
        local = c is not None and c.grads_are_local
        bc.train_step(run_args, ddp, optimizer, scheduler, next(it))
        train_seconds += time.perf_counter() - t0
        if not local and workers > 1:
            bytes_sent += 4 * shard_numel  # the gradient all-reduce across workers
        if s["kind"] == "aedit":
            now[0] += cost
            if not local:
                global_steps += workers  # warmup: lockstep
            if c.sync_in_progress:
                c.flush()  # every worker is right after the same sync: the report now
            for r in c.drain_reports():
                if not r.skipped_sync:
                    syncs, bytes_sent = syncs + 1, bytes_sent + r.payload_bytes
                    global_steps += int(r.worker_steps.sum())
                    if global_steps >= next_eval + args.eval_every * workers or r.final:
                        next_eval = global_steps
                        record(step, global_steps)
            continue
        if c is not None:
            for r in c.drain_reports():
                syncs, bytes_sent = syncs + 1, bytes_sent + r.payload_bytes
        if step == steps or (step >= warmup and (step - warmup) % eval_every == 0):
            record(step, step * workers)
            if c is not None:
                for r in c.drain_reports():  # a layer-wise sync completed by the evaluation
                    syncs, bytes_sent = syncs + 1, bytes_sent + r.payload_bytes
    identical = bc.replicas_identical(run_args, ddp)
    steps_per_worker = bc.gather_floats([step - 1 if s["kind"] == "aedit" else steps])[:, 0]
    result = dict(spec=spec, seed=seed, label=label(spec), curve=curve, final=curve[-1]["loss"],
                  tokens=curve[-1]["tokens"], bytes=bytes_sent, syncs=syncs, identical=identical,
                  seconds=bc.max_over_ranks(train_seconds), load=bc.load_average(),
                  params=sum(p.numel() for p in ddp.parameters()),
                  steps_per_worker=[int(steps_per_worker[r].item()) for r in range(0, dist.get_world_size(),
                                                                                   lay["worker_size"])])
    if s["kind"] == "aedit":
        result["simulated_time"] = bc.max_over_ranks(now[0])
    bc.log0(f"{label(spec)} (seed {seed}): final valid {result['final']:.4f}, {syncs} syncs, "
            f"{bytes_sent / 1e6:.1f} MB across workers per rank, {result['seconds']:.0f} s training, "
            f"replicas identical: {identical}, load {result['load']}")
    return result


# --------------------------------------------------------------------------------------------
# Results file


def results_path(args) -> str:
    return os.path.join(bc.RESULTS_DIR, args.out + ".json")


def setting(args) -> dict:
    """What every run of one results file shares (a file with another setting is not resumed)."""
    keys = ("layers", "hidden", "heads", "seq_length", "micro_batch_size", "lr", "lr_warmup_steps", "eval_samples",
            "bench_steps", "edit_warmup", "outer")
    return {k: getattr(args, k) for k in keys} | {"world": dist.get_world_size() if dist.is_initialized() else None,
                                                  "workers": args.workers}


def load_results(args) -> List[dict]:
    path = results_path(args)
    if args.fresh or not os.path.exists(path):
        return []
    with open(path) as f:
        saved = json.load(f)
    if saved.get("setting") != setting(args):
        raise SystemExit(f"{path} holds runs of another setting ({saved.get('setting')}); use --fresh or --out")
    return saved["runs"]


def save_results(args, runs: List[dict]) -> None:
    if dist.get_rank() == 0:
        bc.write_result(args.out + ".json", json.dumps(dict(setting=setting(args), runs=runs), indent=1))


# --------------------------------------------------------------------------------------------
# Report


def baseline_of(spec: str) -> str:
    """The synchronous run of the same length and model (a MoE run: the same experts)."""
    s = parse_spec(spec)
    keys = ",".join(f"{k}={s[k]}" for k in ("steps", "experts") if k in s)
    return f"sync:{keys}" if keys else "sync"


# The keys that change how the same run exchanges (format, delay, merge, fragments): a run with
# any of them is compared with the run without them ("vs base run", paired by seed).
EXCHANGE_KEYS = ("dtype", "ef", "tau", "alpha", "rule", "F", "topk", "chunk")


def base_of(spec: str) -> str:
    """The same run with the dense fp32 exchange, no delay and no fragments."""
    kind, _, rest = spec.partition(":")
    kept = [item for item in filter(None, rest.split(",")) if item.partition("=")[0] not in EXCHANGE_KEYS]
    return kind + (":" + ",".join(kept) if kept else "")


def _mean(values):
    return sum(values) / len(values)


def summarise(args, runs: List[dict]) -> List[dict]:
    """One row per spec: mean final loss over seeds, its difference to synchronous (paired by
    seed), the spread over seeds (max - min) and bytes."""
    by_spec: Dict[str, Dict[int, dict]] = {}
    for r in runs:
        by_spec.setdefault(r["spec"], {})[r["seed"]] = r
    rows = []
    for spec in [s for s in args.runs if s in by_spec] + [s for s in by_spec if s not in args.runs]:
        seeds = by_spec[spec]
        sync = by_spec.get(baseline_of(spec), {})
        finals = [r["final"] for r in seeds.values()]
        rel = [seeds[k]["final"] / sync[k]["final"] - 1 for k in seeds if k in sync]
        row = dict(spec=spec, label=seeds[next(iter(seeds))]["label"], seeds=len(seeds), final=_mean(finals),
                   spread=max(finals) - min(finals), rel=_mean(rel) if rel else None,
                   rel_range=(min(rel), max(rel)) if rel else None,
                   bytes=_mean([r["bytes"] for r in seeds.values()]),
                   seconds=_mean([r["seconds"] for r in seeds.values()]),
                   identical=all(r["identical"] for r in seeds.values()))
        s = parse_spec(spec)
        if s["kind"] == "aedit":
            row["steps_per_worker"] = seeds[next(iter(seeds))]["steps_per_worker"]
            row["simulated_time"] = _mean([r["simulated_time"] for r in seeds.values()])
        if base_of(spec) != spec:
            base = by_spec.get(base_of(spec), {})
            vs = [seeds[k]["final"] / base[k]["final"] - 1 for k in seeds if k in base]
            row["vs_base"] = _mean(vs) if vs else None
            row["vs_base_range"] = (min(vs), max(vs)) if vs else None
        rows.append(row)
    return rows


def report(args, runs: List[dict]) -> None:
    rows = summarise(args, runs)
    if not rows:
        print("no runs yet")
        return
    sync_bytes = {r["spec"]: r["bytes"] for r in rows if parse_spec(r["spec"])["kind"] == "sync"}

    def pct(x):
        return "-" if x is None else f"{100 * x:+.2f}%"

    headers = ["run", "seeds", "final valid loss (mean)", "spread (max-min)", "vs synchronous (range)",
               "vs base run (range)", "MB across workers", "x fewer bytes", "train s"]
    table_rows = []
    for r in rows:
        table_rows.append([
            r["label"], r["seeds"], f"{r['final']:.4f}", f"{r['spread']:.4f}",
            "-" if r["rel"] is None else f"{pct(r['rel'])} ({pct(r['rel_range'][0])} .. {pct(r['rel_range'][1])})",
            "-" if r.get("vs_base") is None else
            f"{pct(r['vs_base'])} ({pct(r['vs_base_range'][0])} .. {pct(r['vs_base_range'][1])})",
            f"{r['bytes'] / 1e6:.1f}",
            f"{sync_bytes[baseline_of(r['spec'])] / r['bytes']:.1f}" if baseline_of(r["spec"]) in sync_bytes
            and r["bytes"] else "-", f"{r['seconds']:.0f}",
        ])
    first = runs[0]
    notes = [f"{first['params']:,}-parameter GPT ({args.layers} layers, hidden {args.hidden}), "
             f"{args.workers} workers, {args.seq_length}-token sequences, {args.bench_steps} steps "
             f"({first['tokens'] if parse_spec(first['spec'])['kind'] != 'aedit' else runs[0]['tokens']:,} tokens), "
             f"local SGD after {args.edit_warmup} synchronous steps; validation on {args.eval_samples} held-out "
             "samples. 'vs synchronous': final loss / synchronous final loss - 1, paired by seed (mean, and the "
             "range over seeds); 'vs base run': the same against the run without the exchange format, "
             "delay, merge rule and fragments (fp32, blocking, whole model), paired by seed; spread: max - min "
             "of the final loss over seeds; bytes: payload per rank "
             "across workers (warmup included). Train s: wall time of the training steps (load: "
             + ", ".join(sorted({r['load'] for r in runs}))[:200] + ")."]
    for r in rows:
        if "simulated_time" in r:
            slow = parse_spec(r["spec"]).get("slow", 2.0)
            steps = parse_spec(r["spec"]).get("steps", args.bench_steps)
            notes.append(f"{r['label']}: steps per worker {r['steps_per_worker']}; simulated time to the budget "
                         f"{r['simulated_time']:.0f} units (a step of worker 0 = 1) against {steps * slow:.0f} for "
                         f"synchronous training or EDiT with the same straggler (lockstep: every step waits "
                         f"for worker 1): {steps * slow / r['simulated_time']:.2f}x faster.")
    if not all(r["identical"] for r in rows):
        notes.append("WARNING: replicas differed at the end of: "
                     + ", ".join(r["label"] for r in rows if not r["identical"]))
    text = bc.table(headers, table_rows)
    print(f"\nconvergence (validation loss, lower is better)\n{text}\n" + "\n".join(notes))
    bc.write_result(args.out + ".md", bc.table(headers, table_rows, markdown=True) + "\n\n" + "\n\n".join(notes) + "\n")
    plot(args, runs, rows)


def _mean_curve(runs: List[dict], key: str):
    """Mean over seeds of loss against ``key``, at the points every seed has."""
    curves = [r["curve"] for r in runs]
    n = min(len(c) for c in curves)
    return [_mean([c[i][key] for c in curves]) for i in range(n)], [_mean([c[i]["loss"] for c in curves])
                                                                     for i in range(n)]


def plot(args, runs: List[dict], rows: List[dict]) -> None:
    plt = bc.pyplot()
    by_spec: Dict[str, List[dict]] = {}
    for r in runs:
        by_spec.setdefault(r["spec"], []).append(r)
    quant = [r["spec"] for r in rows if "dtype" in parse_spec(r["spec"])]
    main = [r["spec"] for r in rows if r["spec"] not in quant]
    panels = 3 if quant else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 4.2))
    cmap = plt.get_cmap("tab10")
    colors = {spec: ("k" if parse_spec(spec)["kind"] == "sync" else cmap(i % 10)) for i, spec in enumerate(main + quant)}

    def rel_curve(spec):
        """Loss relative to synchronous at the same tokens (interpolated), mean over seeds."""
        points = {}
        sync_runs = {r["seed"]: r for r in by_spec.get(baseline_of(spec), [])}
        for r in by_spec[spec]:
            base = sync_runs.get(r["seed"])
            if base is None:
                continue
            bx, by = [p["tokens"] for p in base["curve"]], [p["loss"] for p in base["curve"]]
            for p in r["curve"][1:]:
                if bx[0] <= p["tokens"] <= bx[-1]:
                    i = max(j for j in range(len(bx)) if bx[j] <= p["tokens"])
                    j = min(i + 1, len(bx) - 1)
                    w = 0.0 if j == i else (p["tokens"] - bx[i]) / (bx[j] - bx[i])
                    ref = by[i] + w * (by[j] - by[i])
                    points.setdefault(round(p["tokens"] / 1e4), []).append((p["tokens"], 100 * (p["loss"] / ref - 1)))
        keys = sorted(points)
        return [_mean([t for t, _ in points[k]]) for k in keys], [_mean([v for _, v in points[k]]) for k in keys]

    ax = axes[0]
    for spec in main:
        xs, ys = _mean_curve(by_spec[spec], "tokens")
        ax.plot([x / 1e6 for x in xs], ys, color=colors[spec], marker=".", ms=3, label=by_spec[spec][0]["label"])
    ax.set_xlabel("tokens (millions, all workers)")
    ax.set_ylabel(f"validation loss (mean of {len(args.seeds)} seeds)")
    lows = [min(_mean_curve(by_spec[s], "tokens")[1]) for s in main or quant]
    ax.set_ylim(min(lows) - 0.05, min(lows) + 1.0)
    ax2 = ax.inset_axes([0.42, 0.45, 0.55, 0.32])
    for spec in main:
        if parse_spec(spec)["kind"] != "sync":
            xs, ys = rel_curve(spec)
            ax2.plot([x / 1e6 for x in xs], ys, color=colors[spec], marker=".", ms=2)
    ax2.axhline(0, color="k", lw=0.8)
    ax2.set_title("% above synchronous", fontsize=7)
    ax2.tick_params(labelsize=6)
    ax2.set_ylim(-3, 8)
    ax.legend(fontsize=6.5, loc="upper left")
    ax.grid(True, alpha=0.3)

    ax = axes[1]
    for spec in main:
        if parse_spec(spec)["kind"] == "aedit":
            continue  # its clock is simulated; see the table
        xs, ys = _mean_curve(by_spec[spec], "seconds")
        ax.plot(xs, ys, color=colors[spec], marker=".", ms=3, label=by_spec[spec][0]["label"])
    ax.set_xlabel("wall time of the training steps, s (2 shared cores; informative only)")
    ax.set_ylabel("validation loss")
    ax.set_ylim(min(lows) - 0.05, min(lows) + 1.0)
    ax.legend(fontsize=6.5)
    ax.grid(True, alpha=0.3)

    if quant:
        ax = axes[2]
        ref = [s for s in main if s in {q.split(",dtype=")[0] for q in quant}]
        for spec in ref + quant:
            xs, ys = rel_curve(spec)
            ax.plot([x / 1e6 for x in xs], ys, color=colors[spec], marker=".", ms=3,
                    label=by_spec[spec][0]["label"] + ("" if spec in quant else ", fp32"))
        ax.axhline(0, color="k", lw=0.8, label="synchronous")
        ax.set_xlabel("tokens (millions, all workers)")
        ax.set_ylabel("validation loss, % above synchronous")
        ax.set_ylim(-3, 8)
        ax.set_title("quantized exchange", fontsize=9)
        ax.legend(fontsize=6.5)
        ax.grid(True, alpha=0.3)
    fig.suptitle(args.title or f"{runs[0]['params'] / 1e6:.1f}M-parameter GPT on the shipped text, "
                 f"{args.workers} workers", fontsize=9)
    fig.tight_layout()
    fig.savefig(bc.plot_path(args.out + ".png"), dpi=110)
    print(f"wrote {bc.plot_path(args.out + '.png')}")


# --------------------------------------------------------------------------------------------


def main():
    args = parse_args()
    specs = args.runs
    for spec in specs:
        parse_spec(spec)  # a bad spec fails before anything runs
    if args.report_only:  # every run in the file, or those --runs names
        with open(results_path(args)) as f:
            runs = json.load(f)["runs"]
        named = any(a == "--runs" or a.startswith("--runs=") for a in sys.argv[1:])
        report(args, [r for r in runs if r["spec"] in specs] if named else runs)
        return
    bc.setup(args, train_samples=1)  # the process group, Megatron's groups, the indexed dataset
    done = load_results(args)
    dist.barrier()  # every rank has read the file before rank 0 writes it
    datasets = {}
    for seed in args.seeds:
        for spec in specs:
            if any(r["spec"] == spec and r["seed"] == seed for r in done):
                continue
            s = parse_spec(spec)
            steps = s.get("steps", args.bench_steps) * (args.workers if s["kind"] == "aedit" else 1)
            steps = math.ceil(steps * s.get("mbs", args.micro_batch_size) / args.micro_batch_size)  # samples
            if (seed, steps) not in datasets:
                datasets = {(seed, steps): build_datasets(args, seed, steps)}
            done.append(train(args, spec, seed, datasets[(seed, steps)]))
            save_results(args, done)
    if dist.get_rank() == 0:
        report(args, [r for r in done if r["spec"] in specs and r["seed"] in args.seeds])
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    bc.run_main(main)
