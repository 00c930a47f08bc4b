"""The pseudo-gradient penalty on real megatron-core (CPU, gloo, 4 processes): exact numbers
against the plain-PyTorch simulation, consistency across tensor-parallel ranks, fault injection."""

import math

import pytest
import torch

from dist import run_ranks
from edit_runs import default_spec, megatron_runs, simulate_edit
from test_edit_megatron import OUTER, SIM_ATOL, _assert_params_close, _assert_params_equal

WORLD = 4
# Sharp weights (T small against norms ~0.1-1), a clip that binds on some layers, and an anomaly
# detector that warms up after one sync with a low threshold, so every branch is exercised.
PENALTY = dict(
    local_sgd_sync_interval=2,
    local_sgd_warmup_steps=1,
    pseudo_gradnorm_reduce=True,
    weight_softmax_temperature=0.02,
    clip_pseudo_grad=0.25,
    skip_anomaly=True,
    ewma_warmup_steps=1,
    ewma_threshold=0.5,
    ewma_alpha=0.5,
)


@pytest.mark.timeout(240)
def test_penalty_matches_simulation_in_both_modes():
    """Weighted averaging, anomaly exclusion (and an all-excluded layer skip if it occurs) and
    per-layer clipping give the simulation's parameters; every rank reports the simulation's
    decisions; layer-wise and step-end agree bit for bit."""
    # Worker 1 goes wrong after step 4 (excluded at the sync after step 5); both workers get NaN
    # after step 8 (every layer excluded at the sync after step 9: outer step skipped, back to
    # the anchor). (Both workers scaled alike would be a shared shift, no one worker's anomaly.)
    faults = [dict(workers=[1], steps=[4], kind="scale", factor=1.5),
              dict(workers=[0, 1], steps=[8], kind="nan")]
    specs = [default_spec(steps=9, local_sgd=dict(PENALTY, sync_mode=m), outer=OUTER, faults=faults)
             for m in ("layerwise", "step_end")]
    results = run_ranks(megatron_runs, WORLD, specs, timeout=200)
    (sim,) = run_ranks(simulate_edit, 1, specs[0], WORLD, timeout=120)
    exclusions = clipped = skipped = 0
    for r in results:
        layerwise, step_end = r["runs"]
        _assert_params_equal(layerwise["params"], step_end["params"], "layer-wise vs step-end")
        _assert_params_close(layerwise["params"], sim["params"][layerwise["worker"]], SIM_ATOL, "EDiT vs simulation")
        reports = layerwise["reports"]
        assert [rep.step for rep in reports] == [3, 5, 7, 9]
        assert reports[0].layer_names == sim["layers"]
        for rep, expected in zip(reports, sim["decisions"]):
            assert torch.allclose(rep.norms, expected["norms"], rtol=1e-4, atol=1e-6, equal_nan=True)
            assert torch.equal(rep.excluded, expected["excluded"])
            assert torch.allclose(rep.weights, expected["weights"], atol=1e-3)
            assert torch.allclose(rep.clip_coef.double(), expected["coef"], rtol=1e-3, equal_nan=True)
            exclusions += int(rep.excluded.sum())
            clipped += int((rep.clip_coef < 1).sum())
            skipped += int(rep.skipped.sum())
    # The configuration really exercised the penalty (otherwise this test proves little).
    weights = results[0]["runs"][0]["reports"][0].weights
    assert (weights - 0.5).abs().max() > 0.05, "weights are not sharp enough to test weighting"
    assert exclusions > 0 and clipped > 0 and skipped > 0, (exclusions, clipped, skipped)
    last = results[0]["runs"][0]["reports"][-1]
    assert last.skipped.all(), "both workers were corrupted before the last sync"


