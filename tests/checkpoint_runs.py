"""Training jobs for the checkpoint tests (tests/mcore/checkpoint/test_checkpointing.py,
test_checkpoint_resume.py; in tests/ itself because tests/mcore's and tests/torchft_backend's
tests save and resume with them too): real megatron-core on CPU over gloo, run inside the ranks of
``dist.run_ranks``; checkpoints written the way a megatron-core user (and Megatron-LM's
``--save``) writes them: ``dist_checkpointing.save({'model': m, 'optimizer':
opt.sharded_state_dict(m, metadata=...)})``.

Every run cuts the same data for 4 data-parallel ranks (``WORLD``): a layout with fewer
data-parallel ranks gives each the micro-batches of several (worker w of a 2-worker run always
sees the samples of ranks 2w and 2w + 1). :func:`canonical` gives a rank's model, Adam and EDiT
state per model tensor, so states of different layouts (shard size, TP, PP) can be compared.
"""

import os
import pickle
from contextlib import contextmanager

import torch

WORLD = 4
# Layer-wise sync overlapped with the forward pass; warmup 2, H=3: syncs after steps 5 and 8.
EDIT = dict(local_sgd_sync_interval=3, local_sgd_warmup_steps=2, sync_mode="layerwise")
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))
STEPS = 10
DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable"}  # Megatron-LM's default
FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable"}
ONE_BUCKET = 10**8  # megatron-core 0.16's fully_reshardable misplaces state after a padded bucket
# Pseudo-gradient penalty that really decides something: sharp weights, a binding clip, an
# anomaly detector warm after one sync with a low threshold (as in test_penalty_megatron).
PENALTY = dict(
    local_sgd_sync_interval=2, local_sgd_warmup_steps=1, sync_mode="layerwise",
    pseudo_gradnorm_reduce=True, weight_softmax_temperature=0.02, clip_pseudo_grad=0.25,
    skip_anomaly=True, ewma_warmup_steps=1, ewma_threshold=0.5, ewma_alpha=0.5,
)


# ----------------------------------------------------------------------- inside the ranks
@contextmanager
def _children_allowed():
    """Megatron's torch_dist writer starts helper processes; run_ranks' ranks are daemonic."""
    import multiprocessing

    config = multiprocessing.current_process()._config
    was = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = was


def _setup(local_sgd, instances=2, outer=OUTER, bucket_size=3000, tp=1, pp=1):
    """Patch, build the tiny GPT in DDP and its distributed optimizer; EDiT unless local_sgd
    is None (then megatron_edit is unpatched: plain Megatron). The default bucket size gives 7
    buckets (7 layer-wise sync groups); ``ONE_BUCKET`` one."""
    import megatron_edit as me
    from edit_runs import _build, default_spec

    if local_sgd is None:
        me.unpatch_megatron_for_local_sgd()
    else:
        me.patch_megatron_for_local_sgd(me.LocalSGDConfig(**local_sgd), me.OuterOptimizerConfig(**outer))
    ddp, opt = _build(default_spec(instances=instances, bucket_size=bucket_size), tp, pp)
    controllers = me.get_local_sgd(opt)
    return ddp, opt, (controllers[0] if controllers else None)


def _sharded(ddp, opt, metadata, is_loading=False):
    model = ddp.module.sharded_state_dict()
    return {"model": model, "optimizer": opt.sharded_state_dict(model, is_loading=is_loading, metadata=metadata)}


