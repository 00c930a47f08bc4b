"""MoE routers' expert bias (``--moe-router-enable-expert-bias``) under EDiT, on real megatron-core
(CPU, gloo, 4 processes, 2 workers; megatron_edit.mcore.expert_bias): the token counts are
all-reduced inside the worker between syncs (over every rank in the warmup), and at each sync
every router's bias becomes the mean of the workers' biases, so the final sync leaves one model,
biases included. Checked against an independent computation from each rank's own counts."""

import pytest
import torch

from compare import max_difference
from dist import run_ranks
from edit_runs import ON_EXPERT_PARALLEL_FSDP, ON_FSDP_RELEASE
from megatron_edit.mcore import compat

pytestmark = pytest.mark.skipif(not compat.version_at_least("0.16.0"),
                                reason="MoE with EDiT is built and checked on megatron-core 0.16+ "
                                       "(tests/mcore/test_moe.py)")

WORLD = 4
EXPERTS = 4
RATE = 0.01
MOE = dict(num_moe_experts=EXPERTS, moe_router_topk=2, moe_token_dispatcher_type="alltoall", add_bias_linear=False,
           moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
           moe_router_bias_update_rate=RATE)
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))
# warmup 1, H=2, 6 steps and the run's length given: syncs after steps 3, 5 and 6 (the last step)
EDIT = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=1)
STEPS, WARMUP, SYNCS = 6, 1, [3, 5, 6]


def expert_bias_job(rank, world_size, runs, steps, ep=1):
    """One EDiT run per ``runs`` entry (LocalSGDConfig fields) on the MoE GPT with expert bias.
    Per step, this rank's token counts before and after Megatron's all-reduce (a spy on
    ``get_updated_expert_bias``), its routers' biases after the step, and every collective whose
    group spans two workers (edit_runs.TrafficLog)."""
    import importlib

    import megatron_edit as me
    from megatron.core import parallel_state as ps

    from edit_runs import MICRO_BATCH, TrafficLog, _build, default_spec
    from gpt_utils import make_batches, named_params, rank_micro_batches, train_step

    # (the package megatron.core.distributed exports the function of the module's name)
    fmg = importlib.import_module("megatron.core.distributed.finalize_model_grads")
    ps.initialize_model_parallel(num_distributed_optimizer_instances=2,
                                 **(dict(expert_model_parallel_size=ep) if ep > 1 else {}))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    worker = dp_rank // (dp // 2)
    workers = [None] * world_size
    torch.distributed.all_gather_object(workers, worker)
    out = []
    for local in runs:
        me.patch_megatron_for_local_sgd(me.LocalSGDConfig(**local), me.OuterOptimizerConfig(**OUTER))
        ddp, optimizer = _build(default_spec(model=MOE), 1, 1)
        me.set_train_iters(optimizer, steps)
        biases = [m.expert_bias for m in ddp.module.modules() if getattr(m, "expert_bias", None) is not None]
        step, counts, after = [0], {}, {0: torch.stack([b.clone() for b in biases])}
        original = fmg.get_updated_expert_bias

        def spy(tokens, *args, **kwargs):
            local_counts = tokens.clone()
            result = original(tokens, *args, **kwargs)  # all-reduces ``tokens`` in place
            counts[step[0]] = (local_counts, tokens.clone())
            return result

        fmg.get_updated_expert_bias = spy
        traffic = TrafficLog(dict(enumerate(workers)))
        batches = make_batches(steps, dp * MICRO_BATCH, seed=0)
        try:
            for step[0] in range(1, steps + 1):
                traffic.phase = f"step {step[0]}"
                train_step(ddp, optimizer, rank_micro_batches(batches[step[0] - 1], dp_rank, dp))
                after[step[0]] = torch.stack([b.clone() for b in biases])
        finally:
            traffic.close()
            fmg.get_updated_expert_bias = original
        ddp.start_param_sync(force_sync=True)
        controllers = me.get_local_sgd(optimizer)
        out.append(dict(worker=worker, ep_rank=ps.get_expert_model_parallel_rank(), counts=counts, biases=after,
                        traffic=traffic.events, params=named_params(ddp),
                        syncs=[[r.step for r in c.drain_reports()] for c in controllers]))
        me.unpatch_megatron_for_local_sgd()
    return out


