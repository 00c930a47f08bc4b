"""Elastic resume of EDiT checkpoints (megatron_edit.mcore.checkpoint.resume) on real
megatron-core (CPU, gloo): another worker count, another TP / PP layout, synchronous <-> EDiT.

One run saves 2 workers x 2 shards (TP 1, PP 1) at the sync boundary (step 5) and between syncs
(step 7), in Megatron's ``fully_reshardable`` and ``dp_reshardable`` formats; each case resumes
it with another layout in fresh processes and continues to step 10 (a sync at 8). The numbers
are checked against the saved workers' states, per model tensor (tests/checkpoint_runs.py
``canonical``): after a worker-count change every worker holds the model of one outer step over
the saved workers (Delta = mean of anchor - worker's params, Nesterov momentum 0.9, lr 0.7,
with the saved momentum), computed here from the saved tensors.
"""

import math

import pytest
import torch

from checkpoint_runs import (
    DP_RESHARDABLE,
    EDIT,
    FULLY_RESHARDABLE,
    ONE_BUCKET,
    OUTER,
    WORLD,
    _equal,
    full_tensors,
    load_errors_job,
    train_job,
)
from dist import run_ranks
from megatron_edit.mcore import checkpoint as checkpointing, compat

pytestmark = pytest.mark.skipif(
    not checkpointing.SUPPORTED.contains(compat.megatron_core_version()),
    reason=f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}",
)

LR, MOMENTUM = OUTER["outer_optim_kwargs"]["lr"], OUTER["outer_optim_kwargs"]["momentum"]
# Resumed layouts: (processes, workers, TP, PP, checkpoint). 2 x 1 (another shard size) is
# test_checkpointing.test_resume_with_a_different_shard_size.
CASES = {
    "1x4": (4, 1, 1, 1, "dp7"),  # 2 -> 1 worker; Megatron-LM's default optimizer format
    "4x1": (4, 4, 1, 1, "fully7"),  # 2 -> 4 workers: workers 2, 3 take Adam of saved 0, 1
    "1x2-TP2": (4, 1, 2, 1, "fully7"),  # 2 -> 1 worker and TP 1 -> 2 at once
    "2x1-PP2": (4, 2, 1, 2, "fully7"),  # same workers, PP 1 -> 2
    "4x1-at-sync": (4, 4, 1, 1, "fully5"),  # saved at a sync boundary: no outer step at load
}
ATOL = 1e-6  # an fp32 outer step summed in another order: a few ulps of values ~0.1


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """2 workers x 2 shards, one bucket, to step 10 (the uninterrupted run), saving at 5 and 7."""
    root = tmp_path_factory.mktemp("elastic")
    paths = {name: str(root / name) for name in ("fully5", "fully7", "dp7")}
    saves = {5: [(paths["fully5"], FULLY_RESHARDABLE)],
             7: [(paths["fully7"], FULLY_RESHARDABLE), (paths["dp7"], DP_RESHARDABLE)]}
    ranks = run_ranks(train_job, WORLD, bucket_size=ONE_BUCKET, saves=saves, snapshots=(5, 7),
                      with_canonical=True, timeout=300)
    return dict(ranks=ranks, paths=paths, metadata=dict(fully5=FULLY_RESHARDABLE, fully7=FULLY_RESHARDABLE,
                                                        dp7=DP_RESHARDABLE))


def _worker_tensors(ranks, kind, snapshot=None, loaded=False):
    """{worker: {key: global tensor}} of ``kind`` from the ranks of a run."""
    out = {}
    for r in ranks:
        state = r["loaded"] if loaded else r["snapshots"][snapshot]
        out.setdefault(r["worker"], []).append(state["canonical"])
    return {w: full_tensors(cs, kind) for w, cs in out.items()}


def _expected_outer_step(ranks, step):
    """The anchor and momentum after one outer step over the saved workers at ``step``."""
    params = _worker_tensors(ranks, "params", step)
    anchor = _worker_tensors(ranks, "anchor", step)[0]
    momentum = _worker_tensors(ranks, "momentum_buffer", step)[0]
    new_anchor, new_momentum = {}, {}
    for key, a in anchor.items():
        delta = sum(a - params[w][key] for w in sorted(params)) / len(params)
        m = MOMENTUM * momentum[key] + delta
        new_anchor[key] = a - LR * (delta + MOMENTUM * m)  # Nesterov, as torch.optim.SGD
        new_momentum[key] = m
    return new_anchor, new_momentum


