"""A-EDiT: time-based syncs without per-step communication, identical decisions everywhere."""

import itertools

import pytest
import torch

from dist import run_ranks
from edit_runs import async_runs, default_spec
from megatron_edit.algorithm import asynchronous
from test_edit_megatron import OUTER, _assert_params_equal

F64 = torch.float64


def test_plan_skip_and_step_weights_on_known_inputs():
    rates = asynchronous.smoothed_rates(torch.tensor([[2.0, 2.0]]), torch.tensor([[2.0, 0.5]]))
    assert rates.tolist() == [1.0, 4.0]
    assert asynchronous.plan_next_interval(rates, 4.0).tolist() == [4, 16]
    assert asynchronous.plan_next_interval(torch.tensor([0.01]), 1.0).tolist() == [1]
    assert asynchronous.skip_sync(torch.tensor([4.0, 5.0]), 10) and not asynchronous.skip_sync(torch.tensor([4.0, 6.0]), 10)
    weights = torch.full((2, 3), 0.5, dtype=F64)
    excluded = torch.tensor([[False, False, True], [False, False, False]])
    blended = asynchronous.blend_step_weights(weights, torch.tensor([4.0, 16.0]), excluded, 0.5)
    # 0.5 * 0.5 + 0.5 * (4 / 20) = 0.35; where worker 0 is excluded its weight stays 0 * ... + 0.
    assert torch.allclose(blended[:, 0], torch.tensor([0.35, 0.65], dtype=F64))
    weights[:, 2] = torch.tensor([0.0, 1.0], dtype=F64)
    blended = asynchronous.blend_step_weights(weights, torch.tensor([4.0, 16.0]), excluded, 0.5)
    assert torch.allclose(blended[:, 2], torch.tensor([0.0, 1.0], dtype=F64))
    # per layer (A-EDiT's final sync with fragments: each layer its fragment's steps)
    per_layer = torch.tensor([[4.0, 4.0, 1.0], [16.0, 16.0, 3.0]])
    both = asynchronous.blend_step_weights(weights, per_layer, torch.zeros_like(excluded), 0.5)
    assert torch.allclose(both[:, 0], torch.tensor([0.35, 0.65], dtype=F64))
    assert torch.allclose(both[:, 2], torch.tensor([0.125, 0.875], dtype=F64))  # 0.5 * (0, 1) + 0.5 * (1, 3) / 4
    message = asynchronous.schedule_message(3, 1, 9, 7, 2.5, 40, 12.0, 30)
    assert message.dtype == F64 and message[:, 1].tolist() == [9, 7, 2.5, 40, 12.0, 30]
    assert message[:, 0].abs().sum() == 0 and message[:, 2].abs().sum() == 0
    schedule = asynchronous.read_schedule(
        torch.tensor([[1, 2], [3, 4], [5.0, 3.5], [10, 20], [9, 9], [0, 0]], dtype=F64))
    assert schedule.idle.tolist() == [0.0, 1.5]


def test_workers_that_come_and_go_plan_from_applied_steps_and_measured_speeds():
    """The torchft backend's A-EDiT: a worker with no measured interval (just joined or healed)
    is planned at the mean speed of those measured; the budget counts the worker-steps applied
    to the anchor, not the workers' own counts (a dead worker's were lost); global progress per
    step counts the run's workers."""
    measured = torch.tensor([True, False, True])
    filled = asynchronous.fill_unmeasured(torch.tensor([1.0, 0.0, 3.0], dtype=F64), measured)
    assert filled.tolist() == [1.0, 2.0, 3.0]
    assert asynchronous.fill_unmeasured(torch.zeros(2, dtype=F64), torch.tensor([False, False])) is None
    rates = torch.tensor([1.0, 1.0], dtype=F64)
    # own counts 100 + 100 would end the run; 30 applied worker-steps leave 10 of a 40 budget
    interval, last = asynchronous.plan(torch.tensor([100.0, 100.0]), rates, 4.0, budget_steps=40, done_steps=30)
    assert last and interval.tolist() == [5, 5]
    interval, last = asynchronous.plan(torch.tensor([100.0, 100.0]), rates, 4.0, budget_steps=40, done_steps=8)
    assert not last and interval.tolist() == [4, 4]
    # two workers left of a run of three: each step of theirs is worth 8 / (3 x 4)
    assert asynchronous.progress_per_step(torch.tensor([4, 4]), 0, workers=3) == pytest.approx(8 / 12)


def test_a_delay_holds_every_interval_but_the_last_to_tau_plus_one_steps():
    """A-EDiT with a delayed outer step (tau = 4): a worker whose speed gives it 3 steps to the
    next sync is planned tau + 1 = 5 (its exchange is applied before the next is launched); the
    final interval is the budget's remainder split by speed, not held (the exchange still in
    flight at the final sync is applied there; tests/mcore/test_async_delayed.py)."""
    rates = torch.tensor([1.0, 4.0], dtype=F64)
    assert asynchronous.min_interval(0) == 1 and asynchronous.min_interval(4) == 5
    assert asynchronous.plan_next_interval(rates, 3.0).tolist() == [3, 12]
    assert asynchronous.plan_next_interval(rates, 3.0, min_steps=5).tolist() == [5, 12]
    interval, last = asynchronous.plan(torch.tensor([6.0, 6.0]), rates, 3.0, budget_steps=40, min_steps=5)
    assert not last and interval.tolist() == [5, 12]
    interval, last = asynchronous.plan(torch.tensor([11.0, 18.0]), rates, 3.0, budget_steps=40, min_steps=5)
    assert last and interval.tolist() == [3, 8]


