"""Settings from the measured link on A-EDiT's schedule (``auto_overlap`` with ``use_async``;
mcore/auto_overlap_async.py) on real megatron-core (CPU, gloo, 2 workers x 2 ranks), workers of
different speeds on the fake clock of tests/mcore/test_async_delayed.py, the measurements
injected per rank (as in tests/mcore/test_auto_overlap.py), so the decisions do not depend on
this machine's clocks: a run that keeps the setting it starts with equals that fixed setting's
run bit for bit; a run that switches on a delay (or to int8) does so on every worker at the same
sync, equals the fixed run before, and matches the plain-PyTorch simulation with the delay
switched on at that sync. Below, the agreement and the decision's timing on a stand-in."""

import pytest
import torch

from compare import max_difference_but_key_bias as max_difference
from dist import run_ranks
from edit_runs import async_runs, default_spec, simulate_edit
from megatron_edit.algorithm.overlap_plan import choose
from test_edit_megatron import OUTER

WORLD = 4
MAX_STEPS = 60
# Megatron's and the simulation's reduction orders differ; the attention's key bias, whose gradient
# is mathematically zero, drifts on that noise under Adam (up to 1.7e-3 over these 26 / 46 steps) and
# is left out (compare.max_difference_but_key_bias); every other parameter is within 1e-4. The switch
# one sync early or late, or to tau = 1, differs by 2.7e-2 to 7.9e-2, no switch by 5.2e-2.
SIM_ATOL = 1e-4
# Worker 0 takes 1 s per step, worker 1 0.5 s (2x faster); one synchronous warmup step; a sync
# every 4 s, the first interval 4 steps; a budget of 36 synchronous iterations (72 worker-steps).
# The plan: syncs after 5 / 5 (the first interval), then 4 / 8 steps each (4 s): 9 / 13,
# 13 / 21, 17 / 29, 21 / 37 (58 worker-steps), then the final sync at 26 / 46 (the 14 left, 5 / 9
# by speed).
A_EDIT = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=4, local_sgd_warmup_steps=1,
              min_total_global_steps=1, sync_mode="layerwise", outer_merge_alpha=0.0)
SYNCS = [([5, 5], False), ([9, 13], False), ([13, 21], False), ([17, 29], False), ([21, 37], False),
         ([26, 46], False)]
# rank -> (inner step s, {format: exchange s}, exposed s). Agreed: the fastest step (0.10 s) and
# the slowest exchange (0.15 s): a delay of ceil(1.2 x 1.5) = 2 <= H/2 (H = 4, the slowest
# worker's planned interval). Rank 3 alone would take a delay of 1 (ceil(1.2 x 0.05 / 0.13)).
MEASURED = {0: (0.10, {"fp32": 0.15}, 0.0), 1: (0.12, {"fp32": 0.14}, 0.0), 2: (0.11, {"fp32": 0.12}, 0.0),
            3: (0.13, {"fp32": 0.05}, 0.0)}


def _spec(**local):
    return default_spec(local_sgd=dict(A_EDIT, **local), outer=OUTER, seconds_per_step=[1.0, 0.5],
                        max_steps=MAX_STEPS, steps=MAX_STEPS, train_iters=36, async_syncs=SYNCS)


def _reports(r):
    return [(rep.step, rep.delay, rep.skipped_sync, rep.final) for rep in r["reports"]]


def test_the_injected_measurements_make_the_choice_the_test_expects():
    """The premise of the tests below, on the pure rule: agreed, a delay of 2 (H = 4); rank 3's
    own numbers alone, a delay of 1."""
    assert choose(0.10, {"fp32": 0.15}, 4, ("fp32",), fragments=(1,)).outer_step_delay == 2
    step, exchange, _ = MEASURED[3]
    assert choose(step, exchange, 4, ("fp32",), fragments=(1,)).outer_step_delay == 1


