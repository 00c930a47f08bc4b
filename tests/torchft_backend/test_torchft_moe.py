"""A MoE model with expert parallelism over the torchft backend (CPU, gloo, real megatron-core):
each worker its own 2-rank job with expert parallelism 2 (each rank two of the 4 experts), so
each rank has two EDiT controllers, the dense optimizer's and the experts', which share one
torchft Manager and one round per sync (``mcore.fault_tolerant.TorchftRound``). With no fault it
computes what the torch backend (one 4-rank world of 2 workers) computes on the same data and
config, to 1e-6; a worker killed between syncs is relaunched and heals both halves of its model
from its peer.

torchft is the optional ``ft`` extra: installed in CI's default lane, skipped where it is not."""

import os
import sys
from pathlib import Path

import pytest
import torch

from megatron_edit.algorithm.wire import all_reduce_bytes
from megatron_edit.exchange.link_probe import RATE_PROBE

pytest.importorskip("torchft")

# The A-EDiT MoE job is tests/mcore/test_moe.py's (its torch-backend test runs it too): its folder
# on the path (pytest puts it there for the tests in that folder only), here and in the ranks.
MCORE_TESTS = str(Path(__file__).resolve().parents[1] / "mcore")
if MCORE_TESTS not in sys.path:
    sys.path.insert(0, MCORE_TESTS)

import ft_jobs  # noqa: E402
from compare import max_difference  # noqa: E402
from dist import run_ranks  # noqa: E402
from edit_runs import default_spec, megatron_runs  # noqa: E402
from megatron_edit.mcore import compat  # noqa: E402

pytestmark = pytest.mark.skipif(not compat.version_at_least("0.16.0"),
                                reason="MoE with EDiT needs megatron-core 0.16+ (0.12's partial "
                                       "distributed optimizer refuses expert parallelism)")

WORKERS, RANKS, EP = 2, 2, 2
TIMEOUT = 400
MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", add_bias_linear=False)
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))
PENALTY = dict(pseudo_gradnorm_reduce=True, clip_pseudo_grad=0.05)


def _ft_moe_worker(rank, world_size, worker, lighthouse, spec):
    """One worker's job: the spec's run with the torchft backend and expert parallelism 2, on the
    micro-batches its ranks have in the one-world run."""
    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    local = dict(spec["local_sgd"], sync_backend="torchft", replica_id=worker, lighthouse=lighthouse,
                 sync_timeout=120.0)
    spec = dict(spec, instances=1, data_dp=WORKERS * world_size, data_rank_offset=worker * world_size, local_sgd=local)
    return megatron_runs(rank, world_size, [spec], ep=EP)["runs"][0]


def _both_backends(local_sgd, steps=6, **spec_kwargs):
    spec = default_spec(steps=steps, model=MOE, outer=OUTER, local_sgd=local_sgd, **spec_kwargs)
    reference = [r["runs"][0] for r in run_ranks(megatron_runs, WORKERS * RANKS, [spec], ep=EP, timeout=TIMEOUT)]
    with ft_jobs.jobs_and_lighthouse(min_replicas=WORKERS) as (server, start):
        jobs = [start(_ft_moe_worker, RANKS, w, server.address(), spec, timeout=TIMEOUT) for w in range(WORKERS)]
        ft = [out for outs in ft_jobs.all_results(jobs) for out in outs]  # worker-major: rank w * RANKS + r
    return reference, ft


