"""Training runs for the EDiT tests: real megatron-core on CPU/gloo, and the plain-PyTorch
simulation of the algorithm they are checked against.

``megatron_runs`` runs inside every rank of a ``dist.run_ranks`` job: it sets up Megatron's
parallel state once, then trains one model per spec (EDiT when the spec has a ``local_sgd``
config, otherwise plain Megatron with the patches removed) on the same data, and returns what
the tests compare. ``simulate_edit`` is an independent implementation of EDiT in plain PyTorch
(one model copy and one AdamW per worker, no Megatron optimizer, no DDP).
"""

from __future__ import annotations

import inspect
import os
import signal
from typing import Dict, List

import torch

from gpt_utils import (
    VOCAB_SIZE,
    SEQ_LENGTH,
    build_tiny_gpt,
    gpt_inputs,
    make_batches,
    named_params,
    rank_micro_batches,
    reinit_by_global_name,
    tiny_gpt_config,
    train_step,
    wrap_ddp,
)

LR = 1e-2
MICRO_BATCH = 2


def _on_fsdp_release():
    import pytest

    from megatron_edit.mcore import compat
    from megatron_edit.mcore.releases import FSDP_SUPPORTED

    return pytest.mark.skipif(
        not FSDP_SUPPORTED.contains(compat.megatron_core_version()),
        reason=f"EDiT on Megatron-FSDP is checked on megatron-core {FSDP_SUPPORTED} only (refused elsewhere)")


ON_FSDP_RELEASE = _on_fsdp_release()
"""Marks a test of EDiT on Megatron-FSDP (``spec["fsdp"]``): skipped where it is refused."""


def _on_expert_parallel_fsdp():
    import pytest

    from megatron_edit.mcore import compat
    from megatron_edit.mcore.releases import FSDP_EXPERT_PARALLEL

    return pytest.mark.skipif(
        not FSDP_EXPERT_PARALLEL.contains(compat.megatron_core_version()),
        reason=f"Megatron-FSDP's HSDP has expert parallelism on megatron-core {FSDP_EXPERT_PARALLEL} "
               "(refused elsewhere)")


ON_EXPERT_PARALLEL_FSDP = _on_expert_parallel_fsdp()
"""Marks a test of EDiT on Megatron-FSDP with expert parallelism > 1: skipped where it is refused."""

FSDP_MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", add_bias_linear=False)
"""The MoE GPT of the Megatron-FSDP tests (as tests/mcore/test_moe.py's: 4 experts, top-2)."""


def default_spec(**overrides) -> dict:
    spec = dict(
        steps=8,
        local_sgd=None,  # dict of LocalSGDConfig fields, or None for plain Megatron
        outer=None,  # dict of OuterOptimizerConfig fields
        instances=2,  # Megatron's num_distributed_optimizer_instances (the EDiT workers)
        bucket_size=3000,  # small: several buckets per model
        overlap_param_gather=True,
        snapshot_every_step=False,
        traffic=False,
        data_seed=0,
    )
    spec.update(overrides)
    return spec


def _optimizer(ddp, loss_scale=None):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    # loss_scale: Megatron's constant grad scaler, whose inf / nan check skips a step as fp16's
    # dynamic one does (the loss itself is not scaled here: the scale is for the check only)
    config = OptimizerConfig(
        optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=True,
        loss_scale=loss_scale,
    )
    return get_megatron_optimizer(config, [ddp])


def _build(spec, tp, pp):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    if pp == 1:
        model = build_tiny_gpt(**spec.get("model", {}))
        if spec.get("model"):  # (MoE) weights independent of the tensor / expert layout
            reinit_by_global_name(model)
    else:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
        torch.manual_seed(1234)
        model = GPTModel(
            config=tiny_gpt_config(pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32),
            transformer_layer_spec=get_gpt_layer_local_spec(),
            vocab_size=VOCAB_SIZE,
            max_sequence_length=SEQ_LENGTH,
            pre_process=ps.is_pipeline_first_stage(),
            post_process=ps.is_pipeline_last_stage(),
            share_embeddings_and_output_weights=spec.get("tied", False),
        )
    if spec.get("fsdp"):
        ddp = wrap_megatron_fsdp(model, spec)
        return ddp, _optimizer(ddp)
    ddp = wrap_ddp(
        model,
        use_distributed_optimizer=True,
        overlap_grad_reduce=True,
        overlap_param_gather=spec["overlap_param_gather"],
        num_distributed_optimizer_instances=spec["instances"],
        bucket_size=spec["bucket_size"],
    )
    return ddp, _optimizer(ddp, spec.get("loss_scale"))


def wrap_megatron_fsdp(model, spec):
    """Megatron-FSDP in HSDP (``spec["instances"]`` instances, outer ``no_shard``), fully sharded
    inside an instance, wired into the model config as Megatron-LM does; on CPU: gloo has no
    PREMUL_SUM (``gradient_reduce_div_fusion=False``) and the device is given. The
    communication unit is small (``spec["fsdp_unit"]``, 2 elements by default), as for a model
    of many large layers: the prefetch window holds one bucket (with none given, megatron-core
    0.16.1 makes it 500M elements, and a model smaller than that is gathered whole at the end of
    each step, so a layer-wise sync would complete there)."""
    from megatron.core.distributed import DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    ddp_config = DistributedDataParallelConfig(
        use_megatron_fsdp=True,
        data_parallel_sharding_strategy=spec.get("sharding", "optim_grads_params"),
        num_distributed_optimizer_instances=spec["instances"],
        outer_dp_sharding_strategy=spec.get("outer_sharding", "no_shard"),
        overlap_grad_reduce=True,
        overlap_param_gather=spec["overlap_param_gather"],
        grad_reduce_in_fp32=True,
        gradient_reduce_div_fusion=False,
        bucket_size=spec["bucket_size"],
        suggested_communication_unit_size=spec.get("fsdp_unit", 2),
    )
    fsdp = FullyShardedDataParallel(config=model.config, ddp_config=ddp_config, module=model,
                                    device=torch.device("cpu"))
    model.config.no_sync_func = fsdp.no_sync
    model.config.finalize_model_grads_func = finalize_model_grads
    return fsdp


