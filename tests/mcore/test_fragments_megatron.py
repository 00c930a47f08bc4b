"""Streaming fragments (``LocalSGDConfig.fragments``) on real megatron-core (CPU, gloo, 2 workers x
2 ranks), against the plain-PyTorch simulation told which parameters each fragment holds
(``simulate_edit`` with ``fragment_params``: how Megatron buckets the model is not simulated,
the schedule and the math are)."""

import pytest
import torch

from compare import max_difference
from dist import RankError, run_ranks
from edit_runs import default_spec, megatron_runs, simulate_edit
from megatron_edit.mcore import checkpoint as checkpointing, compat

WORLD = 4
SIM_ATOL = 2e-4  # as in test_edit_megatron: Megatron's and the simulation's reduction orders differ
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))
# W = 1, H = 4, F = 2, --train-iters 9: fragment 1 syncs after steps 3 and 7, fragment 0 after
# step 5; the run's last step (9) syncs every fragment.
FRAG = dict(local_sgd_sync_interval=4, local_sgd_warmup_steps=1, fragments=2)
STEPS = [(3, 1), (5, 0), (7, 1), (9, None)]


def _spec(**local):
    return default_spec(steps=9, last_step=9, local_sgd=dict(FRAG, **local), outer=OUTER, bucket_size=1000)


def _simulate(spec, fragment_params):
    return run_ranks(simulate_edit, 1, dict(spec, fragment_params=fragment_params), WORLD, timeout=120)[0]["params"]


@pytest.mark.timeout(500)
def test_fragments_sync_in_turn_and_match_the_simulation():
    """F = 2 with the penalty's weights (per layer inside a fragment) in layer-wise and step-end
    mode (bit for bit the same), and with a delay tau = 1 (the keep_local merge): each sync exchanges one
    fragment, in turn, the run's last one every fragment; each run equals the simulation; right
    after a fragment's sync its parameters are identical on both workers and the others are not."""
    specs = [
        _spec(sync_mode="layerwise", pseudo_gradnorm_reduce=True),
        _spec(sync_mode="step_end", pseudo_gradnorm_reduce=True),
        _spec(sync_mode="step_end", outer_step_delay=1, outer_merge_rule="keep_local"),
    ]
    specs[1]["snapshot_every_step"] = True
    results = run_ranks(megatron_runs, WORLD, specs, timeout=420)
    frags = results[0]["runs"][0]["fragment_params"]
    assert len(frags) == 2 and all(frags) and not set(frags[0]) & set(frags[1])
    assert set(frags[0]) | set(frags[1]) == set(results[0]["runs"][0]["params"])
    for r in results:  # the same fragments on every rank
        assert all(run["fragment_params"] == frags for run in r["runs"])
        layerwise, step_end, delayed = r["runs"]
        # a fragment's sync decides on its own layers only (a layer in both fragments is two)
        names = layerwise["per_controller"][0]["layer_names"]
        held = [set(), set()]
        for rep in layerwise["reports"][:3]:
            held[rep.fragment] |= {names[i] for i in (rep.norms[rep.worker] != 0).nonzero()[:, 0].tolist()}
        assert held[0] and held[1] and not held[0] & held[1]
        assert any("@fragment" in name for name in names)  # the buckets cut a layer here
        for run, delay in ((layerwise, 0), (step_end, 0), (delayed, 1)):
            assert [(rep.step, rep.fragment) for rep in run["reports"]] == STEPS
            assert [rep.delay for rep in run["reports"]] == [delay] * 3 + [0]
            assert not run["pending_at_end"]
        for k in layerwise["params"]:
            assert torch.equal(layerwise["params"][k], step_end["params"][k]), k
    sims = [_simulate(specs[0], frags), _simulate(specs[2], frags)]
    for r in results:
        layerwise, _, delayed = r["runs"]
        assert max_difference(layerwise["params"], sims[0][layerwise["worker"]]) <= SIM_ATOL
        assert max_difference(delayed["params"], sims[1][delayed["worker"]]) <= SIM_ATOL
    # replicas: worker 0 is ranks 0-1, worker 1 ranks 2-3 (shard 0 of each)
    a_snap, b_snap = results[0]["runs"][1]["snapshots"], results[2]["runs"][1]["snapshots"]
    for step, fragment in STEPS:
        synced = set(frags[fragment]) if fragment is not None else set(a_snap[step])
        for name in a_snap[step]:
            same = torch.equal(a_snap[step][name], b_snap[step][name])
            assert same == (name in synced), f"after step {step}: {name} {'equal' if same else 'differs'}"
    for run in range(3):  # every worker ends with one model
        a, b = results[0]["runs"][run]["params"], results[2]["runs"][run]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(400)