def _check_equal(reference, ft, syncs):
    for g, (ref, run) in enumerate(zip(reference, ft)):
        assert ref["worker"] == g // RANKS and run["worker"] == 0  # one world / its own job
        assert ref["ep_rank"] == run["ep_rank"] == g % RANKS  # the same two experts
        assert ref["params"].keys() == run["params"].keys()
        assert any(".experts." in k for k in run["params"])
        worst = max_difference(ref["params"], run["params"])
        assert worst <= 1e-6, f"rank {g}: {worst:.3g}"
        assert max(abs(x - y) for x, y in zip(ref["losses"], run["losses"])) <= 1e-6, f"rank {g}"
        assert len(run["per_controller"]) == 2  # the dense optimizer's and the experts'
        assert run["manager_step"] == 1 + len(syncs)  # one round per sync for both (and the join)
        for mine, theirs in zip(run["per_controller"], ref["per_controller"]):
            assert [r.step for r in mine["reports"]] == [r.step for r in theirs["reports"]] == syncs
            assert all(r.committed and r.workers == WORKERS for r in mine["reports"])
            # each controller's own exchange (their collectives interleave in the shared round)
            # (the torch backend's timed syncs also probe the link: all-reduces of 1, 1 and up to
            # RATE_PROBE fp32 elements, the same at every timed sync of a controller)
            extra = {(t.latency_seconds is not None, t.payload_bytes - r.payload_bytes)
                     for r, t in zip(mine["reports"], theirs["reports"])}
            untimed = {e for timed, e in extra if not timed}
            timed = {e for timed, e in extra if timed}
            assert untimed <= {0} and len(timed) <= 1, extra
            for probes in timed:
                assert 2 * all_reduce_bytes(4, WORKERS) < probes <= 2 * all_reduce_bytes(
                    4, WORKERS) + all_reduce_bytes(4 * RATE_PROBE, WORKERS), extra
            assert all(r.latency_seconds is None for r in mine["reports"])
    # after the last sync the ranks holding the same experts hold the same model
    for r in range(RANKS):
        a, b = ft[r], ft[RANKS + r]
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


@pytest.mark.timeout(2 * TIMEOUT + 120)
@pytest.mark.parametrize("mode", ["step_end", "layerwise"])
def test_moe_expert_parallel_over_torchft_equals_the_torch_backend(mode):
    """H = 2, 6 steps, the penalty (norm-weighted averaging, per-layer clipping): the dense and
    the expert syncs after steps 2, 4 and 6 are one torchft round each; the same model as the
    torch backend. Step-end also with the int8 exchange and error feedback."""
    extra = dict(exchange_dtype="int8", exchange_error_feedback=True) if mode == "step_end" else {}
    reference, ft = _both_backends(dict(PENALTY, local_sgd_sync_interval=2, sync_mode=mode, **extra))
    _check_equal(reference, ft, [2, 4, 6])


@pytest.mark.one_lane  # a variant of the test above (CI time; see conftest)
@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_moe_expert_parallel_over_torchft_with_a_delay_equals_the_torch_backend():
    """The delayed outer step (tau 1, lerp 0.5, int8 with error feedback): both optimizers launch
    their exchange after step 3 in one round, which the dense optimizer's apply after step 4
    commits; the run's last step (6) is a blocking sync, its own round."""
    reference, ft = _both_backends(dict(local_sgd_sync_interval=4, outer_step_delay=1, outer_merge_alpha=0.5,
                                        exchange_dtype="int8", exchange_error_feedback=True, sync_mode="layerwise"),
                                   last_step=6)
    _check_equal(reference, ft, [4, 6])
    assert [r.delay for r in ft[0]["per_controller"][1]["reports"]] == [1, 0]


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_a_edit_moe_over_torchft_equals_the_torch_backend():
    """A-EDiT with expert parallelism 2 (worker 0 1 s per step, worker 1 0.25 s on fake clocks,
    a sync every 4 s, a budget of 20 iterations, no warmup): the expert controller follows the
    dense one's plan inside the same torchft round (a skipped sync is one round too); the same
    syncs, parameters (1e-6) and learning-rate progress as the torch backend's one world."""
    from test_moe import a_edit_moe_job

    local = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, local_sgd_warmup_steps=0,
                 min_total_global_steps=10, sync_mode="step_end")
    reference = run_ranks(a_edit_moe_job, WORKERS * RANKS, local, [1.0, 0.25], 20, timeout=TIMEOUT)
    with ft_jobs.jobs_and_lighthouse(min_replicas=WORKERS) as (server, start):
        jobs = [start(a_edit_moe_job, RANKS, local, [1.0, 0.25], 20, (w, server.address()), timeout=TIMEOUT)
                for w in range(WORKERS)]
        ft = [out for outs in ft_jobs.all_results(jobs) for out in outs]  # worker-major
    for g, (ref, run) in enumerate(zip(reference, ft)):
        assert run["worker"] == ref["worker"] == g // RANKS and run["ep_rank"] == ref["ep_rank"]
        assert run["finished"] == [True, True] and run["steps_done"] == ref["steps_done"]
        for mine, theirs in zip(run["reports"], ref["reports"]):
            assert [(r.step, r.skipped_sync, r.final) for r in mine] == [(r.step, r.skipped_sync, r.final) for r in theirs]
        assert any(r.skipped_sync for r in run["reports"][0]) and run["reports"][0][-1].final
        assert run["manager_step"] == 1 + len(run["reports"][0])  # the join, then one round per sync
        assert run["progress"] == pytest.approx(ref["progress"], abs=1e-9)
        worst = max_difference(ref["params"], run["params"])
        assert worst <= 1e-6, f"rank {g}: {worst:.3g}"