def _close(a: dict, b: dict, what, exact=False):
    assert a.keys() == b.keys(), what
    for key in a:
        assert not torch.isnan(a[key]).any(), (what, key, "not covered")
        if exact:
            assert torch.equal(a[key], b[key]), (what, key)
        else:
            torch.testing.assert_close(a[key], b[key], atol=ATOL, rtol=0, msg=f"{what} {key}")


def _mean_loss(ranks, step):
    """The global batch's loss at ``step``: the mean over the last pipeline stage's ranks (each
    holds an equal share of the samples)."""
    values = [r["losses"][step] for r in ranks if r["last_stage"]]
    return sum(values) / len(values)


def _assert_loss_goes_on(resumed, reference, steps):
    """At each step the resumed run's loss is within the noise of the uninterrupted run's: the
    spread of its ranks' losses (each on its own quarter of the batch) around their mean."""
    for step in steps:
        mean = _mean_loss(reference, step)
        noise = max(abs(r["losses"][step] - mean) for r in reference)
        got = _mean_loss(resumed, step)
        print(f"step {step}: resumed {got:.4f}, uninterrupted {mean:.4f} +- {noise:.4f}")
        assert math.isfinite(got) and abs(got - mean) <= noise, (step, got, mean, noise)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(CASES))
def test_resume_with_another_layout(saved, case):
    """After the load every worker holds the specified combination of the saved workers' states
    (one outer step over them after a worker-count change mid-interval; its own state when the
    workers stay, resharded for PP; the saved anchor at a sync boundary), each worker's Adam
    state is a saved worker's, the next sync leaves the workers identical, and the loss goes on
    within noise of the uninterrupted run."""
    world, workers, tp, pp, name = CASES[case]
    step = 5 if name == "fully5" else 7
    resumed = run_ranks(train_job, world, instances=workers, tp=tp, pp=pp, bucket_size=ONE_BUCKET,
                        load=(saved["paths"][name], saved["metadata"][name], step), snapshots=(8,),
                        with_canonical=True, timeout=300)
    ref = saved["ranks"]
    saved_params = _worker_tensors(ref, "params", step)
    saved_adam = _worker_tensors(ref, "exp_avg_sq", step)
    loaded = _worker_tensors(resumed, "params", loaded=True)
    anchor = _worker_tensors(resumed, "anchor", loaded=True)
    momentum = _worker_tensors(resumed, "momentum_buffer", loaded=True)
    assert sorted(loaded) == list(range(workers))
    if workers != 2 and step == 7:  # one outer step over the 2 saved workers
        expected, expected_momentum = _expected_outer_step(ref, step)
        assert not torch.equal(saved_params[0]["output_layer.weight"], saved_params[1]["output_layer.weight"])
        for w in range(workers):
            _close(loaded[w], expected, f"worker {w} model")
            _close(anchor[w], expected, f"worker {w} anchor")
            _close(momentum[w], expected_momentum, f"worker {w} outer momentum")
            _close(loaded[w], loaded[0], "workers identical after the load", exact=True)
    else:  # each worker its own saved model (at a sync boundary: all the same, the anchor)
        saved_anchor = _worker_tensors(ref, "anchor", step)[0]
        saved_momentum = _worker_tensors(ref, "momentum_buffer", step)[0]
        for w in range(workers):
            _close(loaded[w], saved_params[w % 2], f"worker {w} model", exact=True)
            _close(anchor[w], saved_anchor, f"worker {w} anchor", exact=True)
            _close(momentum[w], saved_momentum, f"worker {w} outer momentum", exact=True)
    adam = _worker_tensors(resumed, "exp_avg_sq", loaded=True)
    for w in range(workers):  # worker m: the inner state of saved worker m mod N
        _close(adam[w], saved_adam[w % 2], f"worker {w} Adam state", exact=True)
    for r in resumed:
        assert r["loaded"]["steps_done"] == step
        assert [rep.step for rep in r["reports"]] == [8]  # the schedule's grid goes on
    after_sync = _worker_tensors(resumed, "params", 8)
    for w in range(workers):
        _close(after_sync[w], after_sync[0], "workers identical after the next sync", exact=True)
    _assert_loss_goes_on(resumed, ref, range(step + 1, 11))


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("weights", ["mean", "penalty"])
def test_error_feedback_residuals_follow_a_worker_count_change(tmp_path, weights):
    """int4 exchange with error feedback, 2 workers x 2 shards (7 buckets) saved between syncs,
    resumed by 4 workers x 1: the saved residuals carry on in the next result as they would
    have (review item 3): with the plain mean every new worker's residual is the mean of the
    saved workers' (the result divides by the workers); with the penalty's weights the result
    is a weighted sum, and each new worker carries the sum / 4 (the mean would carry 4 / 2 x
    the sum). The reduced result's residual is the saved one cut into 4 chunks, the model the
    outer step over the saved workers, and the next (quantized) sync leaves the workers
    identical."""
    quantized = dict(EDIT, exchange_dtype="int4", exchange_block_size=64, exchange_error_feedback=True)
    if weights == "penalty":
        quantized.update(pseudo_gradnorm_reduce=True)
    path = str(tmp_path / "int4")
    saver = run_ranks(train_job, WORLD, local_sgd=quantized, steps=7, saves={7: [(path, DP_RESHARDABLE)]},
                      snapshots=(7,), with_canonical=True, timeout=300)
    resumed = run_ranks(train_job, WORLD, local_sgd=quantized, instances=4, load=(path, DP_RESHARDABLE, 7),
                        snapshots=(8,), with_canonical=True, timeout=300)
    saved_residual = _worker_tensors(saver, "residual", 7)
    share = 2 if weights == "mean" else 4
    mean = {k: (saved_residual[0][k] + saved_residual[1][k]) / share for k in saved_residual[0]}
    assert any(v.abs().sum() > 0 for v in mean.values())  # something was dropped and kept
    residual = _worker_tensors(resumed, "residual", loaded=True)
    result = _worker_tensors(resumed, "result_residual", loaded=True)
    saved_result = _worker_tensors(saver, "result_residual", 7)[0]
    expected, _ = _expected_outer_step(saver, 7)
    loaded = _worker_tensors(resumed, "params", loaded=True)
    for w in range(4):
        _close(residual[w], mean, f"worker {w} residual")
        _close(result[w], saved_result, f"worker {w} view of the result residual", exact=True)
        _close(loaded[w], expected, f"worker {w} model")
    after_sync = _worker_tensors(resumed, "params", 8)
    for w in range(4):
        _close(after_sync[w], after_sync[0], "workers identical after the next sync", exact=True)


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(600)
def test_sparse_exchange_residuals_follow_a_worker_count_change(tmp_path):
    """The top-k exchange (2%, int2, error feedback by default), 2 workers x 2 shards saved
    between syncs, resumed by 4 workers x 1: every new worker's residual is the mean of the
    saved workers' (the plain mean divides the result by the workers), there is no result
    residual (zeros), the model is the outer step over the saved workers, and the next (sparse)
    sync leaves the workers identical."""
    sparse = dict(EDIT, exchange_dtype="int2", exchange_topk_density=0.02)
    path = str(tmp_path / "topk")
    saver = run_ranks(train_job, WORLD, local_sgd=sparse, steps=7, saves={7: [(path, DP_RESHARDABLE)]},
                      snapshots=(7,), with_canonical=True, timeout=300)
    resumed = run_ranks(train_job, WORLD, local_sgd=sparse, instances=4, load=(path, DP_RESHARDABLE, 7),
                        snapshots=(8,), with_canonical=True, timeout=300)
    saved_residual = _worker_tensors(saver, "residual", 7)
    mean = {k: (saved_residual[0][k] + saved_residual[1][k]) / 2 for k in saved_residual[0]}
    assert all(v.abs().sum() > 0 for v in mean.values())  # most of each pseudo-gradient was kept back
    residual = _worker_tensors(resumed, "residual", loaded=True)
    result = _worker_tensors(resumed, "result_residual", loaded=True)
    expected, _ = _expected_outer_step(saver, 7)
    loaded = _worker_tensors(resumed, "params", loaded=True)
    for w in range(4):
        _close(residual[w], mean, f"worker {w} residual")
        assert all(not v.any() for v in result[w].values()), f"worker {w}: a result residual"
        _close(loaded[w], expected, f"worker {w} model")
    after_sync = _worker_tensors(resumed, "params", 8)
    for w in range(4):
        _close(after_sync[w], after_sync[0], "workers identical after the next sync", exact=True)


