"""Bytes per sync of the sparse (top-k) exchange against the fp32 and the dense quantized ones,
counted (not timed).

    python scripts/bench/bench_sparse_bytes.py [--numel 1048576] [--workers 2 4]

For each W in ``--workers`` the script starts W CPU processes (gloo, a file rendezvous: no
port) and exchanges one shard of ``--numel`` random elements per process with each form: the
fp32 all-reduce, the dense int8 / int4 exchange (block 256, :mod:`megatron_edit.exchange.quantized`)
and the top-k exchange (:mod:`megatron_edit.exchange.sparse`) at several densities and value
formats, error feedback on. Every ``torch.distributed`` collective the exchange issues is
counted by wrapping it in the process, as ring algorithms send it (an all-reduce of S bytes
2 (W - 1) / W S, an all-gather (W - 1) / W of its output, an all-to-all (W - 1) / W of its
input; the convention of ``megatron_edit.exchange.groups``); indices, scales and padding are in
the tensors, so they are counted. The table gives bytes per rank per sync, their ratio to the
fp32 exchange's, the byte model's ratio (``megatron_edit.algorithm.wire``; it must agree) and
whether every rank decoded the same result. Writes scripts/bench/results/sparse_bytes.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from megatron_edit.algorithm import wire  # noqa: E402

FORMS = [("fp32", None, "fp32"), ("int8", None, "int8"), ("int4", None, "int4"),
         ("top-k 1% int2", 0.01, "int2"), ("top-k 2% int2", 0.02, "int2"), ("top-k 3% int2", 0.03, "int2"),
         ("top-k 2% int4", 0.02, "int4"), ("top-k 2% int8", 0.02, "int8"), ("top-k 2% fp32", 0.02, "fp32")]
CHUNK, BLOCK = 4096, 256


def _count(counted, name, nbytes_of):
    original = getattr(dist, name)

    def wrapper(*args, **kwargs):
        counted[0] += nbytes_of(*args)
        return original(*args, **kwargs)

    setattr(dist, name, wrapper)


def _install_counter(counted, workers):
    def size(t):
        return t.numel() * t.element_size()

    _count(counted, "all_reduce", lambda t, *a: 2 * (workers - 1) * size(t) // workers)
    _count(counted, "all_to_all_single", lambda out, inp, *a: (workers - 1) * size(inp) // workers)
    for name in ("all_gather_into_tensor", "all_gather_single"):
        if hasattr(dist, name):
            _count(counted, name, lambda out, inp, *a: (workers - 1) * size(out) // workers)


def _rank(rank, workers, numel, init, queue):
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=workers)
    from megatron_edit.exchange.groups import SyncGroup
    from megatron_edit.exchange.quantized import QuantizedExchange
    from megatron_edit.exchange.shard import BucketShard
    from megatron_edit.exchange.sparse import SparseExchange

    group = SyncGroup(dist.group.WORLD)
    counted = [0]
    _install_counter(counted, workers)
    rows = []
    for name, density, dtype in FORMS:
        delta = torch.randn(numel, generator=torch.Generator().manual_seed(rank)) * 1e-3
        shard = BucketShard(numel=numel, mains=[torch.zeros(numel)], local_ranges=[(0, numel)],
                            segments=[(0, numel, 0, True)], bucket_layers={0})
        counted[0] = 0
        if density is not None:
            exchange = SparseExchange(group, density, CHUNK, dtype, error_feedback=True)
            exchange.finish(exchange.launch(shard, delta), delta, mean=True)
            model = wire.format_wire_bytes(numel, f"topk{density}-{dtype}", workers, BLOCK, CHUNK)
        elif dtype != "fp32":
            exchange = QuantizedExchange(group, dtype, BLOCK, error_feedback=True)
            exchange.finish(shard, exchange.launch(shard, delta), delta, mean=True)
            model = wire.format_wire_bytes(numel, dtype, workers, BLOCK, CHUNK)
        else:
            group.all_reduce_sum(delta, async_op=False)
            delta /= workers
            model = wire.format_wire_bytes(numel, "fp32", workers)
        sent = counted[0]
        parts = [torch.empty_like(delta) for _ in range(workers)]
        dist.all_gather(parts, delta)  # not counted (all_gather is not wrapped): the check only
        same = all(torch.equal(parts[0], p) for p in parts[1:])
        rows.append((name, sent, model, same))
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def measure(workers: int, numel: int):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=_rank, args=(r, workers, numel, init, queue)) for r in range(workers)]
        for p in procs:
            p.start()
        rows = queue.get(timeout=900)
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.terminate()
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=1 << 20, help="elements of the shard each process exchanges")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args(argv)
    results = {w: measure(w, args.numel) for w in args.workers}
    header = ["exchange"] + [f"W={w} {col}" for w in args.workers for col in ("B/rank", "× fp32", "model × fp32")]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for i, (name, _, _) in enumerate(FORMS):
        cells = [name]
        for w in args.workers:
            _, sent, model, same = results[w][i]
            fp32 = results[w][0][1]
            assert same, f"{name}, W={w}: the ranks decoded different results"
            assert sent == model, f"{name}, W={w}: counted {sent} B, the model says {model} B"
            cells += [f"{sent:,}", f"{sent / fp32:.4f}", f"{model / wire.format_wire_bytes(args.numel, "fp32", w):.4f}"]
        lines.append("| " + " | ".join(cells) + " |")
    cheaper = {d: wire.dense_int4_cheaper_from(d, CHUNK, "int2") for d in (0.01, 0.02, 0.03)}
    text = "\n".join([
        f"Bytes per rank per sync, one shard of {args.numel:,} elements, counted (ring convention); "
        f"top-k chunks of {CHUNK}, dense blocks of {BLOCK}; every rank decoded the same result.", "",
        *lines, "",
        "Dense int4 sends fewer bytes than the top-k all-gather (int2 values) from W = "
        + ", ".join(f"{w} (d = {d:.0%})" for d, w in cheaper.items()) + " on.", ""])
    print(text)
    results = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    os.makedirs(results, exist_ok=True)
    with open(os.path.join(results, "sparse_bytes.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