def _ft_moe_worker_measured(rank, world_size, worker, lighthouse, spec):
    """:func:`_ft_moe_worker` with the measurements the one-world run injects on its ranks
    (global rank: worker x ranks + rank)."""
    spec = dict(spec, measurements={r: spec["measurements"][worker * world_size + r] for r in range(world_size)})
    return _ft_moe_worker(rank, world_size, worker, lighthouse, spec)


# rank -> (inner step s, {format: exchange s}, exposed s): agreed, the fastest step 0.10 s and the
# slowest exchange 0.15 s: a delay of 2 (as tests/torchft_backend/test_torchft_overlap.py's)
MEASURED = {0: (0.10, {"fp32": 0.15}, 0.0), 1: (0.12, {"fp32": 0.14}, 0.0), 2: (0.11, {"fp32": 0.12}, 0.0),
            3: (0.13, {"fp32": 0.05}, 0.0)}


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_auto_overlap_on_a_moe_model_over_torchft_equals_the_torch_backend_with_the_same_measurements():
    """EDiT (H = 4, layer-wise, 24 steps) with --local-sgd-auto-overlap on the MoE model with
    expert parallelism 2: the dense and the expert controller each measure, agree on their
    sync's round and decide (the same measurements injected on both: a delay of 2 decided at
    the sync after 12, in force after 16, so the sync after 20 is launched after step 18); both
    controllers' decisions, syncs and parameters (1e-6) equal the torch backend's under the same
    rule (``auto_rounds``), and one model at the end."""
    local = dict(local_sgd_sync_interval=4, sync_mode="layerwise", auto_overlap=True)
    spec = default_spec(steps=24, last_step=24, model=MOE, outer=OUTER, local_sgd=local, measurements=MEASURED,
                        auto_rounds=True)
    reference = [r["runs"][0] for r in run_ranks(megatron_runs, WORKERS * RANKS, [spec], ep=EP, timeout=TIMEOUT)]
    with ft_jobs.jobs_and_lighthouse(min_replicas=WORKERS) as (server, start):
        jobs = [start(_ft_moe_worker_measured, RANKS, w, server.address(), spec, timeout=TIMEOUT)
                for w in range(WORKERS)]
        ft = [out for outs in ft_jobs.all_results(jobs) for out in outs]  # worker-major
    _check_equal(reference, ft, [4, 8, 12, 16, 20, 24])
    for ref, run in zip(reference, ft):
        for mine, theirs in zip(run["per_controller"], ref["per_controller"]):
            assert [r.delay for r in mine["reports"]] == [r.delay for r in theirs["reports"]] == [0, 0, 0, 0, 2, 0]
            assert mine["decisions"] == theirs["decisions"] and [d[1:] for d in mine["decisions"]] == [(2, "fp32")]


# ---------------------------------------------------------------------- a worker dies and comes back
HEAL_TOTAL, HEAL_H = 12, 2


def _digest(controller) -> str:
    """Exact: the float64 sum of this rank's anchors of one controller, as a hex float."""
    return float(sum(s.anchor.double().sum() for s in controller.shards)).hex()


