"""EDiT state in torch_dist checkpoints (megatron_edit.mcore.checkpoint) on real megatron-core
(CPU, gloo, 4 processes = 2 workers x 2 shards): exact resume, detector statistics, partial
loads, resharding, clear errors, the refused legacy format.

Checkpoints are written the way a megatron-core user (and Megatron-LM's ``--save``) writes them:
``dist_checkpointing.save({'model': m, 'optimizer': opt.sharded_state_dict(m, metadata=...)})``.
"""

import os
import pickle
import shutil
from contextlib import contextmanager

import pytest
import torch

from dist import run_ranks
from megatron_edit.mcore import checkpoint as checkpointing, compat

# EDiT state in checkpoints needs megatron-core 0.16.x; before, saving it is refused
# (tests/test_checkpointing_not_yet.py).
pytestmark = pytest.mark.skipif(
    not checkpointing.SUPPORTED.contains(compat.megatron_core_version()),
    reason=f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}",
)

WORLD = 4
# Layer-wise sync overlapped with the forward pass; warmup 2, H=3: syncs after steps 5 and 8.
EDIT = dict(local_sgd_sync_interval=3, local_sgd_warmup_steps=2, sync_mode="layerwise")
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))
STEPS = 10
DP_RESHARDABLE = {"distrib_optim_sharding_type": "dp_reshardable"}  # Megatron-LM's default
FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable"}
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


def _setup(local_sgd, instances=2, outer=OUTER, bucket_size=3000):
    """Patch, build the tiny GPT in DDP and its distributed optimizer; EDiT unless local_sgd
    is None. The default bucket size gives 7 buckets (7 layer-wise sync groups)."""
    import megatron_edit as me
    from edit_runs import _build, default_spec

    if local_sgd is None:
        me.unpatch_megatron_for_local_sgd()
    else:
        me.patch_megatron_for_local_sgd(me.LocalSGDConfig(**local_sgd), me.OuterOptimizerConfig(**outer))
    ddp, opt = _build(default_spec(instances=instances, bucket_size=bucket_size), 1, 1)
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