@pytest.mark.one_lane  # a variant of what other tests check in every lane (CI time; see conftest)
@pytest.mark.timeout(400)
def test_a_run_that_keeps_its_delay_equals_that_fixed_setting_bit_for_bit():
    """Started with --local-sgd-outer-step-delay 2: the first two syncs (5 / 5, 9 / 13) are timed
    at their launch (the exchange waited for right after it, at the sync), the rule keeps the
    delay 2 at the third (13 / 21). Every rank's parameters and losses equal the same A-EDiT run
    with the delay 2 and no automation, bit for bit: measuring changes when a sync waits and
    what rides on the schedule's all-reduce, never the numbers or the schedule."""
    auto = run_ranks(async_runs, WORLD, dict(_spec(auto_overlap=True, outer_step_delay=2), measurements=MEASURED),
                     timeout=360)
    fixed = run_ranks(async_runs, WORLD, _spec(outer_step_delay=2), timeout=360)
    expected = {0: [(7, 2), (11, 2), (15, 2), (19, 2), (23, 2), (26, 0)],
                1: [(7, 2), (15, 2), (23, 2), (31, 2), (39, 2), (46, 0)]}
    for a, f in zip(auto, fixed):
        assert [rep[:2] for rep in _reports(a)] == [rep[:2] for rep in _reports(f)] == expected[a["worker"]]
        assert [rep.launch_wait_seconds is not None for rep in a["reports"][:4]] == [True, True, False, False]
        assert [d[1:] for d in a["decisions"]] == [(2, "fp32")]
        assert a["finished"] and not a["in_flight_at_end"]
        assert all(torch.equal(a["params"][k], f["params"][k]) for k in f["params"])
    for shard in (0, 1):  # worker 0 is ranks 0-1, worker 1 ranks 2-3
        x, y = auto[shard]["params"], auto[2 + shard]["params"]
        assert all(torch.equal(x[k], y[k]) for k in x), "one model at the end"


@pytest.mark.one_lane  # a variant of what other tests check in every lane (CI time; see conftest)
@pytest.mark.timeout(400)
def test_a_delay_switched_on_mid_run_takes_effect_at_the_same_sync_everywhere_and_matches_the_simulation():
    """Started without a delay (layer-wise): the syncs after 5 / 5 and 9 / 13 are timed (each
    blocks), the third (13 / 21) agrees on the second's measurements (differing per rank) and
    every rank decides a delay of 2, put in force once that sync's exchange is applied; the
    fourth sync (17 / 29) is the first launched with it (applied after 19 / 31), the fifth too,
    and the final one (26 / 46) is blocking. Before the first delayed launch (after 17 / 29)
    every parameter equals the run without a delay and without automation, bit for bit (its
    timed syncs block, with the same numbers); the whole run matches the plain-PyTorch
    simulation with each sync's delay (0, 0, 0, 2, 2, final); one model on every worker at the
    end."""
    spec = dict(_spec(auto_overlap=True), measurements=MEASURED, snapshot_every_step=True)
    results = run_ranks(async_runs, WORLD, spec, timeout=360)
    fixed = run_ranks(async_runs, WORLD, dict(_spec(outer_merge_alpha=None), snapshot_every_step=True), timeout=360)
    for r, f in zip(results, fixed):
        launch = (17, 29)[r["worker"]]
        for step in range(1, launch):
            x, y = r["snapshots"][step], f["snapshots"][step]
            assert all(torch.equal(x[k], y[k]) for k in y), (r["worker"], step)
        assert not all(torch.equal(r["snapshots"][launch + 2][k], f["snapshots"][launch + 2][k]) for k in f["params"])
    sim = run_ranks(simulate_edit, 1, dict(spec, async_delays=[0, 0, 0, 2, 2, 0]), WORLD, timeout=120)[0]["params"]
    expected = {0: [(5, 0), (9, 0), (13, 0), (19, 2), (23, 2), (26, 0)],
                1: [(5, 0), (13, 0), (21, 0), (31, 2), (39, 2), (46, 0)]}
    for r in results:
        assert [rep[:2] for rep in _reports(r)] == expected[r["worker"]]
        assert [rep[3] for rep in _reports(r)] == [False] * 5 + [True]
        # decided after the worker's own step of the second sync, the same choice everywhere
        assert r["decisions"] == [((9, 13)[r["worker"]], 2, "fp32")]
        assert r["finished"] and not r["in_flight_at_end"]
        worst = max_difference(r["params"], sim[r["worker"]])
        assert worst <= SIM_ATOL, worst
    for shard in (0, 1):
        x, y = results[shard]["params"], results[2 + shard]["params"]
        assert all(torch.equal(x[k], y[k]) for k in x), "one model at the end"



