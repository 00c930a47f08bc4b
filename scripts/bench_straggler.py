"""Straggler benchmark: one worker is slowed by a fixed delay per step.

    torchrun --nproc_per_node 4 scripts/bench_straggler.py [--delay 0.15] [--syncs 4]

Three runs on the same small GPT (2 workers x 2 shards, CPU, gloo), worker 1 sleeping
``--delay`` seconds per step:
  synchronous  ordinary Megatron training: every step waits for the slow worker;
  EDiT         sync every H steps: the fast worker still waits for the slow one at each sync;
  A-EDiT       sync every T seconds: the fast worker keeps training in the meantime.
Prints steps per worker between syncs and total tokens/s (ratio against synchronous), and checks
that the replicas are identical after the last sync (parameter checksums across workers).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train_gpt_edit as job  # noqa: E402  (the main job's model, data and step)
from megatron_edit.cpu import adapter as cpu_adapter  # noqa: E402


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--delay", type=float, default=0.15, help="extra seconds per step on worker 1")
    parser.add_argument("--syncs", type=int, default=4, help="syncs per EDiT / A-EDiT run")
    parser.add_argument("--interval", type=int, default=8, help="H of EDiT (and A-EDiT's first interval)")
    parser.add_argument("--sync-time", type=float, default=2.0, help="T of A-EDiT, seconds")
    args, rest = parser.parse_known_args()
    base = job.parse_args(rest + ["--steps", "100000"])  # the scheduler's horizon, not a run length
    for k, v in vars(args).items():
        setattr(base, k, v)
    return base


def run(args, mode, datasets):
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    import megatron_edit
    from megatron_edit.config import LocalSGDConfig
    from megatron_edit.cpu import data

    args.use_local_sgd = mode != "synchronous"
    args.local_sgd_async = mode == "A-EDiT"
    args.local_sgd_sync_interval = args.interval
    args.local_sgd_warmup_steps = 0
    # A-EDiT's flags only with A-EDiT (elsewhere they would do nothing, and are refused).
    default = LocalSGDConfig()
    args.local_sgd_sync_time = args.sync_time if args.local_sgd_async else default.local_sgd_sync_time
    args.local_sgd_min_total_global_steps = 1 if args.local_sgd_async else default.min_total_global_steps
    ddp, optimizer, scheduler = job.build(args, args.use_local_sgd)
    controllers = megatron_edit.get_local_sgd(optimizer)
    dp_rank, dp = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    worker = dp_rank // (dp // args.workers)
    it = data.batch_iterator(datasets[0], args.micro_batch_size, start=dp_rank, stride=dp)
    steps, reports = 0, []
    target_steps = args.syncs * args.interval  # synchronous and EDiT: the same number of steps
    dist.barrier()
    t0 = time.perf_counter()
    while True:
        if mode == "A-EDiT":
            if len(reports) + controllers[0].sync_in_progress >= args.syncs:
                break
        elif steps >= target_steps:
            break
        if worker == 1:
            time.sleep(args.delay)
        ddp.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(
            forward_step_func=job.forward_step, data_iterator=iter([next(it)]), model=[ddp], num_microbatches=1,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, forward_only=False,
        )
        optimizer.step()
        scheduler.step(1)
        steps += 1
        reports += [r for c in controllers for r in c.drain_reports()]
    ddp.start_param_sync(force_sync=True)  # completes a pending layer-wise sync
    reports += [r for c in controllers for r in c.drain_reports()]
    elapsed = time.perf_counter() - t0
    # Totals over all ranks (after the run: not part of the measured time).
    tokens = torch.tensor([steps * args.micro_batch_size * args.seq_length], dtype=torch.float64)
    dist.all_reduce(tokens)
    wall = torch.tensor([elapsed], dtype=torch.float64)
    dist.all_reduce(wall, op=dist.ReduceOp.MAX)
    per_worker = torch.zeros(args.workers, dtype=torch.float64)
    per_worker[worker] = steps
    dist.all_reduce(per_worker, op=dist.ReduceOp.MAX)
    checksum = torch.tensor([float(sum(p.detach().double().sum() for p in ddp.parameters()))], dtype=torch.float64)
    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(sums, checksum)
    intra = dp // args.workers
    same = all(sums[r].item() == sums[r % intra].item() for r in range(dist.get_world_size()))
    between = [r.worker_steps.tolist() for r in reports if r.worker_steps is not None]
    return dict(mode=mode, tokens_per_s=tokens.item() / wall.item(), steps=per_worker.tolist(),
                wall=wall.item(), identical=same, between=between, syncs=len(reports))


def main():
    args = parse_args()
    torch.set_num_threads(1)
    cpu_adapter.activate()
    dist.init_process_group("gloo")
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=args.workers)
    prefix = os.path.join(args.data_dir, "stdlib_docs")
    os.makedirs(args.data_dir, exist_ok=True)
    from megatron_edit.cpu import data

    data.prepare_indexed_dataset(prefix)
    datasets = data.build_gpt_datasets(prefix, args.seq_length, (20000, 64, 0), args.seed)[:2]
    results = [run(args, mode, datasets) for mode in ("synchronous", "EDiT", "A-EDiT")]
    if dist.get_rank() == 0:
        print(f"\nstraggler benchmark: worker 1 sleeps {args.delay} s per step; EDiT H={args.interval}, "
              f"A-EDiT T={args.sync_time} s; {args.syncs} syncs")
        print(f"{'run':12s} {'tokens/s':>10s} {'vs sync':>8s} {'steps w0/w1':>12s} {'wall s':>7s} "
              f"{'syncs':>5s} {'replicas equal':>14s}  steps per worker between syncs")
        base = results[0]["tokens_per_s"]
        for r in results:
            steps = "/".join(str(int(s)) for s in r["steps"])
            between = " ".join("/".join(str(int(x)) for x in b) for b in r["between"]) or "-"
            print(f"{r['mode']:12s} {r['tokens_per_s']:10.0f} {r['tokens_per_s'] / base:8.2f} {steps:>12s} "
                  f"{r['wall']:7.1f} {r['syncs']:5d} {str(r['identical']):>14s}  {between}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