def _healing_moe_worker(rank, world_size, worker, lighthouse, ctl, joiner, mode, resume=False):
    """One worker's job (expert parallelism 2): EDiT H = 2 over torchft for HEAL_TOTAL steps,
    every sync of both controllers logged (one JSON line each in ``ctl``). The first jobs stop
    before step 5 until the test has killed worker 1 (between its syncs 4 and 6); worker 0 then
    stops before step 7 until the relaunched worker 1 (``joiner``) waits in its join round's
    quorum, so that it joins at worker 0's sync 8. ``resume``: the first jobs save their own
    checkpoint after step 4, and the relaunched one loads it after its join: it is then behind
    worker 0 and heals again at its own next sync (its step 6), into worker 0's sync 10."""
    import json

    import megatron_edit as me
    from megatron.core import parallel_state as ps

    from edit_runs import MICRO_BATCH, _build
    from gpt_utils import make_batches, named_params, rank_micro_batches, train_step

    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    ps.initialize_model_parallel(num_distributed_optimizer_instances=1, expert_model_parallel_size=EP)
    me.patch_megatron_for_local_sgd(
        me.LocalSGDConfig(local_sgd_sync_interval=HEAL_H, sync_mode=mode, sync_backend="torchft", replica_id=worker,
                          lighthouse=lighthouse, sync_timeout=120.0, skip_anomaly=True, **PENALTY),
        me.OuterOptimizerConfig())
    if joiner:  # tell the test when this job's join round's quorum request has arrived
        ft_jobs.announce_quorum_requests(os.path.join(ctl, f"joiner-in-quorum-{rank}"), lighthouse)
    else:  # the first jobs ask for their join round's quorum together
        ft_jobs.first_round_together(os.path.join(ctl, "join"), f"w{worker}-r{rank}", WORKERS * world_size)
    ddp, optimizer = _build(default_spec(instances=1, model=MOE), 1, 1)  # the join round runs in here
    controllers = me.get_local_sgd(optimizer)
    assert len(controllers) == 2
    me.set_train_iters(optimizer, HEAL_TOTAL)
    log = open(os.path.join(ctl, f"w{worker}-r{rank}-{os.getpid()}.jsonl"), "a", buffering=1)
    log.write(json.dumps(dict(ev="joined", steps=[c.steps_done for c in controllers],
                              healed=controllers[0].sync_group.healed,
                              anchors=[_digest(c) for c in controllers])) + "\n")
    if not joiner:  # the first jobs start training together
        ft_jobs.gate(os.path.join(ctl, "start"), f"w{worker}-r{rank}", WORKERS * world_size, timeout=300.0)
    from checkpoint_runs import _load, _save

    path = os.path.join(ctl, f"ckpt-worker{worker}")
    if joiner and resume:
        _load(ddp, optimizer, path)
        log.write(json.dumps(dict(ev="loaded", steps=[c.steps_done for c in controllers])) + "\n")
    shares = WORKERS * world_size
    batches = make_batches(HEAL_TOTAL, shares * MICRO_BATCH, seed=0)
    while controllers[0].steps_done < HEAL_TOTAL:
        step = controllers[0].steps_done + 1
        if step == 5 and not joiner:
            ft_jobs.wait_file(os.path.join(ctl, "killed"))
        if step == 7 and worker == 0:
            ft_jobs.wait_file(os.path.join(ctl, f"joiner-in-quorum-{rank}"))
        train_step(ddp, optimizer, rank_micro_batches(batches[step - 1], worker * world_size + rank, shares))
        if resume and not joiner and step == 4:
            _save(ddp, optimizer, path)
        for i, c in enumerate(controllers):
            for r in c.drain_reports():
                log.write(json.dumps(dict(ev="sync", controller=i, step=r.step, workers=r.workers,
                                          committed=r.committed, anchor=_digest(c))) + "\n")
    ddp.start_param_sync(force_sync=True)
    out = dict(params=named_params(ddp), pid=os.getpid(), steps=[c.steps_done for c in controllers],
               manager_step=controllers[0].sync_group.step,
               anchors=[[s.anchor.clone() for s in c.shards] for c in controllers],
               momentum=[[c.outer_optimizer.state[a]["momentum_buffer"].clone()
                          for a in c.outer_optimizer.param_groups[0]["params"]] for c in controllers],
               ewma=[{w: stats.state_dict() for w, stats in c.sync.decisions.ewma_by_worker.items()} for c in controllers])
    for c in controllers:
        c.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return out


