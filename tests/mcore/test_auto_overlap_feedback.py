"""Settings from the measured link (``auto_overlap``) with error feedback and the top-k exchange
(issue 60) on real megatron-core (CPU, gloo, 2 workers x 2 ranks): a run that keeps choosing the
top-k format it starts in equals that fixed setting's run bit for bit, and a run whose format
changes mid-run (int8, then top-k 2% with int2 values, then int8) keeps its replicas
bit-identical after every sync and follows the residual rule
(:mod:`megatron_edit.algorithm.residual`) exactly: checked shard by shard against the exchanges
written out from the codecs (``edit_runs.simulate_shard_exchange``). The measurements are
injected, so the decisions do not depend on this machine's clocks."""

import pytest
import torch

from dist import run_ranks
from megatron_edit.algorithm.overlap_plan import choose

WORLD = 4
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))
FORMATS = ("int8", "topk0.02-int2")
# H = 2, a step of 0.1 s: a delay may be 1 at most (H/2), so a format is chosen with no delay
# when a third of a step hides 1.2 x its exchange (40 ms), else one that can be hidden.
INT8 = (0.10, {"int8": 0.02, "topk0.02-int2": 0.001}, 0.0)  # int8 hides (24 ms): int8
TOPK = (0.10, {"int8": 0.5, "topk0.02-int2": 0.02}, 0.0)  # int8 cannot (tau 6 > 1); top-k hides (24 ms)


def test_the_injected_measurements_make_the_choices_the_tests_expect():
    for numbers, fmt in ((INT8, "int8"), (TOPK, "topk0.02-int2")):
        chosen = choose(numbers[0], numbers[1], 2, FORMATS, fragments=(1,))
        assert (chosen.exchange_dtype, chosen.outer_step_delay, chosen.hidden) == (fmt, 0, True)


@pytest.mark.one_lane  # the auto overlap's hooks, tested in every lane by test_auto_overlap.py
@pytest.mark.timeout(400)
def test_a_run_that_keeps_its_top_k_format_equals_that_fixed_setting_bit_for_bit():
    """--local-sgd-exchange-topk-density 0.02 --local-sgd-exchange-dtype int2 (error feedback
    on by default) with --local-sgd-auto-overlap --local-sgd-auto-formats int8,topk0.02-int2
    --local-sgd-auto-every 1, H = 2, 10 steps: the rule chooses top-k with no delay at every
    decision (after 4 and 8). Every parameter and loss equals the fixed top-k run's bit for bit:
    measuring and deciding change nothing of what is sent or carried."""
    from edit_runs import default_spec, megatron_runs

    local = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=0, sync_mode="layerwise", exchange_dtype="int2",
                 exchange_topk_density=0.02)
    specs = [default_spec(steps=10, last_step=10, outer=OUTER, measurements={r: TOPK for r in range(WORLD)},
                          local_sgd=dict(local, auto_overlap=True, auto_every=1, auto_formats=",".join(FORMATS))),
             default_spec(steps=10, last_step=10, outer=OUTER, local_sgd=local)]
    for r in run_ranks(megatron_runs, WORLD, specs, timeout=360):
        auto, fixed = r["runs"]
        assert [d[1:] for d in auto["decisions"]] == [(0, "topk0.02-int2")] * 2
        assert [(rep.step, rep.exchange_dtype) for rep in auto["reports"]] == \
            [(rep.step, rep.exchange_dtype) for rep in fixed["reports"]] == [(s, "int2") for s in (2, 4, 6, 8, 10)]
        assert auto["losses"] == fixed["losses"]
        assert all(torch.equal(auto["params"][k], fixed["params"][k]) for k in fixed["params"])


SWITCH_STEPS = 14
# One agreed measurement per sync, in order: syncs after 2 and 4 measured (int8 decided after 4),
# 6 not timed, 8 timed (top-k decided after 8: in force from 10), 10 not, 12 timed (int8 again
# from 14, the run's last sync).
SWITCH = [INT8, INT8, INT8, TOPK, TOPK, INT8, INT8]
SWITCH_FORMATS = {2: "int8", 4: "int8", 6: "int8", 8: "int8", 10: "topk0.02-int2", 12: "topk0.02-int2", 14: "int8"}


