"""What the main job prints (``scripts/train_gpt_edit.py``): rank 0's lines, the header that
describes EDiT's settings (:func:`describe_edit`), one line per sync with the penalty's decisions
(:func:`log_syncs`, :func:`penalty_line`), the summary table (:func:`summary`), and the package's
log lines (:func:`setup_logging`).
"""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

import megatron_edit


def log0(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)



class _LogFormatter(logging.Formatter):
    """The package's log lines as they are, except a SyncReport argument (--local-sgd-debug's
    per-rank line) as its scalars instead of its repr (tensors over many lines)."""

    def format(self, record):
        if isinstance(record.args, tuple) and any(isinstance(a, megatron_edit.SyncReport) for a in record.args):
            record.args = tuple(_brief(a) if isinstance(a, megatron_edit.SyncReport) else a for a in record.args)
        return super().format(record)


def _brief(report) -> str:
    figures = ", ".join(f"{k.split('/', 1)[1]} {v:.4g}" for k, v in report.scalars().items())
    return f"sync after step {report.step} ({report.mode}): {figures}"


def setup_logging(debug: bool) -> None:
    """The package logs through ``logging`` (logger ``megatron_edit``): its warnings always,
    --local-sgd-auto-overlap's decisions (one line each), and with --local-sgd-debug every sync
    on every rank."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_LogFormatter("%(message)s"))
    logger = logging.getLogger("megatron_edit")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if debug else logging.WARNING)
    logger.propagate = False
    logging.getLogger("megatron_edit.mcore.auto_overlap").setLevel(logging.INFO)


def describe_edit(controller, args) -> str:
    c, outer = controller.config, controller.outer_config
    kwargs = ", ".join(f"{k} {v}" for k, v in outer.outer_optim_kwargs.items())
    if c.use_async:
        when = (f"A-EDiT: sync every {c.local_sgd_sync_time:g} s of training (the first "
                f"{c.local_sgd_sync_interval} local steps after warmup), skipped below "
                f"{c.min_total_global_steps} steps in total, a budget of {args.steps * args.workers} "
                f"worker-steps (--steps x --workers: each worker stops at its own step count, the "
                f"faster later, at a last sync)")
    else:
        when = f"sync every {c.local_sgd_sync_interval} steps"
        if c.fragments > 1:
            when += (f" in {c.fragments} fragments ({'/'.join(str(len(f)) for f in controller.sync_shards.fragments)}"
                     f" buckets), one every {c.local_sgd_sync_interval // c.fragments} steps")
        if c.outer_step_delay:
            merge = ("keep_local" if c.outer_merge_rule == "keep_local" else f"lerp alpha {c.merge_alpha:g}")
            when += f", each exchange launched {c.outer_step_delay} steps early (merge: {merge})"
    text = (f"{when}, after {c.local_sgd_warmup_steps} synchronous warmup steps, {c.sync_mode} mode; "
            f"outer {outer.optimizer_class.__name__} ({kwargs})")
    auto = getattr(controller, "auto", None)
    if auto is not None:  # what is above is where it starts: its first syncs are timed with it
        from megatron_edit.mcore.auto_overlap import MEASURE_SYNCS

        text += (f"\nauto overlap: the delay, format ({','.join(auto.formats)}) and fragments "
                 f"({','.join(map(str, auto.fragments))}) chosen from the first {MEASURE_SYNCS} syncs, timed with "
                 f"the settings above, and again every {auto.user.auto_every} syncs")
    exchange = c.exchange_dtype
    feedback = ", error feedback" if c.error_feedback else ""
    if c.exchange_topk_density is not None:  # the sparse exchange: its own layout, error feedback by default
        exchange = (f"top-k: the largest {c.exchange_topk_density:g} of each chunk of {c.exchange_topk_chunk} "
                    f"values, sent in {c.exchange_dtype}{feedback}")
    elif exchange != "fp32":
        exchange += f" (a scale per {c.exchange_block_size} values{feedback})"
    arrivals = controller.arrivals
    timeout = ("" if arrivals is None else
               f"; sync timeout {arrivals.timeout:g} s"
               + (" (torch's default; --local-sgd-sync-timeout)" if c.sync_timeout is None else ""))
    model = ("dense model" if not args.num_experts else
             f"MoE: {args.num_experts} experts per layer, top-2, expert parallelism "
             f"{args.expert_model_parallel_size}")
    text += f"\nexchange {exchange}{timeout}; {model}"
    penalty = []
    if c.skip_anomaly:
        penalty.append(f"anomaly elimination (EWMA alpha {c.ewma_alpha}, after {c.ewma_warmup_steps} "
                       f"syncs, z > {c.ewma_threshold})")
    if c.pseudo_gradnorm_reduce:
        penalty.append(f"weights softmax(-norm / {c.weight_softmax_temperature or 1.0:g})")
    if c.clip_pseudo_grad is not None:
        penalty.append(f"clip at {c.clip_pseudo_grad:g}")
    return text + (f"\npenalty: {', '.join(penalty)}" if penalty else "")


def _names(report, layers) -> str:
    total = len(report.layer_names or ()) or None
    if len(layers) == total:
        return f"all {total} layers"
    names = [report.layer_names[i] for i in layers] if report.layer_names else [str(i) for i in layers]
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more layers" if len(names) > 2 else "")


def penalty_line(report):
    """The penalty's decisions at one sync (None when it is off): who was excluded from which
    layers, the averaging weights, the clipping."""
    parts = []
    if report.excluded is not None:
        excluded = [(w, row.nonzero().flatten().tolist()) for w, row in enumerate(report.excluded)]
        excluded = [(w, layers) for w, layers in excluded if layers]
        parts.append("excluded " + "; ".join(f"worker {w} from {_names(report, l)}" for w, l in excluded)
                     if excluded else "no worker excluded")
    if report.skipped is not None and bool(report.skipped.any()):
        layers = report.skipped.nonzero().flatten().tolist()
        parts.append(f"outer step skipped (every worker excluded) for {_names(report, layers)}")
    if report.weights is not None and report.norms is not None:
        parts.append("weights " + ", ".join(
            f"worker {w} {float(row.min()):.3f}-{float(row.max()):.3f}" for w, row in enumerate(report.weights)))
    if report.clip_coef is not None:
        clipped = int((report.clip_coef < 1).sum())
        parts.append(f"clip factor min {float(report.clip_coef.min()):.3f} "
                     f"({clipped} of {len(report.clip_coef)} layers clipped)")
    return "penalty: " + " | ".join(parts) if parts else None


def log_syncs(per_controller, counts, label: str = "sync") -> None:
    """Rank 0 prints each sync (the syncs are the same on every worker). ``per_controller``:
    each EDiT controller's reports (a MoE model with expert parallelism has two, the dense and
    the experts' optimizer, which sync together: one line per sync). ``label``: how the sync
    lines begin (with --local-sgd-sync-backend torchft each worker's job prints its own,
    ``worker N sync``)."""
    for r, *more in zip(*per_controller):
        if r.skipped_sync:
            counts["skipped"] += 1
            log0(f"          sync after step {r.step} skipped: the workers took "
                 f"{int(r.worker_steps.sum())} steps in total since the last exchange "
                 f"({', '.join(str(int(s)) for s in r.worker_steps)}), fewer than "
                 f"--local-sgd-min-total-global-steps")
            continue
        counts["syncs"] += 1
        sent = r.payload_bytes + sum(x.payload_bytes for x in more)
        counts["bytes"] += sent
        steps = ""
        if r.worker_steps is not None:
            steps = f"; steps per worker since the last: {', '.join(str(int(s)) for s in r.worker_steps)}"
        experts = "".join(f" + {x.buckets} expert buckets" for x in more)
        what = "" if r.fragment is None else f" (fragment {r.fragment})"
        if r.delay:
            what += f" (launched after step {r.step - r.delay}, exposed wait {r.exposed_wait_seconds * 1e3:.1f} ms)"
        if not r.committed:  # torchft: the round failed or had too few workers; nothing applied
            what += " NOT COMMITTED (the local progress is kept for the next sync)"
        log0(f"          {label} {counts['syncs']} after step {r.step}{what}: {r.buckets} buckets{experts}, "
             f"{sent / 1e3:.1f} kB sent by this rank across the sync group "
             f"({r.workers} workers{'' if r.trained in (None, r.workers) else f', {r.trained} trained since the last'}), {(r.seconds + sum(x.seconds for x in more)) * 1e3:.1f} ms in EDiT code{steps}")
        for report, what in zip((r, *more), ("", *["experts: "] * len(more))):
            line = penalty_line(report)
            if line:
                log0(f"            {what}{line}")


def summary(results) -> None:
    log0("\n=== summary (per rank; cross-worker bytes = EDiT pseudo-gradient exchange or Megatron's "
         "per-step gradient all-reduce across workers) ===")
    headers = ("run", "valid loss (per worker)", "syncs", "cross-worker MB", "wall s")
    rows = [(r["name"], ", ".join(f"{v:.4f}" for v in r["final"].values()),
             str(r["syncs"]) + (f" (+{r['skipped']} skipped)" if r["skipped"] else ""),
             f"{r['cross_bytes'] / 1e6:.3f}", f"{r['seconds']:.1f}") for r in results]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    log0(line(headers))
    for row in rows:
        log0(line(row))
    if len(results) == 2 and results[0]["cross_bytes"]:
        log0(f"EDiT sent {results[1]['cross_bytes'] / results[0]['cross_bytes']:.1f}x fewer bytes across workers")
