"""A-EDiT with a delayed outer step (``use_async`` with ``outer_step_delay``; mcore/async_delayed.py)
on real megatron-core (CPU, gloo, 2 workers x 2 ranks), workers of different speeds on the fake
clock of tests/mcore/test_async.py, against the plain-PyTorch simulation (``simulate_edit``
with ``async_syncs``: the syncs worked out by hand below)."""

import pytest
import torch

from compare import max_difference_but_key_bias as max_difference
from dist import run_ranks
from edit_runs import async_runs, default_spec, simulate_edit
from test_edit_megatron import OUTER

WORLD = 4
# Megatron's and the simulation's reduction orders differ; the attention's key bias, whose gradient
# is mathematically zero, drifts on that noise under Adam (up to 7e-4 here) and is left out
# (compare.max_difference_but_key_bias); every other parameter is within 1.4e-5 of the simulation
# after these 10-30 steps. One inner step moves the parameters by about 1e-2 here and a sync by
# 4e-2 to 2e-1, so a step or a merge missed would not pass.
SIM_ATOL = 1e-4
MAX_STEPS = 40

# Worker 0 takes 1 s per step, worker 1 0.25 s (4x faster); one synchronous warmup step; a budget
# of 20 synchronous iterations (40 worker-steps).
#
# "skip": sync every 4 s, first interval 2 steps, min_total_global_steps 10, step weights. The
# syncs of test_async.py's budget test: after steps 3 / 3 (skipped: 4 steps in all), 7 / 19 (4
# and 16 steps, 4 s each) and the final one at 10 / 30 (the 14 worker-steps left split 3 / 11 by
# speed). tau = 2, alpha = 0: the exchange launched at 7 / 19 is applied after 9 / 21; the
# final sync is blocking.
SKIP = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, local_sgd_warmup_steps=1,
            min_total_global_steps=10, use_step_weight=True, step_weight_ratio=0.5)
SKIP_SYNCS = [([3, 3], True), ([7, 19], False), ([10, 30], False)]
# "held": sync every 3 s, first interval 5 steps (6 / 6); tau = 4 with keep_local. Worker 0's
# speed gives it 3 steps to the next sync, fewer than tau + 1: it is planned 5 (11 / 18, worker 1
# 12 steps in 3 s, then waits 2 s). The 11 worker-steps left: the final interval, 3 / 8 by
# speed. Worker 0's exchange launched at 11 is still in flight at its final sync after step 14
# (before 11 + 4): applied there, then the final sync; worker 1's is applied after 22.
HELD = dict(use_async=True, local_sgd_sync_time=3.0, local_sgd_sync_interval=5, local_sgd_warmup_steps=1,
            min_total_global_steps=1, use_step_weight=True, step_weight_ratio=0.5)
HELD_SYNCS = [([6, 6], False), ([11, 18], False), ([14, 26], False)]


def _spec(local, syncs, **extra):
    return default_spec(local_sgd=dict(local, **extra), outer=OUTER, seconds_per_step=[1.0, 0.25], max_steps=MAX_STEPS,
                        steps=MAX_STEPS, train_iters=20, async_syncs=syncs, snapshot_every_step=True)


CASES = {
    # (spec, every worker's reports (step, delay, skipped, final): the apply step, launched after step - delay)
    "no delay": (_spec(SKIP, SKIP_SYNCS, sync_mode="step_end"),
                 [[(3, 0, True, False), (7, 0, False, False), (10, 0, False, True)],
                  [(3, 0, True, False), (19, 0, False, False), (30, 0, False, True)]]),
    "skip, tau 2, alpha 0": (_spec(SKIP, SKIP_SYNCS, sync_mode="step_end", outer_step_delay=2, outer_merge_alpha=0.0),
                             [[(3, 0, True, False), (9, 2, False, False), (10, 0, False, True)],
                              [(3, 0, True, False), (21, 2, False, False), (30, 0, False, True)]]),
    "held, tau 4, keep_local": (_spec(HELD, HELD_SYNCS, sync_mode="layerwise", outer_step_delay=4,
                                      outer_merge_rule="keep_local"),
                                [[(10, 4, False, False), (14, 3, False, False), (14, 0, False, True)],
                                 [(10, 4, False, False), (22, 4, False, False), (26, 0, False, True)]]),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.one_lane] if i else [])  # the first in every lane
                                  for i, c in enumerate(CASES)])