@pytest.mark.one_lane  # as the test above
@pytest.mark.timeout(500)
def test_a_format_changed_mid_run_carries_the_residual_by_the_rule_and_keeps_replicas_identical():
    """--local-sgd-auto-formats int8,topk0.02-int2 with --local-sgd-exchange-error-feedback, H = 2,
    14 steps, starting in int8: int8 to the sync after 8, top-k 2% int2 after 10 and 12, int8
    after 14. After every sync worker 0's and worker 1's parameters are bit-identical. Shard by
    shard, from each worker's recorded parameters and the anchor before each sync, the exchanges
    written out from the codecs give every residual exactly, after each sync and after each
    change of format (int8 -> top-k: the chunk residual folded into its owner's residual, times
    2; top-k -> int8: the residual carried on), and the anchors (the outer Nesterov step) to
    rounding."""
    from edit_runs import default_spec, megatron_runs, simulate_format_change, simulate_shard_exchange

    local = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=0, sync_mode="layerwise", exchange_dtype="int8",
                 exchange_error_feedback=True, auto_overlap=True, auto_every=1, auto_formats=",".join(FORMATS))
    spec = default_spec(steps=SWITCH_STEPS, last_step=SWITCH_STEPS, outer=OUTER, local_sgd=local,
                        measurements={r: SWITCH for r in range(WORLD)}, snapshot_every_step=True,
                        record_sync_starts=True)
    results = run_ranks(megatron_runs, WORLD, [spec], timeout=460)
    by_worker = {}
    for r in results:
        run = r["runs"][0]
        assert [d[0] for d in run["decisions"]] == [4, 8, 12]
        assert [(rep.step, rep.exchange_dtype, rep.delay) for rep in run["reports"]] == [
            (s, fmt.rpartition("-")[2], 0) for s, fmt in SWITCH_FORMATS.items()]
        assert sorted(run["sync_starts"]) == list(SWITCH_FORMATS)
        by_worker.setdefault(run["worker"], []).append(run)
    compared = folded = 0
    for run0, run1 in zip(by_worker[0], by_worker[1]):  # the same shard rank on both workers
        for step in SWITCH_FORMATS:
            a, b = run0["snapshots"][step], run1["snapshots"][step]
            assert all(torch.equal(a[k], b[k]) for k in a), f"replicas differ after the sync at {step}"
        starts = [run0["sync_starts"], run1["sync_starts"]]
        for i, first in enumerate(starts[0][2]["anchor"]):  # the sync's shards, in the order it holds them
            anchor, numel = first.clone(), first.numel()
            opt = torch.optim.SGD([anchor], **OUTER["outer_optim_kwargs"])
            residuals, chunk_residuals = [None, None], [None, None]
            for step, fmt in SWITCH_FORMATS.items():
                start = starts[0][step]["anchor"][i]
                assert torch.equal(start, starts[1][step]["anchor"][i])
                assert torch.allclose(start, anchor, rtol=1e-6, atol=1e-7), (i, step)
                for w in (0, 1):  # after the last sync, and after the change of format decided then
                    got = starts[w][step]["residual"][i]
                    assert (got is None) == (residuals[w] is None), (w, i, step)
                    assert got is None or torch.equal(got, residuals[w]), (w, i, step, (got - residuals[w]).abs().max())
                compared += 1
                xs = [start - starts[w][step]["mains"][i] for w in (0, 1)]
                result = simulate_shard_exchange(fmt, xs, residuals, chunk_residuals)
                if step + 2 in SWITCH_FORMATS and SWITCH_FORMATS[step + 2] != fmt:
                    folded += any(c is not None for c in chunk_residuals)
                    simulate_format_change(fmt, residuals, chunk_residuals, numel)
                anchor.grad = result
                opt.step()
    assert compared and folded  # some shard's chunk residual was folded at the change int8 -> top-k
