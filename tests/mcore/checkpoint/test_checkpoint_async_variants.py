"""Exact resume of A-EDiT (``use_async``) with streaming fragments and with ``auto_overlap`` on
real megatron-core (CPU, gloo, 2 workers x 2 ranks; issue 60): a run saved at a sync and stopped
there (as Megatron-LM's --save-interval with --exit-interval), resumed by the same 2 workers on
the same fake clock (tests/checkpoint_runs.py ``async_resume_job``), has the uninterrupted run's
later syncs and final parameters bit for bit, and ends with one model."""

import pytest
import torch

from checkpoint_runs import WORLD, async_resume_job
from dist import run_ranks
from megatron_edit.mcore import checkpoint as checkpointing, compat

pytestmark = pytest.mark.skipif(
    not checkpointing.SUPPORTED.contains(compat.megatron_core_version()),
    reason=f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}",
)


def _runs(tmp_path, local, speeds, train_iters, stop_after_syncs, measurements=None, resume_measurements=None):
    """(uninterrupted, saved, resumed) ranks' results: the saved run stops at its
    ``stop_after_syncs``-th sync; the resumed one loads it (with ``resume_measurements``)."""
    path = str(tmp_path / "ckpt")
    common = dict(measurements=measurements)
    whole = run_ranks(async_resume_job, WORLD, local, speeds, train_iters, timeout=300, **common)
    saved = run_ranks(async_resume_job, WORLD, local, speeds, train_iters, save=path,
                      stop_after_syncs=stop_after_syncs, timeout=300, **common)
    resumed = run_ranks(async_resume_job, WORLD, local, speeds, train_iters, load=path,
                        measurements=resume_measurements, timeout=300)
    return whole, saved, resumed


def _check_exact(whole, saved, resumed):
    """Every rank: the saved run's syncs are the uninterrupted run's first ones, the resumed
    run's the rest; it starts at the saved step count and ends with the uninterrupted run's
    parameters bit for bit; both workers hold one model."""
    for w, s, r in zip(whole, saved, resumed):
        assert w["worker"] == s["worker"] == r["worker"]
        n = len(s["syncs"])
        assert n and w["syncs"][:n] == s["syncs"], (s["worker"], w["syncs"], s["syncs"])
        assert r["syncs"] == w["syncs"][n:] and r["syncs"], (r["worker"], w["syncs"], r["syncs"])
        assert r["loaded"]["steps_done"] == s["saved"]["steps_done"]
        assert r["finished"] and w["finished"] and r["steps_done"] == w["steps_done"]
        assert not r["in_flight_at_end"]
        assert r["params"].keys() == w["params"].keys()
        differ = [k for k in w["params"] if not torch.equal(r["params"][k], w["params"][k])]
        assert not differ, (r["worker"], differ[:4])
    for shard in (0, 1):  # worker 0 is ranks 0-1, worker 1 ranks 2-3
        x, y = resumed[shard]["params"], resumed[2 + shard]["params"]
        assert all(torch.equal(x[k], y[k]) for k in x), "one model at the end"


# A-EDiT with F = 2 (tests/mcore/test_async_sync.py's schedule): worker 0 takes 1 s a step, worker
# 1 0.25 s; one warmup step; a sync every 2 s (4 s / F), the first interval 2 steps; a budget of
# 20 iterations.
FRAG = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=4, local_sgd_warmup_steps=1,
            fragments=2, min_total_global_steps=1, use_step_weight=True, step_weight_ratio=0.5,
            sync_mode="step_end")
def _in_ci(cases, kept):
    """The cases, ``kept`` in CI and the others marked slow (pytest -m slow): CI's time (the
    fragments cases of the auto runs, 17-24 s each on CI's machine, repeat what the kept one
    checks with another setting)."""
    return [c if c == kept else pytest.param(c, marks=pytest.mark.slow) for c in cases]


