"""The delayed outer step (``outer_step_delay``) on real megatron-core (CPU, gloo, 2 workers x 2
ranks), against the plain-PyTorch simulation extended with the delay (``simulate_edit``)."""

import pytest
import torch

from compare import max_difference
from dist import run_ranks
from megatron_edit.mcore import checkpoint as checkpointing, compat
from edit_runs import default_spec, megatron_runs, simulate_edit

WORLD = 4
SIM_ATOL = 2e-4  # as in test_edit_megatron: Megatron's and the simulation's reduction orders differ
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))
# W = 1, H = 3, 9 steps, --train-iters 9: the syncs after steps 4 and 7 are launched tau steps
# earlier and applied there; the one after step 10 would be applied after the last step, so it
# is not launched and the run ends with the blocking sync after step 9.
EDIT = dict(local_sgd_sync_interval=3, local_sgd_warmup_steps=1)


def _spec(**local):
    return default_spec(steps=9, last_step=9, local_sgd=dict(EDIT, **local), outer=OUTER)


@pytest.mark.timeout(400)
def test_delayed_outer_step_matches_the_simulation_in_both_modes():
    """tau = 2, alpha = 0 in layer-wise and step-end mode (the same numbers, bit for bit: both
    apply at the step-end point), tau = 1, alpha = 0.5 with the penalty's weights, and tau = 2,
    alpha = 0.25 (where alpha and 1 - alpha swapped would differ), each against the simulation;
    replicas identical right after an alpha = 0 merge (steps 4, 7) and at the end, different
    between."""
    specs = [
        _spec(outer_step_delay=2, outer_merge_alpha=0.0, sync_mode="layerwise"),
        _spec(outer_step_delay=2, outer_merge_alpha=0.0, sync_mode="step_end"),
        _spec(outer_step_delay=1, outer_merge_alpha=0.5, sync_mode="step_end", pseudo_gradnorm_reduce=True),
        _spec(outer_step_delay=2, outer_merge_alpha=0.25, sync_mode="layerwise"),
    ]
    specs[0]["snapshot_every_step"] = True
    results = run_ranks(megatron_runs, WORLD, specs, timeout=360)
    sims = [run_ranks(simulate_edit, 1, spec, WORLD, timeout=120)[0]["params"]
            for spec in (specs[0], specs[2], specs[3])]
    for r in results:
        layerwise, step_end, merged, quarter = r["runs"]
        assert max_difference(quarter["params"], sims[2][quarter["worker"]]) <= SIM_ATOL
        for run, delay in ((layerwise, 2), (step_end, 2), (merged, 1), (quarter, 2)):
            assert [(rep.step, rep.delay) for rep in run["reports"]] == [(4, delay), (7, delay), (9, 0)]
            assert all(rep.exposed_wait_seconds >= 0 for rep in run["reports"])
            assert not run["pending_at_end"]
        for k in layerwise["params"]:
            assert torch.equal(layerwise["params"][k], step_end["params"][k]), k
        assert max_difference(layerwise["params"], sims[0][layerwise["worker"]]) <= SIM_ATOL
        assert max_difference(merged["params"], sims[1][merged["worker"]]) <= SIM_ATOL
    by_worker = {0: results[0]["runs"][0], 1: results[2]["runs"][0]}
    for step in range(2, 10):
        a, b = by_worker[0]["snapshots"][step], by_worker[1]["snapshots"][step]
        same = all(torch.equal(a[k], b[k]) for k in a)
        assert same == (step in (4, 7, 9)), f"after step {step}: replicas {'equal' if same else 'differ'}"
    # the run ends with one model on every worker (its last sync is blocking), alpha = 0.5 too
    for run in range(len(specs)):
        a, b = results[0]["runs"][run]["params"], results[2]["runs"][run]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.one_lane  # a variant of what this file checks in every lane (CI time; see conftest)
@pytest.mark.timeout(400)
def test_a_delayed_run_whose_last_step_is_a_sync_step_ends_with_one_model():
    """W = 1, H = 3, tau = 2, --train-iters 10: the run's last step is on the grid (10 = W + 3H).
    The exchange of that sync would be launched after step 8 and applied after step 10; it is
    not launched, and the sync after step 10 is the blocking one. With merges that keep local
    progress (lerp alpha 0.5 layer-wise, keep_local step-end; replicas differ after 4 and 7):
    every worker ends with the same model, nothing in flight or pending, and each run equals
    the simulation."""
    specs = [dict(_spec(outer_step_delay=2, sync_mode="layerwise"), steps=10, last_step=10),
             dict(_spec(outer_step_delay=2, outer_merge_rule="keep_local", sync_mode="step_end"), steps=10,
                  last_step=10)]
    results = run_ranks(megatron_runs, WORLD, specs, timeout=360)
    sims = [run_ranks(simulate_edit, 1, spec, WORLD, timeout=120)[0]["params"] for spec in specs]
    for r in results:
        for run, sim in zip(r["runs"], sims):
            assert [(rep.step, rep.delay) for rep in run["reports"]] == [(4, 2), (7, 2), (10, 0)]
            assert not run["pending_at_end"] and not run["in_flight_at_end"]
            assert max_difference(run["params"], sim[run["worker"]]) <= SIM_ATOL
    for run in range(len(specs)):
        for shard in (0, 1):  # worker 0 is ranks 0-1, worker 1 ranks 2-3
            a, b = results[shard]["runs"][run]["params"], results[2 + shard]["runs"][run]["params"]
            assert all(torch.equal(a[k], b[k]) for k in a), (run, shard)