def _local_update(bias, reduced):
    """Megatron's rule (moe_utils.get_updated_expert_bias) on already reduced counts."""
    return bias + torch.sign(reduced.sum(-1, keepdim=True) / reduced.shape[-1] - reduced) * RATE


def _check_run(runs, controllers=1, launches=()):
    """``runs``: one run's results, by rank; ``launches``: steps after which a delayed sync's
    exchange is launched (its traffic crosses workers there too)."""
    workers = [r["worker"] for r in runs]
    assert sorted(workers) == [0, 0, 1, 1]
    for r in runs:
        assert r["syncs"] == [SYNCS] * controllers
    differed = False
    for step in range(1, STEPS + 1):
        updated = []
        for rank, r in enumerate(runs):
            local, reduced = r["counts"][step]
            # (a) the counts are summed over every rank in the warmup, over the worker's after it
            group = [q for q in range(len(runs)) if step <= WARMUP or workers[q] == workers[rank]]
            assert torch.equal(reduced, sum(runs[q]["counts"][step][0] for q in group)), (step, rank)
            updated.append(_local_update(r["biases"][step - 1], reduced))
        if step in SYNCS:  # (b) every rank: the mean over the workers of their updated biases
            one_per_worker = [updated[workers.index(w)] for w in (0, 1)]
            expected = (one_per_worker[0] + one_per_worker[1]) / 2
            for rank, r in enumerate(runs):
                assert torch.equal(updated[rank], one_per_worker[workers[rank]])  # a worker agrees
                assert torch.equal(r["biases"][step], expected), f"bias after sync step {step}, rank {rank}"
        else:
            for rank, r in enumerate(runs):
                assert torch.equal(r["biases"][step], updated[rank]), f"bias after step {step}, rank {rank}"
            differed |= not torch.equal(runs[workers.index(0)]["biases"][step], runs[workers.index(1)]["biases"][step])
    assert differed, "the workers' biases should differ between syncs"
    # nothing crosses workers between syncs; at a sync, the biases' one all-reduce over the sync group
    bias_numel = runs[0]["biases"][0].numel()
    for r in runs:
        phases = {}
        for phase, name, ranks, numel in r["traffic"]:
            phases.setdefault(phase, []).append((name, len(ranks), numel))
        assert set(phases) == {"step 1"} | {f"step {s}" for s in [*SYNCS, *launches]}, sorted(phases)
        for s in SYNCS:
            assert phases[f"step {s}"].count(("all_reduce", 2, bias_numel)) == 1, phases[f"step {s}"]
    # after the final sync: one model on every worker, biases included
    for r in runs:
        assert torch.equal(r["biases"][STEPS], runs[0]["biases"][STEPS])
    for a, b in ((r, q) for r in runs for q in runs if r["ep_rank"] == q["ep_rank"]):
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


@pytest.mark.timeout(400)
@pytest.mark.parametrize("ep", [1, 2])
def test_expert_bias_counts_stay_in_the_worker_and_are_averaged_at_each_sync(ep):
    """EP=1 and EP=2 (a dense and an expert controller: the dense one averages the biases),
    layer-wise and step-end: after the warmup each rank's token counts are summed over its worker
    only (against the sum of every rank's own counts), each local step's bias is Megatron's update
    from them, each sync's bias is the mean of the two workers' updated biases on every rank (bit
    for bit), nothing crosses workers between syncs, and after the final sync every rank holds the
    same biases and parameters. Both modes give the same biases."""
    runs = [dict(EDIT, sync_mode=mode) for mode in ("layerwise", "step_end")]
    results = run_ranks(expert_bias_job, WORLD, runs, STEPS, ep=ep, timeout=360)
    for i in range(len(runs)):
        _check_run([r[i] for r in results], controllers=2 if ep > 1 else 1)
    for r in results:
        layerwise, step_end = r
        assert all(torch.equal(layerwise["biases"][s], step_end["biases"][s]) for s in range(STEPS + 1))