# fp32 or int8: agreed step 0.10 s, exchange fp32 0.30 s (a delay of 4 > H/2 = 2), int8 0.08 s
# (a delay of ceil(1.2 x 0.8) = 1): int8 with a delay of 1.
MEASURED_INT8 = {r: (0.10 + 0.01 * r, {"fp32": 0.30 - 0.05 * r, "int8": 0.08 - 0.01 * r}, 0.0) for r in range(WORLD)}


@pytest.mark.one_lane  # a variant of what other tests check in every lane (CI time; see conftest)
@pytest.mark.timeout(400)
def test_a_change_of_format_mid_run_is_taken_at_the_same_sync_everywhere_and_ends_with_one_model():
    """--local-sgd-auto-formats fp32,int8, started in fp32 without a delay: the third sync decides
    int8 with a delay of 1 on every rank, the fourth and fifth syncs exchange in int8, launched
    at the sync and applied one step later, the final one blocking (in int8); the run ends with
    one model, and before the fourth sync every parameter equals the fixed fp32 run's."""
    assert (choose(0.10, {"fp32": 0.30, "int8": 0.08}, 4, ("fp32", "int8"), fragments=(1,)).exchange_dtype,
            choose(0.10, {"fp32": 0.30, "int8": 0.08}, 4, ("fp32", "int8"), fragments=(1,)).outer_step_delay) == (
        "int8", 1)
    spec = dict(_spec(auto_overlap=True, auto_formats="fp32,int8"), measurements=MEASURED_INT8,
                snapshot_every_step=True)
    results = run_ranks(async_runs, WORLD, spec, timeout=360)
    fixed = run_ranks(async_runs, WORLD, dict(_spec(outer_merge_alpha=None), snapshot_every_step=True), timeout=360)
    expected = {0: [(5, 0), (9, 0), (13, 0), (18, 1), (22, 1), (26, 0)],
                1: [(5, 0), (13, 0), (21, 0), (30, 1), (38, 1), (46, 0)]}
    for r, f in zip(results, fixed):
        assert [rep[:2] for rep in _reports(r)] == expected[r["worker"]]
        assert [rep.exchange_dtype for rep in r["reports"]] == ["fp32"] * 3 + ["int8"] * 3
        assert r["decisions"] == [((9, 13)[r["worker"]], 1, "int8")]
        assert r["finished"] and not r["in_flight_at_end"]
        for step in range(1, (17, 29)[r["worker"]]):
            x, y = r["snapshots"][step], f["snapshots"][step]
            assert all(torch.equal(x[k], y[k]) for k in y), (r["worker"], step)
    for shard in (0, 1):
        x, y = results[shard]["params"], results[2 + shard]["params"]
        assert all(torch.equal(x[k], y[k]) for k in x), "one model at the end"

# --- when it agrees, decides and puts a decision in force (a controller stand-in) -------------

def _stand_in(**local):
    """An :class:`AsyncAutoOverlap` on a stand-in controller (one rank; what it reads: nothing in
    flight or an exchange in flight, the plan's latest sync), every step 0.1 s."""
    from types import SimpleNamespace

    from megatron_edit.config import LocalSGDConfig
    from megatron_edit.mcore.auto_overlap_async import AsyncAutoOverlap, auto_overlap_for

    user = LocalSGDConfig(**dict(A_EDIT, auto_overlap=True, auto_formats="fp32,int8", **local))
    ctl = SimpleNamespace(sync=SimpleNamespace(in_progress=False), delayed=None, num_workers=2,
                          shards=[SimpleNamespace(numel=1024, device="cpu")], applied=[],
                          async_plan=SimpleNamespace(last_sync=None, final_planned=False))
    auto = auto_overlap_for(ctl, user)
    assert type(auto) is AsyncAutoOverlap
    ctl.auto, ctl.config = auto, auto.initial_config()

    def apply_settings(delay, dtype, fragments=None):
        ctl.applied.append((delay, dtype))
        ctl.config = auto.config_for(delay, dtype)

    ctl.apply_settings = apply_settings
    # Every step 0.1 s: the clock moves at each step's end only; no codec, no probes (the
    # stand-in's reports): the other formats' times scale with bytes.
    now, step_ended = [0.0], auto.step_ended
    auto.clock = lambda: now[0]

    def tick():
        now[0] += 0.1
        step_ended()

    auto.step_ended = tick
    auto.codec = lambda config_for, formats, *_: {f: 0.0 for f in formats}
    return ctl


