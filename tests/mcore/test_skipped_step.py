"""A step the loss scaler skips (fp16, ``--loss-scale``) is the worker's own, on real
megatron-core (CPU, gloo, 2 workers x 2 ranks).

The inf is put into the gradients of one rank of a worker only (the partial event): the
worker's gradient-statistics group (kept inside the worker) makes its whole worker skip, the
other worker steps; a sync due at the skipped step still runs, and the numbers equal the
plain-PyTorch simulation in which that worker leaves out its inner update there."""

import pytest
import torch

from compare import max_difference
from dist import run_ranks
from edit_runs import default_spec, megatron_runs, simulate_edit

WORLD = 4
EDIT = dict(local_sgd_sync_interval=3, local_sgd_warmup_steps=2)  # syncs after steps 5 and 8
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))
SIM_ATOL = 2e-4  # as tests/mcore/test_edit_megatron.py (Adam amplifies the reduction order's noise)
# Rank 2 (worker 1's first rank) sees an inf at step 5, a sync step; rank 1 (worker 0's second
# rank) at step 7, between syncs.
INF_GRADS = {5: [2], 7: [1]}
SKIPS = {5: [1], 7: [0]}  # the workers that skip, in the simulation


@pytest.mark.timeout(300)
def test_a_skipped_step_is_the_workers_own_and_a_sync_due_at_it_still_runs():
    specs = [default_spec(local_sgd=dict(EDIT, sync_mode=mode), outer=OUTER, loss_scale=1.0,
                          inf_grads=INF_GRADS, skips=SKIPS)
             for mode in ("layerwise", "step_end")]
    # the delayed outer step (tau 1): launched at step 4, applied inside the skipped step 5
    delayed = default_spec(local_sgd=dict(EDIT, outer_step_delay=1), outer=OUTER, loss_scale=1.0,
                           inf_grads=INF_GRADS, skips=SKIPS, last_step=8)
    results = run_ranks(megatron_runs, WORLD, specs + [delayed], timeout=260)
    (sim,) = run_ranks(simulate_edit, 1, specs[0], WORLD, timeout=120)
    (sim_delayed,) = run_ranks(simulate_edit, 1, delayed, WORLD, timeout=120)
    (plain,) = run_ranks(simulate_edit, 1, dict(specs[0], skips={}), WORLD, timeout=120)
    for r in results:
        for run, expected in zip(r["runs"], (sim, sim, sim_delayed)):
            worker = run["worker"]
            # the whole worker skipped, on the rank that saw the inf and on the one that did not
            assert [s for s, skipped in enumerate(run["skipped"], 1) if skipped] == (
                [5] if worker == 1 else [7]), (r["runs"].index(run), worker)
            assert [rep.step for rep in run["reports"]] == [5, 8]
            assert max_difference(run["params"], expected["params"][worker]) <= SIM_ATOL
        layerwise, step_end, _ = r["runs"]
        assert all(torch.equal(layerwise["params"][k], step_end["params"][k]) for k in layerwise["params"])
    # one model after the last sync, and the skips mattered (not the run without them)
    for run in (0, 2):
        for k, v in results[0]["runs"][run]["params"].items():
            assert torch.equal(v, results[2]["runs"][run]["params"][k]), k
    assert max_difference(results[0]["runs"][0]["params"], plain["params"][0]) > 50 * SIM_ATOL