@pytest.mark.one_lane  # (CI time: 50 s on 0.19.2) the bias entries are release-independent; MoE checkpoints with
# expert parallelism (the ChainedOptimizer's key prefix) are checked in every lane by tests/mcore/test_moe.py
@pytest.mark.timeout(600)
def test_expert_bias_checkpoint_between_syncs_resumes_exactly_and_elastically(tmp_path):
    """EP=2, 2 workers, H=3 (syncs after 4 and 7): saved after step 5, between syncs (each
    worker its own biases: every worker's are saved), resumed there with 2 workers it ends bit
    for bit where the uninterrupted run ends (step 6), parameters and biases; resumed with 1
    worker, the biases are the mean of the two saved workers' (the rule of a sync)."""
    from checkpoint_runs import moe_checkpoint_job
    from megatron_edit.mcore import checkpoint as checkpointing

    if not checkpointing.SUPPORTED.contains(compat.megatron_core_version()):
        pytest.skip(f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}")
    path = str(tmp_path / "step5")
    local = dict(local_sgd_sync_interval=3, local_sgd_warmup_steps=1, sync_mode="layerwise")  # syncs 4, 7
    whole = run_ranks(moe_checkpoint_job, WORLD, MOE, local, path, 6, save_at=5, timeout=280)
    resumed = run_ranks(moe_checkpoint_job, WORLD, MOE, local, path, 6, load_at=5, timeout=280)
    saved = {r["worker"]: r["saved_biases"] for r in whole}
    assert sorted(saved) == [0, 1]
    assert not all(torch.equal(a, b) for a, b in zip(saved[0], saved[1])), "the biases should differ at step 5"
    for a, b in zip(whole, resumed):
        assert len(a["expert_biases"]) == 2
        assert all(torch.equal(x, y) for x, y in zip(a["saved_biases"], b["loaded_biases"])), "the worker's own"
        assert all(torch.equal(x, y) for x, y in zip(a["expert_biases"], b["expert_biases"])), "expert bias"
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    one = run_ranks(moe_checkpoint_job, WORLD, MOE, local, path, 6, load_at=5, instances=1, timeout=280)
    for r in one:
        mean = [((x.double() + y.double()) / 2).to(x.dtype) for x, y in zip(saved[0], saved[1])]
        assert all(torch.equal(x, y) for x, y in zip(r["loaded_biases"], mean)), "the mean over the saved workers"


@pytest.mark.one_lane  # an algorithm's variant (see conftest)
@pytest.mark.timeout(300)
def test_expert_bias_with_a_delayed_outer_step_is_averaged_at_the_apply():
    """The delayed outer step (tau 1, alpha 0.5): the exchange of the syncs of steps 3 and 5 is
    launched after steps 2 and 4, the biases are averaged at the apply (after steps 3 and 5, the
    same rule and checks as without a delay), the run's last step 6 is a blocking sync."""
    runs = [dict(EDIT, sync_mode="step_end", outer_step_delay=1, outer_merge_alpha=0.5)]
    results = run_ranks(expert_bias_job, WORLD, runs, STEPS, timeout=250)
    _check_run([r[0] for r in results], launches=(2, 4))


