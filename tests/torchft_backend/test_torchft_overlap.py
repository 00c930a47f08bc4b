"""The overlap over the torchft backend on real megatron-core (CPU, gloo; issue 60): A-EDiT's
delayed outer step (``--local-sgd-async`` with ``--local-sgd-outer-step-delay``) and the automatic
overlap (``--local-sgd-auto-overlap``), each worker its own job, a torchft Lighthouse in the test
process, fake clocks per worker (a deterministic schedule). With no fault each computes what the
torch backend computes (one world of 2 workers x 2 ranks); a worker killed with an exchange in
flight is relaunched, heals with the settings in force and all end with one model.

torchft is the optional ``ft`` extra: installed in CI's default lane, skipped where it is not."""

import pytest

pytest.importorskip("torchft")

import ft_jobs  # noqa: E402
from compare import max_difference  # noqa: E402
from dist import run_ranks  # noqa: E402
from edit_runs import async_runs, default_spec  # noqa: E402
from test_torchft_async import OUTER, _ft_async_worker  # noqa: E402

TIMEOUT = 300


def _both_backends(spec):
    """``spec`` on the torch backend (one world, 2 workers x 2 ranks) and over torchft (a job per
    worker); every rank's results, worker-major."""
    reference = run_ranks(async_runs, 4, spec, timeout=TIMEOUT)
    with ft_jobs.jobs_and_lighthouse(min_replicas=2) as (server, start):
        jobs = [start(_ft_async_worker, 2, w, server.address(), spec, 2, timeout=TIMEOUT) for w in range(2)]
        ft = [out for outs in ft_jobs.all_results(jobs) for out in outs]
    return reference, ft


def _reports(run):
    return [(r.step, r.delay, r.skipped_sync, r.final) for r in run["reports"]]


# Worker 0 takes 1 s a step, worker 1 0.25 s; a sync every 4 s, the first interval 2 steps
# (skipped: min_total_global_steps 10), a budget of 40 iterations (80 worker-steps).
A_EDIT = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, min_total_global_steps=10,
              sync_mode="step_end")


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_a_edit_with_a_delay_over_torchft_equals_the_torch_backend():
    """A-EDiT with a delay of 2 (lerp 0.5): each sync's round opens at the sync (the quorum, the
    plan, the exchange launched) and commits at its apply two of the worker's own steps later;
    the final sync is blocking. The same syncs as the torch backend, the same parameters (1e-6)
    on every rank, nothing in flight at the end and one model."""
    spec = default_spec(local_sgd=dict(A_EDIT, outer_step_delay=2), outer=OUTER, seconds_per_step=[1.0, 0.25],
                        max_steps=128, train_iters=40)
    reference, ft = _both_backends(spec)
    for g, (ref, run) in enumerate(zip(reference, ft)):
        assert run["worker"] == ref["worker"] == g // 2
        assert _reports(run) == _reports(ref), (g, _reports(run), _reports(ref))
        assert [r[1] for r in _reports(run)][1:-1] and all(r[1] == 2 for r in _reports(run)[1:-1])
        assert _reports(run)[-1][1:] == (0, False, True)  # the final sync: blocking
        assert all(r.committed and r.workers == 2 for r in run["reports"])
        assert run["finished"] and not run["in_flight_at_end"]
        assert run["progress"] == pytest.approx(40.0, abs=1e-9)
        assert max_difference(ref["params"], run["params"]) <= 1e-6, f"rank {g}"
    for run in ft[1:]:
        assert max_difference(ft[0]["params"], run["params"]) == 0.0


def _ft_auto_worker(rank, world_size, worker, lighthouse, spec, workers, gate=None):
    """:func:`_ft_async_worker` with the measurements the one-world run injects on this rank
    (its global rank: worker x ranks + rank)."""
    if spec.get("measurements"):
        spec = dict(spec, measurements={r: spec["measurements"][worker * world_size + r] for r in range(world_size)})
    return _ft_async_worker(rank, world_size, worker, lighthouse, spec, workers, gate)


# Worker 0 1 s a step, worker 1 0.5 s; a sync every 4 s, the first interval 4 steps, a budget of
# 36 iterations (72 worker-steps): syncs after 4 / 4, then 4 / 8 steps each, the final one by speed.
AUTO = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=4, min_total_global_steps=1,
            sync_mode="layerwise", outer_merge_alpha=0.0, auto_overlap=True)
# rank -> (inner step s, {format: exchange s}, exposed s): agreed, the fastest step 0.10 s and the
# slowest exchange 0.15 s: a delay of 2 (tests/mcore/test_auto_overlap_async.py).
MEASURED = {0: (0.10, {"fp32": 0.15}, 0.0), 1: (0.12, {"fp32": 0.14}, 0.0), 2: (0.11, {"fp32": 0.12}, 0.0),
            3: (0.13, {"fp32": 0.05}, 0.0)}


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_auto_overlap_over_torchft_equals_the_torch_backend_with_the_same_measurements():
    """A-EDiT with --local-sgd-auto-overlap, started without a delay, the measurements injected
    per rank: the first two syncs are timed, the third agrees on the second's measurements (on
    the schedule's message, every worker the same) and decides a delay of 2; over torchft it is
    kept where that round commits and in force after the next round, so the fifth sync is the
    first launched with it. The torch backend with the same rule (``auto_rounds``) takes the same
    decisions, syncs and parameters (1e-6); one model at the end."""
    spec = default_spec(local_sgd=AUTO, outer=OUTER, seconds_per_step=[1.0, 0.5], max_steps=128, train_iters=36)
    spec = dict(spec, measurements=MEASURED, auto_rounds=True)
    reference = run_ranks(async_runs, 4, spec, timeout=TIMEOUT)
    with ft_jobs.jobs_and_lighthouse(min_replicas=2) as (server, start):
        jobs = [start(_ft_auto_worker, 2, w, server.address(), spec, 2, timeout=TIMEOUT) for w in range(2)]
        ft = [out for outs in ft_jobs.all_results(jobs) for out in outs]
    for g, (ref, run) in enumerate(zip(reference, ft)):
        assert _reports(run) == _reports(ref), (g, _reports(run), _reports(ref))
        delays = [r[1] for r in _reports(run)]
        assert delays[:4] == [0, 0, 0, 0] and delays[4] == 2 and delays[-1] == 0, delays
        assert [d[1:] for d in run["decisions"]] == [d[1:] for d in ref["decisions"]] == [(2, "fp32")]
        assert run["decisions"] == ref["decisions"]
        assert run["finished"] and not run["in_flight_at_end"]
        assert max_difference(ref["params"], run["params"]) <= 1e-6, f"rank {g}"
    for run in ft[1:]:
        assert max_difference(ft[0]["params"], run["params"]) == 0.0