def test_fragments_with_the_int8_exchange_and_a_delay_keep_replicas_identical():
    """F = 2, tau = 1, the int8 exchange with error feedback and clipping (closed fragments):
    the syncs are where they are without the quantization, the per-layer clip factors of the
    layers outside a fragment are 1, and after the last (blocking) sync the replicas are
    identical."""
    spec = _spec(sync_mode="layerwise", outer_step_delay=1, exchange_dtype="int8",
                 exchange_error_feedback=True, exchange_block_size=64, clip_pseudo_grad=0.05)
    results = run_ranks(megatron_runs, WORLD, [spec], timeout=360)
    for r in results:
        reports = r["runs"][0]["reports"]
        assert [(rep.step, rep.fragment) for rep in reports] == STEPS
        for rep in reports[:3]:  # a fragment's sync: the other fragment's layers are not clipped
            untouched = rep.norms[rep.worker] == 0
            assert bool(untouched.any()) and torch.all(rep.clip_coef[untouched] == 1)
    for shard in (0, 1):
        a, b = results[shard]["runs"][0]["params"], results[2 + shard]["runs"][0]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a), shard


@pytest.mark.one_lane  # an exchange's variant (the int8 one above runs in every lane; see conftest)
@pytest.mark.timeout(800)
def test_fragments_with_the_sparse_exchange_and_a_delay_keep_replicas_identical():
    """F = 2, tau = 1, the top-k exchange (2%, int2, error feedback by default) and clipping: the
    syncs are where they are without it, a fragment's sync sends only its own shards' payloads
    (its residuals move, the other fragment's do not), and after the last (blocking) sync the
    replicas are identical."""
    spec = _spec(sync_mode="layerwise", outer_step_delay=1, exchange_dtype="int2", exchange_topk_density=0.02,
                 clip_pseudo_grad=0.05)
    results = run_ranks(megatron_runs, WORLD, [spec], timeout=360)
    for r in results:
        reports = r["runs"][0]["reports"]
        assert [(rep.step, rep.fragment) for rep in reports] == STEPS
        assert all(rep.quantization_error is not None for rep in reports)
        for rep in reports[:3]:
            untouched = rep.norms[rep.worker] == 0
            assert bool(untouched.any()) and torch.all(rep.clip_coef[untouched] == 1)
    for shard in (0, 1):
        a, b = results[shard]["runs"][0]["params"], results[2 + shard]["runs"][0]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a), shard


FRAG_CKPT = dict(local_sgd_sync_interval=4, local_sgd_warmup_steps=0, fragments=2, outer_step_delay=1,
                 sync_mode="layerwise", pseudo_gradnorm_reduce=True, skip_anomaly=True, ewma_warmup_steps=1,
                 outer_merge_rule="keep_local")


@pytest.mark.timeout(400)
@pytest.mark.skipif(not checkpointing.SUPPORTED.contains(compat.megatron_core_version()),
                    reason=f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}")
@pytest.mark.parametrize("save_at", [4, pytest.param(3, marks=pytest.mark.one_lane)])  # (one_lane: see conftest)
def test_a_checkpoint_between_fragment_syncs_resumes_exactly(tmp_path, save_at):
    """F = 2, tau = 1, keep_local, the penalty with anomaly detection: saved after step 4
    (fragment 0 just applied; fragment 1's anchor and the per-layer statistics from step 2), or
    after step 3 (fragment 0's exchange in flight), resumed to step 8: the same parameters,
    optimizer state, anchors and outer state as the run without the stop."""
    from checkpoint_runs import DP_RESHARDABLE, _equal, train_job

    path = str(tmp_path / "ckpt")
    whole = run_ranks(train_job, WORLD, local_sgd=FRAG_CKPT, steps=8, saves={save_at: [(path, DP_RESHARDABLE)]},
                      bucket_size=1000, timeout=360)
    resumed = run_ranks(train_job, WORLD, local_sgd=FRAG_CKPT, steps=8, load=(path, DP_RESHARDABLE, save_at),
                        bucket_size=1000, timeout=360)
    for a, b in zip(whole, resumed):
        assert [(r.step, r.fragment, r.delay) for r in a["reports"]] == [(2, 1, 1), (4, 0, 1), (6, 1, 1), (8, 0, 1)]
        assert [(r.step, r.fragment) for r in b["reports"]] == [(4, 0), (6, 1), (8, 0)][save_at - 3:]
        for key in ("params", "adam", "anchors", "outer", "mains", "steps_done", "last_sync_step"):
            _equal(a["final"][key], b["final"][key], key)


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(400)
@pytest.mark.skipif(not checkpointing.SUPPORTED.contains(compat.megatron_core_version()),
                    reason=f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}")
