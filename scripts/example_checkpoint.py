"""Save and resume EDiT with megatron-core alone (no Megatron-LM): the example README.md points to.

    torchrun --nproc_per_node 4 scripts/example_checkpoint.py [--dir /tmp/edit_ckpt] [--megatron-fsdp]

2 workers x 2 shards (4 processes, CPU over gloo here; on GPUs drop the CPU adapter and use
NCCL). A tiny GPT trains 10 steps with EDiT (warmup 2, H 3: syncs after steps 5 and 8); at step
7, between two syncs, it is saved the way Megatron-LM's ``--save`` saves it:

    dist_checkpointing.save({"model": model_sd,
                             "optimizer": optimizer.sharded_state_dict(model_sd, metadata=...)}, dir)

Everything EDiT needs (each worker's own parameters and Adam state, the anchor, the outer
momentum, the counters) rides in the optimizer's sharded state dict: no extra call. A new model
and optimizer then load it (model first, then the optimizer, as Megatron-LM does) and train
steps 8-10; the losses equal the uninterrupted run's bit for bit, which the script checks.

``--megatron-fsdp``: the same on Megatron-FSDP in HSDP (megatron-core 0.16.1), saved in its own
format (``fsdp_dtensor``) with torch.distributed.checkpoint, as Megatron-LM's ``--ckpt-format
fsdp_dtensor`` saves it (docs/concepts/megatron-fsdp.md).
"""

import argparse
import os
import shutil
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

SEQ, VOCAB, STEPS, SAVE_AT = 16, 64, 10, 7
METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}  # Megatron-LM's default format


FSDP_METADATA = {"distrib_optim_sharding_type": "fsdp_dtensor"}  # Megatron-FSDP's own format


def build(workers=2, fsdp=False):
    """Model in Megatron's DDP (or Megatron-FSDP in HSDP) and its distributed optimizer (built
    after the patch)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    model_parallel_cuda_manual_seed(1234)
    torch.manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, hidden_dropout=0.0,
                               attention_dropout=0.0, use_cpu_initialization=True)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    if fsdp:  # fully sharded inside a worker, replicated across workers; gloo has no PREMUL_SUM
        from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

        ddp_config = DistributedDataParallelConfig(
            use_megatron_fsdp=True, data_parallel_sharding_strategy="optim_grads_params",
            num_distributed_optimizer_instances=workers, overlap_grad_reduce=True, overlap_param_gather=True,
            grad_reduce_in_fp32=True, gradient_reduce_div_fusion=torch.cuda.is_available(),
            suggested_communication_unit_size=25_000)  # about two layers: a layer-wise sync overlaps
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
        ddp = FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=model, device=device)
    else:
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True,
                                                   overlap_param_gather=True,
                                                   num_distributed_optimizer_instances=workers)
        ddp = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
    config.no_sync_func, config.finalize_model_grads_func = ddp.no_sync, finalize_model_grads
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, clip_grad=0.0, use_distributed_optimizer=True), [ddp])
    return ddp, optimizer


def train_step(ddp, optimizer, step: int) -> float:
    """One step on this rank's 2 samples of a fixed global batch (the same in every run)."""
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    tokens = torch.randint(0, VOCAB, (8, SEQ + 1), generator=torch.Generator().manual_seed(step))
    rank = ps.get_data_parallel_rank()
    mine = tokens[2 * rank: 2 * rank + 2]

    def forward_step(data, model):
        batch = next(data)
        positions = torch.arange(SEQ).unsqueeze(0).expand(batch.shape[0], SEQ)
        out = model(input_ids=batch[:, :-1], position_ids=positions, attention_mask=None, labels=batch[:, 1:])
        return out, lambda per_token: (per_token.float().mean(), {"loss": per_token.float().mean().detach().clone()})

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    losses = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter([mine]), model=[ddp],
                                         num_microbatches=1, seq_length=SEQ, micro_batch_size=2, forward_only=False)
    optimizer.step()
    return losses[0]["loss"].item()


def sharded(ddp, optimizer, is_loading=False):
    model_sd = ddp.module.sharded_state_dict()
    return {"model": model_sd, "optimizer": optimizer.sharded_state_dict(model_sd, is_loading=is_loading,
                                                                          metadata=METADATA)}


