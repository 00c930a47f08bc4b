"""How close one EDiT sync comes to memory speed: ``python scripts/bench/bench_outer_step.py [--device cuda]``.

One worker (no exchange: the collectives are the identity), so what is timed is the memory work
of a sync on synthetic shards shaped like Megatron's buckets (``--params`` split into
``--buckets``, each bucket a few parameters of a few layers; fp32 main params, the model's copy
in ``--model-dtype``): computing the pseudo-gradient, the penalty's per-layer norms, clipping,
GTA, the outer step and the writes of main params and model. Each configuration runs through
:class:`megatron_edit.exchange.outer_sync.OuterSync`, the code a real sync runs.

The minimal sync moves 38 bytes per parameter (bf16 model; 40 with an fp32 model copy): pass 1
reads anchor and main params and writes Delta (12 B); pass 2 reads Delta, anchor and momentum and
writes anchor, momentum, main params and the model copy (26 B). The table gives each
configuration's time, the bandwidth that time means for those 38 bytes, and that bandwidth as a
fraction of a plain device-to-device copy measured in the same run (``copy_`` of a tensor of the
same total size: read + write). The baseline for the ratios is the plain mean on the same path.
On CPU each configuration runs in a process of its own (``--isolate``): in one process, memory
left by one configuration slowed the next by up to 2x, whatever the order.

Paths: ``generic`` = ``torch.optim.SGD.step`` (what every outer optimizer can use), ``fused`` =
the fused momentum-SGD step (eager: the same operations; ``--compile``: one compiled kernel,
the default on CUDA).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from megatron_edit.config import GTAConfig, LocalSGDConfig, OuterOptimizerConfig  # noqa: E402
from megatron_edit.exchange.groups import SyncGroup, WorkerGroups  # noqa: E402
from megatron_edit.exchange.outer_state import OuterState  # noqa: E402
from megatron_edit.exchange.outer_sync import OuterSync  # noqa: E402
from megatron_edit.exchange.shard import BucketShard  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

CONFIGS = {
    "mean": dict(),
    "penalty": dict(skip_anomaly=True, pseudo_gradnorm_reduce=True),
    "penalty+clip": dict(skip_anomaly=True, pseudo_gradnorm_reduce=True, clip_pseudo_grad=1.0),
    "gta": "gta",
}


def build_shards(params: int, buckets: int, layers_per_bucket: int, params_per_layer: int,
                 model_dtype: torch.dtype, device: torch.device):
    per_bucket = params // buckets
    shards, layer = [], 0
    for b in range(buckets):
        segments, ranges, mains = [], [], []
        pieces = layers_per_bucket * params_per_layer
        size = per_bucket // pieces
        for p in range(pieces):
            s, e = p * size, (p + 1) * size
            segments.append((s, e, layer + p // params_per_layer, True))
            ranges.append((s, e))
        layer += layers_per_bucket
        numel = per_bucket
        model = torch.randn(numel, device=device).to(model_dtype)
        if model_dtype == torch.float32:
            mains = [model[s:e] for s, e in ranges]
            flat, model = model, None
        else:
            mains = [torch.randn(e - s, device=device) for s, e in ranges]
            flat = None
        shards.append(BucketShard(numel=numel, mains=mains, local_ranges=ranges, segments=segments,
                                  bucket_layers={seg[2] for seg in segments}, model=model,
                                  flat_mains=flat, device=device, index=b))
    return shards, layer


def sync_seconds(device, shards, layers, local, gta, fused, compile_, repeats):
    state = OuterState(OuterOptimizerConfig(), fused=fused, compile=compile_)
    state.capture(shards)
    pipeline = OuterSync([[s] for s in shards], [f"l{i}" for i in range(layers)], SyncGroup(None),
                         WorkerGroups(None, None), LocalSGDConfig(local_sgd_sync_interval=1, **local),
                         gta, state)
    times = []
    for k in range(repeats + 3):  # three warm-up syncs (first momentum, compilation, allocations)
        for shard in shards:
            for m in shard.mains:
                m.add_(1e-3)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        pipeline.start(step=k + 1, steps_since_last=1)
        pipeline.mark_pending()
        for index in range(len(shards)):
            pipeline.complete_group(index)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if k >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(numel: int, device, repeats: int) -> float:
    src, dst = torch.randn(numel, device=device), torch.empty(numel, device=device)
    times = []
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 2 * 4 * numel / statistics.median(times[1:])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--params", type=int, default=None, help="default: 1.34e9 on CUDA, 32e6 on CPU")
    parser.add_argument("--buckets", type=int, default=None, help="default: 34 on CUDA, 8 on CPU")
    parser.add_argument("--layers-per-bucket", type=int, default=1)
    parser.add_argument("--params-per-layer", type=int, default=6)
    parser.add_argument("--model-dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                        help="compile the fused step (default: on CUDA only)")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (default 1)")
    parser.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                        help="each configuration in a process of its own, with its own copy bandwidth "
                             "(default: on CPU, where memory left by one configuration slowed the next "
                             "by up to 2x in one process)")
    parser.add_argument("--out", default=os.path.join(RESULTS, "outer_step"))
    parser.add_argument("--only", nargs=2, metavar=("PATH", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    cuda = device.type == "cuda"
    params = args.params or (1_340_000_000 if cuda else 32_000_000)
    buckets = args.buckets or (34 if cuda else 8)
    model_dtype = torch.bfloat16 if args.model_dtype == "bf16" else torch.float32
    compile_ = args.compile if args.compile is not None else cuda
    isolate = args.isolate if args.isolate is not None else not cuda
    paths = {"generic": (False, False), "fused": (True, compile_)}

    def measure(path: str, name: str) -> dict:
        """One configuration on fresh shards: ms per sync and the copy bandwidth beside it."""
        fused, comp = paths[path]
        local, gta = CONFIGS[name], GTAConfig()
        if local == "gta":
            local, gta = {}, GTAConfig(reducer="gta", consensus_method="sum")
        shards, layers = build_shards(params, buckets, args.layers_per_bucket, args.params_per_layer,
                                      model_dtype, device)
        numel = sum(s.numel for s in shards)
        copy = copy_bandwidth(numel, device, args.repeats)
        seconds = sync_seconds(device, shards, layers, local, gta, fused, comp, args.repeats)
        return dict(seconds=seconds, copy=copy, numel=numel)

    if args.only:
        print(json.dumps(measure(*args.only)))
        return
    minimal = 38 if model_dtype == torch.bfloat16 else 40
    rows = []
    for path in paths:
        base = None
        for name in CONFIGS:
            if isolate:
                out = subprocess.run([sys.executable, os.path.abspath(__file__), *(argv or sys.argv[1:]),
                                      "--only", path, name], check=True, capture_output=True, text=True).stdout
                m = json.loads(out.strip().splitlines()[-1])
            else:
                m = measure(path, name)
            seconds, copy, numel = m["seconds"], m["copy"], m["numel"]
            base = base or seconds
            bandwidth = minimal * numel / seconds
            rows.append(dict(path=path + (" (compiled)" if paths[path][1] else ""), config=name, ms=1e3 * seconds,
                             gbps=bandwidth / 1e9, copy_gbps=copy / 1e9, of_copy=bandwidth / copy,
                             vs_mean=seconds / base))
    load = os.getloadavg()[0]
    copies = [r["copy_gbps"] for r in rows]
    lines = [
        f"device {device} ({torch.cuda.get_device_name() if cuda else 'CPU, %d thread(s)' % args.threads}), "
        f"{numel / 1e6:.1f}M params in {buckets} buckets, {args.model_dtype} model, one worker; "
        f"copy bandwidth {min(copies):.1f}-{max(copies):.1f} GB/s (measured beside each row"
        f"{', each row in a process of its own' if isolate else ''}); minimal sync {minimal} B/param; "
        f"load average {load:.1f}",
        "",
        "| path | sync | ms per sync | GB/s at the minimal bytes | of copy bandwidth | vs plain mean |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['path']} | {r['config']} | {r['ms']:.1f} | {r['gbps']:.1f} | {r['of_copy']:.0%} | {r['vs_mean']:.2f} |")
    text = "\n".join(lines)
    print(text)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    suffix = "_cuda" if cuda else "_cpu"
    with open(args.out + suffix + ".md", "w") as f:
        f.write(text + "\n")
    with open(args.out + suffix + ".json", "w") as f:
        json.dump(dict(rows=rows, params=numel, load=load, isolated=isolate), f, indent=1)


if __name__ == "__main__":
    main()