@pytest.mark.timeout(600)
def test_synchronous_checkpoint_resumes_edit_with_its_adam_state(tmp_path):
    """Plain Megatron (2 distributed-optimizer instances) saves after 5 steps; EDiT (warmup 2,
    H 3) loads it with the optimizer: every worker gets the model and Adam state, EDiT counts
    the 5 steps and takes its anchor there, and the run is bit-identical to an EDiT run whose
    warmup ended at step 5 (its warmup is synchronous training)."""
    path = str(tmp_path / "sync5")
    sync = run_ranks(train_job, WORLD, local_sgd=None, steps=5, saves={5: [(path, DP_RESHARDABLE)]},
                     snapshots=(5,), timeout=300)
    reference = run_ranks(train_job, WORLD, local_sgd=dict(EDIT, local_sgd_warmup_steps=5), timeout=300)
    resumed = run_ranks(train_job, WORLD, load=(path, DP_RESHARDABLE, 5), timeout=300)
    for plain, ref, res in zip(sync, reference, resumed):
        _equal(res["loaded"]["params"], plain["snapshots"][5]["params"], "model")
        _equal(res["loaded"]["adam"], plain["snapshots"][5]["adam"], "Adam state")
        assert res["loaded"]["steps_done"] == 5
        assert res["loaded"]["global_progress"] == 5.0  # review item 1: it stayed 0
        _equal(res["loaded"]["anchors"], res["loaded"]["mains"], "anchor taken at the load")
        assert [r.step for r in res["reports"]] == [8]
        _equal(res["final"]["params"], ref["final"]["params"], "vs EDiT with warmup to step 5")
        _equal(res["final"]["adam"], ref["final"]["adam"], "Adam vs EDiT with warmup to step 5")


