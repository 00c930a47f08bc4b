"""The main job's checkpoints: ``scripts/train_gpt_edit.py --save DIR [--save-interval N]`` and
``--load DIR``.

megatron-core's own ``torch_dist`` checkpoints, written the way Megatron-LM's ``--save`` writes
them (``dist_checkpointing.save`` of the model's and the optimizer's sharded state dicts, one
folder per step, ``latest_checkpointed_iteration.txt`` naming the newest); everything EDiT needs
(each worker's parameters and Adam state, the anchor, the outer optimizer's state, the counters)
rides in the optimizer's sharded state dict (:mod:`megatron_edit.mcore.checkpoint`). A load with
the saved number of workers resumes each worker exactly; with another ``--workers`` it takes one
outer step over the saved workers at load and every worker starts from that model (an elastic
resume, docs/checkpoints.md).

The saving run also writes, at its end, every worker's loss at every step (``losses.json``), so
that a resumed run says in its last line whether it repeated them bit for bit (same workers) or,
elastically, whether every worker started from one model.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from contextlib import contextmanager
from typing import Dict, Optional

TRACKER = "latest_checkpointed_iteration.txt"  # Megatron-LM's name
LOSSES = "losses.json"
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}  # Megatron-LM's default format


@contextmanager
def _quiet():
    """torch's deprecation notices about what megatron-core's dist_checkpointing calls
    (ShardedTensor, load_state_dict): nothing a user of this job can act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning, message=r".*ShardedTensor.*")
        yield


def step_folder(directory: str, step: int) -> str:
    return os.path.join(directory, f"iter_{step:07d}")