def _at_sync(ctl, seconds, interval=(4, 8), final=False, final_next=False):
    """A sync: its plan's all-reduce (this rank's message is the agreement) then the sync's own
    report (blocking without a delay; a delayed one waited at its launch while timed)."""
    from types import SimpleNamespace

    from megatron_edit.exchange.report import SyncReport

    auto = ctl.auto
    for _ in range(4):
        auto.step_ended()
    numbers = auto.message()
    point = SimpleNamespace(interval=None if final else list(interval), final=final)
    ctl.async_plan.final_planned, ctl.async_plan.last_sync = final_next, point  # as the plan leaves them
    auto.agreed(numbers, point)
    c = ctl.config
    auto.sync_done(SyncReport(step=0, mode="layerwise", buckets=1, payload_bytes=0, seconds=seconds, workers=2,
                              delay=c.outer_step_delay, exchange_dtype=c.exchange_dtype,
                              launch_wait_seconds=seconds if auto.timed and c.outer_step_delay else None,
                              exchange_seconds=seconds))


def test_measurements_agreed_at_the_next_sync_decide_and_the_decision_waits_for_nothing_in_flight():
    """The message of a sync carries the previous sync's measurement (zeros at the first); the
    third sync agrees on the second's and decides (fp32 0.3 s, a step of 0.1 s, H = 4 the
    slowest worker's interval: fp32 would need tau 4 > H/2, int8 0.3 x 1040 / 4096 s takes
    tau 1); the decision waits while an exchange is in flight and is put in force at the first
    step after it."""
    ctl = _stand_in()
    auto = ctl.auto
    assert auto.message().abs().sum() == 0
    _at_sync(ctl, 0.3)
    _at_sync(ctl, 0.3)
    assert auto.pending is None and auto.timed and auto.decisions == []
    ctl.delayed = type("InFlight", (), {"in_flight": True})()
    _at_sync(ctl, 0.3)
    choice = auto.pending
    assert (choice.outer_step_delay, choice.exchange_dtype) == (1, "int8") and not auto.timed
    auto.after_sync()
    assert ctl.applied == []  # an exchange in flight
    ctl.delayed.in_flight = False
    auto.after_sync()
    assert ctl.applied == [(1, "int8")] and auto.pending is None


def test_nothing_is_decided_where_the_next_sync_is_the_final_one():
    ctl = _stand_in()
    _at_sync(ctl, 0.3)
    _at_sync(ctl, 0.3)
    _at_sync(ctl, 0.3, final_next=True)
    assert ctl.auto.pending is None and ctl.auto.decisions == []
    _at_sync(ctl, 0.3, final=True)
    assert ctl.auto.pending is None and ctl.auto.decisions == []


def test_h_is_the_slowest_worker_s_planned_interval():
    """The same measurements with the slowest worker planned 8 steps (H = 8): fp32 with tau 4."""
    ctl = _stand_in()
    for _ in range(3):
        _at_sync(ctl, 0.3, interval=(8, 16))
    assert (ctl.auto.pending.outer_step_delay, ctl.auto.pending.exchange_dtype) == (4, "fp32")


def test_a_resume_takes_a_delay_longer_than_the_first_interval():
    """A-EDiT plans every interval but the last at least tau + 1 steps, so a checkpoint's delay
    may exceed --local-sgd-sync-interval (only the first interval): a resume takes it, where
    EDiT's grid refuses it (tau < H/F)."""
    ctl = _stand_in()
    assert ctl.auto.user.local_sgd_sync_interval <= 6
    assert ctl.auto.resume(6, "int8") is None and ctl.applied == [(6, "int8")]


