"""One run of the fault matrix (scripts/fault_matrix.py): EDiT on megatron-core, 2 workers x 2
shards (torchrun --nproc_per_node 4, CPU over gloo), the tiny GPT of scripts/example_checkpoint.py,
with one fault injected.

Checkpoints are kept as Megatron-LM keeps them: ``<dir>/iter_<N>`` written by
``dist_checkpointing.save``, then, once every rank has finished it, rank 0 writes the tracker
``<dir>/latest`` (atomically, by a rename); a resume loads the iteration the tracker names, so a
checkpoint whose save was cut short is never picked.

The last line on rank 0 is ``RESULT <json>``: the losses per step and the final step.
"""

import argparse
import json
import os
import signal
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from example_checkpoint import build, sharded, train_step  # noqa: E402


FAULT_AT = None  # where the faulty rank writes the time of its fault (the matrix measures from it)


def mark():
    import time

    with open(FAULT_AT, "w") as f:
        f.write(repr(time.time()))


def die():
    mark()
    os.kill(os.getpid(), signal.SIGKILL)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--dir", required=True, help="checkpoint folder")
    p.add_argument("--save-interval", type=int, default=0)
    p.add_argument("--load", action="store_true", help="resume from <dir>/latest")
    p.add_argument("--exchange-dtype", default="fp32")
    p.add_argument("--skip-anomaly", action="store_true")
    p.add_argument("--penalty", action="store_true",
                   help="the pseudo-gradient penalty: norm-weighted averaging, anomaly elimination, clipping")
    p.add_argument("--workers", type=int, default=2, help="EDiT workers (4 ranks: 1, 2 or 4)")
    p.add_argument("--edit-log-lines", action="store_true", help="megatron_edit's log lines (INFO) on stderr")
    p.add_argument("--sync-timeout", type=float, default=None)
    p.add_argument("--fault", choices=["none", "kill-between", "kill-exchange", "kill-save", "hang", "nan"],
                   default="none")
    p.add_argument("--fault-rank", type=int, default=1)
    p.add_argument("--fault-step", type=int, default=6)
    args = p.parse_args()
    if args.edit_log_lines:
        import logging

        logging.basicConfig(format="%(message)s")
        logging.getLogger("megatron_edit").setLevel(logging.INFO)
    global FAULT_AT
    FAULT_AT = os.path.join(args.dir, "fault_at")
    warnings.filterwarnings("ignore", category=FutureWarning)
    torch.set_num_threads(1)
    from megatron_edit.cpu import adapter

    adapter.activate()
    dist.init_process_group("gloo")
    import megatron_edit as me
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    rank = dist.get_rank()
    ps.initialize_model_parallel(num_distributed_optimizer_instances=args.workers)
    local = dict(local_sgd_sync_interval=3, local_sgd_warmup_steps=2, sync_timeout=args.sync_timeout)
    if args.exchange_dtype != "fp32":
        local.update(exchange_dtype=args.exchange_dtype, exchange_error_feedback=True, exchange_block_size=64)
    if args.skip_anomaly:
        local.update(skip_anomaly=True, ewma_warmup_steps=100)
    if args.penalty:
        local.update(skip_anomaly=True, ewma_warmup_steps=1, pseudo_gradnorm_reduce=True, clip_pseudo_grad=1.0)
    me.patch_megatron_for_local_sgd(me.LocalSGDConfig(**local), me.OuterOptimizerConfig("sgd", {"lr": 0.8, "momentum": 0.0}))
    ddp, optimizer = build(args.workers)
    (edit,) = me.get_local_sgd(optimizer)
    me.set_train_iters(optimizer, args.steps)
    first = 1
    if args.load:
        with open(os.path.join(args.dir, "latest")) as f:
            first = int(f.read()) + 1
        state = dist_checkpointing.load(sharded(ddp, optimizer, is_loading=True), os.path.join(args.dir, f"iter_{first - 1}"))
        ddp.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    mine = rank == args.fault_rank
    losses = {}
    for step in range(first, args.steps + 1):
        if args.fault == "hang" and mine and step == args.fault_step:
            import time

            mark()
            time.sleep(3600)
        losses[step] = train_step(ddp, optimizer, step)
        if mine and step == args.fault_step:
            if args.fault == "kill-between" or (args.fault == "kill-exchange" and edit.sync_in_progress):
                die()  # kill-exchange: the layer-wise exchange of this sync is launched, in flight
            if args.fault == "nan":
                with torch.no_grad():
                    edit.shards[0].mains[0].view(-1)[0] = float("nan")
        if args.save_interval and step % args.save_interval == 0:
            if args.fault == "kill-save" and mine and step == args.fault_step:
                # killed inside the save: its data written, the checkpoint not finalized
                from megatron.core.dist_checkpointing.strategies import torch as torch_strategy

                torch_strategy.save_state_dict_async_finalize = lambda *a, **k: die()
            path = os.path.join(args.dir, f"iter_{step}")
            os.makedirs(path, exist_ok=True)
            dist_checkpointing.save(sharded(ddp, optimizer), path)
            dist.barrier()
            if rank == 0:  # the tracker, once every rank has saved (Megatron-LM's order)
                with open(os.path.join(args.dir, "latest.tmp"), "w") as f:
                    f.write(str(step))
                os.replace(os.path.join(args.dir, "latest.tmp"), os.path.join(args.dir, "latest"))
    ddp.start_param_sync(force_sync=True)
    params = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    if rank == 0:
        print("RESULT " + json.dumps(dict(losses=losses, last=args.steps, finite=bool(torch.isfinite(params).all()),
                                          workers=edit.num_workers,
                                          reports=[(r.step, None if r.excluded is None else r.excluded.tolist())
                                                   for r in edit.drain_reports()])), flush=True)
    me.unpatch_megatron_for_local_sgd()
    dist.destroy_process_group()


if __name__ == "__main__":
    from megatron_edit.arguments import end_rank

    try:
        main()
    except BaseException as error:  # noqa: B036  (an erroring rank: no teardown of live gloo groups)
        end_rank(error)