DELAYED = dict(local_sgd_sync_interval=4, local_sgd_warmup_steps=0, outer_step_delay=2, sync_mode="layerwise")


@pytest.mark.timeout(400)
@pytest.mark.skipif(not checkpointing.SUPPORTED.contains(compat.megatron_core_version()),
                    reason=f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}")
@pytest.mark.parametrize("variant", [pytest.param("lerp", marks=pytest.mark.one_lane), "keep_local-int8"])  # (one_lane: see conftest)
def test_a_checkpoint_mid_flight_resumes_exactly(tmp_path, variant):
    """Saved after step 3, while the exchange of the sync after step 4 is in flight (launched
    after step 2): the save waits for the exchange and keeps its result (and, for keep_local,
    each worker's launch parameters); the resumed run applies it after step 4 and ends with the
    same parameters, optimizer state, anchors and outer state as the run without the stop. The
    int8 exchange with error feedback: its residuals are the finished exchange's."""
    from checkpoint_runs import DP_RESHARDABLE, _equal, train_job

    local = dict(DELAYED)
    if variant != "lerp":
        local.update(outer_merge_rule="keep_local", exchange_dtype="int8", exchange_error_feedback=True,
                     exchange_block_size=64)
    path = str(tmp_path / "ckpt")
    whole = run_ranks(train_job, WORLD, local_sgd=local, steps=8, saves={3: [(path, DP_RESHARDABLE)]}, timeout=360)
    resumed = run_ranks(train_job, WORLD, local_sgd=local, steps=8, load=(path, DP_RESHARDABLE, 3), timeout=360)
    for a, b in zip(whole, resumed):
        assert [(r.step, r.delay) for r in a["reports"]] == [(4, 2), (8, 2)]
        assert [(r.step, r.delay) for r in b["reports"]] == [(4, 2), (8, 2)]
        for key in ("params", "adam", "anchors", "outer", "mains", "steps_done", "last_sync_step", "residuals"):
            _equal(a["final"][key], b["final"][key], key)


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(400)
@pytest.mark.skipif(not checkpointing.SUPPORTED.contains(compat.megatron_core_version()),
                    reason=f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}")
def test_a_checkpoint_mid_flight_resumes_with_the_same_workers_only(tmp_path):
    from checkpoint_runs import DP_RESHARDABLE, train_job
    from dist import RankError

    path = str(tmp_path / "ckpt")
    run_ranks(train_job, WORLD, local_sgd=DELAYED, steps=3, saves={3: [(path, DP_RESHARDABLE)]}, timeout=360)
    with pytest.raises(RankError, match="saved while the exchange of a delayed outer step was in flight "
                                        r"\(launched after step 2, due after step 4\); it resumes with the "
                                        "same number of workers only"):
        run_ranks(train_job, WORLD, local_sgd=DELAYED, instances=4, steps=8, load=(path, DP_RESHARDABLE, 3),
                  timeout=360)


@pytest.mark.timeout(400)
def test_two_phase_exchanges_with_a_delay_keep_replicas_identical():
    """The int8 exchange with error feedback and GTA (second phase started one step after the
    launch, tau = 2): both workers apply the same bytes, so after the last (blocking) sync the
    replicas are identical; the syncs are where they are without the quantization. The
    collectives across workers, in order: at the launch (step s - 2) the norms' all-gather and
    the first phase (int8: one all-to-all per shard; GTA: the consensus all-reduces), one step
    later the second phase (int8: one all-gather per shard; GTA: the merge all-reduces), and
    nothing at the apply (step s): a second phase started late (the numbers are the same, the
    overlap is lost) fails here."""
    specs = [
        _spec(outer_step_delay=2, sync_mode="step_end", exchange_dtype="int8", exchange_error_feedback=True,
              exchange_block_size=64),
        dict(_spec(outer_step_delay=2, sync_mode="layerwise"),
             gta=dict(reducer="gta", consensus_method="sum", sparsification_method="magnitude", density=0.5)),
    ]
    for spec in specs:
        spec["traffic"] = True
    results = run_ranks(megatron_runs, WORLD, specs, timeout=360)
    for r in results:
        for run, name in enumerate(("int8", "gta")):
            phases = {}
            for phase, op, _, _ in r["runs"][run]["traffic"]:
                phases.setdefault(phase, []).append(op)
            shards = len(r["runs"][run]["shard_numels"])
            for s in (4, 7):
                launch, second = phases.get(f"step {s - 2}", []), phases.get(f"step {s - 1}", [])
                assert launch[0] == "all_gather", (name, s, launch)  # the norms first
                if name == "int8":
                    assert launch[1:] == ["all_to_all_single"] * shards, (s, launch)
                    # the all-gather of the reduced chunks (torch < 2.9 has no all_gather_single:
                    # the exchange calls all_gather_into_tensor there)
                    gathers = ["all_gather_single" if op == "all_gather_into_tensor" else op for op in second]
                    assert gathers == ["all_gather_single"] * shards, (s, second)
                else:
                    assert launch[1:] == ["all_reduce"] * shards, (s, launch)  # the consensus
                    assert len(second) >= shards and set(second) == {"all_reduce"}, (s, second)
                assert f"step {s}" not in phases, (name, s, phases.get(f"step {s}"))
    for run in range(len(specs)):
        for r in results:
            assert [(rep.step, rep.delay) for rep in r["runs"][run]["reports"]] == [(4, 2), (7, 2), (9, 0)]
        for shard in (0, 1):
            a, b = results[shard]["runs"][run]["params"], results[2 + shard]["runs"][run]["params"]
            assert all(torch.equal(a[k], b[k]) for k in a), (run, shard)