_events, _until = ft_jobs.events, ft_jobs.until


@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("mode", ["step_end", pytest.param("layerwise", marks=pytest.mark.one_lane)])
def test_a_killed_moe_worker_is_relaunched_and_heals_both_halves_of_its_model(tmp_path, mode):
    """2 workers x 2 ranks, expert parallelism 2 (each rank: the dense optimizer and one of the
    expert halves), the penalty on. Worker 1's job is SIGKILLed between its syncs 4 and 6; worker
    0 commits sync 6 alone, both controllers in one round; a fresh job for worker 1 joins at sync
    8 in one round for both controllers, heals both from worker 0's same rank (anchors, outer
    momentum, every worker's penalty statistics) and is bit-identical to it from then on."""
    ctl = str(tmp_path)
    synced = lambda w, step, **kw: all(  # noqa: E731
        any(e["ev"] == "sync" and e["step"] == step and e["controller"] == i and all(e[k] == v for k, v in kw.items())
            for e in _events(ctl, w, r)) for r in range(RANKS) for i in range(2))
    with ft_jobs.jobs_and_lighthouse(heartbeat_timeout_ms=3000, join_timeout_ms=60000) as (server, start):
        addr = server.address()
        survivor = start(_healing_moe_worker, RANKS, 0, addr, ctl, False, mode, timeout=3 * TIMEOUT - 60)
        victim = start(_healing_moe_worker, RANKS, 1, addr, ctl, False, mode, timeout=3 * TIMEOUT - 60)
        _until(lambda: synced(0, 4, workers=2) and synced(1, 4, workers=2), "the joint sync 4", [survivor, victim])
        victim.kill()  # every rank of the job
        open(os.path.join(ctl, "killed"), "w").close()
        _until(lambda: synced(0, 6, workers=1, committed=True), "worker 0's sync 6 alone", [survivor])
        joiner = start(_healing_moe_worker, RANKS, 1, addr, ctl, True, mode, timeout=2 * TIMEOUT)
        final0, final1 = ft_jobs.all_results([survivor, joiner])
    for r in range(RANKS):
        ev0 = [e for e in _events(ctl, 0, r) if e["ev"] == "sync"]
        for i in range(2):
            assert [(e["step"], e["workers"], e["committed"]) for e in ev0 if e["controller"] == i] == [
                (2, 2, True), (4, 2, True), (6, 1, True), (8, 2, True), (10, 2, True), (12, 2, True)]
        assert len({e["pid"] for e in _events(ctl, 0, r)}) == 1  # the survivor never restarted
        new = [e for e in _events(ctl, 1, r) if e["pid"] == final1[r]["pid"]]
        joined, *syncs = new
        assert joined["ev"] == "joined" and joined["healed"] and joined["steps"] == [8, 8]
        assert joined["anchors"] == [next(e["anchor"] for e in ev0 if e["step"] == 8 and e["controller"] == i)
                                     for i in range(2)]
        for i in range(2):
            assert [(e["step"], e["workers"], e["anchor"]) for e in syncs if e["controller"] == i] == [
                (e["step"], e["workers"], e["anchor"]) for e in ev0 if e["controller"] == i][-2:]
        a, b = final0[r], final1[r]
        assert a["steps"] == b["steps"] == [HEAL_TOTAL, HEAL_TOTAL]
        # one round per sync for both controllers: the join, 6 syncs (the relaunched worker took
        # the survivor's count when it healed)
        assert a["manager_step"] == b["manager_step"] == 7
        for i in range(2):
            assert all(torch.equal(x, y) for x, y in zip(a["anchors"][i], b["anchors"][i]))
            assert all(torch.equal(x, y) for x, y in zip(a["momentum"][i], b["momentum"][i]))
            assert sorted(a["ewma"][i]) == sorted(b["ewma"][i]) == [0, 1]
            assert all(torch.equal(a["ewma"][i][w][k], b["ewma"][i][w][k]) for w in (0, 1) for k in a["ewma"][i][w])
        assert any(".experts." in k for k in a["params"])
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


# ---------------------------------------------------------------------- checkpoints
RESUME_STEPS = 8