def test_rates_are_smoothed_over_the_last_intervals():
    steps = torch.tensor([[10.0, 10.0], [10.0, 10.0], [10.0, 14.0], [10.0, 6.0]])
    seconds = torch.ones(4, 2)
    # the last three intervals: 30 steps / 3 s for both workers, not the last one's 10 vs 6
    assert asynchronous.smoothed_rates(steps, seconds).tolist() == [10.0, 10.0]


def test_final_interval_uses_the_budget_exactly_and_splits_it_by_speed():
    rates = torch.tensor([1.0, 4.0], dtype=F64)
    interval, last = asynchronous.plan(torch.tensor([7.0, 19.0]), rates, 4.0, budget_steps=40)
    assert last and interval.tolist() == [3, 11] and int(interval.sum()) == 40 - 26
    interval, last = asynchronous.plan(torch.tensor([3.0, 3.0]), rates, 4.0, budget_steps=40)
    assert not last and interval.tolist() == [4, 16]  # 34 left: a whole interval, then the end
    interval, last = asynchronous.plan(torch.tensor([3.0, 3.0]), rates, 4.0, remaining_seconds=5.0)
    assert last and interval.tolist() == [5, 20]  # wall-clock budget: the 5 s left, by speed
    assert asynchronous.split_by_rate(10, torch.tensor([1.0, 1.0, 1.0])).tolist() == [4, 3, 3]
    with pytest.raises(ValueError, match="cannot split 2 worker-steps over 3 workers"):
        asynchronous.split_by_rate(2, torch.tensor([1.0, 5.0, 1.0]))  # each takes >= 1: never 3 for 2
    # global progress: in an interval of 3 + 11 steps, a step of worker 0 is worth 14 / (2 x 3)
    assert asynchronous.progress_per_step(torch.tensor([3, 11]), 0) == pytest.approx(14 / 6)
    assert asynchronous.progress_per_step(torch.tensor([3, 11]), 1) == pytest.approx(14 / 22)


@pytest.mark.parametrize("workers", [2, 3, 4, 7])
def test_planned_intervals_end_exactly_at_any_budget(workers):
    """Review item 5: workers of fixed speeds follow plan() from sync to sync; the worker-steps
    taken add up to the budget exactly, for every budget (W = 4, budget 43 ended at 44: the
    final interval gave each worker a step when 3 were left)."""
    gen = torch.Generator().manual_seed(workers)
    for budget, sync_time in itertools.product(range(workers, 12 * workers + 20), (0.5, 1.5, 4.0)):
        rates = torch.rand(workers, generator=gen, dtype=F64) * 4 + 0.1
        steps = torch.zeros(workers, dtype=F64)
        for _ in range(1000):
            interval, last = asynchronous.plan(steps, rates, sync_time, budget_steps=budget)
            assert (interval >= 1).all()
            steps += interval
            if last:
                break
        assert last and int(steps.sum()) == budget, (budget, steps.tolist())


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
        # only the schedule: 6 x W float64, all-reduced over the 4 ranks (2 x 3/4 of it sent)
        assert r["reports"][0].payload_bytes == 2 * 3 * (6 * 2 * 8) // 4
        assert r["reports"][1].worker_steps.tolist() == [6, 18]  # since the anchor (skip in between)
        assert r["reports"][1].worker_seconds.tolist() == [4.0, 4.0]
        assert r["reports"][2].worker_steps.tolist() == [4, 16]
        # 0.5 * 0.5 + 0.5 * 6 / 24 = 0.375
        assert torch.allclose(r["reports"][1].weights[:, 0], torch.tensor([0.375, 0.625], dtype=F64))
    for rep_a, rep_b in zip(results[0]["reports"], results[3]["reports"]):  # two workers agree
        assert torch.equal(rep_a.worker_steps, rep_b.worker_steps) and rep_a.skipped_sync == rep_b.skipped_sync
    _assert_params_equal(results[0]["params"], results[2]["params"], "replicas after the last sync")


