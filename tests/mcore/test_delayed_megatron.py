"""The delayed outer step (``outer_step_delay``) on real megatron-core (CPU, gloo, 2 workers x 2
ranks), against the plain-PyTorch simulation extended with the delay (``simulate_edit``)."""

import pytest
import torch

from dist import run_ranks
from edit_runs import default_spec, megatron_runs, simulate_edit

WORLD = 4
SIM_ATOL = 2e-4  # as in test_edit_megatron: Megatron's and the simulation's reduction orders differ
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))
# W = 1, H = 3, 9 steps, --train-iters 9: the syncs after steps 4 and 7 are launched tau steps
# earlier and applied there; the one after step 10 would be applied after the last step, so it
# is not launched and the run ends with the blocking sync after step 9.
EDIT = dict(local_sgd_sync_interval=3, local_sgd_warmup_steps=1)


def _spec(**local):
    return default_spec(steps=9, last_step=9, local_sgd=dict(EDIT, **local), outer=OUTER)


def _worst(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.timeout(400)
def test_delayed_outer_step_matches_the_simulation_in_both_modes():
    """tau = 2, alpha = 0 in layer-wise and step-end mode (the same numbers, bit for bit: both
    apply at the step-end point), and tau = 1, alpha = 0.5 with the penalty's weights, each
    against the simulation; replicas identical right after an alpha = 0 merge (steps 4, 7) and
    at the end, different between."""
    specs = [
        _spec(outer_step_delay=2, sync_mode="layerwise"),
        _spec(outer_step_delay=2, sync_mode="step_end"),
        _spec(outer_step_delay=1, outer_merge_alpha=0.5, sync_mode="step_end", pseudo_gradnorm_reduce=True),
    ]
    specs[0]["snapshot_every_step"] = True
    results = run_ranks(megatron_runs, WORLD, specs, timeout=360)
    sims = [run_ranks(simulate_edit, 1, spec, WORLD, timeout=120)[0]["params"] for spec in (specs[0], specs[2])]
    for r in results:
        layerwise, step_end, merged = r["runs"]
        for run, delay in ((layerwise, 2), (step_end, 2), (merged, 1)):
            assert [(rep.step, rep.delay) for rep in run["reports"]] == [(4, delay), (7, delay), (9, 0)]
            assert all(rep.exposed_wait_seconds >= 0 for rep in run["reports"])
            assert not run["pending_at_end"]
        for k in layerwise["params"]:
            assert torch.equal(layerwise["params"][k], step_end["params"][k]), k
        assert _worst(layerwise["params"], sims[0][layerwise["worker"]]) <= SIM_ATOL
        assert _worst(merged["params"], sims[1][merged["worker"]]) <= SIM_ATOL
    by_worker = {0: results[0]["runs"][0], 1: results[2]["runs"][0]}
    for step in range(2, 10):
        a, b = by_worker[0]["snapshots"][step], by_worker[1]["snapshots"][step]
        same = all(torch.equal(a[k], b[k]) for k in a)
        assert same == (step in (4, 7, 9)), f"after step {step}: replicas {'equal' if same else 'differ'}"
    # the run ends with one model on every worker (its last sync is blocking), alpha = 0.5 too
    for run in range(3):
        a, b = results[0]["runs"][run]["params"], results[2]["runs"][run]["params"]
        assert all(torch.equal(a[k], b[k]) for k in a)