def full_params(ddp) -> dict:
    """``{name: detached copy}`` of the whole model's parameters; Megatron-FSDP's are gathered
    inside the worker first (completing a pending layer-wise sync, as the next forward would)."""
    if hasattr(ddp.module, "param_and_grad_buffer"):  # Megatron-FSDP: ddp.module is MegatronFSDP
        ddp.start_param_sync(force_sync=True)  # the raw parameters now view gathered buckets
        return {name: p.detach().clone() for name, p in ddp.module.raw_param.items()}
    return named_params(ddp)


class TrafficLog:
    """Records every collective whose group spans more than one EDiT worker (those of
    ``NAMES`` this torch has: ``all_gather_single`` is the quantized exchange's all-gather), and
    the bytes this rank put on the wire for it (``sent``: (phase, bytes), a ring's: an all-reduce
    of S bytes over W ranks sends 2 (W - 1) / W x S, an all-gather of S per rank (W - 1) x S, an
    all-to-all of S (W - 1) / W x S), counted from the tensors handed to torch.distributed."""

    NAMES = ("all_reduce", "all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "broadcast",
             "all_gather", "reduce_scatter", "send", "recv", "isend", "irecv", "barrier", "all_to_all_single")

    def __init__(self, worker_of_rank: Dict[int, int]):
        import megatron.core.distributed.param_and_grad_buffer as pgb
        import torch.distributed as dist

        self.worker_of_rank = worker_of_rank
        self.events: List[tuple] = []
        self.sent: List[tuple] = []
        self.phase = "setup"
        self._saved = []
        for name in self.NAMES:
            if hasattr(dist, name):
                self._wrap(dist, name)
        for name in ("dist_all_gather_func", "dist_reduce_scatter_func"):
            self._wrap(pgb, name)

    def _wrap(self, owner, name):
        import torch.distributed as dist

        original = getattr(owner, name)
        log = self

        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
            if len({log.worker_of_rank[r] for r in ranks}) > 1 and name != "send" and name != "recv":
                tensor = args[0] if args and torch.is_tensor(args[0]) else kwargs.get("tensor")
                if name == "all_gather" and len(args) > 1 and torch.is_tensor(args[1]):
                    tensor = args[1]  # all_gather(output list, tensor): what this rank sends
                numel = tensor.numel() if torch.is_tensor(tensor) else -1
                log.events.append((log.phase, name, tuple(ranks), numel))
                log.sent.append((log.phase, _ring_bytes(name, args, len(ranks))))
            return original(*args, **kwargs)

        self._saved.append((owner, name, original))
        setattr(owner, name, wrapper)

    def close(self):
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)


def _ring_bytes(name, args, ranks) -> int:
    """The bytes this rank sends in collective ``name`` called with ``args`` over ``ranks`` ranks
    (see :class:`TrafficLog`); -1 for a collective an EDiT sync does not use."""
    if name == "all_reduce":
        return 2 * (ranks - 1) * args[0].numel() * args[0].element_size() // ranks
    sent = args[1] if len(args) > 1 and torch.is_tensor(args[1]) else None  # (output, input)
    if sent is None:
        return -1
    size = sent.numel() * sent.element_size()
    if name in ("all_gather_into_tensor", "all_gather_single", "all_gather"):
        return (ranks - 1) * size
    return (ranks - 1) * size // ranks if name == "all_to_all_single" else -1