@pytest.mark.one_lane  # a variant of what this file checks in every lane (CI time; see conftest)
@pytest.mark.timeout(300)
def test_a_edit_with_the_sparse_exchange_keeps_the_schedule_and_replicas():
    """The fake-clock schedule above with the top-k exchange (2%, int2, error feedback by
    default): the same syncs, the same skip and step weights (decided on the dense
    pseudo-gradients), each weighted pseudo-gradient sparsified, replicas identical after the
    last sync, and a real sync sends a few hundredths of the fp32 one's bytes."""
    local = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, local_sgd_warmup_steps=1,
                 min_total_global_steps=10, use_step_weight=True, step_weight_ratio=0.5, sync_mode="step_end")
    runs = {}
    for name, extra in (("fp32", {}), ("topk", dict(exchange_dtype="int2", exchange_topk_density=0.02))):
        spec = default_spec(local_sgd=dict(local, **extra), outer=OUTER, seconds_per_step=[1.0, 0.25], syncs=3,
                            max_steps=64)
        runs[name] = run_ranks(async_runs, 4, spec, timeout=250)
    for ref, r in zip(runs["fp32"], runs["topk"]):
        assert [rep.step for rep in r["reports"]] == [rep.step for rep in ref["reports"]]
        assert [rep.skipped_sync for rep in r["reports"]] == [True, False, False]
        assert torch.equal(r["reports"][1].weights, ref["reports"][1].weights)
        assert r["reports"][1].quantization_error is not None
        assert r["reports"][1].payload_bytes < 0.1 * ref["reports"][1].payload_bytes
    _assert_params_equal(runs["topk"][0]["params"], runs["topk"][2]["params"], "replicas after the last sync")


@pytest.mark.timeout(240)
def test_run_ends_at_its_global_budget_with_a_final_sync_planned_from_the_speeds():
    """The synchronous run would take 20 iterations (40 worker-steps for 2 workers). Worker 0
    takes 1 s per step, worker 1 0.25 s: after the sync at steps 7 / 19 (26 worker-steps) the
    14 left are split by speed, 3 and 11: both arrive at the final sync after 3 s / 2.75 s
    (worker 1 waits 0.25 s, reported), each stops at its own step count, the budget is used
    exactly, the learning-rate schedule reaches the synchronous run's 20 iterations on both."""
    spec = default_spec(
        local_sgd=dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, local_sgd_warmup_steps=1,
                       min_total_global_steps=10, sync_mode="step_end"),
        outer=OUTER, seconds_per_step=[1.0, 0.25], max_steps=64, train_iters=20,
    )
    results = run_ranks(async_runs, 4, spec, timeout=200)
    for r in results:
        assert [rep.step for rep in r["reports"]] == ([3, 7, 10] if r["worker"] == 0 else [3, 19, 30])
        assert r["finished"] and r["steps"] == (10 if r["worker"] == 0 else 30)
        last = r["reports"][-1]
        assert last.final and not last.skipped_sync and last.worker_idle.tolist() == [0.0, 0.25]
        assert r["progress"] == pytest.approx(20.0)  # synchronous iterations of LR schedule
    _assert_params_equal(results[0]["params"], results[2]["params"], "replicas after the final sync")


@pytest.mark.timeout(240)
def test_a_budget_shorter_than_one_interval_is_one_final_sync():
    spec = default_spec(
        local_sgd=dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=8, local_sgd_warmup_steps=1,
                       min_total_global_steps=100, sync_mode="layerwise"),
        outer=OUTER, seconds_per_step=[1.0, 0.25], max_steps=64, train_iters=6,
    )
    results = run_ranks(async_runs, 4, spec, timeout=200)
    for r in results:
        assert [rep.step for rep in r["reports"]] == [6] and r["reports"][0].final
        assert not r["reports"][0].skipped_sync  # the last sync is never skipped
    _assert_params_equal(results[0]["params"], results[2]["params"], "replicas after the final sync")


@pytest.mark.one_lane  # a variant of what this file checks in every lane (CI time; see conftest)
@pytest.mark.timeout(240)
def test_slower_worker_real_clock_plans_from_measured_speeds_and_ends_together():
    """Real clock, worker 1 sleeps 0.1 s per step, a budget of 2 x 60 worker-steps: no
    deadlock, every sync's plan follows from the speeds the workers reported (checked from the
    reports, so it holds under any load), the budget is used exactly, replicas are identical."""
    spec = default_spec(
        local_sgd=dict(use_async=True, local_sgd_sync_time=1.0, local_sgd_sync_interval=2,
                       min_total_global_steps=1),
        outer=OUTER, sleep=[0.0, 0.1], max_steps=2000, train_iters=60,
    )
    results = run_ranks(async_runs, 4, spec, timeout=230)
    fast, slow = results[0], results[2]
    assert fast["worker"] == 0 and slow["worker"] == 1
    assert fast["steps"] + slow["steps"] == 120
    _assert_params_equal(fast["params"], slow["params"], "replicas after the last sync")
    reports = fast["reports"]
    assert all(torch.equal(r["reports"][-1].worker_steps, reports[-1].worker_steps) for r in results)
    history_steps, history_seconds = [], []
    for previous, current in zip(reports, reports[1:]):
        history_steps.append(previous.worker_steps)
        history_seconds.append(previous.worker_seconds)
        rates = asynchronous.smoothed_rates(torch.stack(history_steps), torch.stack(history_seconds))
        if not current.final:
            assert current.worker_steps.tolist() == asynchronous.plan_next_interval(rates, 1.0).tolist()
        else:
            assert int(current.worker_steps.sum()) == 120 - int(sum(r.worker_steps.sum() for r in reports[:-1]))
