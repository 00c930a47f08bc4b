"""A-EDiT: time-based syncs without per-step communication, identical decisions everywhere."""

import pytest
import torch

from dist import run_ranks
from edit_runs import async_runs, default_spec
from megatron_edit.algorithm import asynchronous
from test_edit_megatron import OUTER, _assert_params_equal

F64 = torch.float64


def test_plan_skip_and_step_weights_on_known_inputs():
    plan = asynchronous.plan_next_interval(torch.tensor([2.0, 2.0]), torch.tensor([2.0, 0.5]), 4.0)
    assert plan.tolist() == [4, 16]
    assert asynchronous.plan_next_interval(torch.tensor([1.0]), torch.tensor([100.0]), 1.0).tolist() == [1]
    assert asynchronous.skip_sync(torch.tensor([4.0, 5.0]), 10) and not asynchronous.skip_sync(torch.tensor([4.0, 6.0]), 10)
    weights = torch.full((2, 3), 0.5, dtype=F64)
    excluded = torch.tensor([[False, False, True], [False, False, False]])
    blended = asynchronous.blend_step_weights(weights, torch.tensor([4.0, 16.0]), excluded, 0.5)
    # 0.5 * 0.5 + 0.5 * (4 / 20) = 0.35; where worker 0 is excluded its weight stays 0 * ... + 0.
    assert torch.allclose(blended[:, 0], torch.tensor([0.35, 0.65], dtype=F64))
    weights[:, 2] = torch.tensor([0.0, 1.0], dtype=F64)
    blended = asynchronous.blend_step_weights(weights, torch.tensor([4.0, 16.0]), excluded, 0.5)
    assert torch.allclose(blended[:, 2], torch.tensor([0.0, 1.0], dtype=F64))
    message = asynchronous.schedule_message(3, 1, 9, 7, 2.5, 40)
    assert message.dtype == F64 and message.tolist() == [[0, 9, 0], [0, 7, 0], [0, 2.5, 0], [0, 40, 0]]
    nxt = asynchronous.next_sync_steps(torch.tensor([7.0, 19.0]), torch.tensor([4, 16]), None)
    assert nxt.tolist() == [11, 35]
    # Worker 1 would pass the last step (20) before its next sync: everybody's last sync is at 20.
    assert asynchronous.next_sync_steps(torch.tensor([7.0, 19.0]), torch.tensor([4, 16]), 20).tolist() == [20, 20]
    assert asynchronous.next_sync_steps(torch.tensor([3.0, 3.0]), torch.tensor([4, 16]), 20).tolist() == [7, 19]


@pytest.mark.timeout(240)
def test_fake_clock_schedule_skip_and_step_weights_are_exact_and_identical_everywhere():
    """Worker 0 takes 1 s per step, worker 1 0.25 s (4x faster), one synchronous warmup step,
    sync every 4 s, first interval 2 steps. Sync 1 (steps 2/2, 4 steps in total < 10) is
    skipped; then worker 0 syncs every 4 steps and worker 1 every 16; step weights blend 50/50
    with the step share."""
    spec = default_spec(
        local_sgd=dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, local_sgd_warmup_steps=1,
                       min_total_global_steps=10, use_step_weight=True, step_weight_ratio=0.5,
                       sync_mode="step_end"),
        outer=OUTER, seconds_per_step=[1.0, 0.25], syncs=3, max_steps=64,
    )
    results = run_ranks(async_runs, 4, spec, timeout=200)
    for r in results:
        expected_steps = [3, 7, 11] if r["worker"] == 0 else [3, 19, 35]
        assert [rep.step for rep in r["reports"]] == expected_steps
        assert r["steps"] == expected_steps[-1]
        assert [rep.skipped_sync for rep in r["reports"]] == [True, False, False]
        assert r["reports"][0].worker_steps.tolist() == [2, 2]
        assert r["reports"][0].worker_seconds.tolist() == [2.0, 0.5]
        # only the schedule: 4 x W float64, all-reduced over the 4 ranks (2 x 3/4 of it sent)
        assert r["reports"][0].payload_bytes == 2 * 3 * (4 * 2 * 8) // 4
        assert r["reports"][1].worker_steps.tolist() == [6, 18]  # since the anchor (skip in between)
        assert r["reports"][1].worker_seconds.tolist() == [4.0, 4.0]
        assert r["reports"][2].worker_steps.tolist() == [4, 16]
        # 0.5 * 0.5 + 0.5 * 6 / 24 = 0.375
        assert torch.allclose(r["reports"][1].weights[:, 0], torch.tensor([0.375, 0.625], dtype=F64))
    for rep_a, rep_b in zip(results[0]["reports"], results[3]["reports"]):  # two workers agree
        assert torch.equal(rep_a.worker_steps, rep_b.worker_steps) and rep_a.skipped_sync == rep_b.skipped_sync
    _assert_params_equal(results[0]["params"], results[2]["params"], "replicas after the last sync")


@pytest.mark.timeout(240)
def test_run_ends_with_one_final_sync_on_every_worker():
    """With the run's last step known (Megatron-LM's --train-iters = 20), the sync that would
    take worker 1 past it becomes the final one, at step 20 for every worker: both end at a
    sync with identical models (without it the slow worker's next sync would never come)."""
    spec = default_spec(
        local_sgd=dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, local_sgd_warmup_steps=1,
                       min_total_global_steps=10, sync_mode="step_end"),
        outer=OUTER, seconds_per_step=[1.0, 0.25], syncs=3, max_steps=64, final_step=20,
    )
    results = run_ranks(async_runs, 4, spec, timeout=200)
    for r in results:
        assert [rep.step for rep in r["reports"]] == ([3, 7, 20] if r["worker"] == 0 else [3, 19, 20])
        assert r["steps"] == 20
    _assert_params_equal(results[0]["params"], results[2]["params"], "replicas after the final sync")


@pytest.mark.timeout(180)
def test_five_times_slower_worker_no_deadlock_and_identical_replicas():
    """Real clock; worker 1 sleeps 5x as long per step as worker 0's whole step. Three syncs
    complete, the fast worker took several times more steps, replicas are identical."""
    spec = default_spec(
        local_sgd=dict(use_async=True, local_sgd_sync_time=1.0, local_sgd_sync_interval=2,
                       min_total_global_steps=1),
        outer=OUTER, sleep=[0.0, 0.1], syncs=3, max_steps=2000,
    )
    results = run_ranks(async_runs, 4, spec, timeout=170)
    fast, slow = results[0], results[2]
    assert fast["worker"] == 0 and slow["worker"] == 1
    assert fast["steps"] > 2 * slow["steps"], (fast["steps"], slow["steps"])
    _assert_params_equal(fast["params"], slow["params"], "replicas after the last sync")
    assert all(r["reports"][-1].worker_steps.tolist() == fast["reports"][-1].worker_steps.tolist() for r in results)
