"""Training runs for the GPU lane: real megatron-core on CUDA (NCCL), inside ``dist.run_ranks``
ranks started with ``device="cuda"``. The tiny GPT of gpt_utils, in fp32 or bf16 (Megatron's
Float16Module), DDP with the distributed optimizer, EDiT when the spec has a ``local_sgd``."""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from gpt_utils import build_tiny_gpt, make_batches, named_params, rank_micro_batches, train_step, wrap_ddp

LR = 1e-2


def spec(**overrides) -> dict:
    out = dict(steps=9, local_sgd=None, outer=None, gta=None, bf16=False, workers=1, bucket_size=3000,
               overlap_param_gather=True, sync_debug=False, save_at=None, save_dir=None, load=None)
    out.update(overrides)
    return out


def _build(s):
    import megatron_edit as me
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    if s["local_sgd"] is not None:
        me.patch_megatron_for_local_sgd(
            me.LocalSGDConfig(**s["local_sgd"]),
            me.OuterOptimizerConfig(**s["outer"]) if s["outer"] else me.OuterOptimizerConfig(),
            me.GTAConfig(**s["gta"]) if s["gta"] else None,
        )
    else:
        me.unpatch_megatron_for_local_sgd()
    overrides = dict(bf16=True, params_dtype=torch.bfloat16) if s["bf16"] else {}
    model = build_tiny_gpt(**overrides).cuda()
    if s["bf16"]:
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(model.config, model)
    ddp = wrap_ddp(model, use_distributed_optimizer=True, overlap_grad_reduce=True,
                   overlap_param_gather=s["overlap_param_gather"],
                   num_distributed_optimizer_instances=s["workers"], bucket_size=s["bucket_size"])
    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=0.0, bf16=s["bf16"],
                             use_distributed_optimizer=True)
    return ddp, get_megatron_optimizer(config, [ddp])


@contextmanager
def _no_host_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _guard(controller):
    """Every EDiT hook runs with CUDA's sync debug mode at "error": a host-device
    synchronisation inside one raises."""
    for name in ("begin_step", "end_step", "after_inner_update", "before_param_gather"):
        original = getattr(controller, name)

        def guarded(*args, _original=original, **kwargs):
            with _no_host_sync():
                return _original(*args, **kwargs)

        setattr(controller, name, guarded)


def _save(ddp, opt, path):
    import multiprocessing

    from megatron.core import dist_checkpointing

    os.makedirs(path, exist_ok=True)
    model = ddp.module.sharded_state_dict()
    state = {"model": model, "optimizer": opt.sharded_state_dict(
        model, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}
    config = multiprocessing.current_process()._config  # the writer starts helper processes
    was, config["daemon"] = config.get("daemon"), False
    try:
        dist_checkpointing.save(state, path)
    finally:
        config["daemon"] = was


def _load(ddp, opt, path):
    from megatron.core import dist_checkpointing

    model = ddp.module.sharded_state_dict()
    sharded = {"model": model, "optimizer": opt.sharded_state_dict(
        model, is_loading=True, metadata={"distrib_optim_sharding_type": "dp_reshardable"})}
    state = dist_checkpointing.load(sharded, path)
    ddp.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])


def cuda_train(rank, world_size, s):
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=s["workers"])
    ddp, opt = _build(s)
    controllers = me.get_local_sgd(opt)
    if controllers and s["sync_debug"]:
        _guard(controllers[0])
    first = 1
    if s["load"]:
        path, step = s["load"]
        _load(ddp, opt, path)
        first = step + 1
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = make_batches(s["steps"], dp * 2, seed=0)
    losses = []
    for step in range(first, s["steps"] + 1):
        micro = rank_micro_batches(batches[step - 1], dp_rank, dp).cuda()
        losses.append(train_step(ddp, opt, micro))
        if step == s["save_at"]:
            _save(ddp, opt, s["save_dir"])
    ddp.start_param_sync(force_sync=True)  # completes a pending layer-wise sync
    torch.cuda.synchronize()
    out = dict(losses=losses, params={k: v.cpu() for k, v in named_params(ddp).items()})
    if controllers:
        c = controllers[0]
        c.outer_state.synchronize()
        out.update(
            reports=c.drain_reports(),
            anchors=[None if sh.anchor is None else sh.anchor.cpu().clone() for sh in c.shards],
            anchor_devices=sorted({str(sh.anchor.device) for sh in c.shards if sh.anchor is not None}),
            anchor_pinned=all(sh.anchor.is_pinned() for sh in c.shards if sh.anchor is not None and sh.anchor.device.type == "cpu"),
            state_bytes=c.state_bytes(),
            fused=c.outer_state.fused,
        )
    me.unpatch_megatron_for_local_sgd()
    return out