FRAG_CASES = {  # flags, each sync (worker 0's step, worker 1's, delay, fragment, skipped)
    # Syncs after 3 / 3 (fragment 1), 5 / 11 (fragment 0), 7 / 19 (fragment 1), the final one at
    # 10 / 30 (every fragment). Saved at the first, 3 / 3: the round-robin's count and each
    # fragment's last sync (controller_state's ``async_fragments``) decide the rest (restarted
    # from nothing, the next sync would exchange fragment 1 again, weighed from 3 / 3).
    "no delay": (FRAG, [(3, 3, 0, 1, False), (5, 11, 0, 0, False), (7, 19, 0, 1, False),
                        (10, 30, 0, None, False)]),
    # tau = 1: every real sync but the final one has its exchange in flight at the sync, where a
    # save is refused (async_delayed), so the save is at a skipped sync: the first, 3 / 3 (2 + 2
    # worker-steps since the anchor, fewer than --local-sgd-min-total-global-steps 5; nothing
    # launched). Then 5 / 11 (fragment 1, the first real sync; launched there, applied a step
    # later), 7 / 19 (fragment 0), the final one at 10 / 30, not delayed.
    "tau 1, saved at a skipped sync": (
        dict(FRAG, sync_mode="layerwise", outer_step_delay=1, outer_merge_alpha=0.0, min_total_global_steps=5),
        [(3, 3, 0, None, True), (6, 12, 1, 1, False), (8, 20, 1, 0, False), (10, 30, 0, None, False)]),
}


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", list(FRAG_CASES))
def test_a_edit_with_fragments_resumes_at_a_sync_bit_for_bit(tmp_path, case):
    """Saved at the first sync (3 / 3) and stopped there. Without a delay fragment 1 was synced
    there and fragment 0 has trained locally since the anchor (after the warmup step): the
    resumed run exchanges fragment 0 with step weights counted from the anchor (4 / 10 steps),
    then fragment 1, then every fragment at 10 / 30; with tau = 1 the sync was skipped and the
    resumed run starts the round-robin at fragment 1, weighed from the anchor. Either way it has
    the uninterrupted run's syncs and, bit for bit, its parameters."""
    local, syncs = FRAG_CASES[case]
    whole, saved, resumed = _runs(tmp_path, local, [1.0, 0.25], 20, stop_after_syncs=1)
    for r in whole:
        got = [(x[0], x[1], x[2], x[5]) for x in r["syncs"]]  # (step, delay, fragment, skipped)
        assert got == [(s[r["worker"]], d, f, k) for *s, d, f, k in syncs], (r["worker"], got)
    assert [len(s["syncs"]) for s in saved] == [1] * WORLD
    _check_exact(whole, saved, resumed)


# --- auto_overlap on A-EDiT (mcore/auto_overlap_async.py) --------------------------------------
# tests/mcore/test_auto_overlap_async.py's run: worker 0 takes 1 s a step, worker 1 0.5 s; one
# warmup step; a sync every 4 s, the first interval 4 steps; the measurements injected per rank
# (every rank's step 0.10-0.13 s). Two timed syncs, then the third agrees on the second's
# measurements and decides; the decision is in force from the step after that sync (nothing in
# flight: no delay), so the fourth sync is the first with it. A decision with a delay leaves an
# exchange in flight at every later sync but the final one (a save there is refused), so the
# decisions here keep no delay: a fast link (exchange 0.01 s: 1.2 x 0.01 <= a third of a step)
# takes tau = 0 and the first format / the fewest fragments allowed.
AUTO = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=4, local_sgd_warmup_steps=1,
            min_total_global_steps=1, sync_mode="layerwise", outer_merge_alpha=0.0, auto_overlap=True)