def saved_record(directory: str, step: Optional[int] = None) -> Optional[dict]:
    """The record (step, workers, processes, ...) of the checkpoint of ``step`` in ``directory``
    (None: the newest), or None when there is none."""
    try:
        if step is None:
            with open(os.path.join(directory, TRACKER)) as f:
                step = int(f.read().strip())
        with open(os.path.join(step_folder(directory, step), "main_job.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def check(args, fail) -> None:
    """The flags, before anything is imported or started (``fail``: one line, exit code 2)."""
    if args.save_interval is not None and not args.save:
        fail("--save-interval needs --save DIR (where the checkpoints go).")
    if args.ckpt_step is not None and not args.load:
        fail("--ckpt-step needs --load DIR (the checkpoints to choose from).")
    if not (args.save or args.load):
        return
    flag = "--save" if args.save else "--load"
    if args.mode != "edit":
        fail(f"{flag} with --mode {args.mode}: the main job checkpoints its EDiT run (--mode edit, the default).")
    if args.local_sgd_sync_backend == "torchft":
        fail(f"{flag} with --local-sgd-sync-backend torchft: a relaunched torchft worker heals from a live one; "
             "the main job's checkpoints are built for the torch backend.")
    if args.local_sgd_async:
        fail(f"{flag} with --local-sgd-async: not built in the main job (A-EDiT saves at a sync's common "
             "label; Megatron-LM's --save has it).")
    if args.use_megatron_fsdp:
        fail(f"{flag} with --use-megatron-fsdp: not built in the main job (Megatron-FSDP's fsdp_dtensor "
             "checkpoints: scripts/example_checkpoint.py --megatron-fsdp).")
    if args.load:
        record = saved_record(args.load, args.ckpt_step)
        if record is None:
            saved = sorted(int(n[5:]) for n in os.listdir(args.load) if n.startswith("iter_") and n[5:].isdigit()) \
                if os.path.isdir(args.load) else []
            fail(f"--load {args.load}" + (f" --ckpt-step {args.ckpt_step}" if args.ckpt_step is not None else "")
                 + ": no checkpoint of this job's --save there"
                 + (f" (steps saved: {', '.join(map(str, saved))})." if saved else "."))
        if record["step"] >= args.steps:
            fail(f"--load {args.load} holds step {record['step']}: --steps {args.steps} leaves nothing to "
                 "train; raise --steps.")
        if record["seq_length"] != args.seq_length or record["micro_batch_size"] != args.micro_batch_size \
                or record["model"] != model_shape(args):
            fail(f"--load {args.load} was saved with another model or batch ({record['model']}, "
                 f"--seq-length {record['seq_length']}, --micro-batch-size {record['micro_batch_size']}): "
                 "resume with the saved run's model flags.")


def model_shape(args) -> str:
    return (f"--layers {args.layers} --hidden {args.hidden} --heads {args.heads}"
            + (f" --num-experts {args.num_experts}" if args.num_experts else ""))


def _sharded(ddp, optimizer, is_loading=False) -> dict:
    model_sd = ddp.module.sharded_state_dict()
    return {"model": model_sd,
            "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading, metadata=METADATA)}


def save(ddp, optimizer, scheduler, args, step: int, processes: int) -> None:
    """One checkpoint after ``step`` (every rank calls it at the same step)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing

    folder = step_folder(args.save, step)
    if dist.get_rank() == 0:
        os.makedirs(folder, exist_ok=True)
    dist.barrier()
    with _quiet():
        state = _sharded(ddp, optimizer)
        state["scheduler"] = scheduler.state_dict()  # common state (rank 0 writes it)
        dist_checkpointing.save(state, folder)
    if dist.get_rank() == 0:
        record = dict(step=step, workers=args.workers, processes=processes, steps=args.steps, seed=args.seed,
                      seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, model=model_shape(args))
        with open(os.path.join(folder, "main_job.json"), "w") as f:
            json.dump(record, f)
        with open(os.path.join(args.save, TRACKER), "w") as f:
            f.write(str(step))
    dist.barrier()


def load(ddp, optimizer, scheduler, args) -> dict:
    """Model first, then the optimizer (EDiT's state: exact or elastic), then the learning-rate
    schedule, as Megatron-LM loads; returns the saved record."""
    from megatron.core import dist_checkpointing

    record = saved_record(args.load, args.ckpt_step)
    with _quiet():
        state = dist_checkpointing.load(_sharded(ddp, optimizer, is_loading=True),
                                        step_folder(args.load, record["step"]))
        ddp.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state.get("scheduler") or {})
    return record


def model_digest(ddp) -> str:
    """This rank's model parameters, as a digest (every rank of a worker holds them whole)."""
    import torch

    ddp.start_param_sync(force_sync=True)  # the gathered parameters, nothing pending
    flat = torch.cat([p.detach().float().reshape(-1).cpu() for p in ddp.parameters()])
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def all_ranks(value) -> list:
    """``value`` of every rank, on every rank (a collective: every rank at the same point)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def write_losses(args, losses: Dict[int, Dict[int, float]]) -> None:
    """At the end of a saving run: every worker's loss at every step (rank 0)."""
    with open(os.path.join(args.save, LOSSES), "w") as f:
        json.dump(dict(workers=args.workers, steps=args.steps, seed=args.seed,
                       losses={str(s): {str(w): v for w, v in by_worker.items()} for s, by_worker in losses.items()}), f)


def resume_line(args, record: dict, losses: Dict[int, Dict[int, float]], one_model_at_load: bool) -> str:
    """The resumed run's last line: what was resumed and whether it matched."""
    where = f"step {record['step']} of {args.load} ({record['workers']} workers saved, {args.workers} now)"
    if record["workers"] != args.workers:
        return (f"resumed {where} elastically: one outer step over the saved workers at load; every worker "
                f"started from one model: {'yes' if one_model_at_load else 'NO'}")
    try:
        with open(os.path.join(args.load, LOSSES)) as f:
            saved = json.load(f)
    except (OSError, ValueError):
        saved = None
    steps = sorted(losses)
    if not saved or (saved["workers"], saved["steps"], saved["seed"]) != (args.workers, args.steps, args.seed) \
            or not all(str(s) in saved["losses"] for s in steps):
        return (f"resumed {where}: each worker's own state, exactly; not compared (the saving run's losses "
                f"for steps {steps[0]}-{steps[-1]} with these settings are not in {args.load})")
    same = all(saved["losses"][str(s)] == {str(w): v for w, v in losses[s].items()} for s in steps)
    return (f"resumed {where}: steps {steps[0]}-{steps[-1]} repeat the saving run's losses bit for bit: "
            + ("yes" if same else "NO"))