def _moe_checkpoint_job(rank, world_size, worker, lighthouse, folder, save_at, load_at=None, delay=0):
    """Worker ``worker``'s job (2 ranks, expert parallelism 2): EDiT H = 2 over torchft with the
    penalty, RESUME_STEPS steps on its slice of the data, saving its own checkpoint after step
    ``save_at`` (Megatron's dist_checkpointing) or resuming from it (``load_at``); ``delay``: the
    delayed outer step's tau."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    from checkpoint_runs import _load, _save
    from edit_runs import MICRO_BATCH, _build
    from gpt_utils import make_batches, named_params, rank_micro_batches, train_step

    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    ps.initialize_model_parallel(num_distributed_optimizer_instances=1, expert_model_parallel_size=EP)
    me.patch_megatron_for_local_sgd(
        me.LocalSGDConfig(local_sgd_sync_interval=2, sync_mode="step_end", sync_backend="torchft", replica_id=worker,
                          lighthouse=lighthouse, sync_timeout=120.0, skip_anomaly=True, outer_step_delay=delay,
                          **PENALTY),
        me.OuterOptimizerConfig(**OUTER))
    ddp, opt = _build(default_spec(instances=1, model=MOE), 1, 1)
    controllers = me.get_local_sgd(opt)
    me.set_train_iters(opt, RESUME_STEPS)
    path = os.path.join(folder, f"worker{worker}")
    first = 1
    if load_at is not None:
        _load(ddp, opt, path)
        first = load_at + 1
    shares = WORKERS * world_size
    batches = make_batches(RESUME_STEPS, shares * MICRO_BATCH, seed=0)
    for step in range(first, RESUME_STEPS + 1):
        train_step(ddp, opt, rank_micro_batches(batches[step - 1], worker * world_size + rank, shares))
        if step == save_at and load_at is None:
            _save(ddp, opt, path)
    ddp.start_param_sync(force_sync=True)
    out = dict(params=named_params(ddp), manager=dict(controllers[0].sync_group.manager.state_dict()), controllers=[])
    for c in controllers:
        outer = c.outer_optimizer
        out["controllers"].append(dict(
            steps_done=c.steps_done, reports=[(r.step, r.workers, r.committed, r.delay) for r in c.drain_reports()],
            anchors=[s.anchor.clone() for s in c.shards],
            outer=[{k: v.clone() for k, v in outer.state[s.anchor].items()} for s in c.shards],
            ewma={w: st.state_dict() for w, st in c.sync.decisions.ewma_by_worker.items()}))
    for c in controllers:
        c.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return out


def _checkpoint_runs(folder, save_at, load_at=None, delay=0):
    with ft_jobs.jobs_and_lighthouse(min_replicas=WORKERS) as (server, start):
        jobs = [start(_moe_checkpoint_job, RANKS, w, server.address(), folder, save_at, load_at, delay,
                      timeout=TIMEOUT) for w in range(WORKERS)]
        return [out for outs in ft_jobs.all_results(jobs) for out in outs]


@pytest.mark.timeout(2 * TIMEOUT + 120)
@pytest.mark.parametrize("delay", [0, pytest.param(1, marks=pytest.mark.one_lane)], ids=["blocking", "delay-in-flight"])
def test_each_moe_worker_resumes_from_its_own_checkpoint_exactly(tmp_path, delay):
    """Each worker (expert parallelism 2: two controllers per rank) saves its own checkpoint after
    step 3, between syncs (``delay`` 1: with the round of the sync of step 4 in flight, launched
    after step 3 by both controllers: the save commits it once for both); fresh jobs resuming
    from them end bit-identical to the run that went on: parameters, both controllers' anchors,
    outer momentum, syncs and penalty statistics, and the Manager's committed rounds."""
    from megatron_edit.mcore import checkpoint as checkpointing

    if not checkpointing.SUPPORTED.contains(compat.megatron_core_version()):
        pytest.skip(f"EDiT checkpoints need megatron-core {checkpointing.SUPPORTED}")
    straight = _checkpoint_runs(str(tmp_path), save_at=3, delay=delay)
    resumed = _checkpoint_runs(str(tmp_path), save_at=3, load_at=3, delay=delay)
    for a, b in zip(straight, resumed):
        assert a["manager"] == b["manager"] and a["manager"]["step"] == 5  # the join round and 4 syncs
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        assert len(a["controllers"]) == 2
        for x, y in zip(a["controllers"], b["controllers"]):
            assert [r[0] for r in x["reports"]] == [2, 4, 6, 8] and [r[0] for r in y["reports"]] == [4, 6, 8]
            assert [r[3] for r in x["reports"]] == [delay] * 3 + [0]  # the last step: a blocking sync
            assert x["steps_done"] == y["steps_done"] == RESUME_STEPS
            assert all(torch.equal(p, q) for p, q in zip(x["anchors"], y["anchors"]))
            assert all(torch.equal(p[k], q[k]) for p, q in zip(x["outer"], y["outer"]) for k in p)
            assert sorted(x["ewma"]) == sorted(y["ewma"]) == [0, 1]
            assert all(torch.equal(x["ewma"][w][k], y["ewma"][w][k]) for w in x["ewma"] for k in x["ewma"][w])