def _state(ddp, opt, ctl, gather=True) -> dict:
    """Everything an exact resume must reproduce, on this rank. ``gather=False``: the model's
    parameters as they are (right after a load they must already be the worker's own)."""
    from gpt_utils import named_params

    if gather:
        ddp.start_param_sync(force_sync=True)  # completes a pending layer-wise sync too
    inner = opt.chained_optimizers[0].optimizer
    adam = [{k: (v.clone() if torch.is_tensor(v) else v) for k, v in inner.state[p].items()}
            for g in inner.param_groups for p in g["params"]]
    out = dict(params=named_params(ddp), adam=adam, steps_done=None)
    if ctl is not None:
        outer = ctl.outer_optimizer
        out.update(
            steps_done=ctl.steps_done,
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


def _train(ddp, opt, ctl, first, last, saves=None, snapshots=(), faults=()):
    """Steps first..last on the same data as every other run; saves {step: [(path, metadata[,
    fully_parallel])]};
    ``faults`` as in edit_runs (a worker's parameters corrupted after its optimizer step)."""
    from megatron.core import parallel_state as ps

    from edit_runs import MICRO_BATCH, _inject_fault
    from gpt_utils import make_batches, rank_micro_batches, train_step

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    batches = make_batches(STEPS, WORLD * MICRO_BATCH)  # always cut for 4 data-parallel ranks
    per_rank = WORLD // dp
    out = {}
    for step in range(first, last + 1):
        mine = torch.cat([rank_micro_batches(batches[step - 1], dp_rank * per_rank + i, WORLD) for i in range(per_rank)], 1)
        train_step(ddp, opt, mine)
        if faults:
            worker = dp_rank // (dp // ctl.num_workers)
            _inject_fault({"faults": faults}, step, worker, [m for sh in ctl.shards for m in sh.mains])
        for path, metadata, *fully_parallel in (saves or {}).get(step, ()):
            _save(ddp, opt, path, metadata, *fully_parallel)
        if step in snapshots:
            out[step] = _state(ddp, opt, ctl)
    return out


def train_job(rank, world, local_sgd=EDIT, instances=2, steps=STEPS, load=None, saves=None, snapshots=(),
              bucket_size=3000, faults=()):
    """One training run: optionally resume from ``load=(path, metadata, step)``, train to
    ``steps``, return the final state, snapshots and the sync reports."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=instances)
    ddp, opt, ctl = _setup(local_sgd, instances, bucket_size=bucket_size)
    first = 1
    loaded = None
    if load is not None:
        path, metadata, step = load
        _load(ddp, opt, path, metadata)
        loaded = _state(ddp, opt, ctl, gather=False)
        first = step + 1
    snaps = _train(ddp, opt, ctl, first, steps, saves, snapshots, faults)
    out = dict(final=_state(ddp, opt, ctl), loaded=loaded, snapshots=snaps,
               reports=ctl.drain_reports() if ctl else [], worker=ps.get_data_parallel_rank() // (ps.get_data_parallel_world_size() // instances))
    me.unpatch_megatron_for_local_sgd()
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
    """Try each load in ``cases`` ([(name, path)] or [(name, path, metadata)]) in turn; returns
    {name: error message}. The errors must be raised on every rank (or the other ranks would
    hang in the collectives)."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=instances)
    if plain_save is not None:  # a checkpoint of ordinary (synchronous) Megatron training
        ddp, opt, _ = _setup(None, instances)
        _train(ddp, opt, None, 1, 1)
        _save(ddp, opt, plain_save)
    out = {}
    for name, path, *metadata in cases:
        ddp, opt, _ = _setup(EDIT, instances)
        try:
            _load(ddp, opt, path, *metadata)
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


def _same_params(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------- tests
@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """An uninterrupted run to step 10, and the same run saving at the sync boundary (step 5,
    sync pending in layer-wise mode) and between syncs (step 7, with Megatron-LM's fully
    parallel save strategy, which may pick any data-parallel rank to write a shard)."""
    root = tmp_path_factory.mktemp("edit_ckpt")
    ckpt = {5: str(root / "step5"), 7: str(root / "step7")}
    saves = {5: [(ckpt[5], DP_RESHARDABLE)], 7: [(ckpt[7], DP_RESHARDABLE, True)]}
    reference = run_ranks(train_job, WORLD, timeout=200)  # no snapshot: nothing but training
    saver = run_ranks(train_job, WORLD, saves=saves, snapshots=(5, 7), timeout=200)
    return dict(reference=reference, saver=saver, ckpt=ckpt, root=root)


@pytest.mark.timeout(420)
def test_saving_neither_syncs_nor_changes_training(runs):
    """Saving twice changes nothing: same final state, same number of collectives and bytes
    across workers as the run that never saved (no extra or off-schedule sync), and the step-7
    checkpoint really holds two different workers."""
    for ref, saved in zip(runs["reference"], runs["saver"]):
        _equal(saved["final"], ref["final"], "saver vs uninterrupted")
        assert [r.step for r in saved["reports"]] == [5, 8]
    saver = runs["saver"]
    assert not _same_params(saver[0]["snapshots"][7]["params"], saver[2]["snapshots"][7]["params"])
    assert _same_params(saver[0]["snapshots"][5]["params"], saver[2]["snapshots"][5]["params"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("step", [5, 7], ids=["sync-boundary", "mid-interval"])
def test_exact_resume(runs, step):
    """Restart from the checkpoint in fresh processes and continue to step 10: parameters of
    both workers, inner Adam state, main params, anchor, outer momentum, counters and detector
    state are bit-identical to the uninterrupted run; the restored state equals the saved one."""
    resumed = run_ranks(train_job, WORLD, load=(runs["ckpt"][step], DP_RESHARDABLE, step), timeout=200)
    _assert_exact(runs["reference"], runs["saver"], resumed, step)


@pytest.mark.timeout(300)
def test_exact_resume_fully_reshardable_format(tmp_path):
    """The same between syncs with Megatron's 'fully_reshardable' optimizer format (one bucket:
    with several, megatron-core 0.16's format itself misplaces state and is refused)."""
    path = str(tmp_path / "fully")
    kwargs = dict(bucket_size=10**8)
    saver = run_ranks(train_job, WORLD, saves={7: [(path, FULLY_RESHARDABLE)]}, snapshots=(7,), **kwargs, timeout=200)
    resumed = run_ranks(train_job, WORLD, load=(path, FULLY_RESHARDABLE, 7), **kwargs, timeout=200)
    _assert_exact(saver, saver, resumed, 7)


def _assert_exact(reference, savers, resumed, step):
    """Per rank: the restored state is the saved one, the final state the uninterrupted one
    (sync traffic counters aside: the resumed process counts from its start)."""
    for ref, saved_run, res in zip(reference, savers, resumed):
        loaded = {k: v for k, v in res["loaded"].items() if k not in ("collectives", "payload")}
        saved = {k: v for k, v in saved_run["snapshots"][step].items() if k not in ("collectives", "payload")}
        _equal(loaded, saved, f"restored state after step {step}")
        final = {k: v for k, v in res["final"].items() if k not in ("collectives", "payload")}
        expected = {k: v for k, v in ref["final"].items() if k not in ("collectives", "payload")}
        _equal(final, expected, "resumed vs uninterrupted")
        assert [r.step for r in res["reports"]] == [8]


@pytest.mark.timeout(420)
def test_exact_resume_with_quantized_exchange_and_error_feedback(tmp_path):
    """int4 exchange with error feedback, saved between syncs: the residuals (each worker's
    own and the chunk each one requantizes) are restored, and the run continues bit-identical
    to the uninterrupted one."""
    quantized = dict(EDIT, exchange_dtype="int4", exchange_block_size=64, exchange_error_feedback=True)
    path = str(tmp_path / "int4")
    reference = run_ranks(train_job, WORLD, local_sgd=quantized, timeout=200)
    saver = run_ranks(train_job, WORLD, local_sgd=quantized, steps=7, saves={7: [(path, DP_RESHARDABLE)]},
                      snapshots=(7,), timeout=200)
    resumed = run_ranks(train_job, WORLD, local_sgd=quantized, load=(path, DP_RESHARDABLE, 7), timeout=200)
    _assert_exact(reference, saver, resumed, 7)
    residuals = reference[0]["final"]["residuals"]
    assert all(r is not None and c is not None for r, c in residuals)
    assert any(r.abs().sum() > 0 for r, _ in residuals)  # something was dropped and kept


@pytest.mark.timeout(300)
def test_penalty_detector_statistics_are_restored(tmp_path):
    """Penalty on (weights, clipping, anomaly detector): resumed between syncs, the syncs after
    the restart make the decisions of the uninterrupted run (norms, exclusions, weights, clip
    factors) and the detector statistics and parameters stay bit-identical."""
    from megatron_edit.mcore.controller import LocalSGD

    if not hasattr(LocalSGD, "extra_state"):
        pytest.skip("LocalSGD.extra_state() (detector statistics) does not exist yet")
    path = str(tmp_path / "penalty")
    # Syncs after steps 3, 5, 7, 9. Worker 1's parameters go wrong after step 6 (in the
    # checkpoint): only statistics restored from the checkpoint can flag it at the sync after 7.
    faults = [dict(workers=[1], steps=[6], kind="scale", factor=1.5)]
    kwargs = dict(local_sgd=PENALTY, steps=9, faults=faults)
    reference = run_ranks(train_job, WORLD, snapshots=(6,), **kwargs, timeout=200)
    run_ranks(train_job, WORLD, steps=6, local_sgd=PENALTY, faults=faults, saves={6: [(path, DP_RESHARDABLE)]},
              timeout=200)
    resumed = run_ranks(train_job, WORLD, load=(path, DP_RESHARDABLE, 6), **kwargs, timeout=200)
    for ref, res in zip(reference, resumed):
        ewma = ref["snapshots"][6]["extra"]["ewma"]
        assert int(ewma["count"].min()) >= 1, "the detector had no statistics to restore"
        _equal(res["loaded"]["extra"], ref["snapshots"][6]["extra"], "detector statistics after load")
        after = [r for r in ref["reports"] if r.step > 6]
        assert [r.step for r in res["reports"]] == [r.step for r in after] == [7, 9]
        for mine, theirs in zip(res["reports"], after):
            for field in ("norms", "excluded", "weights", "clip_coef", "skipped"):
                _equal(getattr(mine, field), getattr(theirs, field), f"sync {mine.step} {field}")
        _equal(res["final"]["params"], ref["final"]["params"], "parameters")
        _equal(res["final"]["extra"], ref["final"]["extra"], "detector statistics at the end")
    first_after = resumed[0]["reports"][0]
    assert first_after.excluded[1].any() and not first_after.excluded[0].any(), first_after.excluded


@pytest.mark.timeout(300)
def test_resume_with_a_different_shard_size(runs):
    """The 2 workers x 2 shards checkpoint taken between syncs loads into 2 workers x 1 shard
    (2 processes): each worker's parameters and the anchor are restored exactly; training
    continues and the workers agree after the next sync."""
    resumed = run_ranks(train_job, 2, load=(runs["ckpt"][7], DP_RESHARDABLE, 7), snapshots=(8,), timeout=200)
    ref = runs["saver"]
    for res in resumed:
        w = res["worker"]
        saved = ref[2 * w]["snapshots"][7]
        _equal(res["loaded"]["params"], saved["params"], f"worker {w} parameters")
        assert res["loaded"]["steps_done"] == 7
        for i, anchor in enumerate(res["loaded"]["anchors"]):
            halves = torch.cat([ref[2 * w]["snapshots"][7]["anchors"][i], ref[2 * w + 1]["snapshots"][7]["anchors"][i]])
            assert torch.equal(anchor, halves[: anchor.numel()]), f"anchor of bucket {i}"
        assert [r.step for r in res["reports"]] == [8]
    assert _same_params(resumed[0]["snapshots"][8]["params"], resumed[1]["snapshots"][8]["params"])
    # Different reduction order inside a worker: close to the 4-process run, not bit-equal.
    for res in resumed:
        for k, v in ref[2 * res["worker"]]["final"]["params"].items():
            assert torch.allclose(res["final"]["params"][k], v, atol=1e-4), k


@pytest.mark.timeout(300)
def test_model_only_load_restarts_edit_from_worker_0_and_legacy_format_is_refused(runs, tmp_path):
    """``--no-load-optim``-style load of a checkpoint taken between syncs: every worker gets
    worker 0's model and EDiT starts afresh (no anchor, warmup again), so the workers stay
    consistent. The legacy ``torch`` format (save/load_parameter_state) is refused clearly."""
    results = run_ranks(model_only_and_legacy_job, WORLD, runs["ckpt"][7], str(tmp_path), timeout=200)
    worker0_params = runs["saver"][0]["snapshots"][7]["params"]
    for r in results:
        _equal(r["loaded"]["params"], worker0_params, "model-only load")
        assert r["loaded"]["steps_done"] == 0 and r["loaded"]["anchors"] == [None] * len(r["loaded"]["anchors"])
        for name, message in r["refused"].items():
            assert message and message.startswith("NotSupportedYet") and "torch_dist" in message, (name, message)
    # Two synchronous warmup steps from the same model: the workers are still identical.
    assert _same_params(results[0]["after"]["params"], results[2]["after"]["params"])


@pytest.mark.timeout(300)
def test_missing_or_corrupted_edit_state_is_a_clear_error(runs, tmp_path):
    """Loading with EDiT on fails on every rank, never a silent fresh start: CheckpointStateError
    naming the problem for a checkpoint of ordinary training and for one whose anchor or
    worker-1 part was removed; NotSupportedYet for the optimizer format megatron-core 0.16
    corrupts; torch.distributed.checkpoint's own unpickling error for garbled record bytes."""
    src = runs["ckpt"][7]
    cases = {"plain": str(tmp_path / "plain")}
    for name, prefix in (("no-anchor", "local_sgd.anchor"), ("no-worker-1", "local_sgd.worker_1.")):
        cases[name] = str(tmp_path / name)
        shutil.copytree(src, cases[name])
        _drop_from_checkpoint(cases[name], prefix)
    cases["garbled-record"] = str(tmp_path / "garbled")
    shutil.copytree(src, cases["garbled-record"])
    _garble_object(cases["garbled-record"], "local_sgd.record")
    cases = [(name, path) for name, path in cases.items()]
    # 7 buckets: megatron-core 0.16's fully_reshardable format would misplace state.
    cases.insert(0, ("fully-reshardable-padded-buckets", src, FULLY_RESHARDABLE))
    results = run_ranks(load_errors_job, WORLD, cases, plain_save=str(tmp_path / "plain"), timeout=250)
    expected = {
        "fully-reshardable-padded-buckets": "misplaces the optimizer state",
        "plain": "has no EDiT (local SGD) state",
        "no-anchor": "is incomplete or corrupted",
        "no-worker-1": "holds EDiT state of 1 worker(s)",
        "garbled-record": "UnpicklingError",  # torch.distributed.checkpoint's own error
    }
    for r in results:
        for name, fragment in expected.items():
            message = r[name]
            assert message is not None, f"{name}: loaded without error"
            assert fragment in message, (name, message)
            if name not in ("garbled-record", "fully-reshardable-padded-buckets"):
                assert message.startswith("CheckpointStateError"), (name, message)


@pytest.mark.timeout(300)
def test_corrupted_record_and_worker_count_change_are_refused(runs, tmp_path):
    """A record with an impossible step count, and a 2-worker checkpoint loaded by 1 or 4
    workers: CheckpointStateError naming the cause."""
    path = str(tmp_path / "bad_record")
    run_ranks(corrupt_save_job, WORLD, path, timeout=200)
    (bad,) = {m for r in run_ranks(load_errors_job, WORLD, [("bad", path)], timeout=200) for m in r.values()}
    assert bad.startswith("CheckpointStateError") and "corrupted EDiT step count" in bad, bad
    for instances, fragment in ((1, "holds EDiT state of 2 workers, this run has 1"),
                                (4, "holds EDiT state of 2 worker(s), this run has more")):
        messages = {m for r in run_ranks(load_errors_job, WORLD, [("n", runs["ckpt"][7])], instances=instances,
                                         timeout=200) for m in r.values()}
        assert len(messages) == 1, messages
        (message,) = messages
        assert message and message.startswith("CheckpointStateError") and fragment in message, message

