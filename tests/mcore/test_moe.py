"""EDiT on a MoE GPT (4 experts, top-2, sequential experts, alltoall dispatcher) on real
megatron-core (CPU, gloo, 4 processes, 2 workers): expert parallelism 1 (the experts live in the
dense buffers) and 2 (Megatron's expert-parallel buffers and a second distributed optimizer),
against the independent plain-PyTorch simulation, with the pseudo-gradient penalty.

Layouts with 2 workers: on 4 ranks EP=2 with TP=1 and TP=2 with EP=1 (TP=2 x EP=2 leaves one
expert data-parallel rank there, which cannot hold 2 workers, but TP=2 with expert tensor
parallelism 1 and EP=2 fits); TP=2 x EP=2 on 8 ranks (4 per worker, each with one copy of every
expert).
"""

import pytest
import torch

from compare import max_difference
from dist import run_ranks
from megatron_edit.mcore import compat
from edit_runs import default_spec, megatron_runs, simulate_edit
from gpt_utils import global_param_name

# megatron-core before 0.16 refuses expert parallelism with the partial distributed optimizer
# ("Partial DistOpt cannot support MoE models with expert parallelism", 0.12.3); MoE under EDiT
# is built and checked on 0.16+.
pytestmark = pytest.mark.skipif(not compat.version_at_least("0.16.0"),
                                reason="MoE with EDiT needs megatron-core 0.16+ (0.12's partial "
                                       "distributed optimizer refuses expert parallelism)")

WORLD = 4
EXPERTS = 4
MOE = dict(num_moe_experts=EXPERTS, moe_router_topk=2, moe_token_dispatcher_type="alltoall",
           add_bias_linear=False)  # 0.16.1: a sequential expert's bias is added in place on a view
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))
# warmup 1, H=2, 6 steps: syncs after steps 3 and 5; the penalty weights and clips per layer
EDIT = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=1, pseudo_gradnorm_reduce=True,
            clip_pseudo_grad=0.05)
SYNCS = [3, 5]
SIM_ATOL = 2e-4  # as tests/mcore/test_edit_megatron.py: Adam amplifies reduction-order noise


def _specs(model=MOE, **extra):
    return [default_spec(steps=6, model=model, local_sgd=dict(EDIT, sync_mode=mode), outer=OUTER,
                         snapshot_every_step=True, **extra) for mode in ("layerwise", "step_end")]