@pytest.mark.one_lane  # a variant of the test above (CI time; see conftest)
@pytest.mark.timeout(3 * TIMEOUT)
def test_a_relaunched_moe_worker_that_loads_an_older_checkpoint_heals_again_at_its_next_sync(tmp_path):
    """As above (step-end), but the relaunched worker 1 loads its own checkpoint of step 4 after
    its join (which healed it into worker 0's sync 8): its state and its Manager's count are
    then behind worker 0's, and its own next sync (after its step 6) heals both controllers
    into worker 0's sync 10, at worker 0's step; bit-identical from then on."""
    ctl = str(tmp_path)
    synced = lambda w, step, **kw: all(  # noqa: E731
        any(e["ev"] == "sync" and e["step"] == step and e["controller"] == i and all(e[k] == v for k, v in kw.items())
            for e in _events(ctl, w, r)) for r in range(RANKS) for i in range(2))
    with ft_jobs.jobs_and_lighthouse(heartbeat_timeout_ms=3000, join_timeout_ms=60000) as (server, start):
        addr = server.address()
        survivor = start(_healing_moe_worker, RANKS, 0, addr, ctl, False, "step_end", True, timeout=3 * TIMEOUT - 60)
        victim = start(_healing_moe_worker, RANKS, 1, addr, ctl, False, "step_end", True, timeout=3 * TIMEOUT - 60)
        _until(lambda: synced(0, 4, workers=2) and synced(1, 4, workers=2), "the joint sync 4", [survivor, victim])
        victim.kill()
        open(os.path.join(ctl, "killed"), "w").close()
        _until(lambda: synced(0, 6, workers=1, committed=True), "worker 0's sync 6 alone", [survivor])
        joiner = start(_healing_moe_worker, RANKS, 1, addr, ctl, True, "step_end", True, timeout=2 * TIMEOUT)
        final0, final1 = ft_jobs.all_results([survivor, joiner])
    for r in range(RANKS):
        ev0 = [e for e in _events(ctl, 0, r) if e["ev"] == "sync"]
        new = [e for e in _events(ctl, 1, r) if e["pid"] == final1[r]["pid"]]
        joined, loaded, *syncs = new
        assert joined["ev"] == "joined" and joined["healed"] and joined["steps"] == [8, 8]
        assert loaded == dict(loaded, ev="loaded", steps=[4, 4])
        for i in range(2):
            assert [(e["step"], e["workers"], e["anchor"]) for e in syncs if e["controller"] == i] == [
                (e["step"], e["workers"], e["anchor"]) for e in ev0 if e["controller"] == i][-2:]
            assert [e["step"] for e in ev0 if e["controller"] == i] == [2, 4, 6, 8, 10, 12]
        a, b = final0[r], final1[r]
        assert a["steps"] == b["steps"] == [HEAL_TOTAL, HEAL_TOTAL]
        assert a["manager_step"] == b["manager_step"] == 7
        for i in range(2):
            assert all(torch.equal(x, y) for x, y in zip(a["anchors"][i], b["anchors"][i]))
            assert all(torch.equal(x, y) for x, y in zip(a["momentum"][i], b["momentum"][i]))
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
