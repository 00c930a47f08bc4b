"""The torchft sync backend on real megatron-core (CPU, gloo): each worker its own job (a 2-rank
world, ``num_distributed_optimizer_instances`` 1) and a torchft Lighthouse in the test process.
With no fault it computes what the torch backend (one 4-rank world of 2 workers) computes on the
same data and config, to 1e-6.

torchft is the optional ``ft`` extra: installed in CI's default lane, skipped where it is not."""

import os

import pytest
import torch

pytest.importorskip("torchft")

import ft_jobs  # noqa: E402
from dist import run_ranks  # noqa: E402
from edit_runs import default_spec, megatron_runs  # noqa: E402

WORKERS, RANKS = 2, 2
TIMEOUT = 400


def _ft_worker(rank, world_size, worker, lighthouse, spec):
    """One worker's job: the spec's run with the torchft backend, on the micro-batches its ranks
    have in the one-world run."""
    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    local = dict(spec["local_sgd"], sync_backend="torchft", replica_id=worker, lighthouse=lighthouse,
                 sync_timeout=120.0)
    spec = dict(spec, instances=1, data_dp=WORKERS * world_size, data_rank_offset=worker * world_size,
                local_sgd=local)
    return megatron_runs(rank, world_size, [spec])["runs"][0]


def _both_backends(local_sgd, steps=8):
    spec = default_spec(steps=steps, local_sgd=local_sgd)
    reference = [r["runs"][0] for r in run_ranks(megatron_runs, WORKERS * RANKS, [spec], timeout=TIMEOUT)]
    # min_replicas: the Lighthouse's first quorum waits for both workers (a run that starts together)
    with ft_jobs.jobs_and_lighthouse(min_replicas=WORKERS) as (server, start):
        jobs = [start(_ft_worker, RANKS, w, server.address(), spec, timeout=TIMEOUT) for w in range(WORKERS)]
        ft = [out for job in jobs for out in job.results()]  # worker-major: rank w * RANKS + r
    return reference, ft


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _check_equal(reference, ft, syncs):
    for g, (ref, run) in enumerate(zip(reference, ft)):
        assert run["worker"] == 0 and ref["worker"] == g // RANKS  # its own job / one world
        assert _max_diff(ref["params"], run["params"]) <= 1e-6, f"rank {g}"
        assert max(abs(x - y) for x, y in zip(ref["losses"], run["losses"])) <= 1e-6, f"rank {g}"
        assert [r.step for r in run["reports"]] == [r.step for r in ref["reports"]] == syncs
        assert all(r.committed and r.workers == WORKERS for r in run["reports"])
    # after the last sync every rank holds the same model (the torch backend's too)
    for run in ft[1:]:
        assert _max_diff(ft[0]["params"], run["params"]) == 0.0


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_torchft_equals_torch_backend_fp32_layerwise():
    reference, ft = _both_backends(dict(local_sgd_sync_interval=4))
    _check_equal(reference, ft, [4, 8])


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_torchft_equals_torch_backend_int8_error_feedback_step_end():
    reference, ft = _both_backends(dict(local_sgd_sync_interval=2, exchange_dtype="int8",
                                        exchange_error_feedback=True, sync_mode="step_end"), steps=6)
    _check_equal(reference, ft, [2, 4, 6])
    assert all(r.quantization_error is not None for run in ft for r in run["reports"])