def _global(run, params, ep):
    return {global_param_name(k, EXPERTS // ep, run["ep_rank"]): v for k, v in params.items()}


def _slice(full, run, name):
    """This tensor-parallel rank's slice of a whole-model tensor."""
    dim = run["partition_dims"].get(name)
    if dim is None or full.shape == run["params"][name].shape:
        return full
    return full.chunk(full.shape[dim] // run["params"][name].shape[dim], dim)[run["tp_rank"]]


def _worst(run, params, expected, ep):
    names = {global_param_name(k, EXPERTS // ep, run["ep_rank"]): k for k in params}
    return max((_slice(expected[g], run, k) - params[k]).abs().max().item() for g, k in names.items())


def _check_job(results, sim, ep, tp=1, slots=None):
    """Both modes: the syncs, layer-wise == step-end bit for bit, the simulation, and the
    replicas (every dense and expert slice) identical after each sync, different between;
    ``slots``: the distinct (TP rank, EP rank) pairs (default TP x EP)."""
    expected_slots, slots = slots, {}
    for r in results:
        layerwise, step_end = r["runs"]
        assert len(layerwise["per_controller"]) == (2 if ep > 1 else 1)
        for controller in layerwise["per_controller"]:
            assert [rep.step for rep in controller["reports"]] == SYNCS
        for a, b in zip(layerwise["params"].values(), step_end["params"].values()):
            assert torch.equal(a, b), "layer-wise vs step-end"
        worst = _worst(layerwise, layerwise["params"], sim["params"][layerwise["worker"]], ep)
        assert worst <= SIM_ATOL, f"EDiT vs simulation: {worst:.3g}"
        slots.setdefault((layerwise["tp_rank"], layerwise["ep_rank"]), []).append(layerwise)
    assert len(slots) == (tp * ep if expected_slots is None else expected_slots)
    for runs in slots.values():
        by_worker = {x["worker"]: x for x in runs}
        assert sorted(by_worker) == [0, 1]
        a, b = by_worker[0]["snapshots"], by_worker[1]["snapshots"]
        for step in range(1, 7):
            same = all(torch.equal(a[step][k], b[step][k]) for k in a[step])
            experts_same = all(torch.equal(a[step][k], b[step][k]) for k in a[step] if ".experts." in k)
            if step == 1 or step in SYNCS:
                assert same, f"replicas differ after step {step}"
            else:
                assert not experts_same, f"experts identical after local step {step}"
    # worker 0's whole model (global expert numbers), from its tensor-parallel rank 0 ranks
    return {k: v for r in results for k, v in _global(r["runs"][0], r["runs"][0]["params"], ep).items()
            if r["runs"][0]["worker"] == 0 and r["runs"][0]["tp_rank"] == 0}


@pytest.mark.timeout(400)
def test_moe_expert_parallel_1_and_2_match_the_simulation_in_both_modes():
    """EP=1 and EP=2 (TP=1), layer-wise and step-end, penalty on: every parameter equals the
    simulation's (the router with its layer, each layer's experts one layer), the replicas are
    identical after every sync, and the EP=2 run equals the EP=1 run."""
    specs = _specs()
    (sim,) = run_ranks(simulate_edit, 1, specs[0], WORLD, timeout=200)
    assert [l for l in sim["layers"] if l.endswith(".mlp.experts")] == ["decoder.layers.0.mlp.experts",
                                                                          "decoder.layers.1.mlp.experts"]
    weights = sim["decisions"][0]["weights"]
    assert not torch.allclose(weights, torch.full_like(weights, 0.5)), "the penalty should weigh the workers"
    worker0 = {}
    for ep in (1, 2):
        results = run_ranks(megatron_runs, WORLD, specs, ep=ep, timeout=280)
        worker0[ep] = _check_job(results, sim, ep)
        if ep == 2:  # the expert optimizer: 8 bytes (fp32 anchor + momentum) per parameter of its shard
            for r in results:
                dense, experts = r["runs"][0]["per_controller"]
                assert experts["state_bytes"] == 8 * sum(experts["shard_numels"])
                assert experts["layer_names"] == ["decoder.layers.0.mlp.experts", "decoder.layers.1.mlp.experts"]
                assert not any(n.endswith(".mlp.experts") for n in dense["layer_names"])
    worst = max_difference(worker0[1], worker0[2])
    assert worst <= SIM_ATOL, f"EP=2 vs EP=1: {worst:.3g}"


@pytest.mark.timeout(400)
def test_moe_tensor_parallel_2_matches_the_simulation_in_both_modes():
    """TP=2 (experts tensor-parallel too), EP=1, 2 workers: as above, each rank's slices."""
    specs = _specs(model=dict(MOE, sequence_parallel=True))  # MoE with TP needs it
    (sim,) = run_ranks(simulate_edit, 1, _specs()[0], WORLD // 2, timeout=200)
    results = run_ranks(megatron_runs, WORLD, specs, tp=2, timeout=280)
    _check_job(results, sim, 1, tp=2)


@pytest.mark.timeout(900)
def test_moe_tensor_parallel_2_with_expert_parallel_2_matches_the_simulation_in_both_modes():
    """TP=2 x EP=2 (experts tensor-parallel too: ETP = TP), 2 workers on 8 ranks, penalty on:
    each rank's dense and expert slices equal the simulation's in both modes; the replicas are
    identical after every sync. The expert controller sums each layer's norm over the expert
    TP x EP ranks (4 pieces per layer here), or the clipping and the weights would differ."""
    specs = _specs(model=dict(MOE, sequence_parallel=True))
    (sim,) = run_ranks(simulate_edit, 1, _specs()[0], 2 * WORLD // 2, timeout=200)
    results = run_ranks(megatron_runs, 2 * WORLD, specs, tp=2, ep=2, timeout=840)
    _check_job(results, sim, 2, tp=2)


def uneven_gather_job(rank, world_size):
    """Megatron's tensor-parallel all-gather in uneven pieces (what the alltoall dispatcher does
    with TP > 1) under the CPU adapter (run_ranks activates it)."""
    from megatron.core.tensor_parallel import mappings

    sizes = [3, 5]
    piece = torch.arange(sizes[rank] * 2, dtype=torch.float32).view(-1, 2) + 100 * rank
    return mappings._gather_along_first_dim(piece, torch.distributed.group.WORLD, sizes)


@pytest.mark.timeout(120)
def test_cpu_adapter_gathers_uneven_pieces_over_gloo():
    """gloo refuses an all-gather of pieces of different sizes; the adapter pads them to the
    largest and cuts them back: every rank gets the pieces in rank order."""
    expected = torch.cat([torch.arange(6, dtype=torch.float32).view(-1, 2),
                          torch.arange(10, dtype=torch.float32).view(-1, 2) + 100])
    for out in run_ranks(uneven_gather_job, 2, timeout=100):
        assert torch.equal(out, expected)


@pytest.mark.timeout(300)
def test_moe_nothing_crosses_workers_between_syncs():
    """EP=2: no collective between syncs spans two workers (dispatcher all-to-alls, router
    statistics, expert gradient reductions stay inside the worker); at a sync only the sync
    group talks: the norms' all-gather and one all-reduce per bucket, dense and expert."""
    spec = default_spec(steps=5, model=MOE, local_sgd=dict(EDIT, local_sgd_sync_interval=3), outer=OUTER,
                        traffic=True)
    results = run_ranks(megatron_runs, WORLD, [spec], ep=2, timeout=280)
    for r in results:
        run = r["runs"][0]
        phases = {}
        for phase, name, ranks, numel in run["traffic"]:
            assert len(ranks) == 2 and set(ranks) == set(run["sync_group_ranks"]), (phase, name, ranks)
            phases.setdefault(phase, []).append(name)
        assert set(phases) == {"step 1", "step 4"}, phases  # warmup step 1, the sync after step 4
        shards = sum(len(c["shard_numels"]) for c in run["per_controller"])
        assert phases["step 4"].count("all_reduce") == shards
        assert phases["step 4"].count("all_gather") == len(run["per_controller"])


@pytest.mark.one_lane  # a variant of what this file checks in every lane (CI time; see conftest)
@pytest.mark.timeout(300)
def test_moe_expert_parallel_quantized_exchange_and_cpu_offload():
    """EP=2: the int8 exchange with error feedback and cpu_offload take the expert shards like
    the dense ones: layer-wise == step-end bit for bit, replicas identical after each sync, the
    expert optimizer's state on the CPU, the same bytes per parameter as the dense one."""
    quant = dict(EDIT, exchange_dtype="int8", exchange_block_size=64, exchange_error_feedback=True, cpu_offload=True)
    specs = [default_spec(steps=6, model=MOE, local_sgd=dict(quant, sync_mode=mode), outer=OUTER,
                          snapshot_every_step=True) for mode in ("layerwise", "step_end")]
    for layerwise in _compressed_expert_runs(specs):
        dense, experts = layerwise["per_controller"]
        # the same bytes per parameter as the dense shards (anchor, momentum, int8 error feedback)
        per_param = [c["state_bytes"] / sum(c["shard_numels"]) for c in (dense, experts)]
        assert per_param[1] == pytest.approx(per_param[0], abs=0.1), per_param  # block padding aside
        assert layerwise["anchor_devices"] == ["cpu"]


def _compressed_expert_runs(specs):
    """Run ``specs`` (layer-wise, then step-end, with a compressed exchange) with EP=2: the two
    modes equal bit for bit, the expert controller synced at SYNCS and reported what its
    exchange changed, the replicas of each expert shard identical after each sync. Returns
    each rank's layer-wise run."""
    results = run_ranks(megatron_runs, WORLD, specs, ep=2, timeout=280)
    slots, runs = {}, []
    for r in results:
        layerwise, step_end = r["runs"]
        for a, b in zip(layerwise["params"].values(), step_end["params"].values()):
            assert torch.equal(a, b), "layer-wise vs step-end"
        experts = layerwise["per_controller"][1]
        assert [rep.step for rep in experts["reports"]] == SYNCS
        assert experts["reports"][0].quantization_error is not None
        slots.setdefault(layerwise["ep_rank"], {})[layerwise["worker"]] = layerwise
        runs.append(layerwise)
    for by_worker in slots.values():
        for step in SYNCS:
            a, b = by_worker[0]["snapshots"][step], by_worker[1]["snapshots"][step]
            assert all(torch.equal(a[k], b[k]) for k in a), f"replicas differ after sync step {step}"
    return runs


@pytest.mark.one_lane  # a variant of what this file checks in every lane (CI time; see conftest)
@pytest.mark.timeout(300)
def test_moe_expert_parallel_sparse_exchange():
    """EP=2: the top-k exchange (2%, int2, error feedback by default) takes the expert shards
    like the dense ones, over the expert sync group: layer-wise == step-end bit for bit,
    replicas identical after each sync, the expert controller reports what it did not send."""
    sparse = dict(EDIT, exchange_dtype="int2", exchange_topk_density=0.02)
    specs = [default_spec(steps=6, model=MOE, local_sgd=dict(sparse, sync_mode=mode), outer=OUTER,
                          snapshot_every_step=True) for mode in ("layerwise", "step_end")]
    _compressed_expert_runs(specs)


def a_edit_moe_job(rank, world_size, local_sgd, seconds_per_step, train_iters, ft=None):
    """A-EDiT on the MoE GPT with EP=2 (2 workers, a dense and an expert controller), each
    worker's fake clock advancing ``seconds_per_step[worker]`` per step, until the budget of
    ``train_iters`` synchronous iterations is used. ``ft``: ``(worker, lighthouse)``, this job
    is that worker alone over the torchft backend (tests/torchft_backend/test_torchft_moe.py), on the
    micro-batches its ranks have in the one-world run."""
    import os

    import megatron_edit as me
    from megatron.core import parallel_state as ps

    from edit_runs import MICRO_BATCH, _build
    from gpt_utils import make_batches, named_params, rank_micro_batches, train_step

    instances = 2
    if ft is not None:
        import ft_jobs  # tests/torchft_backend/ft_jobs.py, on the path of the torchft tests' ranks

        host, port = ft_jobs.job_store_address()
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
        local_sgd = dict(local_sgd, sync_backend="torchft", replica_id=ft[0], lighthouse=ft[1], sync_timeout=120.0)
        instances = 1
    ps.initialize_model_parallel(num_distributed_optimizer_instances=instances, expert_model_parallel_size=2)
    me.patch_megatron_for_local_sgd(me.LocalSGDConfig(**local_sgd), me.OuterOptimizerConfig(**OUTER))
    ddp, optimizer = _build(default_spec(model=MOE, instances=instances), 1, 1)
    controllers = me.get_local_sgd(optimizer)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    worker = dp_rank // (dp // 2)
    if ft is not None:  # its ranks' place in the one world of both workers
        worker, dp_rank, dp = ft[0], ft[0] * world_size + dp_rank, 2 * world_size
    now = [0.0]
    for c in controllers:
        c.clock = lambda: now[0]
        c.budget_steps = train_iters * 2
    batches = make_batches(4 * train_iters, dp * MICRO_BATCH, seed=0)
    steps, reports, progress = 0, [[] for _ in controllers], [0.0 for _ in controllers]
    while not controllers[0].finished:
        steps += 1
        train_step(ddp, optimizer, rank_micro_batches(batches[steps - 1], dp_rank, dp))
        now[0] += seconds_per_step[worker]
        for i, c in enumerate(controllers):
            reports[i] += c.drain_reports()
            progress[i] += c.last_step_progress
    ddp.start_param_sync(force_sync=True)
    for out, c in zip(reports, controllers):
        out += c.drain_reports()
    result = dict(worker=worker, ep_rank=ps.get_expert_model_parallel_rank(), steps=steps, reports=reports,
                  finished=[c.finished for c in controllers], params=named_params(ddp), progress=progress,
                  steps_done=[c.steps_done for c in controllers])
    if ft is not None:
        result["manager_step"] = controllers[0].sync_group.step
        for c in controllers:
            c.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return result


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["layerwise", pytest.param("step_end", marks=pytest.mark.one_lane)])  # (one_lane: see conftest)
def test_moe_a_edit_with_expert_parallelism_syncs_both_halves_at_the_same_steps(mode):
    """A-EDiT with EP=2 (worker 0 1 s per step, worker 1 0.25 s, sync every 4 s, a budget of 20
    synchronous iterations): the expert controller follows the dense one's schedule, so both
    halves of the model sync after the same steps (the schedule of the dense A-EDiT test in
    tests/mcore/test_async.py: worker 0 after 3, 7, 10, worker 1 after 3, 19, 30, the first
    sync skipped), both end at the budget with the same learning-rate progress, and the final
    sync leaves every replica identical, experts included."""
    local = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, local_sgd_warmup_steps=1,
                 min_total_global_steps=10, sync_mode=mode)
    results = run_ranks(a_edit_moe_job, WORLD, local, [1.0, 0.25], 20, timeout=250)
    slots = {}
    for r in results:
        expected = [3, 7, 10] if r["worker"] == 0 else [3, 19, 30]
        assert r["finished"] == [True, True] and r["steps_done"] == [expected[-1]] * 2
        assert [[rep.step for rep in reports] for reports in r["reports"]] == [expected, expected]
        dense, experts = r["reports"]
        assert [rep.skipped_sync for rep in dense] == [rep.skipped_sync for rep in experts] == [True, False, False]
        assert all(torch.equal(a.worker_steps, b.worker_steps) for a, b in zip(dense, experts))
        assert experts[-1].final and r["progress"] == [pytest.approx(20.0)] * 2
        slots.setdefault(r["ep_rank"], {})[r["worker"]] = r["params"]
    for by_worker in slots.values():
        a, b = by_worker[0], by_worker[1]
        assert any(".experts." in k for k in a)
        assert all(torch.equal(a[k], b[k]) for k in a), "replicas after the final sync"


@pytest.mark.timeout(200)
def test_moe_a_edit_with_expert_parallelism_refuses_the_auto_overlap_in_one_line():
    """A-EDiT's auto overlap carries its measurements on the dense plan's all-reduce; the expert
    controller follows that plan and has none to ride on: refused when the model is built,
    naming both flags (mcore/runtime.py)."""
    local = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, local_sgd_warmup_steps=1,
                 min_total_global_steps=10, auto_overlap=True)
    with pytest.raises(Exception, match="--local-sgd-auto-overlap with --local-sgd-async on a MoE model"):
        run_ranks(a_edit_moe_job, WORLD, local, [1.0, 0.25], 20, timeout=150)


def _moe_config(**overrides):
    from types import SimpleNamespace

    fields = dict(num_moe_experts=4, tensor_model_parallel_size=1, expert_tensor_parallel_size=1,
                  context_parallel_size=1, moe_router_enable_expert_bias=False,
                  moe_router_load_balancing_type="aux_loss", moe_grouped_gemm=False,
                  moe_token_dispatcher_type="alltoall")
    fields.update(overrides)
    return SimpleNamespace(**fields)


@pytest.mark.parametrize("overrides,expert_parallel,use_async,match", [
    (dict(moe_router_load_balancing_type=["aux_loss", "global_aux_loss"]), False, False, "global_aux_loss"),
    (dict(moe_router_load_balancing_type="quantile_balancing"), False, False, "quantile_balancing"),
    (dict(moe_grouped_gemm=True), False, False, "--moe-grouped-gemm"),
    (dict(moe_token_dispatcher_type="flex"), False, False, "flex"),
])
def test_moe_options_refused_with_a_message_naming_the_option(overrides, expert_parallel, use_async, match):
    from megatron_edit import LocalSGDConfig
    from megatron_edit.mcore.checks import check_moe_options

    local = LocalSGDConfig(use_async=use_async, async_time_budget=None) if use_async else LocalSGDConfig()
    with pytest.raises(Exception, match=match):
        check_moe_options(local, _moe_config(**overrides), expert_parallel)


def test_moe_options_accepted():
    """Sequential experts, alltoall or allgather, EP with ETP = TP and ETP != TP, A-EDiT with and
    without EP."""
    from megatron_edit import LocalSGDConfig
    from megatron_edit.mcore.checks import check_moe_options

    check_moe_options(LocalSGDConfig(), _moe_config(), True)
    check_moe_options(LocalSGDConfig(), _moe_config(tensor_model_parallel_size=2, expert_tensor_parallel_size=2), True)
    check_moe_options(LocalSGDConfig(), _moe_config(tensor_model_parallel_size=2, expert_tensor_parallel_size=1), True)
    check_moe_options(LocalSGDConfig(use_async=True), _moe_config(moe_token_dispatcher_type="allgather"), False)
    check_moe_options(LocalSGDConfig(use_async=True), _moe_config(), True)
    # the expert bias: counted inside the worker, averaged at each sync (tests/mcore/test_expert_bias.py)
    check_moe_options(LocalSGDConfig(), _moe_config(moe_router_enable_expert_bias=True), True)
    check_moe_options(LocalSGDConfig(use_async=True), _moe_config(moe_router_enable_expert_bias=True), False)


def test_moe_expert_bias_refused_with_torchft():
    from megatron_edit import LocalSGDConfig
    from megatron_edit.mcore.checks import check_moe_options

    bias = _moe_config(moe_router_enable_expert_bias=True)
    ft = LocalSGDConfig()  # the torchft backend's settings, set past the config's torchft-installed check
    ft.sync_backend, ft.replica_id, ft.lighthouse = "torchft", 0, "http://127.0.0.1:29510"
    with pytest.raises(Exception, match="--moe-router-enable-expert-bias with --local-sgd-sync-backend torchft"):
        check_moe_options(ft, bias, False)
    check_moe_options(ft, _moe_config(), False)  # without the bias: accepted


@pytest.mark.timeout(400)
def test_moe_expert_parallel_checkpoint_resumes_exactly(tmp_path):
    """EP=2, 2 workers, penalty on: a run saved between syncs (step 4, the workers apart) and
    resumed there ends bit for bit where the uninterrupted run ends (step 6), parameters and
    both controllers' (dense and expert) anchors, mains and outer momentum."""
    from checkpoint_runs import moe_checkpoint_job
    from megatron_edit.mcore import checkpoint as checkpointing, compat

    if not checkpointing.SUPPORTED.contains(compat.megatron_core_version()):
        pytest.skip(f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}")
    path = str(tmp_path / "step4")
    local = dict(EDIT, sync_mode="layerwise")
    whole = run_ranks(moe_checkpoint_job, WORLD, MOE, local, path, 6, save_at=4, timeout=280)
    resumed = run_ranks(moe_checkpoint_job, WORLD, MOE, local, path, 6, load_at=4, timeout=280)
    for a, b in zip(whole, resumed):
        assert len(a["controllers"]) == 2
        for k in a["params"]:
            assert torch.equal(a["params"][k], b["params"][k]), k
        for ca, cb in zip(a["controllers"], b["controllers"]):
            assert ca["steps_done"] == cb["steps_done"] == 6
            for what in ("anchors", "mains"):
                assert all(torch.equal(x, y) for x, y in zip(ca[what], cb[what])), what
            for x, y in zip(ca["outer"], cb["outer"]):
                assert all(torch.equal(x[k], y[k]) for k in x), "outer state"
    # another expert-parallel size: refused, naming it
    from dist import RankError

    with pytest.raises(RankError, match="chained_0., chained_1.. than this run.s.*expert-parallel change"):
        run_ranks(moe_checkpoint_job, WORLD, MOE, local, path, 6, load_at=4, ep=1, timeout=280)


def _assert_resumed_exactly(whole, resumed):
    """Every rank's parameters and both controllers' step count, anchors and mains at step 6:
    the resumed run's equal the uninterrupted one's, bit for bit."""
    for a, b in zip(whole, resumed):
        assert len(a["controllers"]) == 2
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        for ca, cb in zip(a["controllers"], b["controllers"]):
            assert ca["steps_done"] == cb["steps_done"] == 6
            for what in ("anchors", "mains"):
                assert all(torch.equal(x, y) for x, y in zip(ca[what], cb[what])), what


@pytest.mark.one_lane  # an algorithm's variant on a checkpoint path (see conftest)
@pytest.mark.timeout(400)
def test_moe_expert_tensor_parallel_1_under_tensor_parallel_2_checkpoint_resumes_exactly(tmp_path):
    """TP=2, ETP=1, EP=2, 2 workers: saved between syncs (step 4) and resumed there, the run ends
    bit for bit where the uninterrupted one ends (step 6), both controllers' state too."""
    from checkpoint_runs import moe_checkpoint_job
    from megatron_edit.mcore import checkpoint as checkpointing, compat

    if not checkpointing.SUPPORTED.contains(compat.megatron_core_version()):
        pytest.skip(f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}")
    path, model = str(tmp_path / "step4"), dict(MOE, sequence_parallel=True, expert_tensor_parallel_size=1)
    local = dict(EDIT, sync_mode="layerwise")
    kw = dict(tp=2, etp=1, timeout=280)
    whole = run_ranks(moe_checkpoint_job, WORLD, model, local, path, 6, save_at=4, **kw)
    resumed = run_ranks(moe_checkpoint_job, WORLD, model, local, path, 6, load_at=4, **kw)
    _assert_resumed_exactly(whole, resumed)


@pytest.mark.one_lane  # a variant of what other tests check in every lane (CI time; see conftest)
@pytest.mark.timeout(400)
def test_moe_expert_parallel_checkpoint_with_a_delayed_exchange_in_flight_resumes_exactly(tmp_path):
    """EP=2, 2 workers, the delayed outer step (tau 1, H 2): saved after step 3, with both
    controllers' exchanges of the sync of step 4 in flight. The load asks for their results under
    the keys of Megatron's ChainedOptimizer (``chained_0.`` / ``chained_1.``; before, it asked
    without them and refused its own checkpoint as incomplete) and ends bit for bit where the
    uninterrupted run ends."""
    from checkpoint_runs import moe_checkpoint_job
    from megatron_edit.mcore import checkpoint as checkpointing

    if not checkpointing.SUPPORTED.contains(compat.megatron_core_version()):
        pytest.skip(f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}")
    path = str(tmp_path / "step3")
    local = dict(local_sgd_sync_interval=2, sync_mode="step_end", outer_step_delay=1)
    whole = run_ranks(moe_checkpoint_job, WORLD, MOE, local, path, 6, save_at=3, timeout=280)
    resumed = run_ranks(moe_checkpoint_job, WORLD, MOE, local, path, 6, load_at=3, timeout=280)
    _assert_resumed_exactly(whole, resumed)


@pytest.mark.one_lane  # an algorithm's variant on checkpoints: the default lane (see conftest)
@pytest.mark.timeout(400)
def test_moe_expert_parallel_elastic_resume_to_one_worker(tmp_path):
    """EP=2: a checkpoint of 2 workers saved between syncs, resumed by 1 worker (2 ranks, EP=2)
    as in the dense case: the experts' anchor (and model) after the load is one outer step over
    the 2 saved workers' expert shards (Nesterov SGD, momentum carried), and training goes on."""
    from checkpoint_runs import moe_checkpoint_job
    from megatron_edit.mcore import checkpoint as checkpointing, compat

    if not checkpointing.SUPPORTED.contains(compat.megatron_core_version()):
        pytest.skip(f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}")
    path = str(tmp_path / "step4")
    local = dict(local_sgd_sync_interval=2, local_sgd_warmup_steps=1, sync_mode="layerwise")  # syncs 3, 5
    saver = run_ranks(moe_checkpoint_job, WORLD, MOE, local, path, 4, save_at=4, timeout=280)
    resumed = run_ranks(moe_checkpoint_job, 2, MOE, local, path, 6, load_at=4, instances=1, timeout=280)
    lr, mu = OUTER["outer_optim_kwargs"]["lr"], OUTER["outer_optim_kwargs"]["momentum"]
    for r in resumed:
        experts = r["loaded"][1]
        saved = [s["saved"][1] for s in saver if s["ep_rank"] == r["ep_rank"]]  # worker 0, worker 1
        assert len(saved) == 2
        for i, anchor in enumerate(experts["anchors"]):
            old = saved[0]["anchors"][i]
            assert torch.equal(old, saved[1]["anchors"][i])
            delta = sum(old - s["mains"][i] for s in saved) / 2
            momentum = mu * saved[0]["outer"][i]["momentum_buffer"] + delta
            expected = old - lr * (delta + mu * momentum)
            torch.testing.assert_close(anchor, expected, atol=1e-6, rtol=0)
            torch.testing.assert_close(experts["mains"][i], expected, atol=1e-6, rtol=0)
        assert r["controllers"][1]["steps_done"] == 6
        assert all(torch.isfinite(p).all() for p in r["params"].values())


@pytest.mark.one_lane  # a variant of what this file checks in every lane (CI time; see conftest)
@pytest.mark.timeout(400)
def test_moe_expert_parallel_with_a_delayed_outer_step_matches_the_simulation():
    """EP=2 with the delayed outer step (tau 1, alpha 0.5; H=3 so the delay fits): the dense and
    the expert controllers launch after step s - 1 and apply after step s together; every
    parameter equals the simulation's (which models the delay), in both modes."""
    local = dict(EDIT, local_sgd_sync_interval=3, outer_step_delay=1, outer_merge_alpha=0.5)
    specs = [default_spec(steps=7, model=MOE, local_sgd=dict(local, sync_mode=mode), outer=OUTER)
             for mode in ("layerwise", "step_end")]
    (sim,) = run_ranks(simulate_edit, 1, specs[0], WORLD, timeout=200)
    results = run_ranks(megatron_runs, WORLD, specs, ep=2, timeout=280)
    for r in results:
        for run in r["runs"]:
            assert [[rep.step for rep in c["reports"]] for c in run["per_controller"]] == [[4, 7]] * 2
            worst = _worst(run, run["params"], sim["params"][run["worker"]], 2)
            assert worst <= SIM_ATOL, f"EDiT vs simulation: {worst:.3g}"


@pytest.mark.timeout(600)
def test_moe_expert_tensor_parallel_1_under_tensor_parallel_2_matches_the_simulation():
    """TP=2 with expert tensor parallelism 1 and EP=2 (Megatron-LM's usual MoE layout: experts
    whole, spread over the tensor-parallel ranks), 2 workers on 4 ranks: the experts' own
    data-parallel groups differ from the dense ones (each worker: one dense data-parallel rank
    of TP 2, two expert-parallel ranks holding 2 whole experts each). Both modes equal the
    simulation; the replicas are identical after every sync."""
    specs = _specs(model=dict(MOE, sequence_parallel=True, expert_tensor_parallel_size=1))
    (sim,) = run_ranks(simulate_edit, 1, _specs()[0], WORLD // 2, timeout=200)
    results = run_ranks(megatron_runs, WORLD, specs, tp=2, ep=2, etp=1, timeout=540)
    _check_job(results, sim, 2, tp=2, slots=2)
    for r in results:  # the experts whole (not cut by TP), the dense layers cut
        run = r["runs"][0]
        shapes = {global_param_name(k, EXPERTS // 2, run["ep_rank"]): v.shape for k, v in run["params"].items()}
        full = sim["params"][0]
        assert all(shapes[k] == full[k].shape for k in shapes if ".experts." in k)
        assert any(shapes[k] != full[k].shape for k in shapes if ".experts." not in k)