# Fragments (issue 60): worker 1 at 0.75 s per step; a sync every 6 s, the first interval 4 steps;
# a budget of 33 synchronous iterations (66 worker-steps). Agreed: a step of 0.10 s, an exchange
# of 0.30 s: 1.2 x 0.3 / 0.1 = 3.6 steps, over H/2 = 3 with one fragment (H = 6, the slowest
# worker's 6 steps), hidden with two: tau = ceil(3.6 / 2) = 2 < H/F = 3.
MEASURED_FRAGMENTS = {r: (0.10 + 0.01 * r, {"fp32": 0.30 - 0.05 * r}, 0.0) for r in range(WORLD)}
# The plan: 5 / 5 (the first interval), 11 / 13, 17 / 21 (6 / 8 steps: 6 s each; the third
# decides F = 2 with tau 2, in force once its exchange is applied), 23 / 29 (planned with F = 1;
# the first sync of one fragment: fragment 1, launched with tau 2), then 3 s a sync (3 / 4
# steps): 26 / 33 (fragment 0, 59 worker-steps); the 7 left make the final interval, 3 / 4 by
# speed: the final sync at 29 / 37, of every fragment.
SYNCS_FRAGMENTS = [([5, 5], False), ([11, 13], False), ([17, 21], False), ([23, 29], False), ([26, 33], False),
                   ([29, 37], False)]


@pytest.mark.one_lane  # a variant of what other tests check in every lane (CI time; see conftest)
@pytest.mark.timeout(400)
def test_fragments_chosen_mid_run_take_effect_at_the_same_sync_everywhere_and_match_the_simulation():
    """--local-sgd-auto-fragments 1,2 on A-EDiT, started with one fragment and no delay: the third
    sync decides two fragments with a delay of 2 on every rank (H = 6: one fragment would need a
    delay over H/2); from the fourth sync each sync exchanges one fragment, in turn, launched at
    the sync and applied 2 steps later, a sync every 3 s instead of 6; the final sync is of every
    fragment, blocking; the run matches the plain-PyTorch simulation with those fragments and
    delays and ends with one model."""
    choice = choose(0.10, {"fp32": 0.30}, 6, ("fp32",), fragments=(1, 2))
    assert (choice.fragments, choice.outer_step_delay) == (2, 2)
    spec = default_spec(local_sgd=dict(A_EDIT, local_sgd_sync_time=6.0, auto_overlap=True, auto_fragments="1,2"),
                        outer=OUTER, seconds_per_step=[1.0, 0.75], max_steps=MAX_STEPS, steps=MAX_STEPS, train_iters=33,
                        async_syncs=SYNCS_FRAGMENTS, measurements=MEASURED_FRAGMENTS, bucket_size=1000)
    results = run_ranks(async_runs, WORLD, spec, timeout=360)
    frags = results[0]["fragment_params"]
    assert len(frags) == 2 and all(frags)
    expected = {0: [(5, 0, None), (11, 0, None), (17, 0, None), (25, 2, 1), (28, 2, 0), (29, 0, None)],
                1: [(5, 0, None), (13, 0, None), (21, 0, None), (31, 2, 1), (35, 2, 0), (37, 0, None)]}
    for r in results:
        assert r["fragment_params"] == frags
        got = [(rep.step, rep.delay, rep.fragment) for rep in r["reports"]]
        assert got == expected[r["worker"]], (r["worker"], got)
        assert [rep.final for rep in r["reports"]] == [False] * 5 + [True]
        assert r["decisions"] == [((11, 13)[r["worker"]], 2, "fp32")]
        assert r["finished"] and not r["in_flight_at_end"]
    sim = run_ranks(simulate_edit, 1, dict(spec, fragment_params=frags, async_delays=[0, 0, 0, 2, 2, 0],
                                           async_fragments_from=3), WORLD, timeout=120)[0]["params"]
    for r in results:
        worst = max_difference(r["params"], sim[r["worker"]])
        assert worst <= SIM_ATOL, worst
    for shard in (0, 1):
        x, y = results[shard]["params"], results[2 + shard]["params"]
        assert all(torch.equal(x[k], y[k]) for k in x), "one model at the end"