FAST_LINK = {r: (0.10 + 0.01 * r, {"fp32": 0.01 - 0.001 * r, "int8": 0.005}, 0.0) for r in range(WORLD)}
AUTO_CASES = {  # (flags, budget, each worker's syncs, formats, fragments, the steps decided after)
    # started in int8 (--local-sgd-exchange-dtype int8 --local-sgd-auto-formats fp32,int8), decides
    # fp32: syncs after 5 / 5, 9 / 13, 13 / 21 (decides), 17 / 29 (the first in fp32; saved), 21 / 37,
    # the final one at 26 / 46 (a budget of 36 iterations)
    "int8 to fp32": (dict(AUTO, exchange_dtype="int8", auto_formats="fp32,int8"), 36,
                     {0: [5, 9, 13, 17, 21, 26], 1: [5, 13, 21, 29, 37, 46]}, ["int8"] * 3 + ["fp32"] * 3,
                     [None] * 6, (9, 13)),
    # started with 2 fragments (--local-sgd-fragments 2 --local-sgd-auto-fragments 1,2), a sync every
    # 2 s: 3 / 3 (fragment 1), 5 / 7 (0), 7 / 11 (1, decides one fragment), 9 / 15 (the whole model,
    # planned with F = 2; saved), then every 4 s: 13 / 23, 17 / 31, the final one at 21 / 39 (a budget
    # of 30 iterations)
    "2 fragments to 1": (dict(AUTO, fragments=2, auto_fragments="1,2"), 30,
                         {0: [3, 5, 7, 9, 13, 17, 21], 1: [3, 7, 11, 15, 23, 31, 39]}, ["fp32"] * 7,
                         [1, 0, 1] + [None] * 4, (5, 7)),
}


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", _in_ci(AUTO_CASES, "int8 to fp32"))
def test_a_edit_auto_overlap_resumes_with_the_settings_in_force_bit_for_bit(tmp_path, case):
    """Saved at the fourth sync, the first with the decision in force, and resumed with the
    flags' start settings (int8, or 2 fragments): the resume continues with the checkpoint's
    (fp32, or one fragment; no measuring: the decision stands), its syncs and final parameters
    equal the uninterrupted run's bit for bit, and it ends with one model."""
    local, iters, steps, dtypes, fragments, decided_after = AUTO_CASES[case]
    whole, saved, resumed = _runs(tmp_path, local, [1.0, 0.5], iters, stop_after_syncs=4, measurements=FAST_LINK,
                                  resume_measurements=FAST_LINK)
    start = (0, local.get("exchange_dtype", "fp32"), local.get("fragments", 1))
    for w, s, r in zip(whole, saved, resumed):
        assert [x[0] for x in w["syncs"]] == steps[w["worker"]]
        assert [x[4] for x in w["syncs"]] == dtypes and [x[2] for x in w["syncs"]] == fragments
        assert [x[1] for x in w["syncs"]] == [0] * len(steps[0])  # no delay
        # decided at the third sync, on the second's measurements (after the worker's step there)
        assert w["decisions"] == s["decisions"] == [(decided_after[w["worker"]], 0, "fp32", 1)]
        assert s["saved"]["settings"] == (0, "fp32", 1) != start
        assert r["loaded"]["settings"] == (0, "fp32", 1) and r["loaded"]["timed"] is False
        assert r["decisions"] == [] and r["settings"] == w["settings"] == (0, "fp32", 1)
    _check_exact(whole, saved, resumed)