def test_a_edit_with_a_delay_matches_the_simulation(case):
    """Every rank's syncs are where the fake clock puts them, each delayed exchange applied tau of
    the worker's own steps after its sync (or at the final sync if that comes first), the final
    sync blocking; the parameters equal the simulation's on every worker; the run ends with one
    model, nothing in flight; with alpha = 0 the replicas are identical right after each apply
    (worker 0 after step 9, worker 1 after step 21) and differ just before it."""
    spec, expected = CASES[case]
    results = run_ranks(async_runs, WORLD, spec, timeout=240)
    sim = run_ranks(simulate_edit, 1, spec, WORLD, timeout=120)[0]["params"]
    for r in results:
        got = [(rep.step, rep.delay, rep.skipped_sync, rep.final) for rep in r["reports"]]
        assert got == expected[r["worker"]], (r["worker"], got)
        assert r["finished"] and r["steps"] == spec["async_syncs"][-1][0][r["worker"]]
        assert not r["in_flight_at_end"]
        assert max_difference(r["params"], sim[r["worker"]]) <= SIM_ATOL, case
    for shard in (0, 1):  # worker 0 is ranks 0-1, worker 1 ranks 2-3
        a, b = results[shard], results[2 + shard]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"]), "one model at the end"
        if case == "skip, tau 2, alpha 0":
            for (s0, s1), same in (((9, 21), True), ((8, 20), False)):
                x, y = a["snapshots"][s0], b["snapshots"][s1]
                assert all(torch.equal(x[k], y[k]) for k in x) == same, (s0, s1)
    if case != "no delay":  # step weights: launch to launch, as without a delay
        weights = results[0]["reports"][1].weights[:, 0]
        steps = torch.tensor([6.0, 18.0] if case.startswith("skip") else [5.0, 12.0], dtype=torch.float64)
        assert torch.allclose(weights, 0.25 + 0.5 * steps / steps.sum())


def test_a_checkpoint_with_an_exchange_in_flight_is_refused_in_one_line():
    """Not built for A-EDiT yet: refused, naming the apply step and the way out; with nothing in
    flight there is nothing to save (as for EDiT)."""
    from types import SimpleNamespace

    from megatron_edit.config import LocalSGDConfig
    from megatron_edit.mcore.async_delayed import AsyncDelayedOuterStep, delayed_outer_step
    from megatron_edit.mcore.delayed import DelayedOuterStep

    config = LocalSGDConfig(use_async=True, outer_step_delay=2, outer_merge_alpha=0.0)
    delayed = delayed_outer_step(SimpleNamespace(config=config))
    assert type(delayed) is AsyncDelayedOuterStep and delayed.alpha == 0.0
    assert delayed.checkpoint_state() is None
    delayed.apply_at = 9
    with pytest.raises(RuntimeError, match=r"in flight \(applied after step 9\) is not supported yet; save at another "
                                           r"step .*or drop --local-sgd-outer-step-delay"):
        delayed.checkpoint_state()
    edit = LocalSGDConfig(local_sgd_sync_interval=4, outer_step_delay=2)
    assert type(delayed_outer_step(SimpleNamespace(config=edit))) is DelayedOuterStep
    assert delayed_outer_step(SimpleNamespace(config=LocalSGDConfig())) is None


@pytest.mark.one_lane  # a variant of what this file checks in every lane (CI time; see conftest)
@pytest.mark.timeout(300)
def test_a_two_phase_exchange_with_a_delay_keeps_the_schedule_and_ends_with_one_model():
    """The int8 exchange with error feedback (two phases: the second is started at the sync too,
    after a wait for the first, so no collective across workers is issued after it): the syncs of
    the "skip" case, and one model at the end."""
    spec = _spec(SKIP, SKIP_SYNCS, sync_mode="step_end", outer_step_delay=2, outer_merge_alpha=0.0,
                 exchange_dtype="int8", exchange_error_feedback=True, exchange_block_size=64)
    results = run_ranks(async_runs, WORLD, spec, timeout=240)
    for r in results:
        got = [(rep.step, rep.delay, rep.skipped_sync, rep.final) for rep in r["reports"]]
        assert got == CASES["skip, tau 2, alpha 0"][1][r["worker"]]
        assert r["reports"][1].quantization_error is not None and not r["in_flight_at_end"]
    for shard in (0, 1):
        a, b = results[shard]["params"], results[2 + shard]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a), "one model at the end"
