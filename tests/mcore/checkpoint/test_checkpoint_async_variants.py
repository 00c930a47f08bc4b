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
# 1 0.25 s; a sync every 2 s (4 s / F), the first interval 2 steps; a budget of 20 iterations:
# syncs after 3 / 3 (fragment 1), 5 / 11 (fragment 0), 7 / 19 (fragment 1), the final one at
# 10 / 30 (every fragment). Saved at the first, 3 / 3: the round-robin's count and each
# fragment's last sync (controller_state's ``async_fragments``) decide the rest (restarted from
# nothing, the next sync would exchange fragment 1 again, weighed from 3 / 3).
FRAG = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=4, local_sgd_warmup_steps=1,
            fragments=2, min_total_global_steps=1, use_step_weight=True, step_weight_ratio=0.5,
            sync_mode="step_end")
FRAG_SYNCS = {0: [(3, 1), (5, 0), (7, 1), (10, None)], 1: [(3, 1), (11, 0), (19, 1), (30, None)]}


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(600)
def test_a_edit_with_fragments_resumes_at_a_sync_bit_for_bit(tmp_path):
    """Saved at the first sync (fragment 1's, 3 / 3), fragment 0 trained locally since the anchor
    (after the warmup step): the resumed run exchanges fragment 0 at 5 / 11 with step weights
    counted from the anchor (4 / 10 steps), fragment 1 at 7 / 19, then every fragment at 10 / 30,
    as the uninterrupted run."""
    whole, saved, resumed = _runs(tmp_path, FRAG, [1.0, 0.25], 20, stop_after_syncs=1)
    for r in whole:
        assert [(s[0], s[2]) for s in r["syncs"]] == FRAG_SYNCS[r["worker"]]
    assert [len(s["syncs"]) for s in saved] == [1] * WORLD
    _check_exact(whole, saved, resumed)