# Decisions with a delay (tests/mcore/test_auto_overlap_async.py's runs), taken at the third sync:
DECIDING_CASES = {  # (flags, speeds, budget, measurements, the settings decided, syncs after the save)
    # a step of 0.10 s, an fp32 exchange of 0.30 s (a delay of 4 > H/2 = 2), int8 0.08 s: int8
    # with a delay of 1 at the third sync (13 / 21); then syncs applied after 18 / 30 and 22 / 38
    # (launched a step before), the final one at 26 / 46
    "int8, tau 1": (dict(AUTO, auto_formats="fp32,int8"), [1.0, 0.5], 36,
                    {r: (0.10 + 0.01 * r, {"fp32": 0.30 - 0.05 * r, "int8": 0.08 - 0.01 * r}, 0.0)
                     for r in range(WORLD)},
                    (1, "int8", 1), [((18, 30), 1, None), ((22, 38), 1, None), ((26, 46), 0, None)]),
    # --local-sgd-auto-fragments 1,2, worker 1 at 0.75 s a step, a sync every 6 s: fp32 at 0.30 s
    # over a step of 0.10 s needs 2 fragments with a delay of 2 (H = 6), decided at the third sync
    # (17 / 21); then a sync every 3 s, one fragment each: 25 / 31 (fragment 1), 28 / 35
    # (fragment 0), the final one at 29 / 37
    "2 fragments, tau 2": (dict(AUTO, local_sgd_sync_time=6.0, auto_fragments="1,2"), [1.0, 0.75], 33,
                           {r: (0.10 + 0.01 * r, {"fp32": 0.30 - 0.05 * r}, 0.0) for r in range(WORLD)},
                           (2, "fp32", 2), [((25, 31), 2, 1), ((28, 35), 2, 0), ((29, 37), 0, None)]),
}


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", _in_ci(DECIDING_CASES, "int8, tau 1"))
def test_a_edit_auto_overlap_saved_at_the_sync_that_decides_keeps_the_decision(tmp_path, case):
    """With a delay decided, every later sync but the final one has an exchange in flight (a save
    there is refused), so the one point to save a run after its decision is the deciding sync
    itself (not delayed; its exchange is done): saved there and resumed with the flags' start
    settings, the run goes on with the decision, its syncs and final parameters the
    uninterrupted run's bit for bit. Before the fix (issue 60) the decision, pending until the
    next optimizer step, was in no checkpoint: the run record carried the settings the run
    started with, the resume measured from scratch and never decided (to the end without a
    delay, in fp32 / one fragment)."""
    local, speeds, iters, measured, decided, after = DECIDING_CASES[case]
    whole, saved, resumed = _runs(tmp_path, local, speeds, iters, stop_after_syncs=3, measurements=measured,
                                  resume_measurements=measured)
    for w, s, r in zip(whole, saved, resumed):
        assert [(x[0], x[1], x[2]) for x in w["syncs"]][3:] == [(steps[w["worker"]], d, f) for steps, d, f in after]
        assert [d[1:] for d in s["decisions"]] == [decided]
        assert s["saved"]["settings"] == decided  # put in force at the save (before_save)
        assert r["loaded"]["settings"] == decided and r["loaded"]["timed"] is False, r["loaded"]
    _check_exact(whole, saved, resumed)


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(600)
def test_a_edit_auto_overlap_resumed_on_the_machine_s_clocks_measures_and_ends_with_one_model(tmp_path):
    """Saved at the second sync (5 / 7, before any decision) of the run with 2 fragments and
    resumed with nothing injected: the steps and exchanges are timed on this machine's clocks
    from the load. (EDiT resumed one step before a sync crashed in its measurement with no step
    timed since the load: ``StatisticsError``, tests/mcore/test_auto_overlap.py.) On A-EDiT the
    first sync after the load carries no measurement (zeros, alike everywhere), the next ones
    do: the run decides on every rank alike, reaches its budget and ends with one model."""
    local = AUTO_CASES["2 fragments to 1"][0]
    path = str(tmp_path / "ckpt")
    run_ranks(async_resume_job, WORLD, local, [1.0, 0.5], 30, save=path, stop_after_syncs=2, measurements=FAST_LINK,
              timeout=300)
    resumed = run_ranks(async_resume_job, WORLD, local, [1.0, 0.5], 30, load=path, timeout=300)
    for r in resumed:
        assert r["loaded"]["steps_done"] == (5, 7)[r["worker"]] and r["loaded"]["timed"] is True
        assert r["finished"] and not r["in_flight_at_end"] and r["syncs"][-1][3]  # the final sync
        assert r["decisions"]  # the two syncs after the load's first measured, then decided (then maybe again)
        # every rank took the same settings at each sync, and the same decision
        same = resumed[2 * (r["worker"] == 0)]  # a rank of the other worker
        assert [x[1:] for x in r["syncs"]] == [x[1:] for x in same["syncs"]]
        assert [d[1:] for d in r["decisions"]] == [d[1:] for d in same["decisions"]]
    assert sum(r["steps_done"] for r in resumed[::2]) == 30 * 2  # the budget, exactly
    for shard in (0, 1):
        x, y = resumed[shard]["params"], resumed[2 + shard]["params"]
        assert all(torch.equal(x[k], y[k]) for k in x), "one model at the end"