@pytest.mark.timeout(240)
def test_tensor_parallel_ranks_take_identical_decisions_equal_to_tp1():
    """TP=2 x 2 workers: both TP ranks of a worker compute the same per-layer norms, weights and
    exclusions (whole-layer norms, duplicates counted once), equal to a TP=1 run's."""
    spec = default_spec(steps=5, local_sgd=dict(PENALTY), outer=OUTER)
    tp2 = run_ranks(megatron_runs, WORLD, [spec], tp=2, timeout=200)
    tp1 = run_ranks(megatron_runs, 2, [spec], tp=1, timeout=200)
    by_worker = {}
    for r in tp2:
        by_worker.setdefault(r["runs"][0]["worker"], []).append(r["runs"][0]["reports"])
    for worker, (a, b) in by_worker.items():
        for ra, rb in zip(a, b):
            assert torch.equal(ra.norms, rb.norms) and torch.equal(ra.weights, rb.weights)
            assert torch.equal(ra.excluded, rb.excluded) and torch.equal(ra.clip_coef, rb.clip_coef)
    reference = tp1[0]["runs"][0]["reports"]
    for rep, ref in zip(tp2[0]["runs"][0]["reports"], reference):
        assert rep.layer_names == ref.layer_names
        assert torch.allclose(rep.norms, ref.norms, rtol=1e-3), (rep.norms, ref.norms)
        assert torch.equal(rep.excluded, ref.excluded)


FAULTY = dict(workers=[1], steps=[11], factor=3.0)


def _fault_runs(fault_kind):
    base = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=0, ewma_warmup_steps=3,
                ewma_threshold=3.0, ewma_alpha=0.1)
    faults = [dict(FAULTY, kind=fault_kind)]
    specs = [
        default_spec(steps=16, local_sgd=dict(base, skip_anomaly=True), outer=OUTER),  # clean
        default_spec(steps=16, local_sgd=dict(base, skip_anomaly=True), outer=OUTER, faults=faults),
        default_spec(steps=16, local_sgd=dict(base, skip_anomaly=False), outer=OUTER, faults=faults),
    ]
    if fault_kind == "nan":  # unprotected, a NaN stops the run at the sync (next test)
        specs.pop()
    return run_ranks(megatron_runs, WORLD, specs, timeout=200)


@pytest.mark.one_lane  # the penalty's hooks run in every lane (test_penalty_matches_simulation_in_both_modes)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kind", ["scale", "nan"])
def test_fault_injection_anomaly_elimination_protects_the_other_workers(kind):
    """Worker 1's parameters get a huge perturbation (or NaN) after step 11. With skip_anomaly
    the sync after step 12 excludes it, every worker restarts from a clean anchor and the
    held-out loss stays close to a clean run; without it the damage reaches every worker."""
    results = _fault_runs(kind)
    clean, protected, unprotected = ([r["runs"][i] for r in results if i < len(r["runs"])] for i in range(3))
    clean_loss = clean[0]["eval_loss"]
    for run in protected:
        assert all(torch.isfinite(v).all() for v in run["params"].values())
        assert abs(run["eval_loss"] - clean_loss) < 0.05, (run["eval_loss"], clean_loss)
        flagged = {rep.step: rep.excluded[1].float().mean().item() for rep in run["reports"]}
        assert flagged[12] > 0.5, f"fault not detected: {flagged}"
        assert all(rep.excluded[0].sum() == 0 for rep in run["reports"]), "clean worker excluded"
    for run in unprotected:
        loss = run["eval_loss"]
        assert math.isnan(loss) or loss > clean_loss + 0.5, (loss, clean_loss)
    print(f"\nfault={kind}: held-out loss clean {clean_loss:.4f}, with skip_anomaly "
          f"{protected[0]['eval_loss']:.4f}" + (f", without {unprotected[0]['eval_loss']:.4f}" if unprotected else ""))


@pytest.mark.timeout(240)
def test_without_anomaly_elimination_a_nan_stops_the_run_naming_the_worker_and_step():
    """The NaN of the test above without --local-sgd-skip-anomaly: every rank stops at the sync
    after step 12, before the exchange (the NaN never reaches the anchor), naming worker 1."""
    from dist import RankError

    base = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=0)
    spec = default_spec(steps=16, local_sgd=base, outer=OUTER, faults=[dict(FAULTY, kind="nan")])
    with pytest.raises(RankError) as err:
        run_ranks(megatron_runs, WORLD, [spec], timeout=200)
    message = str(err.value)
    assert "NonFinitePseudoGradient" in message and "of worker 1 is not finite" in message, message[-1500:]
    assert "at the sync after step 12" in message