def plain_load_job(rank, world, path, metadata):
    """Plain megatron-core loads an EDiT checkpoint with its optimizer: first without
    megatron_edit (megatron-core 0.16.1's own defect without apex / TE), then with
    patch_megatron_load_fixes()."""
    from checkpoint_runs import _load, _setup

    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(num_distributed_optimizer_instances=2)
    ddp, opt, _ = _setup(None, 2, bucket_size=ONE_BUCKET)
    try:
        _load(ddp, opt, path, metadata)
        return None
    except AssertionError as e:
        return f"AssertionError: {e}"


@pytest.mark.timeout(600)
def test_edit_checkpoint_loads_into_plain_megatron(saved):
    """An EDiT checkpoint taken between syncs, loaded by plain Megatron with its optimizer
    (megatron_edit.patch_megatron_load_fixes(); without it megatron-core 0.16.1 fails without
    apex / TE): every rank gets worker 0's model and inner Adam state; training goes on within
    noise of the uninterrupted EDiT run."""
    from megatron.core.optimizer import distrib_optimizer

    path, ref = saved["paths"]["fully7"], saved["ranks"]
    if not distrib_optimizer.HAVE_APEX_OR_TE:
        failures = run_ranks(plain_load_job, WORLD, path, FULLY_RESHARDABLE, timeout=300)
        assert all(f and "len(steps) == 1" in f or f == "AssertionError: " for f in failures), failures
    plain = run_ranks(train_job, WORLD, local_sgd=None, bucket_size=ONE_BUCKET, load=(path, FULLY_RESHARDABLE, 7),
                      timeout=300)
    for rank, r in enumerate(plain):
        _equal(r["loaded"]["params"], ref[0]["snapshots"][7]["params"], "worker 0's model")
        _equal(r["loaded"]["adam"], ref[rank % 2]["snapshots"][7]["adam"], "worker 0's Adam shard")
    _assert_loss_goes_on(plain, ref, range(8, 11))


