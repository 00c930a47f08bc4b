"""Stress the gloo collective pattern of an EDiT run on CPU, without megatron_edit or Megatron.

    torchrun --nproc_per_node 4 scripts/dev/repro_gloo_crash.py --iters 300 [--workers 2]

What one training step of the convergence benchmark does to gloo, over the same process groups
(W workers x S ranks each; S = world / W):

* Megatron's gradient reduction inside a worker: ``reduce_scatter_tensor`` of every bucket under
  ``_coalescing_manager(intra_group, async_ops=True)``, waited later (``overlap_grad_reduce``);
* Megatron's parameter all-gather inside a worker: ``all_gather_into_tensor`` of every bucket
  (its shard -> the whole bucket) under ``_coalescing_manager(intra_group, async_ops=True)``,
  waited just before the bucket's forward;
* EDiT's layer-wise sync across workers every ``--sync-every`` steps: every bucket's exchange
  launched at once (``all_reduce`` async on the inter-worker group, fp32; or the quantized
  exchange: an async ``all_to_all_single`` of uint8 chunks, then an async
  ``all_gather_into_tensor`` of uint8), the Python references to the send buffers dropped right
  after the launch (only the handles kept), each completed one bucket group at a time while the
  "forward" of the next runs;
* the benchmark's own ``all_reduce`` over the world group (evaluation) while EDiT exchanges
  are still in flight;
* compute between the collectives that allocates and frees memory (so a write into a freed
  block corrupts the allocator's lists, which ``MALLOC_CHECK_=3`` then reports).

Every result is checked against its expected value (the same arithmetic on every rank), so a
tensor overwritten or read while in flight shows up as a wrong number as well as a crash.
Exit 0: no mismatch. Run it many times (scripts/dev/crash_loop.sh, config gloo_stress).
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
import torch.distributed as dist


def _groups(workers: int, size: int, worker: int, me: int):
    """(this rank's worker group, its group across workers); every rank creates every group, in
    the same order."""
    intra = inter = None
    for w in range(workers):
        g = dist.new_group(list(range(w * size, (w + 1) * size)))
        if w == worker:
            intra = g
    for r in range(size):
        g = dist.new_group([w * size + r for w in range(workers)])
        if r == me:
            inter = g
    return intra, inter


def _backward(grads, it: int, rank: int, worker: int, me: int, size: int, shard: int, intra) -> int:
    """"backward": gradients, then the worker's async coalesced reduce-scatter (memory allocated
    and freed while it is in flight); the number of wrong results."""
    bad = 0
    for b, g in enumerate(grads):
        g.fill_(float(rank + b + it % 7))
    junk = [torch.randn(4096 + 37 * (it % 11)) for _ in range(8)]  # allocator churn
    with dist._coalescing_manager(intra, async_ops=True) as cm_rs:
        for g in grads:
            dist.reduce_scatter_tensor(g[me * shard:(me + 1) * shard], g, group=intra, async_op=True)
    del junk
    cm_rs.wait()
    for b, g in enumerate(grads):
        expect = sum(float(worker * size + r + b + it % 7) for r in range(size))
        if not torch.all(g[me * shard:(me + 1) * shard] == expect):
            bad += 1
    return bad


def _launch_exchanges(params, worker: int, shard: int, quantized: int, inter) -> list:
    """EDiT layer-wise: every bucket's exchange launched now, in forward order; the references to
    the send buffers dropped right after each launch (only the handles kept)."""
    handles = []
    for b, prm in enumerate(params):
        delta = torch.full((shard,), float(worker + 1 + b), dtype=torch.float32)
        if quantized:
            send = (delta[: shard].to(torch.uint8)).contiguous()  # a new tensor: only the handle keeps it
            recv = torch.empty_like(send)
            handles.append(("a2a", b, dist.all_to_all_single(recv, send, group=inter, async_op=True), recv))
            del send
        else:
            handles.append(("ar", b, dist.all_reduce(delta, group=inter, async_op=True), delta))
        del delta
    return handles


def _forward(params, handles, it: int, me: int, shard: int, W: int, intra, inter) -> int:
    """"forward": bucket by bucket, complete its exchange (if any), then gather its params, with
    compute while the gather is in flight; the number of wrong results."""
    bad = 0
    cm_ag = None
    for b, prm in enumerate(params):
        if handles:
            kind, hb, h, buf = handles[b]
            h.wait()
            if kind == "a2a":  # step 2 of the quantized exchange: gather the reduced chunk
                own = buf.to(torch.float32).view(W, -1).sum(0)
                data = own.to(torch.uint8)
                gathered = torch.empty(W * data.numel(), dtype=torch.uint8)
                dist.all_gather_into_tensor(gathered, data, group=inter, async_op=True).wait()
                del data
                expect = sum(w + 1 + hb for w in range(W)) % 256
                if not torch.all(gathered == expect):
                    bad += 1
            elif not torch.all(buf == float(sum(w + 1 + hb for w in range(W)))):
                bad += 1
            prm[me * shard:(me + 1) * shard] = float(b + it)  # outer step writes the shard
        if cm_ag is not None:
            cm_ag.wait()
        with dist._coalescing_manager(intra, async_ops=True) as cm_ag:
            dist.all_gather_into_tensor(prm, prm[me * shard:(me + 1) * shard], group=intra, async_op=True)
        x = torch.randn(64, 64) @ torch.randn(64, 64)  # compute while the gather is in flight
        del x
    cm_ag.wait()
    for b, prm in enumerate(params):
        if not torch.all(prm == float(b + it)):
            bad += 1
    return bad


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--buckets", type=int, default=24)
    p.add_argument("--bucket-numel", type=int, default=20000)
    p.add_argument("--sync-every", type=int, default=2)
    p.add_argument("--quantized", type=int, default=1, help="1: all_to_all + all_gather uint8; 0: all_reduce fp32")
    a = p.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames; same calls
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    size = world // a.workers
    worker, me = rank // size, rank % size
    intra, inter = _groups(a.workers, size, worker, me)
    W = a.workers
    numel = a.bucket_numel - a.bucket_numel % (size * W * 4)
    shard = numel // size
    params = [torch.full((numel,), float(b), dtype=torch.float32) for b in range(a.buckets)]
    grads = [torch.zeros(numel) for _ in range(a.buckets)]
    bad = 0
    for it in range(a.iters):
        bad += _backward(grads, it, rank, worker, me, size, shard, intra)
        # "optimizer step": the shard of each bucket's params
        for b, prm in enumerate(params):
            prm[me * shard:(me + 1) * shard] = float(b + it)
        sync = (it + 1) % a.sync_every == 0
        handles = _launch_exchanges(params, worker, shard, a.quantized, inter) if sync else []
        if sync and it % 3 == 0:  # every rank (a collective over the world group)
            t = torch.ones(3, dtype=torch.float64)
            dist.all_reduce(t)  # the benchmark's evaluation / timing figure over the world group
            if not torch.all(t == world):
                bad += 1
        bad += _forward(params, handles, it, me, shard, W, intra, inter)
    flag = torch.tensor([bad], dtype=torch.int64)
    dist.all_reduce(flag)
    if rank == 0:
        print(f"gloo stress: {a.iters} iterations, world {world}, {W} workers, {a.buckets} buckets, "
              f"quantized {a.quantized}: {int(flag.item())} mismatches", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if int(flag.item()) else 0


if __name__ == "__main__":
    sys.exit(main())