def _train(rank, spec, tp, pp):
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    if spec["local_sgd"] is not None:
        me.patch_megatron_for_local_sgd(
            me.LocalSGDConfig(**spec["local_sgd"]),
            me.OuterOptimizerConfig(**spec["outer"]) if spec["outer"] else me.OuterOptimizerConfig(),
            me.GTAConfig(**spec["gta"]) if spec.get("gta") else None,
        )
    else:
        me.unpatch_megatron_for_local_sgd()
    ddp, optimizer = _build(spec, tp, pp)

    dp = ps.get_data_parallel_world_size()
    dp_rank = ps.get_data_parallel_rank()
    num_mb = 2 if pp > 1 else 1
    # data_dp: how many data-parallel ranks the data is cut for (a smaller job can replay the
    # micro-batches of the first ranks of a larger one).
    data_dp = spec.get("data_dp") or dp
    batches = make_batches(spec["steps"], data_dp * MICRO_BATCH * num_mb, seed=spec["data_seed"])
    worker_size = dp // spec["instances"]
    traffic = None
    if spec["traffic"]:
        world = torch.distributed.get_world_size()
        # Instances are contiguous blocks of the data-parallel group; map global ranks to them.
        dp_ranks = torch.tensor([dp_rank])
        all_dp = [torch.zeros(1, dtype=torch.long) for _ in range(world)]
        torch.distributed.all_gather(all_dp, dp_ranks)
        traffic = TrafficLog({r: int(all_dp[r]) // worker_size for r in range(world)})

    out = dict(losses=[], snapshots={}, dp_rank=dp_rank, tp_rank=ps.get_tensor_model_parallel_rank(),
               pp_rank=ps.get_pipeline_model_parallel_rank(), worker=dp_rank // worker_size,
               ep_rank=ps.get_expert_model_parallel_rank())
    controllers = me.get_local_sgd(optimizer)
    _inject_measurements(controllers, spec, rank)
    if controllers and spec.get("record_sync_starts"):
        # At the start of every sync (after the inner step, before anything is exchanged; a
        # blocking sync too): each shard's anchor, this worker's parameters and its residual.
        sync, starts = controllers[0].sync, out.setdefault("sync_starts", {})
        original_start = sync.start

        def recording_start(step, *args, **kwargs):
            starts[step] = dict(
                anchor=[s.anchor.clone() for s in sync.shards],
                mains=[s.read_current(torch.empty(s.numel)) for s in sync.shards],
                residual=[None if s.residual is None else s.residual.clone() for s in sync.shards])
            return original_start(step, *args, **kwargs)

        sync.start = recording_start
    if controllers and spec.get("last_step"):
        me.set_train_iters(optimizer, spec["last_step"])  # as Megatron-LM's --train-iters says it
    for step in range(1, spec["steps"] + 1):
        if traffic:
            traffic.phase = f"step {step}"
        # data_rank_offset: a worker's own job (the torchft backend) replays the micro-batches of
        # its ranks in the one-world run.
        micro = rank_micro_batches(batches[step - 1], dp_rank + spec.get("data_rank_offset", 0), data_dp,
                                   num_microbatches=num_mb)
        # inf_grads={step: [global ranks]}: an inf in those ranks' gradients before the optimizer
        # step (with a loss_scale the worker's optimizer skips the step)
        poisoned = rank in spec.get("inf_grads", {}).get(step, ())
        out["losses"].append(train_step(
            ddp, optimizer, micro, skipped=out.setdefault("skipped", []) if spec.get("loss_scale") else None,
            before_step=(lambda: [b.grad_data.fill_(float("inf")) for b in ddp.buffers]) if poisoned else None))
        if spec.get("faults") and controllers:
            # The same corruption as the simulation, applied to this rank's fp32 main shards.
            _inject_fault(spec, step, out["worker"], [m for sh in controllers[0].shards for m in sh.mains])
            hit = any(step in f["steps"] and out["worker"] in f["workers"] for f in spec["faults"])
            if spec.get("fsdp") and hit:
                # Megatron-FSDP's model weights are a copy of the mains (DDP's fp32 mains are the
                # model): install the corrupted mains, as the next step's forward would see them
                # (after the step's prefetch, which reads the model weights, is waited for).
                ddp.module.synchronize_param_gather()
                ddp.module.install_optimized_model_weights()
                ddp.module.start_param_sync()
        if traffic:
            traffic.phase = f"after step {step}"
        if step == spec.get("anchor_params_at_step"):
            out["anchor_params"] = full_params(ddp)
        if step == spec.get("presync_params_at_step"):
            # With shard size 1 a pending layer-wise sync has not touched the model yet: these
            # are the worker's own parameters after its inner step, before the sync.
            out["presync"] = named_params(ddp)
        if controllers and step == spec.get("record_anchor_at_step"):
            out["anchor"] = [s.anchor.clone() for s in controllers[0].shards]
        if controllers and step == spec.get("record_mains_at_step"):
            out["mains"] = [s.read_current(torch.empty(s.numel)) for s in controllers[0].shards]
        if controllers and step in spec.get("record_shards_at_steps", ()):
            # Each shard's anchor, this worker's parameters and its error-feedback residual (a
            # layer-wise sync due here is still pending: the state before it).
            out.setdefault("shard_records", {})[step] = dict(
                anchor=[s.anchor.clone() for s in controllers[0].shards],
                mains=[s.read_current(torch.empty(s.numel)) for s in controllers[0].shards],
                residual=[None if s.residual is None else s.residual.clone() for s in controllers[0].shards],
                pending=[controllers[0].sync._is_pending(s) for s in controllers[0].shards])
        if spec["snapshot_every_step"]:
            ddp.start_param_sync(force_sync=True)  # completes a pending layer-wise sync too
            out["snapshots"][step] = full_params(ddp)
        biases = [m.expert_bias for m in ddp.modules() if getattr(m, "expert_bias", None) is not None]
        if biases:  # MoE routers' expert biases (--moe-router-enable-expert-bias), after each step
            out.setdefault("expert_biases", {})[step] = torch.stack([b.detach().clone() for b in biases])
    if controllers:
        out["pending_at_end"] = controllers[0].sync_in_progress
        out["in_flight_at_end"] = any(c.delayed is not None and c.delayed.in_flight for c in controllers)
    if not spec.get("no_final_gather"):
        ddp.start_param_sync(force_sync=True)
    if pp == 1 and not spec.get("fsdp"):  # loss of this rank's model on a fixed held-out batch
        ddp.eval()
        with torch.no_grad():
            held_out = make_batches(1, 8, seed=99)[0]
            out["eval_loss"] = ddp(**gpt_inputs(held_out)).float().mean().item()
        ddp.train()
    if traffic:
        traffic.close()
        out["traffic"] = traffic.events
        out["wire_bytes"] = traffic.sent
    out["params"] = full_params(ddp)
    if not spec.get("fsdp"):
        out["partition_dims"] = {n: p.partition_dim for n, p in ddp.module.named_parameters()
                                 if getattr(p, "tensor_model_parallel", False)}
    if controllers:
        c = controllers[0]
        out["reports"] = c.drain_reports()
        if c.auto is not None:  # auto_overlap: (the step after which it decided, tau, format) each time
            out["decisions"] = [(step, ch.outer_step_delay, ch.exchange_dtype) for step, ch, _ in c.auto.decisions]
        out["shard_numels"] = [s.numel for s in c.shards]
        out["forward_numels"] = [s.numel for group in c.sync.groups for s in group]
        out["groups_per_sync"] = len(c.group_order)
        out["fragment_params"] = fragment_params(ddp, c, spec)
        out["state_bytes"] = c.state_bytes()
        out["sync_group_ranks"] = (
            None if c.sync_group.group is None else torch.distributed.get_process_group_ranks(c.sync_group.group)
        )
        out["anchor_devices"] = sorted({str(s.anchor.device) for s in c.shards if s.anchor is not None})
        # every controller (MoE with expert parallelism: the dense one, then the experts')
        out["per_controller"] = [dict(reports=o.drain_reports() if o is not c else out["reports"],
                                      state_bytes=o.state_bytes(), shard_numels=[s.numel for s in o.shards],
                                      layer_names=list(o.layer_names),
                                      decisions=None if o.auto is None else [
                                          (step, ch.outer_step_delay, ch.exchange_dtype)
                                          for step, ch, _ in o.auto.decisions]) for o in controllers]
    for c in controllers or ():
        if c.backend.dynamic:  # the torchft backend: this rank's Manager
            out["manager_step"] = c.sync_group.step  # its committed rounds
            c.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return out


def fragment_params(ddp, c, spec):
    """Streaming fragments: the parameter names of each of controller ``c``'s fragments (the
    simulation syncs them)."""
    if spec.get("fsdp"):  # Megatron-FSDP's buckets hold its raw parameters, named as full_params names them
        names = {p: n for n, p in ddp.module.raw_param.items()}
    else:
        names = {p: n for n, p in getattr(ddp, "module", ddp).named_parameters()}
    # (a DDP bucket group holds buckets; a Megatron-FSDP group is one bucket of parameters)
    return [sorted(names[p] for g in c.group_order if any(s is c.group_shards[g][0] for s in frag)
                   for b in getattr(g, "buckets", (g,)) for p in b.params)
            for frag in c.sync_shards.fragments]


def _inject_measurements(controllers, spec, rank):
    """auto_overlap: ``spec["measurements"]`` = {rank: (step s, {format: s}, exposed s)}, or a
    list of them, one per sync measured, in order (the last one from then on).
    ``spec["auto_rounds"]``: the torchft backend's rule of when a decision is in force
    (:class:`~megatron_edit.mcore.auto_overlap_ft.RoundRule`) on the torch backend too."""
    for c in controllers if spec.get("auto_rounds") else ():
        if c.config.use_async:
            c.auto.rounds.confirm = True
        elif not getattr(c.auto, "rides_on_rounds", False):  # EDiT's grid: agreed at each sync's start
            from megatron_edit.mcore.auto_overlap_ft import RoundAutoOverlap

            c.auto = RoundAutoOverlap(c, c.auto.user)
    if not controllers or not spec.get("measurements"):
        return
    from megatron_edit.algorithm.overlap_plan import Measurement

    numbers = spec["measurements"][rank]
    for c in controllers:
        if isinstance(numbers, list):
            calls = iter(range(10**9))
            c.auto.measure = lambda: Measurement(*numbers[min(next(calls), len(numbers) - 1)])
        else:
            c.auto.measure = lambda: Measurement(*numbers)


def megatron_runs(rank, world_size, specs, tp=1, pp=1, ep=1, etp=None):
    """Set up parallel state once, then one training run per spec; returns their results."""
    from megatron.core import parallel_state as ps

    instances = {s["instances"] for s in specs}
    assert len(instances) == 1, "one parallel layout per job"
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        num_distributed_optimizer_instances=instances.pop(),
        **(dict(expert_model_parallel_size=ep) if ep > 1 else {}),
        **(dict(expert_tensor_parallel_size=etp) if etp is not None else {}),  # default: tp
    )
    out = dict(
        tp_group=torch.distributed.get_process_group_ranks(ps.get_tensor_model_parallel_group()),
        pp_group=torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        runs=[_train(rank, spec, tp, pp) for spec in specs],
    )
    out["tp_group_after"] = torch.distributed.get_process_group_ranks(ps.get_tensor_model_parallel_group())
    out["pp_group_after"] = torch.distributed.get_process_group_ranks(ps.get_pipeline_model_parallel_group())
    return out


def simulate_edit(rank, world_size, spec, dp_size):
    """EDiT in plain PyTorch: ``instances`` model copies, each with torch AdamW, fed the samples
    of its worker's data-parallel ranks; synchronous warmup; per-layer penalty (norms over whole
    parameters, decisions from megatron_edit.algorithm.penalty); outer optimizer on the anchor."""
    from megatron.core import parallel_state as ps
    from megatron_edit.algorithm import penalty
    from megatron_edit.mcore.shards import layer_key

    ps.initialize_model_parallel()
    cfg = spec["local_sgd"]
    warmup, interval = cfg.get("local_sgd_warmup_steps", 0), cfg.get("local_sgd_sync_interval", 1)
    outer_kwargs = (spec["outer"] or {}).get("outer_optim_kwargs", {"lr": 0.7, "momentum": 0.9, "nesterov": True})
    outer_cls = getattr(torch.optim, (spec["outer"] or {}).get("outer_optim_class", "torch.optim.SGD").split(".")[-1])
    n = spec["instances"]
    models = [build_tiny_gpt(**spec.get("model", {})) for _ in range(n)]  # same seed: identical initial weights
    if spec.get("model"):
        for model in models:
            reinit_by_global_name(model)
    inner = [torch.optim.AdamW(m.parameters(), lr=LR, weight_decay=0.0) for m in models]
    batches = make_batches(spec["steps"], dp_size * MICRO_BATCH, seed=spec["data_seed"])
    per_worker = batches.shape[1] // n
    names = [name for name, _ in models[0].named_parameters()]

    def cut(fragment_params):
        """(layers, each parameter's layer index): a layer in several fragments is one layer per
        fragment."""
        key = {name: layer_key(name) for name in names}
        if fragment_params:
            frag_of = {name: f for f, members in enumerate(fragment_params) for name in members}
            spread = {}
            for name in names:
                spread.setdefault(key[name], set()).add(frag_of[name])
            key = {name: key[name] if len(spread[key[name]]) == 1 else f"{key[name]}@fragment{frag_of[name]}"
                   for name in names}
        layers = sorted(set(key.values()))
        return layers, [layers.index(key[name]) for name in names]

    layers, layer_index = cut(spec.get("fragment_params"))
    stats = penalty.EWMAStats.zeros(n, len(layers))
    anchor, outer_opt, decisions = None, None, []
    tau, alpha, last, flight = cfg.get("outer_step_delay", 0), cfg.get("outer_merge_alpha"), spec.get("last_step"), None
    # delay_switch=(k, tau'): the delay is tau' from the step after k on (auto_overlap's change at
    # a sync, nothing in flight), 0 before
    switch = spec.get("delay_switch")
    if switch:
        tau = switch[1]
    alpha = 0.5 if alpha is None else alpha  # LocalSGDConfig.merge_alpha: 0.5 with a delay by default
    if cfg.get("outer_merge_rule") == "keep_local":
        alpha = 0.0
    # Streaming fragments: which parameters each fragment holds (from the real run: how Megatron
    # buckets the model is not simulated); fragment f syncs after s - W = f H/F (mod H).
    frags = spec.get("fragment_params")
    period = interval // len(frags) if frags else interval
    everything = set(names)
    # fragment_switch=(k, fragment_params'): those fragments from the step after k on
    # (auto_overlap's change of F at a sync, nothing in flight); a layer cut anew starts its
    # statistics afresh
    fswitch = spec.get("fragment_switch")

    def fragment_of(step):
        """The parameter names synchronised after ``step`` (None: no sync there)."""
        if step == last and step > warmup and (tau or frags):
            return everything
        if step <= warmup or (step - warmup) % period:
            return None
        return set(frags[((step - warmup) // period) % len(frags)]) if frags else everything

    def loss_of(model, tokens):
        return model(**gpt_inputs(tokens)).float().mean()

    @torch.no_grad()
    def decide_and_reduce(members=None, steps=None):
        """The workers' pseudo-gradients now, the decisions and the reduced (clipped) one;
        ``members``: the parameter names synchronised (a fragment; the others get no step);
        ``steps`` (A-EDiT): each worker's steps since the last real sync of what is synchronised
        (the step weights; [W], or [W, layers] at A-EDiT's final sync with fragments)."""
        nonlocal stats
        members = everything if members is None else members
        params = [list(m.parameters()) for m in models]
        deltas = [[a - p[i] if names[i] in members else torch.zeros_like(a) for i, a in enumerate(anchor)]
                  for p in params]
        in_sync = torch.zeros(len(layers), dtype=torch.bool)
        for i, name in enumerate(names):
            in_sync[layer_index[i]] |= name in members
        norms = torch.zeros(n, len(layers), dtype=torch.float64)
        for w in range(n):
            for i, d in enumerate(deltas[w]):
                norms[w, layer_index[i]] += d.double().pow(2).sum()
        norms = norms.sqrt()
        excluded = None
        if cfg.get("skip_anomaly"):
            excluded, stats = penalty.detect_anomalies(
                norms, stats, cfg.get("ewma_alpha", 0.02), cfg.get("ewma_warmup_steps", 120),
                cfg.get("ewma_threshold", 3.0), None if members is everything else in_sync)
        if cfg.get("skip_anomaly") or cfg.get("pseudo_gradnorm_reduce"):
            weights = penalty.averaging_weights(
                norms, excluded, bool(cfg.get("pseudo_gradnorm_reduce")),
                cfg.get("weight_softmax_temperature") or 1.0)
        else:
            weights = torch.full((n, len(layers)), 1.0 / n, dtype=torch.float64)
        if cfg.get("use_step_weight"):  # (1 - r) w + r * each worker's share of the steps
            r, share = cfg.get("step_weight_ratio", 0.5), torch.as_tensor(steps, dtype=torch.float64)
            assert excluded is None, "the simulation blends step weights without exclusions only"
            share = share if share.dim() == 2 else share.unsqueeze(1)
            weights = (1 - r) * weights + r * share / share.sum(0, keepdim=True)
        if spec.get("gta"):
            avg = simulate_gta(spec["gta"], deltas, weights, layer_index)
        else:
            avg = [_weighted_sum(deltas, weights, layer_index, i, anchor[i]) for i in range(len(anchor))]
        tau_clip = cfg.get("clip_pseudo_grad")
        coef = torch.ones(len(layers), dtype=torch.float64)
        if tau_clip is not None:
            avg_norms = torch.zeros(len(layers), dtype=torch.float64)
            for i, a in enumerate(avg):
                avg_norms[layer_index[i]] += a.double().pow(2).sum()
            coef = penalty.clip_coefficients(avg_norms.sqrt(), tau_clip)
        skipped = penalty.skipped_layers(excluded, len(layers))
        decisions.append(dict(norms=norms, weights=weights, excluded=excluded, coef=coef))
        return avg, coef, skipped, members

    @torch.no_grad()
    def _outer_step(reduced):
        """Outer step of the anchor with the reduced pseudo-gradient (the synchronised
        parameters only: a fragment's)."""
        avg, coef, skipped, members = reduced
        for i, a in enumerate(anchor):
            a.grad = None if skipped[layer_index[i]] or names[i] not in members else avg[i] * coef[layer_index[i]].item()
        outer_opt.step()

    @torch.no_grad()
    def _merge(w, members, merge_alpha, launch=None):
        """Worker ``w`` restarts from the anchor, or merges with it (``members`` only);
        ``launch`` (keep_local): its parameters at the launch, theta <- theta + anchor' - launch."""
        for i, (name, p, a) in enumerate(zip(names, models[w].parameters(), anchor)):
            if name not in members:
                continue
            if launch is not None:
                p.add_(a - launch[i])
            else:
                p.copy_(a if not merge_alpha else merge_alpha * p + (1 - merge_alpha) * a)

    def _sync_and_restart(reduced, merge_alpha, launch=None):
        """Outer step of the anchor; every worker restarts from it or merges with it."""
        _outer_step(reduced)
        for w in range(n):
            _merge(w, reduced[3], merge_alpha, None if launch is None else launch[w])

    def train(w, step):
        """Worker ``w``'s inner step ``step`` (its own count): the whole batch in warmup, else
        its data-parallel ranks' slice."""
        model, opt = models[w], inner[w]
        opt.zero_grad()
        tokens = batches[step - 1] if step <= warmup else batches[step - 1][w * per_worker : (w + 1) * per_worker]
        loss_of(model, tokens).backward()
        if w not in spec.get("skips", {}).get(step, ()):  # skips={step: [workers]}: no inner update
            opt.step()
        _inject_fault(spec, step, w, list(model.parameters()))

    def capture():
        nonlocal anchor, outer_opt
        anchor = [p.detach().clone() for p in models[0].parameters()]
        outer_opt = outer_cls(anchor, **outer_kwargs)

    if cfg.get("use_async"):  # A-EDiT: each worker at its own pace between the syncs given
        # each layer's fragment (A-EDiT's final sync weighs a layer by its fragment's steps)
        fragment_by_name = {name: f for f, members in enumerate(frags or [names]) for name in members}
        run = dict(train=train, capture=capture, decide=decide_and_reduce, outer_step=_outer_step, merge=_merge,
                   models=models, frags=frags,
                   layer_fragment=[fragment_by_name[names[layer_index.index(layer)]] for layer in range(len(layers))])
        snapshots = _simulate_async(spec, n, warmup, tau, alpha, run)
        return dict(params=[named_params(m) for m in models], decisions=decisions, layers=layers, snapshots=snapshots)

    for step in range(1, spec["steps"] + 1):
        if fswitch and step == fswitch[0] + 1:
            frags = fswitch[1] if len(fswitch[1]) > 1 else None
            period = interval // len(frags) if frags else interval
            old_layers, (layers, layer_index) = layers, cut(frags)
            stats = stats.relabel(old_layers, layers)
        if anchor is None and step - 1 >= warmup:
            capture()
        for w in range(n):
            train(w, step)
        due = fragment_of(step)
        if not tau or (switch and step <= switch[0]):
            if due is not None:
                _sync_and_restart(decide_and_reduce(due), None)
            continue
        # Delayed outer step: launched tau steps before its sync step (its decisions and Delta
        # are taken then), applied after the inner step of the sync step with the merge; the
        # run's last step is a blocking sync, and nothing is launched for a sync at or after it.
        if flight is not None and step == flight[0]:
            _sync_and_restart(flight[1], alpha, flight[2])
            flight = None
        if step == last and step > warmup:
            _sync_and_restart(decide_and_reduce(), None)
        target = step + tau
        if fragment_of(target) is not None and (last is None or target < last):
            keep = cfg.get("outer_merge_rule") == "keep_local"
            launch = [[p.detach().clone() for p in m.parameters()] for m in models] if keep else None
            flight = (target, decide_and_reduce(fragment_of(target)), launch)
    return dict(params=[named_params(m) for m in models], decisions=decisions, layers=layers)


def simulate_shard_exchange(fmt, xs, residuals, chunk_residuals, block=256, chunk=4096):
    """One shard's exchange among W workers in format ``fmt`` (dense, or ``topk<d>-<values>``),
    the plain mean, with error feedback, written out from the codecs
    (:mod:`megatron_edit.algorithm.quantize`, :mod:`megatron_edit.algorithm.topk`) as
    :mod:`megatron_edit.exchange.quantized` and :mod:`megatron_edit.exchange.sparse` describe it:
    ``xs[w]``: worker w's pseudo-gradient; ``residuals[w]`` (None: none yet) and
    ``chunk_residuals[w]`` (the quantized exchange's, of the chunk worker w owns) are updated in
    place. A shard for which the format sends more bytes than fp32 goes in fp32 and sends a
    residual it finds once (:mod:`megatron_edit.algorithm.residual`). Returns the result."""
    from megatron_edit.algorithm import quantize, topk, wire
    from megatron_edit.algorithm.formats import topk_format

    W, n = len(xs), xs[0].numel()
    sparse = topk_format(fmt)
    if fmt == "fp32" or wire.format_wire_bytes(n, fmt, W, block, chunk) > wire.all_reduce_bytes(4 * n, W):
        sent = [x if residuals[w] is None else x + residuals[w] for w, x in enumerate(xs)]
        residuals[:] = [None] * W
        return sum(sent[1:], sent[0]) / W
    xs = [x if residuals[w] is None else x + residuals[w] for w, x in enumerate(xs)]
    if sparse is not None:
        density, values = sparse
        c = wire.topk_chunk(n, chunk)
        got = [topk.decode(topk.encode(x, density, c, values), n, density, c, values) for x in xs]
        residuals[:] = [x - g for x, g in zip(xs, got)]
        total = torch.zeros(n)
        for g in got:
            total += g
        return total / W
    size = wire.quantized_block(n, W, fmt, block)
    sizes = list(quantize.split_sizes(n, W, fmt, size))
    per, offsets = max(sizes), [sum(sizes[:w]) for w in range(W)]

    def encode(values):
        return quantize.encode(torch.cat([values, values.new_zeros(per - values.numel())]), fmt, size)

    parts = [[encode(x[o : o + k]) for o, k in zip(offsets, sizes)] for x in xs]
    for w, x in enumerate(xs):
        residuals[w] = x - torch.cat([quantize.decode(p, per, fmt, size)[:k] for p, k in zip(parts[w], sizes)])
    result = torch.empty(n)
    for c, (o, k) in enumerate(zip(offsets, sizes)):  # worker c owns chunk c
        own = torch.zeros(k)
        for w in range(W):
            own += quantize.decode(parts[w][c], per, fmt, size)[:k]
        own /= W
        if chunk_residuals[c] is None:
            chunk_residuals[c] = torch.zeros(per)
        own += chunk_residuals[c][:k]
        sent = quantize.decode(encode(own), per, fmt, size)[:k]
        chunk_residuals[c][:k] = own - sent
        result[o : o + k] = sent
    return result


def simulate_format_change(fmt, residuals, chunk_residuals, n, block=256):
    """The residual rule at a change from format ``fmt`` (:mod:`megatron_edit.algorithm.residual`):
    a quantized format's chunk residuals are folded into their owners' residuals, times the
    plain mean's divisor W, and restart."""
    from megatron_edit.algorithm import quantize, wire

    W = len(residuals)
    if all(c is None for c in chunk_residuals):
        return
    size = wire.quantized_block(n, W, fmt, block)
    sizes = list(quantize.split_sizes(n, W, fmt, size))
    for c, (o, k) in enumerate(zip([sum(sizes[:w]) for w in range(W)], sizes)):
        if chunk_residuals[c] is not None:
            if residuals[c] is None:
                residuals[c] = torch.zeros(n)
            residuals[c][o : o + k] += W * chunk_residuals[c][:k]
    chunk_residuals[:] = [None] * W


def _simulate_async(spec, n, warmup, tau, alpha, run):
    """A-EDiT in :func:`simulate_edit` (``run``: its closures). ``spec["async_syncs"]``: the
    syncs, each ``(every worker's step count there, skipped?)``, the last one final (the
    schedule is the test's, worked out by hand from the fake clock). Warmup in lockstep; then
    each worker trains to its step of the next sync. At a real sync the pseudo-gradients are
    taken (step weights: each worker's steps since the last real sync) and, without a delay or
    at the final sync, every worker restarts from the new anchor; with a delay tau the anchor
    steps now and each worker merges after its own step s + tau, or at the next sync if that
    comes first (the final interval may be shorter than tau). ``spec["async_delays"]``: each
    sync's own delay (auto_overlap's changes; default tau for every one). With streaming
    fragments (``fragment_params``) the k-th real sync exchanges fragment k mod F, its step weights
    counting each worker's steps since that fragment's last real sync; the final sync exchanges
    every fragment, each layer weighted by its own fragment's steps (``async_fragments_from``: the
    index of the first sync with fragments, auto_overlap's change of F; the syncs before it and
    the change do not count in the round-robin). Returns each worker's
    parameters after each of its steps (``spec["snapshot_every_step"]``; else empty)."""
    keep = spec["local_sgd"].get("outer_merge_rule") == "keep_local"
    snapshots = [{} for _ in range(n)]

    def snap(w):
        if spec.get("snapshot_every_step"):
            snapshots[w][done[w]] = named_params(run["models"][w])
    for step in range(1, warmup + 1):
        for w in range(n):
            run["train"](w, step)
    run["capture"]()
    done, last_real, pending = [warmup] * n, [warmup] * n, None  # pending: (members, launch, apply after)
    frags = run["frags"] or [None]
    last_frag, exchanges = [[warmup] * n for _ in frags], 0  # each fragment's last real sync
    syncs = spec["async_syncs"]
    delays = spec.get("async_delays") or [tau] * len(syncs)
    for k, (target, skipped) in enumerate(syncs):
        for w in range(n):
            while done[w] < target[w]:
                done[w] += 1
                run["train"](w, done[w])
                if pending is not None and done[w] == min(pending[2][w], target[w]):
                    run["merge"](w, pending[0], alpha, None if pending[1] is None else pending[1][w])
                snap(w)
        pending = None
        if skipped:
            continue
        final = k == len(syncs) - 1
        if len(frags) == 1 or k < spec.get("async_fragments_from", 0):
            reduced = run["decide"](steps=[t - l for t, l in zip(target, last_real)])
            last_frag = [list(target) for _ in frags]  # (a change of F: from the last real sync)
        elif final:  # every fragment, each layer weighed by its fragment's steps
            since = torch.tensor([[t - l for t, l in zip(target, last)] for last in last_frag], dtype=torch.float64)
            reduced = run["decide"](steps=since[run["layer_fragment"]].T)
        else:
            exchanges += 1
            f = exchanges % len(frags)
            reduced = run["decide"](set(frags[f]), steps=[t - l for t, l in zip(target, last_frag[f])])
            last_frag[f] = list(target)
        last_real = list(target)
        launch = [[p.detach().clone() for p in run["models"][w].parameters()] for w in range(n)] if keep else None
        run["outer_step"](reduced)
        if final or not delays[k]:  # the final sync is blocking
            for w in range(n):
                run["merge"](w, reduced[3], None)
                snap(w)
        else:
            pending = (reduced[3], launch, [t + delays[k] for t in target])
    return snapshots


def _weighted_sum(deltas, weights, layer_index, i, like):
    terms = [d[i] * weights[w, layer_index[i]].item() for w, d in enumerate(deltas) if weights[w, layer_index[i]] != 0]
    return torch.stack(terms).sum(0) if terms else torch.zeros_like(like)


def simulate_gta(g, deltas, weights, layer_index):
    """GTA on whole parameters (= the shards when a worker is one rank): magnitude
    sparsification per parameter, consensus, normalized mean of the agreeing entries.
    ``deltas[w][i]``: worker w's pseudo-gradient of parameter i; ``weights[w, layer]``."""
    import math

    n = len(deltas)
    avg = []
    for i in range(len(deltas[0])):
        ws = [weights[w, layer_index[i]].item() for w in range(n)]
        parts = []
        for w in range(n):
            d = deltas[w][i].flatten().clone()
            if g.get("sparsification_method") == "magnitude" and g.get("density", 1.0) < 1:
                k = max(1, math.ceil(g["density"] * d.numel()))
                keep = torch.zeros_like(d, dtype=torch.bool)
                keep[d.abs().topk(k).indices] = True
                d[~keep] = 0
            parts.append(d * ws[w])
        if g.get("consensus_method") == "sum":
            majority = torch.sign(torch.stack(parts).sum(0))
        elif g.get("consensus_method") == "count":
            majority = torch.sign(torch.stack([torch.sign(p) for p in parts]).sum(0))
        else:
            majority = None
        kept = [p.masked_fill(torch.sign(p) != majority, 0.0) if majority is not None else p for p in parts]
        num = torch.stack(kept).sum(0)
        if g.get("normalize", True):
            den = sum((k != 0).to(num.dtype) * ws[w] for w, k in enumerate(kept))
            num = torch.where(den > 0, num / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(num))
        avg.append(num.view_as(deltas[0][i]))
    return avg


def _inject_fault(spec, step, worker, mains):
    """Corrupt a worker's parameters after its optimizer step (fault-injection tests).

    ``spec["faults"]``: list of ``{"workers": [...], "steps": [...], "kind": "scale"|"nan",
    "factor": f}``. ``scale`` multiplies every element by ``factor`` (the same whether applied
    to a whole tensor or to a shard of it); ``nan`` poisons the first element of each tensor.
    """
    for fault in spec.get("faults", ()):
        if worker not in fault["workers"] or step not in fault["steps"]:
            continue
        with torch.no_grad():
            for p in mains:
                if fault["kind"] == "nan":
                    p.view(-1)[:1].fill_(float("nan"))
                else:
                    p.mul_(fault["factor"])


def async_runs(rank, world_size, spec):
    """A-EDiT: every worker trains at its own pace until it has done ``spec["syncs"]`` syncs.

    ``spec["seconds_per_step"][w]``: a fake clock advancing that much per step of worker w
    (deterministic schedule), or None for the real clock with ``spec["sleep"][w]`` seconds of
    extra work per step (a straggler)."""
    import time as _time

    import megatron_edit as me
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=spec["instances"])
    me.patch_megatron_for_local_sgd(me.LocalSGDConfig(**spec["local_sgd"]), me.OuterOptimizerConfig(**spec["outer"]))
    ddp, optimizer = _build(spec, 1, 1)
    (controller,) = me.get_local_sgd(optimizer)
    _inject_measurements([controller], spec, rank)
    if spec.get("train_iters"):  # A-EDiT's budget: what a synchronous run of that length takes
        me.set_train_iters(optimizer, spec["train_iters"])
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    worker = spec["worker"] if "worker" in spec else dp_rank // (dp // spec["instances"])
    fake = spec.get("seconds_per_step")
    now = [0.0]
    if fake:
        controller.clock = lambda: now[0]
    # data_dp / data_rank_offset: a worker's own job (torchft) replays its micro-batches of the
    # one-world run (see megatron_runs)
    data_dp, data_rank = spec.get("data_dp") or dp, dp_rank + spec.get("data_rank_offset", 0)
    batches = make_batches(spec["max_steps"], data_dp * MICRO_BATCH, seed=0)
    reports, steps, progress, t0, snapshots = [], 0, 0.0, _time.monotonic(), {}

    def more():
        if spec.get("train_iters"):
            return not controller.finished
        return len(reports) + controller.sync_in_progress < spec["syncs"]

    while more():
        assert steps < spec["max_steps"], "never reached the expected number of syncs"
        steps += 1
        if spec.get("sleep"):
            _time.sleep(spec["sleep"][worker])
        train_step(ddp, optimizer, rank_micro_batches(batches[steps - 1], data_rank, data_dp))
        if spec.get("die_after") == steps:  # a worker's crash (the torchft backend's fault tests)
            os.kill(os.getpid(), signal.SIGKILL)
        progress += controller.last_step_progress
        if fake:
            now[0] += fake[worker]
        reports += controller.drain_reports()
        if spec.get("snapshot_every_step"):  # this worker's parameters after each of its steps
            ddp.start_param_sync(force_sync=True)
            snapshots[steps] = full_params(ddp)
    in_flight = controller.delayed is not None and controller.delayed.in_flight
    ddp.start_param_sync(force_sync=True)  # completes a pending layer-wise sync
    reports += controller.drain_reports()
    out = dict(worker=worker, steps=steps, reports=reports, params=full_params(ddp),
               seconds=_time.monotonic() - t0, finished=controller.finished, progress=progress,
               last_sync=controller.last_sync, snapshots=snapshots, in_flight_at_end=in_flight,
               fragment_params=fragment_params(ddp, controller, spec),
               decisions=None if controller.auto is None else [  # auto_overlap: (after step, tau, format)
                   (step, ch.outer_step_delay, ch.exchange_dtype) for step, ch, _ in controller.auto.decisions])
    if controller.backend is not None:
        controller.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return out


def vpp_runs(rank, world_size, specs):
    """Virtual pipeline parallelism (PP=2 x VPP=2, 2 workers of one rank): Megatron-LM's set-up
    (one DDP per model chunk, bucketing only in the first, the interleaved schedule with
    overlapped point-to-point, ``param_sync_func`` when ``align_param_gather``), one run per spec;
    returns every chunk's parameters and the sync reports."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from gpt_utils import forward_step

    pp, vp, micro = 2, 2, 4
    ps.initialize_model_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                                 num_distributed_optimizer_instances=2)
    pp_rank, dp_rank, dp = ps.get_pipeline_model_parallel_rank(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
    out = []
    for spec in specs:
        me.patch_megatron_for_local_sgd(me.LocalSGDConfig(**spec["local_sgd"]), me.OuterOptimizerConfig(**spec["outer"]))
        config = tiny_gpt_config(num_layers=4, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vp,
                                 pipeline_dtype=torch.float32, batch_p2p_comm=False, overlap_p2p_comm=True)
        ddp_config = DistributedDataParallelConfig(
            use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=spec["overlap_param_gather"],
            align_param_gather=spec["align"], num_distributed_optimizer_instances=2, bucket_size=3000)
        chunks = []
        for i in range(vp):
            model_parallel_cuda_manual_seed(1234 + i)
            torch.manual_seed(1234 + i)
            # megatron-core >= 0.13 takes the virtual stage as an argument; older versions read it
            # from parallel_state, which Megatron-LM's get_model set before building each chunk.
            stage = dict(vp_stage=i) if "vp_stage" in inspect.signature(GPTModel.__init__).parameters else {}
            if not stage:
                ps.set_virtual_pipeline_model_parallel_rank(i)
            module = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB_SIZE,
                              max_sequence_length=SEQ_LENGTH, pre_process=pp_rank == 0 and i == 0,
                              post_process=pp_rank == pp - 1 and i == vp - 1, **stage)
            chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=module,
                                                  disable_bucketing=i > 0))
        config.no_sync_func = [c.no_sync for c in chunks]
        config.grad_sync_func = [c.start_grad_sync for c in chunks]
        if spec["align"]:
            config.param_sync_func = [c.start_param_sync for c in chunks]
        config.finalize_model_grads_func = finalize_model_grads
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.0, clip_grad=0.0, use_distributed_optimizer=True),
            chunks)
        controllers = me.get_local_sgd(optimizer)
        batches = make_batches(spec["steps"], dp * micro, seed=0)
        for step in range(spec["steps"]):
            mine = rank_micro_batches(batches[step], dp_rank, dp, num_microbatches=micro)
            for c in chunks:
                c.zero_grad_buffer()
            optimizer.zero_grad()
            get_forward_backward_func()(
                forward_step_func=forward_step, data_iterator=[iter(mine) for _ in chunks], model=chunks,
                num_microbatches=micro, seq_length=SEQ_LENGTH, micro_batch_size=mine.shape[1], forward_only=False)
            optimizer.step()
        for c in chunks:
            c.start_param_sync(force_sync=True)
        out.append(dict(params=[named_params(c) for c in chunks],
                        reports=[r for c in controllers for r in c.drain_reports()], pp_rank=pp_rank,
                        worker=dp_rank))
        me.unpatch_megatron_for_local_sgd()
    return out


def hung_worker_job(rank, world_size, local_sgd, hang_after_step, hung_worker=1, steps=6, hung_ranks=None):
    """EDiT, 2 workers x 2 shards; the ranks of ``hung_worker`` (or only the global ranks
    ``hung_ranks``) stop arriving (sleep far longer than the sync timeout) after their step
    ``hang_after_step``: the others must stop at their next sync with a message naming the
    worker, not wait for torch's process-group timeout."""
    import time as _time

    import megatron_edit as me
    from megatron.core import parallel_state as ps

    from gpt_utils import make_batches, rank_micro_batches, train_step

    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    me.patch_megatron_for_local_sgd(me.LocalSGDConfig(**local_sgd), me.OuterOptimizerConfig())
    ddp, optimizer = _build(default_spec(), 1, 1)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    worker = dp_rank // (dp // 2)
    batches = make_batches(steps, dp * MICRO_BATCH, seed=0)
    for step in range(1, steps + 1):
        hung = rank in hung_ranks if hung_ranks is not None else worker == hung_worker
        if hung and step == hang_after_step + 1:
            _time.sleep(600)
        train_step(ddp, optimizer, rank_micro_batches(batches[step - 1], dp_rank, dp))
    return step


def patch_order_job(rank, world_size, case):
    """Patching at the wrong time on 2 workers x 1 rank: returns the error
    message raised, or ``"ran"`` with whether EDiT drove the optimizer."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    from gpt_utils import make_batches, rank_micro_batches, train_step

    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    local = me.LocalSGDConfig(local_sgd_sync_interval=2)
    spec = default_spec()
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batch = rank_micro_batches(make_batches(1, dp * MICRO_BATCH, seed=0)[0], dp_rank, dp)
    me.unpatch_megatron_for_local_sgd()
    try:
        if case == "after-both":
            ddp, optimizer = _build(spec, 1, 1)
            me.patch_megatron_for_local_sgd(local)
        elif case == "after-ddp":
            ddp, _ = _build(spec, 1, 1)
            me.patch_megatron_for_local_sgd(local)
            optimizer = _optimizer(ddp)
        else:
            me.patch_megatron_for_local_sgd(local)
            ddp, optimizer = _build(spec, 1, 1)
            other = local if case == "again-same" else me.LocalSGDConfig(local_sgd_sync_interval=3)
            me.patch_megatron_for_local_sgd(other)
        train_step(ddp, optimizer, batch)
        return ("ran", len(me.get_local_sgd(optimizer)), me.get_local_sgd(optimizer)[0].steps_done)
    except RuntimeError as e:
        return ("refused", str(e))
    finally:
        me.unpatch_megatron_for_local_sgd()