@pytest.mark.timeout(400)
def test_what_megatrons_bucket_format_cannot_reshard_is_named(saved):
    """EDiT's state reshards everywhere; Megatron's dp_reshardable (bucket-space) optimizer state
    does not follow a TP change or a bucket change: the error says which."""
    path = saved["paths"]["dp7"]
    cases = [("tp", path, DP_RESHARDABLE, dict(tp=2, instances=1)),
             ("buckets", path, DP_RESHARDABLE, dict(bucket_size=3000))]
    results = run_ranks(load_errors_job, WORLD, cases, timeout=300)
    for r in results:
        assert r["tp"].startswith("CheckpointStateError") and "TP=1, PP=1, this run has TP=2" in r["tp"], r["tp"]
        assert "fully_reshardable" in r["tp"]
        assert r["buckets"].startswith("CheckpointStateError") and "the buckets changed" in r["buckets"], r["buckets"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("resumed_workers", [pytest.param(4, marks=pytest.mark.one_lane), 1])  # (one_lane: see conftest)
def test_elastic_a_edit_resume_keeps_global_progress_and_reaches_the_budget_exactly(tmp_path, resumed_workers):
    """Review item 1: A-EDiT, 2 workers (1 s and 0.25 s a step on a fake clock), a budget of 30
    synchronous iterations, saved at its second sync and resumed by 4 workers (or 1). Before
    the fix global progress restarted at 0 (every save / exit interval crossed at the first
    sync) and every new worker took worker 0's own step count, so the budget was planned from
    the wrong count. Now: global progress continues from the checkpoint's, the new workers'
    counts add up to the worker-steps done, progress only grows, and the run ends at the budget
    exactly (30 iterations = 30 x M worker-steps)."""
    from checkpoint_runs import async_budget_job

    path = str(tmp_path / "aedit")
    saved = run_ranks(async_budget_job, WORLD, 2, 30, [1.0, 0.25], save=path, stop_after_syncs=2, timeout=300)
    progress = saved[0]["progress"]
    assert all(r["progress"] == progress for r in saved)  # every worker agrees at a sync
    assert progress == sum(saved[0]["worker_steps"]) / 2 and progress not in (0.0, float(saved[0]["steps_done"]))
    speeds = [1.0, 0.5, 0.25, 0.25][:resumed_workers]
    resumed = run_ranks(async_budget_job, WORLD, resumed_workers, 30, speeds, load=path, timeout=300)
    done = round(progress * resumed_workers)
    starts = {r["worker"]: r["loaded"]["steps_done"] for r in resumed}
    assert sum(starts.values()) == done and max(starts.values()) - min(starts.values()) <= 1
    for r in resumed:
        assert r["loaded"]["global_progress"] == progress
        assert r["finished"] and r["progress"] == pytest.approx(30.0)
        assert all(b > a for a, b in zip([progress] + r["progress_at_syncs"], r["progress_at_syncs"]))
        assert sum(r["worker_steps"]) == 30 * resumed_workers  # the budget, exactly
    ends = {r["worker"]: r["steps_done"] for r in resumed}
    assert sum(ends.values()) == 30 * resumed_workers and len(ends) == resumed_workers


def _check_partial_restart(saver, resumed, step, workers):
    """After an elastic load of a checkpoint saved after ``step``: the parameter elements where
    every saved worker held the anchor (a sync just restarted them there) are the anchor, the
    others the one outer step over the saved workers (Nesterov, the saved momentum; zero before
    a fragment's first sync); every new worker holds the same model. Returns the numbers of
    elements (kept, stepped). Elementwise: a stacked key holds layers of both fragments."""
    params = _worker_tensors(saver, "params", step)
    anchor = _worker_tensors(saver, "anchor", step)[0]
    expected, _ = _expected_outer_step(saver, step)
    loaded = _worker_tensors(resumed, "params", loaded=True)
    assert sorted(loaded) == list(range(workers))
    kept = stepped = 0
    for key in anchor:
        same = (params[0][key] == anchor[key]) & (params[1][key] == anchor[key])
        for w in range(workers):
            got = loaded[w][key]
            assert torch.equal(got[same], anchor[key][same]), (w, key, "synced: the anchor")
            torch.testing.assert_close(got[~same], expected[key][~same], atol=ATOL, rtol=0,
                                       msg=f"worker {w} {key}: one outer step over the saved workers")
            assert not torch.equal(got[~same], anchor[key][~same]) or not (~same).any(), (w, key, "progress lost")
            assert torch.equal(got, loaded[0][key]), (w, key, "workers identical")
        kept, stepped = kept + int(same.sum()), stepped + int((~same).sum())
    return kept, stepped


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(600)
def test_elastic_resume_right_after_a_fragments_sync_keeps_the_other_fragments_progress(tmp_path):
    """H = 4, F = 2, no warmup: saved by 2 workers x 2 shards after step 2, right after fragment
    1's sync (fragment 0 has trained locally since the anchor), resumed by 4 workers x 1. Fragment
    1's parameters restart from the saved anchor (what both saved workers held); fragment 0's take
    the load-time outer step over the saved workers. (Before: "saved at a sync" restarted every
    parameter from the anchor, fragment 0 back at the initial model.) Resumed with another F,
    which would put other buckets in fragment 1, it is refused."""
    local = dict(local_sgd_sync_interval=4, local_sgd_warmup_steps=0, fragments=2, sync_mode="layerwise")
    path = str(tmp_path / "ckpt")
    saver = run_ranks(train_job, WORLD, local_sgd=local, steps=2, saves={2: [(path, DP_RESHARDABLE)]},
                      snapshots=(2,), bucket_size=1000, with_canonical=True, timeout=360)
    assert [(r.step, r.fragment) for r in saver[0]["reports"]] == [(2, 1)]
    resumed = run_ranks(train_job, WORLD, local_sgd=local, instances=4, steps=3, load=(path, DP_RESHARDABLE, 2),
                        bucket_size=1000, with_canonical=True, timeout=360)
    kept, stepped = _check_partial_restart(saver, resumed, 2, 4)
    assert kept > 1000 and stepped > 1000  # both fragments hold parameters
    # With another F the saved fragment 1 names other buckets: refused, naming the flag.
    other = dict(instances=4, bucket_size=1000, local_sgd=dict(local, fragments=4))
    (refused,) = set(r["F4"] for r in run_ranks(load_errors_job, WORLD, [("F4", path, DP_RESHARDABLE, other)],
                                                timeout=360))
    assert refused.startswith("CheckpointStateError") and "right after fragment 1's sync with " \
        "--local-sgd-fragments 2, this run has 4" in refused, refused


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("merge", ["lerp", "keep_local"])
def test_elastic_resume_right_after_a_delayed_merge_keeps_local_progress(tmp_path, merge):
    """tau = 2, H = 4: the exchange launched after step 2 is applied after step 4 by a merge that
    keeps local progress (lerp with the default alpha 0.5, or keep_local), so the workers differ
    right after it by design. Saved there by 2 workers x 2 shards and resumed by 4 workers x 1:
    the load takes the outer step over the saved workers (before: every worker reset to the
    anchor, their local progress lost)."""
    local = dict(local_sgd_sync_interval=4, local_sgd_warmup_steps=0, outer_step_delay=2, sync_mode="layerwise")
    if merge == "keep_local":
        local.update(outer_merge_rule="keep_local")
    path = str(tmp_path / "ckpt")
    saver = run_ranks(train_job, WORLD, local_sgd=local, steps=4, saves={4: [(path, DP_RESHARDABLE)]},
                      snapshots=(4,), with_canonical=True, timeout=360)
    assert [(r.step, r.delay) for r in saver[0]["reports"]] == [(4, 2)]
    resumed = run_ranks(train_job, WORLD, local_sgd=local, instances=4, steps=5, load=(path, DP_RESHARDABLE, 4),
                        with_canonical=True, timeout=360)
    kept, stepped = _check_partial_restart(saver, resumed, 4, 4)
    assert stepped > 100 * kept  # (nearly) every element kept some local progress


# A delayed outer step in flight at the save: H = 8, tau = 1, F = 2 (fragment 1, due after step 4,
# is launched after step 3); saved after step 3.
IN_FLIGHT = dict(local_sgd_sync_interval=8, local_sgd_warmup_steps=0, outer_step_delay=1, fragments=2,
                 sync_mode="layerwise")


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(600)
def test_a_resume_mid_flight_with_another_merge_delay_or_fragments_is_refused(tmp_path):
    """A delayed exchange in flight at the save is applied by the rule it was launched with: a
    resume that switches lerp <-> keep_local (before: lerp saved and keep_local resumed applied
    alpha 0, the reverse applied keep_local), changes alpha, the delay, or the fragment count
    (the saved fragment index names other buckets) is refused in one line naming the flag."""
    paths = {merge: str(tmp_path / merge) for merge in ("lerp", "keep_local")}
    for merge, path in paths.items():
        local = dict(IN_FLIGHT, outer_merge_rule=merge)
        run_ranks(train_job, WORLD, local_sgd=local, steps=3, saves={3: [(path, DP_RESHARDABLE)]},
                  bucket_size=1000, timeout=360)
    options = lambda **local: dict(bucket_size=1000, local_sgd=dict(IN_FLIGHT, **local))  # noqa: E731
    cases = [
        ("to keep_local", paths["lerp"], DP_RESHARDABLE, options(outer_merge_rule="keep_local")),
        ("to lerp", paths["keep_local"], DP_RESHARDABLE, options()),
        ("alpha", paths["lerp"], DP_RESHARDABLE, options(outer_merge_alpha=0.0)),
        ("delay", paths["lerp"], DP_RESHARDABLE, options(outer_step_delay=2)),
        ("fragments", paths["lerp"], DP_RESHARDABLE, options(fragments=4)),
        ("same", paths["keep_local"], DP_RESHARDABLE, options(outer_merge_rule="keep_local")),
    ]
    results = run_ranks(load_errors_job, WORLD, cases, timeout=360)
    expected = {
        "to keep_local": "to be merged by --local-sgd-outer-merge-rule lerp, --local-sgd-outer-merge-alpha 0.5; "
                         "this run has keep_local",
        "to lerp": "to be merged by --local-sgd-outer-merge-rule keep_local; this run has lerp, "
                   "--local-sgd-outer-merge-alpha 0.5",
        "alpha": "--local-sgd-outer-merge-alpha 0.5; this run has lerp, --local-sgd-outer-merge-alpha 0.0",
        "delay": "launched with --local-sgd-outer-step-delay 1; this run has 2",
        "fragments": "for fragment 1 of --local-sgd-fragments 2; this run has 4",
    }
    for r in results:
        assert r["same"] is None, r["same"]
        for name, text in expected.items():
            assert r[name] and r[name].startswith("CheckpointStateError") and text in r[name], (name, r[name])
            assert "\n" not in r[name]


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(600)
def test_error_feedback_residuals_keep_their_units_when_the_averaging_changes(tmp_path):
    """int4 exchange with error feedback, 2 workers saved between syncs with the plain mean and
    resumed by the same 2 workers with the penalty's weighted sum: each worker's residual added
    r / 2 to the next (mean) result, and a weighted sum adds what is carried, so it carries r / 2
    (before: r, twice what the saved run would have added)."""
    quantized = dict(EDIT, exchange_dtype="int4", exchange_block_size=64, exchange_error_feedback=True)
    path = str(tmp_path / "int4")
    saver = run_ranks(train_job, WORLD, local_sgd=quantized, steps=7, saves={7: [(path, DP_RESHARDABLE)]},
                      snapshots=(7,), timeout=300)
    resumed = run_ranks(train_job, WORLD, local_sgd=dict(quantized, pseudo_gradnorm_reduce=True), steps=7,
                        load=(path, DP_RESHARDABLE, 7), timeout=300)
    for a, b in zip(saver, resumed):
        saved, loaded = a["snapshots"][7]["residuals"], b["loaded"]["residuals"]
        assert any(r.abs().sum() > 0 for r, _ in saved)
        for (r, chunk), (r2, chunk2) in zip(saved, loaded):
            assert torch.equal(r2, r / 2)
            assert torch.equal(chunk2, chunk)  # the reduced result's: the sum's units either way


def test_residual_units_keep_what_a_residual_adds_to_the_next_result():
    from megatron_edit.mcore.checkpoint.after_load import residual_units

    workers, r = 4, 1.0
    # the mean divides the sum by the workers, a weighted sum does not
    assert r * residual_units(workers, saved_summed=False) == r / workers  # mean -> weighted
    assert r * residual_units(workers, saved_summed=True) / workers == r  # weighted -> mean