@ON_FSDP_RELEASE
@pytest.mark.timeout(600)
# expert parallelism 1 in the default lane (0.16.1), 2 in the newest (0.19.2: 0.16 refuses it on Megatron-FSDP)
@pytest.mark.parametrize("ep", [pytest.param(1, marks=pytest.mark.one_lane), pytest.param(2, marks=ON_EXPERT_PARALLEL_FSDP)])
def test_expert_bias_on_megatron_fsdp_equals_the_distributed_optimizer(ep):
    """Megatron-FSDP (2 workers x 2 shards, layer-wise): after every step each rank's routers'
    biases are bit for bit those of the same run on DDP + the distributed optimizer (counted
    inside the worker between syncs, the mean over the workers at each sync), the workers'
    biases differ between syncs and agree after each, and the parameters match to 1e-6."""
    from edit_runs import FSDP_MOE, default_spec, megatron_runs  # (the 4 ranks' functions)

    model = dict(FSDP_MOE, **{k: MOE[k] for k in MOE if k.startswith("moe_router_")})
    specs = [default_spec(steps=6, model=model, local_sgd=dict(EDIT, sync_mode="layerwise"), outer=OUTER, fsdp=fsdp)
             for fsdp in (False, True)]
    results = run_ranks(megatron_runs, WORLD, specs, timeout=560, ep=ep)
    for r in results:
        ddp, fsdp = r["runs"]
        assert [rep.step for rep in fsdp["reports"]] == [rep.step for rep in ddp["reports"]] == [3, 5]
        assert sorted(fsdp["expert_biases"]) == list(range(1, 7))
        for step in range(1, 7):
            assert torch.equal(fsdp["expert_biases"][step], ddp["expert_biases"][step]), step
        assert max_difference(fsdp["params"], ddp["params"]) <= 1e-6
    by_worker = {r["runs"][1]["worker"]: r["runs"][1]["expert_biases"] for r in results}
    for step in range(1, 7):
        assert torch.equal(by_worker[0][step], by_worker[1][step]) == (step in (1, 3, 5)), step


@pytest.mark.slow  # (CI time, 30 s) the fsdp_dtensor checkpoint path: the bias entries' resume is the DDP test's
@ON_FSDP_RELEASE
@pytest.mark.timeout(600)
def test_expert_bias_on_megatron_fsdp_checkpoint_between_syncs_resumes_exactly_and_elastically(tmp_path):
    """Megatron-FSDP's fsdp_dtensor checkpoint, 2 workers, saved after step 7 (between the syncs
    of steps 5 and 8: the workers' biases differ): resumed with 2 workers it ends bit for bit
    where the uninterrupted run ends (step 10), biases, parameters and EDiT state; resumed with 1
    worker the biases are the mean of the two saved workers' (the rule of a sync)."""
    from checkpoint_runs import fsdp_train_job
    from edit_runs import FSDP_MOE

    model = dict(FSDP_MOE, **{k: MOE[k] for k in MOE if k.startswith("moe_router_")})
    path = str(tmp_path / "ckpt")
    whole = run_ranks(fsdp_train_job, WORLD, saves=(7,), path=path, snapshots=(7,), model=model, timeout=400)
    resumed = run_ranks(fsdp_train_job, WORLD, load=7, path=path, model=model, timeout=400)
    saved = {r["worker"]: r["snapshots"][7]["expert_biases"] for r in whole}
    assert len(saved[0]) == 2 and not all(torch.equal(a, b) for a, b in zip(saved[0], saved[1]))
    for a, b in zip(whole, resumed):
        assert all(torch.equal(x, y) for x, y in zip(a["snapshots"][7]["expert_biases"], b["loaded"]["expert_biases"]))
        for key in ("expert_biases", "params", "anchors", "mains", "steps_done"):
            x, y = a["final"][key], b["final"][key]
            assert (x == y) if isinstance(x, int) else all(
                torch.equal(x[k], y[k]) for k in x) if isinstance(x, dict) else all(
                torch.equal(u, v) for u, v in zip(x, y)), key
    one = run_ranks(fsdp_train_job, WORLD, instances=1, load=7, path=path, model=model, timeout=400)
    mean = [((x.double() + y.double()) / 2).to(x.dtype) for x, y in zip(saved[0], saved[1])]
    for r in one:
        assert all(torch.equal(x, y) for x, y in zip(r["loaded"]["expert_biases"], mean)), "the mean over the saved workers"