def _save(ddp, opt, path, metadata=DP_RESHARDABLE, fully_parallel=False, corrupt=None):
    """``fully_parallel``: Megatron-LM's default save strategy (--ckpt-fully-parallel-save),
    which spreads the writes over the data-parallel ranks holding each shard."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    os.makedirs(path, exist_ok=True)
    state = _sharded(ddp, opt, metadata)
    if corrupt:
        corrupt(state)
    strategy = get_default_save_sharded_strategy()
    if fully_parallel:
        strategy = FullyParallelSaveStrategyWrapper(strategy, ps.get_data_parallel_group(with_context_parallel=True))
    with _children_allowed():
        dist_checkpointing.save(state, path, strategy)


def _load(ddp, opt, path, metadata=DP_RESHARDABLE, optimizer=True):
    from megatron.core import dist_checkpointing

    if optimizer:
        state = dist_checkpointing.load(_sharded(ddp, opt, metadata, is_loading=True), path)
    else:  # --no-load-optim / --finetune
        state = dist_checkpointing.load({"model": ddp.module.sharded_state_dict()}, path)
    ddp.load_state_dict(state["model"])
    if optimizer:
        opt.load_state_dict(state["optimizer"])


def _state(ddp, opt, ctl, gather=True, with_canonical=False) -> dict:
    """Everything an exact resume must reproduce, on this rank. ``gather=False``: the model's
    parameters as they are (right after a load they must already be the worker's own).
    ``with_canonical``: also :func:`canonical` (collectives inside the worker)."""
    from gpt_utils import named_params

    if gather:
        ddp.start_param_sync(force_sync=True)  # completes a pending layer-wise sync too
    extra = dict(canonical=canonical(ddp, opt, ctl)) if with_canonical else {}
    inner = opt.chained_optimizers[0].optimizer
    adam = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in inner.state[p].items()}
            for g in inner.param_groups for p in g["params"]]
    out = dict(params=named_params(ddp), adam=adam, steps_done=None, **extra)
    if ctl is not None:
        outer = ctl.outer_optimizer
        out.update(
            steps_done=ctl.steps_done,
            global_progress=ctl.global_progress,
            last_sync_step=ctl._last_sync_step,
            anchors=[None if s.anchor is None else s.anchor.clone() for s in ctl.shards],
            outer=[{k: v.clone() for k, v in outer.state[s.anchor].items()} if outer else None for s in ctl.shards],
            mains=[s.read_current(torch.empty(s.numel)) for s in ctl.shards],
            extra=ctl.extra_state() if hasattr(ctl, "extra_state") else None,
            residuals=[(None if s.residual is None else s.residual.clone(),
                        None if s.chunk_residual is None else s.chunk_residual.clone()) for s in ctl.shards],
            collectives=ctl.sync_group.counters.collectives,
            payload=ctl.sync_group.counters.payload_bytes,
        )
    return out


def _train(ddp, opt, ctl, first, last, saves=None, snapshots=(), faults=(), losses=None, with_canonical=False):
    """Steps first..last on the same data as every other run; saves {step: [(path, metadata[,
    fully_parallel])]}; ``faults`` as in edit_runs (a worker's parameters corrupted after its
    optimizer step); ``losses``: a dict that gets {step: this rank's loss} (NaN off the last
    pipeline stage)."""
    from megatron.core import parallel_state as ps

    from edit_runs import MICRO_BATCH, _inject_fault
    from gpt_utils import make_batches, rank_micro_batches, train_step

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = make_batches(max(STEPS, last), WORLD * MICRO_BATCH)  # always cut for 4 data-parallel ranks
    per_rank = WORLD // dp
    out = {}
    for step in range(first, last + 1):
        mine = torch.cat([rank_micro_batches(batches[step - 1], dp_rank * per_rank + i, WORLD) for i in range(per_rank)], 1)
        loss = train_step(ddp, opt, mine)
        if losses is not None:
            losses[step] = loss
        if faults:
            worker = dp_rank // (dp // ctl.num_workers)
            _inject_fault({"faults": faults}, step, worker, [m for sh in ctl.shards for m in sh.mains])
        for path, metadata, *fully_parallel in (saves or {}).get(step, ()):
            _save(ddp, opt, path, metadata, *fully_parallel)
        if step in snapshots:
            out[step] = _state(ddp, opt, ctl, with_canonical=with_canonical)
    return out


def train_job(rank, world, local_sgd=EDIT, instances=2, steps=STEPS, load=None, saves=None, snapshots=(),
              bucket_size=3000, faults=(), tp=1, pp=1, with_canonical=False, measurements=None):
    """One training run: optionally resume from ``load=(path, metadata, step)``, train to
    ``steps``, return the final state, snapshots, losses and the sync reports. ``local_sgd``
    None: plain Megatron (megatron_edit's load fixes only). ``measurements``: with
    ``auto_overlap``, {rank: (step s, {format: exchange s}, exposed s)}, what each rank's
    :class:`AutoOverlap` measures at every sync (instead of its clocks)."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 num_distributed_optimizer_instances=instances)
    ddp, opt, ctl = _setup(local_sgd, instances, bucket_size=bucket_size, tp=tp, pp=pp)
    if measurements is not None:
        from megatron_edit.algorithm.overlap_plan import Measurement

        ctl.auto.measure = lambda: Measurement(*measurements[rank])
    if local_sgd is None:
        me.patch_megatron_load_fixes()
    first = 1
    loaded = None
    if load is not None:
        path, metadata, step = load
        _load(ddp, opt, path, metadata)
        loaded = _state(ddp, opt, ctl, gather=False, with_canonical=with_canonical)
        first = step + 1
    losses = {}
    snaps = _train(ddp, opt, ctl, first, steps, saves, snapshots, faults, losses, with_canonical)
    dp = ps.get_data_parallel_world_size()
    out = dict(final=_state(ddp, opt, ctl), loaded=loaded, snapshots=snaps, losses=losses,
               reports=ctl.drain_reports() if ctl else [], worker=ps.get_data_parallel_rank() // (dp // instances),
               last_stage=ps.is_pipeline_last_stage(),
               decisions=[(step, ch.outer_step_delay, ch.exchange_dtype, m.step_s, dict(m.exchange_s))
                          for step, ch, m in ctl.auto.decisions] if ctl and ctl.auto else None)
    me.unpatch_megatron_for_local_sgd()
    me.unpatch_megatron_load_fixes()
    return out


def canonical(ddp, opt, ctl) -> dict:
    """This rank's state per model tensor, comparable across layouts: {kind: {(key,
    global_offset): (global_shape, prepend_axis_num, whole parameter)}} for the kinds
    ``params`` (the model), ``main``, ``exp_avg``, ``exp_avg_sq`` (inner Adam) and, with EDiT,
    ``anchor``, ``momentum_buffer`` and, with error feedback, ``residual`` (the worker's own)
    and ``result_residual`` (the reduced result's, every worker's chunk). The pieces of a parameter in the worker's shards are
    put together by a sum over the worker's shard group (each element lies in one shard)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    distopt = opt.chained_optimizers[0]
    meta = {id(v.data): v for v in nested_values(ddp.module.sharded_state_dict()) if isinstance(v, ShardedTensor)}
    params = [p for buffer in distopt.buffers for p in buffer.param_index_map]
    param_maps = [bm["param_map"] for g in range(len(distopt.buffers))
                  for maps in distopt.gbuf_ranges[g].values() for bm in maps]
    outer = ctl.outer_optimizer if ctl is not None else None
    kinds = ["main", "exp_avg", "exp_avg_sq"]
    if outer is not None:
        kinds.append("anchor")
        if any("momentum_buffer" in outer.state.get(s.anchor, {}) for s in ctl.shards):
            kinds.append("momentum_buffer")  # zero for a fragment not synchronised yet
    result = []
    if ctl is not None and ctl.shards[0].residual is not None:
        kinds += ["residual", "result_residual"]
        for shard in ctl.shards:  # every worker's chunk at its place (a sum over the workers)
            full = torch.zeros(shard.numel)
            offset, length, _ = ctl.chunk_span(shard)
            if shard.chunk_residual is not None:  # none with the sparse exchange (zeros)
                full[offset : offset + length] = shard.chunk_residual[:length]
            torch.distributed.all_reduce(full, group=ctl.sync_group.group)
            result.append(full)

    def piece(kind, slot, param, ranges):
        lo, hi = ranges["gbuf_local"].start, ranges["gbuf_local"].end
        if kind == "anchor":
            return ctl.shards[slot].anchor[lo:hi]
        if kind == "momentum_buffer":
            buffer = outer.state.get(ctl.shards[slot].anchor, {}).get("momentum_buffer")
            return torch.zeros(hi - lo) if buffer is None else buffer[lo:hi]
        if kind == "residual":
            return ctl.shards[slot].residual[lo:hi]
        if kind == "result_residual":
            return result[slot][lo:hi]
        return distopt._get_main_param_and_optimizer_states(param)["param" if kind == "main" else kind].view(-1)

    def entry(param, value):
        sh = meta[id(param)]
        return (sh.key, tuple(sh.global_offset)), (tuple(sh.global_shape), sh.prepend_axis_num, value)

    out = {"params": dict(entry(p, p.detach().clone()) for p in params)}
    for kind in kinds:
        whole = {id(p): torch.zeros(p.numel()) for p in params}
        for slot, param_map in enumerate(param_maps):
            for p, ranges in param_map.items():
                whole[id(p)][ranges["param"].start : ranges["param"].end] = piece(kind, slot, p, ranges)
        for p in params:
            torch.distributed.all_reduce(whole[id(p)], group=distopt.data_parallel_group)
        out[kind] = dict(entry(p, whole[id(p)].view(p.shape)) for p in params)
    return out


def full_tensors(canonicals, kind) -> dict:
    """{key: global tensor} from the :func:`canonical` of one worker's ranks (its shards, TP
    ranks, PP stages); NaN where no rank had a value."""
    out = {}
    for c in canonicals:
        for (key, offset), (shape, prepend, data) in c[kind].items():
            full = out.setdefault(key, torch.full(shape, float("nan")))
            local = (1,) * prepend + tuple(data.shape)
            full[tuple(slice(o, o + n) for o, n in zip(offset, local))] = data.reshape(local)
    return out


def _drop_from_checkpoint(path, prefix):
    """Remove every entry whose key starts with ``prefix`` from a torch_dist checkpoint."""
    meta_path = os.path.join(path, ".metadata")
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)

    def keep(key):
        return not str(getattr(key, "fqn", key)).startswith(prefix)

    meta.state_dict_metadata = {k: v for k, v in meta.state_dict_metadata.items() if keep(k)}
    meta.storage_data = {k: v for k, v in meta.storage_data.items() if keep(k)}
    if isinstance(getattr(meta, "planner_data", None), dict):
        meta.planner_data = {k: v for k, v in meta.planner_data.items() if keep(k)}
    with open(meta_path, "wb") as f:
        pickle.dump(meta, f)


def _garble_object(path, prefix):
    """Overwrite the stored bytes of the ShardedObject whose key starts with ``prefix``."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        meta = pickle.load(f)
    (index,) = [k for k in meta.storage_data if k.fqn.startswith(prefix)]
    info = meta.storage_data[index]
    with open(os.path.join(path, info.relative_path), "r+b") as f:
        f.seek(info.offset)
        f.write(b"\x00garbage" * (info.length // 8) + b"\x00" * (info.length % 8))


def load_errors_job(rank, world, cases, instances=2, plain_save=None):
    """Try each load in ``cases`` ([(name, path[, metadata[, options]])], options: ``tp``,
    ``instances``, ``bucket_size``, ``local_sgd`` of the loading run) in turn; returns {name:
    error message}.
    The errors must be raised on every rank (or the other ranks would hang in the collectives)."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=instances)
    if plain_save is not None:  # a checkpoint of ordinary (synchronous) Megatron training
        ddp, opt, _ = _setup(None, instances)
        _train(ddp, opt, None, 1, 1)
        _save(ddp, opt, plain_save)
    out = {}
    for name, path, *rest in cases:
        metadata = rest[0] if rest else DP_RESHARDABLE
        options = dict(dict(tp=1, instances=instances, bucket_size=3000, local_sgd=EDIT),
                       **(rest[1] if len(rest) > 1 else {}))
        ps.destroy_model_parallel()
        ps.initialize_model_parallel(tensor_model_parallel_size=options["tp"],
                                     num_distributed_optimizer_instances=options["instances"])
        ddp, opt, _ = _setup(options["local_sgd"], options["instances"], bucket_size=options["bucket_size"],
                             tp=options["tp"])
        try:
            _load(ddp, opt, path, metadata)
            out[name] = None
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            out[name] = f"{type(e).__name__}: {e}"
        me.unpatch_megatron_for_local_sgd()
    return out


def model_only_and_legacy_job(rank, world, path, legacy_dir):
    """Load only the model of an EDiT checkpoint taken between syncs, train two steps; then try
    the legacy torch format."""
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    ddp, opt, ctl = _setup(EDIT)
    _load(ddp, opt, path, optimizer=False)
    loaded = _state(ddp, opt, ctl, gather=False)
    after = _train(ddp, opt, ctl, 1, 2, snapshots=(2,))[2]
    refused = {}
    for name, call in (("save", lambda: opt.save_parameter_state(os.path.join(legacy_dir, "o.pt"))),
                       ("load", lambda: opt.load_parameter_state(os.path.join(legacy_dir, "o.pt")))):
        try:
            call()
            refused[name] = None
        except Exception as e:  # noqa: BLE001
            refused[name] = f"{type(e).__name__}: {e}"
    return dict(loaded=loaded, after=after, refused=refused, worker=ps.get_data_parallel_rank() // 2)


def corrupt_save_job(rank, world, path):
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    ddp, opt, ctl = _setup(EDIT)
    _train(ddp, opt, ctl, 1, 3)

    def corrupt(state):
        state["optimizer"]["local_sgd"]["record"].data["steps_done"] = -1

    _save(ddp, opt, path, corrupt=corrupt)


# ----------------------------------------------------------------------- comparisons
def _equal(a, b, what):
    """Bit-for-bit equality of nested dicts / lists / tensors / numbers."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), what
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), what
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (what, a.keys(), getattr(b, "keys", lambda: b)())
        for k in a:
            _equal(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{what}[{i}]")
    else:
        assert a == b, (what, a, b)


# A-EDiT on a fake clock (worker w takes SECONDS_PER_STEP[w] s a step), syncing every 4 s, with a
# global budget; used by the elastic A-EDiT resume test.
AEDIT = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, local_sgd_warmup_steps=1,
             min_total_global_steps=1, sync_mode="step_end")


def async_budget_job(rank, world, instances, train_iters, seconds_per_step, save=None, stop_after_syncs=None,
                     load=None):
    """A-EDiT with a budget of ``train_iters`` x ``instances`` worker-steps. ``save``: a path
    written at the ``stop_after_syncs``-th real sync, where the run then stops (as Megatron-LM's
    ``--save-interval`` / ``--exit-interval`` do at a sync). ``load``: a path to resume from.
    Returns this worker's step counts, its global progress at each sync and at the end."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    from edit_runs import MICRO_BATCH
    from gpt_utils import make_batches, rank_micro_batches, train_step

    ps.initialize_model_parallel(num_distributed_optimizer_instances=instances)
    ddp, opt, ctl = _setup(AEDIT, instances, bucket_size=ONE_BUCKET)
    ctl.budget_steps = train_iters * instances
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    worker = dp_rank // (dp // instances)
    now = [0.0]
    ctl.clock = lambda: now[0]
    loaded = None
    if load is not None:
        _load(ddp, opt, load, DP_RESHARDABLE)
        loaded = dict(steps_done=ctl.steps_done, global_progress=ctl.global_progress)
    batches = make_batches(8 * train_iters, WORLD * MICRO_BATCH)
    start, syncs, progress_at_syncs = ctl.steps_done, 0, []
    while not ctl.finished:
        step = ctl.steps_done + 1
        train_step(ddp, opt, rank_micro_batches(batches[step - 1], dp_rank, dp))
        now[0] += seconds_per_step[worker]
        if ctl.at_sync and not ctl.last_sync.skipped:
            syncs += 1
            progress_at_syncs.append(ctl.global_progress)
            if save is not None and syncs == stop_after_syncs:
                _save(ddp, opt, save, DP_RESHARDABLE)
                break
    out = dict(worker=worker, start=start, steps_done=ctl.steps_done, finished=ctl.finished, loaded=loaded,
               progress=ctl.global_progress, progress_at_syncs=progress_at_syncs,
               worker_steps=list(ctl.last_sync.worker_steps))
    me.unpatch_megatron_for_local_sgd()
    return out


def moe_checkpoint_job(rank, world, model, local_sgd, path, steps, save_at=None, load_at=None, ep=2, instances=2,
                       tp=1, etp=None):
    """EDiT on a MoE GPT with expert parallelism ``ep`` (``instances`` workers): train to
    ``steps``, saving at ``save_at`` or resuming from ``load_at`` (the checkpoint at ``path``);
    returns every rank's final parameters and both controllers' anchors, mains and outer state
    (also at the save, and right after the load)."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    from edit_runs import MICRO_BATCH, _build, default_spec
    from gpt_utils import make_batches, rank_micro_batches, train_step

    ps.initialize_model_parallel(num_distributed_optimizer_instances=instances, expert_model_parallel_size=ep,
                                 tensor_model_parallel_size=tp,
                                 **(dict(expert_tensor_parallel_size=etp) if etp is not None else {}))
    me.patch_megatron_for_local_sgd(me.LocalSGDConfig(**local_sgd), me.OuterOptimizerConfig(**OUTER))
    ddp, opt = _build(default_spec(model=model, instances=instances), tp, 1)
    controllers = me.get_local_sgd(opt)

    def states():
        out = []
        for c in controllers:
            outer = c.outer_optimizer
            out.append(dict(
                steps_done=c.steps_done,
                anchors=[s.anchor.clone() for s in c.shards],
                mains=[s.read_current(torch.empty(s.numel)) for s in c.shards],
                outer=[{k: v.clone() for k, v in outer.state[s.anchor].items()} for s in c.shards]))
        return out

    def biases():  # MoE expert bias: buffers
        return [m.expert_bias.clone() for m in ddp.module.modules() if getattr(m, "expert_bias", None) is not None]

    first, out = 1, dict(ep_rank=ps.get_expert_model_parallel_rank(), worker=opt.chained_optimizers[0]
                         .distributed_optimizer_instance_id if hasattr(opt, "chained_optimizers") else None)
    if load_at is not None:
        _load(ddp, opt, path)
        first = load_at + 1
        out["loaded"] = states()
        out["loaded_biases"] = biases()
    # data cut for 4 data-parallel ranks whatever the layout (as train_job)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = make_batches(steps, WORLD * MICRO_BATCH)
    per_rank = WORLD // dp
    for step in range(first, steps + 1):
        mine = torch.cat([rank_micro_batches(batches[step - 1], dp_rank * per_rank + i, WORLD) for i in range(per_rank)], 1)
        train_step(ddp, opt, mine)
        if step == save_at:
            _save(ddp, opt, path)
            out["saved"] = states()
            out["saved_biases"] = biases()
    from gpt_utils import named_params

    ddp.start_param_sync(force_sync=True)
    out.update(params=named_params(ddp), controllers=states(), expert_biases=biases())
    me.unpatch_megatron_for_local_sgd()
    return out


# ----------------------------------------------------------------------- Megatron-FSDP (fsdp_dtensor)
FSDP_DTENSOR = {"distrib_optim_sharding_type": "fsdp_dtensor"}  # Megatron-LM's --ckpt-format fsdp_dtensor


def _fsdp_state_dict(ddp, opt, is_loading=False, optimizer=True) -> dict:
    """What Megatron-LM's fsdp_dtensor save / load hands to torch.distributed.checkpoint
    (``optimizer=False``: the model alone, as with --no-load-optim)."""
    from megatron.core.distributed.fsdp.src.megatron_fsdp.uneven_dtensor import (
        preprocess_state_dict_for_uneven_dtensor,
    )

    state = {"model": ddp.state_dict()}
    if optimizer:
        state["optimizer"] = opt.sharded_state_dict(state, is_loading=is_loading, metadata=FSDP_DTENSOR)
    experts = ddp.config.num_moe_experts
    if experts:  # local expert numbers -> global ones (the same tensors), as Megatron-LM does
        from megatron.core.transformer.fsdp_dtensor_checkpoint import handle_experts_in_state_dict

        state["model"] = handle_experts_in_state_dict(dict(state["model"]), experts)
    preprocess_state_dict_for_uneven_dtensor(state)
    return state


def fsdp_save(ddp, opt, path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save(_fsdp_state_dict(ddp, opt), checkpoint_id=path)


def fsdp_load(ddp, opt, path, optimizer=True) -> None:
    import torch.distributed.checkpoint as dcp

    model = ddp.state_dict()  # the local names of the tensors DCP loads into
    state = _fsdp_state_dict(ddp, opt, is_loading=True, optimizer=optimizer)
    dcp.load(state, checkpoint_id=path)
    ddp.module.load_state_dict(model if ddp.config.num_moe_experts else state["model"])
    if optimizer:
        opt.load_state_dict(state["optimizer"])


def _fsdp_state(ddp, opt, ctl) -> dict:
    """Everything an exact resume must reproduce on this rank (Megatron-FSDP): the gathered
    parameters, Adam's state, EDiT's."""
    from edit_runs import full_params

    # (by position: Megatron's _param_name caches the names of whichever parameters the module
    # holds at its first call, the raw ones after a forward pass; a parameter with no element in
    # this rank's shard has no Adam state that means anything)
    adam = [{k: (v.to_local() if hasattr(v, "to_local") else v).clone() for k, v in opt.optimizer.state[p].items()}
            for g in opt.optimizer.param_groups for p in g["params"] if p.to_local().numel()]
    out = dict(params=full_params(ddp), adam=adam,
               expert_biases=[m.expert_bias.clone() for m in ddp.modules() if getattr(m, "expert_bias", None) is not None])
    if ctl is not None:
        outer = ctl.outer_optimizer
        out.update(
            steps_done=ctl.steps_done, last_sync_step=ctl._last_sync_step,
            anchors=[None if s.anchor is None else s.anchor.clone() for s in ctl.shards],
            outer=[{k: v.clone() for k, v in outer.state[s.anchor].items()} if outer else None for s in ctl.shards],
            mains=[s.read_current(torch.empty(s.numel)) for s in ctl.shards],
            residuals=[None if s.residual is None else s.residual.clone() for s in ctl.shards],
            extra=ctl.extra_state())
    return out


def fsdp_train_job(rank, world, local_sgd=EDIT, instances=2, steps=STEPS, load=None, saves=(), path=None,
                   snapshots=(), load_optimizer=True, train_iters=True, model=None, ep=1):
    """EDiT on Megatron-FSDP (HSDP, ``instances`` workers over the 4 ranks): optionally resume at
    step ``load`` from ``path``, train to ``steps`` saving at ``saves`` (``path/step_<n>``);
    returns the final state and the states at ``snapshots``. ``local_sgd`` None: plain
    Megatron-FSDP (no EDiT). ``model``: the GPT's options (MoE), ``ep`` its expert parallelism."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    from edit_runs import MICRO_BATCH, _build, default_spec
    from gpt_utils import make_batches, rank_micro_batches, train_step

    ps.initialize_model_parallel(num_distributed_optimizer_instances=instances,
                                 **(dict(expert_model_parallel_size=ep) if ep > 1 else {}))
    if local_sgd is None:  # plain Megatron-FSDP, with megatron_edit's fixes of its checkpoints
        me.unpatch_megatron_for_local_sgd()
        me.patch_megatron_load_fixes()
    else:
        me.patch_megatron_for_local_sgd(me.LocalSGDConfig(**local_sgd), me.OuterOptimizerConfig(**OUTER))
    ddp, opt = _build(default_spec(instances=instances, fsdp=True, **(dict(model=model) if model else {})), 1, 1)
    controllers = me.get_local_sgd(opt)
    ctl = controllers[0] if controllers else None
    if ctl is not None and train_iters:  # the run's last step known (Megatron-LM's --train-iters)
        me.set_train_iters(opt, steps)
    first, loaded = 1, None
    if load is not None:
        fsdp_load(ddp, opt, os.path.join(path, f"step_{load}"), optimizer=load_optimizer)
        loaded = _fsdp_state(ddp, opt, ctl)
        first = load + 1
    batches = make_batches(STEPS, WORLD * MICRO_BATCH)
    dp_rank = ps.get_data_parallel_rank()
    out = dict(snapshots={}, losses={})
    for step in range(first, steps + 1):
        out["losses"][step] = train_step(ddp, opt, rank_micro_batches(batches[step - 1], dp_rank, WORLD))
        if step in saves:
            fsdp_save(ddp, opt, os.path.join(path, f"step_{step}"))
        if step in snapshots:
            out["snapshots"][step] = _fsdp_state(ddp, opt, ctl)
    out.update(final=_fsdp_state(ddp, opt, ctl), loaded=loaded, reports=ctl.drain_reports() if ctl else [],
               worker=dp_rank // (WORLD // instances))
    me.unpatch_megatron_for_local_sgd()
    me.unpatch_megatron_load_fixes()
    return out


def async_resume_job(rank, world, local_sgd, seconds_per_step, train_iters, save=None, stop_after_syncs=None,
                     load=None, measurements=None, bucket_size=1000):
    """A-EDiT, 2 workers x 2 ranks, on a fake clock where worker w's step takes
    ``seconds_per_step[w]`` s, with a budget of ``train_iters`` synchronous iterations, to the
    final sync. The clock advances during a step, before the sync at its end reads it, so a run
    resumed from a checkpoint (its interval clock restarts at the load) times each interval as
    the uninterrupted run does. (Advanced after the step, as in edit_runs.async_runs, the sync
    would read the clock before its own step's time: the resumed run's first interval would be
    one step shorter.) ``save``: a path written at the ``stop_after_syncs``-th sync (skipped or
    not), where the run stops; ``load``: a path to resume from. ``measurements``: as in
    :func:`train_job` (None with ``auto_overlap``: the machine's own clocks time the steps and
    exchanges). Returns this worker's syncs, parameters (gathered) and settings in force."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    from edit_runs import MICRO_BATCH, full_params
    from gpt_utils import make_batches, rank_micro_batches, train_step

    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    ddp, opt, ctl = _setup(local_sgd, 2, bucket_size=bucket_size)
    me.set_train_iters(opt, train_iters)
    if measurements is not None:
        from megatron_edit.algorithm.overlap_plan import Measurement

        ctl.auto.measure = lambda: Measurement(*measurements[rank])
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    worker = dp_rank // (dp // 2)
    now = [0.0]
    ctl.clock = lambda: now[0]

    def settings():
        c = ctl.config
        return c.outer_step_delay, c.exchange_dtype, c.fragments

    loaded = None
    if load is not None:
        _load(ddp, opt, load, DP_RESHARDABLE)
        loaded = dict(steps_done=ctl.steps_done, settings=settings(), timed=ctl.auto.timed if ctl.auto else None)
    batches = make_batches(4 * train_iters, WORLD * MICRO_BATCH)
    syncs, reports, saved = 0, [], None
    while not ctl.finished:
        step = ctl.steps_done + 1
        now[0] += seconds_per_step[worker]
        train_step(ddp, opt, rank_micro_batches(batches[step - 1], dp_rank, dp))
        reports += ctl.drain_reports()
        if ctl.at_sync:
            syncs += 1
            if save is not None and syncs == stop_after_syncs:
                _save(ddp, opt, save, DP_RESHARDABLE)
                saved = dict(steps_done=ctl.steps_done, settings=settings())
                break
    in_flight = ctl.delayed is not None and ctl.delayed.in_flight
    ddp.start_param_sync(force_sync=True)  # completes a pending layer-wise sync
    reports += ctl.drain_reports()
    out = dict(worker=worker, loaded=loaded, saved=saved, steps_done=ctl.steps_done, finished=ctl.finished,
               in_flight_at_end=in_flight, params=full_params(ddp), settings=settings(),
               syncs=[(r.step, r.delay, r.fragment, r.final, r.exchange_dtype, r.skipped_sync) for r in reports],
               decisions=None if ctl.auto is None else [(s, ch.outer_step_delay, ch.exchange_dtype, ch.fragments)
                                                        for s, ch, _ in ctl.auto.decisions])
    me.unpatch_megatron_for_local_sgd()
    return out