def fsdp_state(ddp, optimizer, is_loading=False):
    """Megatron-FSDP: the DTensor state dict torch.distributed.checkpoint saves and loads (the
    optimizer is given the dict holding the model's, as Megatron-LM gives it)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    state = {"model": ddp.state_dict()}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=is_loading, metadata=FSDP_METADATA)
    preprocess_state_dict_for_uneven_dtensor(state)  # Megatron-FSDP's own requirement
    return state


def save(ddp, optimizer, path, fsdp):
    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    if fsdp:
        dist.barrier()  # every rank sees the folder before DCP writes into it
        dcp.save(fsdp_state(ddp, optimizer), checkpoint_id=path)
    else:
        dist_checkpointing.save(sharded(ddp, optimizer), path)


def load(ddp, optimizer, path, fsdp):
    """Model first, then the optimizer, as Megatron-LM does."""
    from megatron.core import dist_checkpointing

    if fsdp:
        state = fsdp_state(ddp, optimizer, is_loading=True)
        dcp.load(state, checkpoint_id=path)  # fitted to the checkpoint by megatron_edit
        ddp.module.load_state_dict(state["model"])
    else:
        state = dist_checkpointing.load(sharded(ddp, optimizer, is_loading=True), path)
        ddp.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", default=None, help="checkpoint folder (default: a temporary one)")
    parser.add_argument("--megatron-fsdp", action="store_true",
                        help="Megatron-FSDP in HSDP and its fsdp_dtensor checkpoints (megatron-core 0.16.1)")
    args = parser.parse_args()
    fsdp = args.megatron_fsdp
    # torch's deprecation notices about what megatron-core calls (ShardedTensor in every save and
    # load, all_gather_into_tensor in the parameter gather), megatron-core's notes that Transformer
    # Engine / Apex are absent (never there on a CPU), its own deprecation of a default it sets
    # itself and its read of a non-leaf .grad on the CPU: nothing to act on here
    from megatron_edit.launch import quiet_upstream_warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    quiet_upstream_warnings(cpu=not torch.cuda.is_available())
    warnings.filterwarnings("ignore", category=UserWarning, message=r"full scope is deprecated")
    warnings.filterwarnings("ignore", category=UserWarning, message=r"The \.grad attribute of a Tensor that is not a leaf")
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        from megatron_edit.cpu import adapter

        adapter.activate()  # megatron-core on CPU (never on a GPU)
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)  # 2 workers x 2 shards
    me.patch_megatron_for_local_sgd(
        me.LocalSGDConfig(local_sgd_sync_interval=3, local_sgd_warmup_steps=2),
        me.OuterOptimizerConfig("sgd", {"lr": 0.8, "momentum": 0.0}),
    )
    path = args.dir or os.path.join(tempfile.gettempdir(), "megatron_edit_example_ckpt")
    if args.dir is None and dist.get_rank() == 0:  # the example's own folder: a rerun starts afresh
        shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    ddp, optimizer = build(fsdp=fsdp)
    me.set_train_iters(optimizer, STEPS)  # the run's length: its last step is a sync (one model at the end)
    uninterrupted = {}
    for step in range(1, STEPS + 1):
        uninterrupted[step] = train_step(ddp, optimizer, step)
        if step == SAVE_AT:  # between syncs: each worker's own state is saved as it is
            save(ddp, optimizer, path, fsdp)

    ddp, optimizer = build(fsdp=fsdp)  # a fresh model and optimizer, as a restarted job would build
    me.set_train_iters(optimizer, STEPS)
    load(ddp, optimizer, path, fsdp)
    (edit,) = me.get_local_sgd(optimizer)
    resumed = {step: train_step(ddp, optimizer, step) for step in range(SAVE_AT + 1, STEPS + 1)}
    same = all(resumed[s] == uninterrupted[s] for s in resumed)
    if dist.get_rank() == 0:
        print(f"saved at step {SAVE_AT} to {path}; resumed at step {edit.steps_done - (STEPS - SAVE_AT)} "
              f"with {edit.num_workers} workers")
        for s in resumed:
            print(f"step {s}: loss {uninterrupted[s]:.6f} uninterrupted, {resumed[s]:.6f} resumed")
        print("resume exact: " + ("yes" if same else "NO"))
    me.unpatch_megatron_for_local_sgd()
    dist.destroy_process_group()
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