def test_elastic_resume_with_fragments_and_the_int8_exchange(tmp_path):
    """Saved by 2 workers x 2 shards after step 3 (fragment 1 synced after step 2, fragment 0
    not since warmup; int8 exchange with error feedback), resumed by 4 workers x 1 shard: one
    outer step at load over the saved workers makes every new worker identical, and each
    fragment's anchor is then the loaded model; the fragments' schedule goes on from step 3."""
    from checkpoint_runs import DP_RESHARDABLE, train_job

    local = dict(local_sgd_sync_interval=4, local_sgd_warmup_steps=0, fragments=2, sync_mode="layerwise",
                 exchange_dtype="int8", exchange_error_feedback=True, exchange_block_size=64)
    path = str(tmp_path / "ckpt")
    saved = run_ranks(train_job, WORLD, local_sgd=local, steps=3, saves={3: [(path, DP_RESHARDABLE)]},
                      bucket_size=1000, timeout=360)
    assert [(r.step, r.fragment) for r in saved[0]["reports"]] == [(2, 1)]
    resumed = run_ranks(train_job, WORLD, local_sgd=local, instances=4, steps=8,
                        load=(path, DP_RESHARDABLE, 3), bucket_size=1000, timeout=360)
    first = resumed[0]["loaded"]
    for r in resumed:
        loaded = r["loaded"]
        assert loaded["steps_done"] == 3
        for k in first["params"]:
            assert torch.equal(loaded["params"][k], first["params"][k]), k  # one model on every worker
        for anchor, main in zip(loaded["anchors"], loaded["mains"]):
            assert torch.equal(anchor, main)  # every fragment restarts from the load's anchor
        assert [(rep.step, rep.fragment) for rep in r["reports"]] == [(4, 0), (6, 1), (8, 0)]
    # and the saved workers really differed (the load made one model of two)
    assert not all(torch.equal(saved[0]["final"]["params"][k], saved[2]["final"]["params"][k])
                   for k in saved[0]["final"]["params"])


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(400)
@pytest.mark.skipif(not checkpointing.SUPPORTED.contains(compat.megatron_core_version()),
                    reason=f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}")
def test_a_resume_with_another_fragment_count_names_the_saved_one(tmp_path):
    """Saved with F = 2, resumed by the same layout with F = 4: refused before the load, naming
    the saved count (before: "EDiT checkpoint state was saved for different layers", after the
    load, without the count)."""
    from checkpoint_runs import DP_RESHARDABLE, train_job

    local = dict(local_sgd_sync_interval=4, local_sgd_warmup_steps=0, fragments=2, sync_mode="layerwise")
    path = str(tmp_path / "ckpt")
    run_ranks(train_job, WORLD, local_sgd=local, steps=3, saves={3: [(path, DP_RESHARDABLE)]},
              bucket_size=1000, timeout=360)
    with pytest.raises(RankError) as err:
        run_ranks(train_job, WORLD, local_sgd=dict(local, fragments=4), steps=4,
                  load=(path, DP_RESHARDABLE, 3), bucket_size=1000, timeout=360)
    assert ("the checkpoint was saved with --local-sgd-fragments 2, this run has 4" in str(err.value)
            and "Resume with --local-sgd-fragments 2" in str(err.value)), str(err.value)[-3000:]


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_make_the_same_fragments_and_decisions():
    """TP = 2 x 2 workers, F = 2, the penalty's weights and clipping: both tensor-parallel ranks
    of a worker make the same fragments (the sizes are summed over the worker's ranks) and take
    the same per-layer decisions at every sync; the run ends with one model on every worker."""
    spec = _spec(sync_mode="layerwise", pseudo_gradnorm_reduce=True, clip_pseudo_grad=0.05)
    results = run_ranks(megatron_runs, WORLD, [spec], tp=2, timeout=240)
    by_worker = {}
    for r in results:
        run = r["runs"][0]
        assert [(rep.step, rep.fragment) for rep in run["reports"]] == STEPS
        by_worker.setdefault(run["worker"], []).append(run)
    assert sorted(by_worker) == [0, 1]
    for a, b in by_worker.values():
        names = a["per_controller"][0]["layer_names"]
        assert names == b["per_controller"][0]["layer_names"]
        for ra, rb in zip(a["reports"], b["reports"]):
            assert torch.equal(ra.norms, rb.norms) and torch.equal(ra.weights, rb.weights)
            assert torch.equal(ra.clip_coef, rb.clip_coef)
    for tp_rank in (0, 1):  # worker 0 and worker 1 hold the same slice: equal after the last sync
        a = next(r["runs"][0] for r in results if r["runs"][0]["worker"] == 0 and r["runs"][0]["tp_rank"] == tp_rank)
        b = next(r["runs"][0] for r in results if r["runs"][0]["worker"] == 1 and r["runs"][0]["tp_rank"] == tp_rank)
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
