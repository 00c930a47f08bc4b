"""The smallest reproducer of issue 62's native crash: torch's gloo process group, nothing else.

    LD_PRELOAD=libc_malloc_debug.so.0 MALLOC_CHECK_=3 PYTHONFAULTHANDLER=1 \\
        torchrun --nproc_per_node 2 scripts/dev/repro_gloo_crash.py --iters 6000 [--one-thread]

Each iteration launches ``--in-flight`` coalesced all-gathers on the default group (what
Megatron's overlapped parameter all-gather does, ``_coalescing_manager`` ->
``allgather_into_tensor_coalesced``, op ``ALLGATHER_COALESCED``), waits for them, and checks
the numbers. With torch's default of two worker threads per gloo group, two of them finish
together, and both threads assign the group's ``lastCompletedWorkName`` without a lock
(``ProcessGroupGloo::runLoop``). The 19-character name lives on the heap, so its buffer is freed
twice: glibc aborts with ``free(): invalid pointer`` (exit -6). Without the malloc check, a
later allocation may crash instead (SIGSEGV). Measured here (torch 2.13.0+cpu, 2 ranks on 2
cores): see ``scripts/bench/results/native_crash.md``, round 8.

``--one-thread``: the same run with the way around it that megatron_edit's CPU adapter installs
(:mod:`megatron_edit.cpu.gloo_threads`: one worker thread per gloo group). It never crashes.

Exit 0: no crash, every number right. Upstream: pytorch/pytorch,
``torch/csrc/distributed/c10d/ProcessGroupGloo.cpp``.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings

import torch
import torch.distributed as dist


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--iters", type=int, default=6000)
    p.add_argument("--in-flight", type=int, default=8, help="coalesced all-gathers launched before the waits")
    p.add_argument("--numel", type=int, default=4, help="elements each rank contributes")
    p.add_argument("--one-thread", action="store_true", help="one worker thread per gloo group (the way around)")
    a = p.parse_args()
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames; same calls
    torch.set_num_threads(1)
    if a.one_thread:
        import torch.distributed.distributed_c10d as c10d
        from megatron_edit.cpu.gloo_threads import OneThreadGloo

        c10d.ProcessGroupGloo = OneThreadGloo(c10d.ProcessGroupGloo)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    threads = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu")).options._threads
    outs = [torch.empty(world * a.numel) for _ in range(a.in_flight)]
    expect = torch.arange(world, dtype=torch.float32).repeat_interleave(a.numel)
    bad, start = 0, time.monotonic()
    for it in range(a.iters):
        mine = torch.full((a.numel,), float(rank))
        handles = []
        for out in outs:
            with dist._coalescing_manager(async_ops=True) as cm:
                dist.all_gather_into_tensor(out, mine, async_op=True)
            handles.append(cm)
        for handle in handles:
            handle.wait()
        bad += sum(not torch.equal(out, expect) for out in outs)
    if rank == 0:
        print(f"{a.iters} iterations x {a.in_flight} coalesced all-gathers, {threads} gloo worker thread(s): "
              f"{bad} wrong results, {time.monotonic() - start:.1f} s", flush=True)
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
