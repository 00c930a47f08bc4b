"""A-EDiT over the torchft backend on real megatron-core (CPU, gloo): each worker its own job, a
torchft Lighthouse in the test process, a fake clock per worker (a deterministic schedule).

With no fault it computes what the torch backend computes (one world of 2 workers x 2 ranks);
when a worker dies the others go on without it and the run's budget of worker-steps is used
exactly by the workers that remain.

torchft is the optional ``ft`` extra: installed in CI's default lane, skipped where it is not."""

import os
import time

import pytest
import torch

pytest.importorskip("torchft")

import ft_jobs  # noqa: E402
from compare import max_difference  # noqa: E402
from dist import run_ranks  # noqa: E402
from edit_runs import async_runs, default_spec  # noqa: E402

TIMEOUT = 300
OUTER = dict(outer_optim_class="torch.optim.SGD", outer_optim_kwargs=dict(lr=0.7, momentum=0.9, nesterov=True))


def _worker_world() -> None:
    """Inside a job's rank: the job's store for torchft's Manager, and megatron-core's groups of
    one worker (num_distributed_optimizer_instances 1)."""
    from megatron.core import parallel_state as ps

    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    ps.initialize_model_parallel(num_distributed_optimizer_instances=1)


def _ft_async_worker(rank, world_size, worker, lighthouse, spec, workers, gate=None):
    """One worker's job: :func:`edit_runs.async_runs` with the torchft backend, on the
    micro-batches its ranks have in the one-world run; ``gate``: a supervisor's start gate (the
    run's first sync waits for every worker)."""
    from megatron_edit.exchange.run_gate import START_GATE_ENV

    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    if gate is not None:
        os.environ[START_GATE_ENV] = gate
    local = dict(spec["local_sgd"], sync_backend="torchft", replica_id=worker, lighthouse=lighthouse)
    local.setdefault("sync_timeout", 120.0)  # (a spec's own: a test that waits one out)
    spec = dict(spec, instances=1, worker=worker, data_dp=workers * world_size, data_rank_offset=worker * world_size,
                local_sgd=local, die_after=spec.get("die_after", {}).get(worker))
    return async_runs(rank, world_size, spec)


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_a_edit_over_torchft_equals_the_torch_backend():
    """2 workers x 2 ranks, worker 0 1 s per step, worker 1 0.25 s, a budget of 40 iterations
    (80 worker-steps): the first sync (2 + 2 steps) is skipped, then the workers sync every 4 s
    and end at a final sync planned from their speeds (worker 0 after 18 steps, worker 1 after
    62); the torchft run takes the same syncs as the torch backend's (one world), ends with the
    same parameters (1e-6) and the same learning-rate progress (the budget's 40 iterations)."""
    spec = default_spec(
        local_sgd=dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, min_total_global_steps=10,
                       sync_mode="step_end"),
        outer=OUTER, seconds_per_step=[1.0, 0.25], max_steps=128, train_iters=40)
    reference = run_ranks(async_runs, 4, spec, timeout=TIMEOUT)
    with ft_jobs.jobs_and_lighthouse(min_replicas=2) as (server, start):
        jobs = [start(_ft_async_worker, 2, w, server.address(), spec, 2, timeout=TIMEOUT) for w in range(2)]
        ft = [out for outs in ft_jobs.all_results(jobs) for out in outs]  # worker-major
    for g, (ref, run) in enumerate(zip(reference, ft)):
        assert run["worker"] == ref["worker"] == g // 2
        syncs = [(r.step, r.skipped_sync, r.final) for r in run["reports"]]
        assert syncs == [(r.step, r.skipped_sync, r.final) for r in ref["reports"]]
        assert [s[1:] for s in syncs] == [(True, False), (False, False), (False, False), (False, True)]
        assert [s[0] for s in syncs][::3] == ([2, 18] if g < 2 else [2, 62])  # 18 + 62: the budget
        assert all(r.committed and r.workers == 2 for r in run["reports"])
        assert run["finished"] and run["progress"] == pytest.approx(40.0, abs=1e-9)
        assert run["last_sync"].global_progress == 40.0  # 80 worker-steps applied, over 2 workers
        assert max_difference(ref["params"], run["params"]) <= 1e-6, f"rank {g}"
    for run in ft[1:]:  # the final sync leaves every rank of every worker with the same model
        assert max_difference(ft[0]["params"], run["params"]) == 0.0


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_a_edit_s_fragments_over_torchft_equal_the_torch_backend():
    """A-EDiT with 2 streaming fragments and a delay of 1 (alpha 0, layer-wise) over torchft, 2
    workers x 2 ranks (1 s and 0.25 s a step, a sync every 2 s, a budget of 20 iterations): the
    same syncs as the torch backend's (each exchanging one fragment in turn, the final one every
    fragment), the same step weights (each worker's steps since its fragment's last sync, kept by
    worker id over torchft), parameters to 1e-6 and one model at the end."""
    spec = default_spec(
        local_sgd=dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=4, fragments=2,
                       min_total_global_steps=1, use_step_weight=True, step_weight_ratio=0.5, sync_mode="layerwise",
                       outer_step_delay=1, outer_merge_alpha=0.0),
        outer=OUTER, seconds_per_step=[1.0, 0.25], max_steps=64, train_iters=20, bucket_size=1000)
    reference = run_ranks(async_runs, 4, spec, timeout=TIMEOUT)
    with ft_jobs.jobs_and_lighthouse(min_replicas=2) as (server, start):
        jobs = [start(_ft_async_worker, 2, w, server.address(), spec, 2, timeout=TIMEOUT) for w in range(2)]
        ft = [out for outs in ft_jobs.all_results(jobs) for out in outs]  # worker-major
    for g, (ref, run) in enumerate(zip(reference, ft)):
        syncs = [(r.step, r.delay, r.fragment, r.final, r.worker_steps.tolist()) for r in run["reports"]]
        assert syncs == [(r.step, r.delay, r.fragment, r.final, r.worker_steps.tolist()) for r in ref["reports"]]
        assert [s[2] for s in syncs] == [1, 0, 1, None] and all(r.committed for r in run["reports"]), syncs
        assert run["finished"] and run["progress"] == pytest.approx(20.0, abs=1e-9)
        assert max_difference(ref["params"], run["params"]) <= 1e-6, f"rank {g}"
    for run in ft[1:]:  # the final sync leaves every rank of every worker with the same model
        assert max_difference(ft[0]["params"], run["params"]) == 0.0


def _ft_async_worker_one_rank_fails(rank, world_size, worker, lighthouse, spec, workers, fail_at):
    """:func:`_ft_async_worker`, where rank 1 of worker 1 reports an error in the round of its
    ``fail_at``-th commit (the join round's is the first): that round fails on that rank, so on
    the whole worker (a worker is one unit), while worker 0 commits it."""
    if worker == 1 and rank == 1:
        ft_jobs.fail_round(fail_at)
    return _ft_async_worker(rank, world_size, worker, lighthouse, spec, workers)


@pytest.mark.timeout(TIMEOUT + 60)
def test_an_a_edit_fragment_s_round_that_fails_on_one_rank_of_a_worker_is_healed_at_the_next_sync():
    """The partial event with A-EDiT's fragments: 2 workers x 2 ranks, 2 fragments, the round of
    the second sync (fragment 0) fails on rank 1 of worker 1 only. Worker 1 commits nothing on
    either rank (a worker is one unit) and its fragments' counts go back to before that round;
    at its next sync it heals from worker 0 (the anchors and the counts, by worker id), so it
    exchanges the fragment worker 0 exchanges (1) with no steps of its own, then both go on
    with the same fragments and step weights and end with one model."""
    spec = default_spec(
        local_sgd=dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=4, fragments=2,
                       min_total_global_steps=1, use_step_weight=True, sync_mode="step_end"),
        outer=OUTER, seconds_per_step=[1.0, 1.0], max_steps=64, train_iters=12, bucket_size=1000)
    with ft_jobs.jobs_and_lighthouse(min_replicas=2) as (server, start):
        jobs = [start(_ft_async_worker_one_rank_fails, 2, w, server.address(), spec, 2, 3, timeout=TIMEOUT)
                for w in range(2)]
        ft = [out for outs in ft_jobs.all_results(jobs) for out in outs]  # worker-major
    for g, run in enumerate(ft):
        syncs = [(r.step, r.fragment, r.committed, r.worker_steps.tolist()) for r in run["reports"]]
        # (step, fragment, committed, step weights): at 8 worker 1 heals (0 steps), at 10 fragment
        # 0 weighs worker 0's 4 steps since 6 and worker 1's 2 since its heal at 8
        assert syncs == [(2, 1, True, [2.0, 2.0]), (6, 0, g < 2, [6.0, 6.0]), (8, 1, True, [6.0, 0.0]),
                         (10, 0, True, [4.0, 2.0]), (13, None, True, [5.0, 5.0])], (g, syncs)
        assert run["finished"] and run["last_sync"].global_progress == 12  # the budget
    for run in ft[1:]:
        assert max_difference(ft[0]["params"], run["params"]) == 0.0


@pytest.mark.timeout(2 * TIMEOUT)
def test_a_edit_over_torchft_goes_on_without_a_dead_worker_and_uses_the_budget_exactly():
    """3 workers of one rank (1 s, 0.5 s, 0.5 s per step), a budget of 16 iterations (48
    worker-steps). At the first sync (2 steps each) the 42 worker-steps left are about one
    interval: they plan the final one, 9, 17 and 16 steps by speed. Worker 2 dies after its step
    5, 3 steps into it. Workers 0 and 1 sync without it (their quorum forms once its heartbeat
    stops: nothing waits for its steps) and its unsynced steps are lost: 32 worker-steps have
    reached the anchor, not 48, so that sync is not the last. The two plan the 16 left from their
    own speeds (6 + 10): their final sync applies exactly 48 worker-steps, their learning-rate
    schedules end at the budget's 16 iterations (the last interval makes up for the dead
    worker's planned steps) and they end identical."""
    import torch.distributed as dist

    from megatron_edit.exchange.run_gate import start_gate_value

    spec = default_spec(
        local_sgd=dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, min_total_global_steps=1,
                       sync_mode="layerwise"),
        outer=OUTER, seconds_per_step=[1.0, 0.5, 0.5], max_steps=64, train_iters=16, die_after={2: 5})
    # The start gate (a supervisor's): every worker's Manager is up before the first quorum, which
    # then holds all three. Heartbeat 3 s: a dead worker leaves the quorum 3 s after its death;
    # join timeout 60 s: a quorum waits for a live worker that has not asked yet.
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    gate = start_gate_value("127.0.0.1", store.port, 3, 240.0)
    with ft_jobs.jobs_and_lighthouse(heartbeat_timeout_ms=3000, join_timeout_ms=60000) as (server, start):
        jobs = [start(_ft_async_worker, 1, w, server.address(), spec, 3, gate, timeout=2 * TIMEOUT - 60)
                for w in range(3)]
        survivors = [out for outs in ft_jobs.all_results(jobs[:2]) for out in outs]
        assert jobs[2].procs[0].exitcode == -9  # it died where it was told to, not earlier
    del store
    fast, slow = survivors
    assert [(r.step, r.workers, r.committed, r.final) for r in fast["reports"]] == [
        (2, 3, True, False), (11, 2, True, False), (17, 2, True, True)]
    assert [(r.step, r.workers, r.committed, r.final) for r in slow["reports"]] == [
        (2, 3, True, False), (19, 2, True, False), (29, 2, True, True)]
    assert fast["reports"][1].worker_steps.tolist() == [9, 17]  # the dead worker's 3 steps are not there
    for run in survivors:
        assert run["finished"] and run["last_sync"].global_progress * 3 == 48  # the budget, exactly
        assert run["last_sync"].replica_ids == [0, 1] and run["last_sync"].worker_steps == [17, 29]
        assert run["progress"] == pytest.approx(16.0, abs=1e-9)
    assert max_difference(fast["params"], slow["params"]) == 0.0


def _checkpoint_job(rank, world_size, worker, lighthouse, folder, resume):
    """Worker ``worker``'s job (1 rank): A-EDiT over torchft, fake clock (1 s / 0.5 s per step),
    a budget of 24 iterations; it saves its own checkpoint right after its first real sync
    (Megatron's dist_checkpointing), or (``resume``) resumes from it and trains to the end."""
    import megatron_edit as me

    import checkpoint_runs as cr
    from edit_runs import MICRO_BATCH
    from gpt_utils import make_batches, rank_micro_batches, train_step

    _worker_world()
    local = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, min_total_global_steps=1,
                 sync_mode="step_end", sync_backend="torchft", replica_id=worker, lighthouse=lighthouse,
                 sync_timeout=120.0)
    ddp, opt, ctl = cr._setup(local, instances=1)
    me.set_train_iters(opt, 24)
    now = [0.0]
    ctl.clock = lambda: now[0]
    path = os.path.join(folder, f"worker{worker}")
    if resume:
        cr._load(ddp, opt, path)
    batches = make_batches(64, 2 * MICRO_BATCH, seed=0)
    reports, progress = [], 0.0
    while not ctl.finished:
        step = ctl.steps_done + 1
        # The step's time counts before it: a step-end sync (inside the step) ends its interval
        # after it, and the resumed run's clock (restarted at the load) measures the same.
        now[0] += (1.0, 0.5)[worker]
        train_step(ddp, opt, rank_micro_batches(batches[step - 1], worker, 2))
        progress += ctl.last_step_progress
        reports += [(r.step, r.workers, r.skipped_sync, r.final) for r in ctl.drain_reports()]
        if not resume and ctl.at_sync and [r for r in reports if not r[2]] == reports[-1:]:
            cr._save(ddp, opt, path)  # right after its first real sync
    out = cr._state(ddp, opt, ctl)
    out.update(reports=reports, progress=progress, manager=ctl.backend.group.manager.state_dict(),
               applied=ctl.async_plan.applied_steps)
    ctl.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return out


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_each_a_edit_worker_resumes_from_its_own_checkpoint_exactly(tmp_path):
    """Each worker saves its own checkpoint right after its first real sync; fresh jobs resuming
    from them take the same syncs and end bit-identical to the run that went on: parameters,
    Adam, anchors, outer momentum, step counters, the Manager's committed syncs, the applied
    worker-steps (the budget) and the learning-rate progress of the steps after the save."""
    runs = {}
    for resume in (False, True):
        with ft_jobs.jobs_and_lighthouse(min_replicas=2) as (server, start):
            jobs = [start(_checkpoint_job, 1, w, server.address(), str(tmp_path), resume, timeout=TIMEOUT)
                    for w in range(2)]
            runs[resume] = [out[0] for out in ft_jobs.all_results(jobs)]
    for a, b in zip(runs[False], runs[True]):
        saved_at = next(i for i, r in enumerate(a["reports"]) if not r[2])
        assert a["reports"][saved_at + 1:] == b["reports"] and b["reports"][-1][3]  # the same syncs to the final
        assert len(b["reports"]) == 3 and a["progress"] == pytest.approx(24.0, abs=1e-9)
        assert b["progress"] == pytest.approx(24.0 - 2.0, abs=1e-9)  # 2: the progress of the first sync
        assert a["manager"] == b["manager"] and a["applied"] == b["applied"] == 48
        assert (a["steps_done"], a["last_sync_step"]) == (b["steps_done"], b["last_sync_step"])
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        assert all(torch.equal(x, y) for x, y in zip(a["anchors"], b["anchors"]))
        assert all(torch.equal(x[k], y[k]) for x, y in zip(a["outer"], b["outer"]) for k in x)
        assert all(torch.equal(x[k], y[k]) for x, y in zip(a["adam"], b["adam"]) for k in x if torch.is_tensor(x[k]))
    assert all(torch.equal(runs[True][0]["params"][k], runs[True][1]["params"][k]) for k in runs[True][0]["params"])


def _relaunch_job(rank, world_size, worker, lighthouse, ctl, joiner, extra=None, budget=15):
    """Worker ``worker``'s job (1 rank): A-EDiT over torchft, fake clock (1 s a step for both), a
    budget of 15 iterations, the step-end sync. The first worker 1 dies after its step 5;
    worker 0 waits before its step 7 until the relaunched worker 1 (``joiner``) asks for its join
    round's quorum (a file in ``ctl``), so that it joins worker 0's next sync (after its step
    10)."""
    import megatron_edit as me
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    import checkpoint_runs as cr
    from edit_runs import LR, MICRO_BATCH
    from gpt_utils import make_batches, rank_micro_batches, train_step

    _worker_world()
    if joiner:
        ft_jobs.announce_quorum_requests(os.path.join(ctl, "joiner-in-quorum"), lighthouse)
    local = dict(dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, min_total_global_steps=1,
                      sync_mode="step_end", sync_backend="torchft", replica_id=worker, lighthouse=lighthouse,
                      sync_timeout=120.0), **(extra or {}))
    ddp, opt, ctl_ = cr._setup(local, instances=1)
    # Megatron's learning-rate schedule over the budget's 15 iterations: a healed worker's
    # follows the heal (patch sched-step-global-progress)
    for group in opt.param_groups:  # what get_megatron_optimizer sets from OptimizerConfig.lr / min_lr
        group["max_lr"], group["min_lr"] = LR, LR / 10
    scheduler = OptimizerParamScheduler(opt, init_lr=LR, max_lr=LR, min_lr=LR / 10, lr_warmup_steps=0,
                                        lr_decay_steps=budget, lr_decay_style="linear", start_wd=0.0, end_wd=0.0,
                                        wd_incr_steps=budget, wd_incr_style="constant")
    joined = dict(step=ctl_.steps_done, healed=ctl_.sync_group.healed, progress=ctl_.global_progress,
                  applied=ctl_.async_plan.applied_steps, run_workers=ctl_.async_plan.run_workers)
    me.set_train_iters(opt, budget)  # after the build, as Megatron-LM tells it: after the join
    now = [0.0]
    ctl_.clock = lambda: now[0]
    batches = make_batches(128, 2 * MICRO_BATCH, seed=0)
    reports, fragment_syncs = [], []
    while not ctl_.finished:
        step = ctl_.steps_done + 1
        if step == 7 and worker == 0:
            ft_jobs.wait_file(os.path.join(ctl, "joiner-in-quorum"), timeout=240.0)
        now[0] += 1.0
        train_step(ddp, opt, rank_micro_batches(batches[step - 1], worker, 2))
        scheduler.step(1)
        if step == 5 and worker == 1 and not joiner:
            os.kill(os.getpid(), 9)  # a crash: its 3 steps since the sync after step 2 are lost
        for r in ctl_.drain_reports():
            reports.append((r.step, r.workers, r.trained, r.committed, r.final))
            fragment_syncs.append((r.step, r.fragment, r.worker_steps.tolist()))
    out = cr._state(ddp, opt, ctl_)
    out.update(reports=reports, joined=joined, last_sync=ctl_.last_sync, schedule=scheduler.num_steps,
               fragment_syncs=fragment_syncs)
    ctl_.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return out


@pytest.mark.timeout(2 * TIMEOUT)
def test_a_relaunched_a_edit_worker_heals_and_the_budget_stays_exact(tmp_path):
    """2 workers of one rank, 1 s a step each, a budget of 15 iterations (30 worker-steps). Both
    sync after step 2 and plan 8 steps each; worker 1 dies after its step 5. A fresh job for
    worker 1 joins worker 0's sync after step 10 (2 workers in it, 1 that trained), heals from
    worker 0 (the anchor, the outer momentum and the plan: the run's 2 workers, the worker-steps
    applied, the speeds by worker id, and the budget, which Megatron-LM tells a job only after
    its optimizer, and so its join, is built; its learning-rate schedule jumps to the
    survivor's) and takes the same plan. 4 + 8 = 12 worker-steps have reached the anchor there:
    the dead worker's 3 unsynced steps are not among them. The 18 left make that plan the final
    interval (7 steps for worker 0, 11 for worker 1, by their speeds; a joiner without the
    budget planned 4 and 8 and synced twice more, and with a faster joiner overran the budget).
    The two end at that final sync, which applies exactly 30 worker-steps and leaves them
    bit-identical."""
    ctl = str(tmp_path)
    with ft_jobs.jobs_and_lighthouse(min_replicas=2, heartbeat_timeout_ms=3000, join_timeout_ms=60000) as (
            server, start):
        addr = server.address()
        first = [start(_relaunch_job, 1, w, addr, ctl, False, timeout=2 * TIMEOUT - 60) for w in range(2)]
        while first[1].procs[0].exitcode is None:  # its crash after step 5
            time.sleep(0.1)
        joiner = start(_relaunch_job, 1, 1, addr, ctl, True, timeout=2 * TIMEOUT - 60)
        survivor, rejoined = ft_jobs.all_results([first[0], joiner])
        survivor, rejoined = survivor[0], rejoined[0]
    assert first[1].procs[0].exitcode == -9
    assert survivor["reports"][:2] == [(2, 2, 2, True, False), (10, 2, 1, True, False)]
    assert rejoined["joined"] == dict(step=10, healed=True, progress=6.0, applied=12, run_workers=2)
    # The join round plans the final interval for both (the joiner with the budget it healed):
    # worker 0 syncs after 10 + 7, worker 1 after 10 + 11, once.
    assert survivor["reports"][2:] == [(17, 2, 2, True, True)] and rejoined["reports"] == [(21, 2, 2, True, True)]
    for run in (survivor, rejoined):
        assert run["last_sync"].final and run["last_sync"].global_progress * 2 == 30  # the budget, exactly
        # Megatron's schedule at the budget's 15 iterations: the relaunched worker's jumped to the
        # survivor's progress at the heal (6 iterations) and went on from there
        assert run["schedule"] == pytest.approx(15.0, abs=1e-9)
    assert all(torch.equal(x, y) for x, y in zip(survivor["anchors"], rejoined["anchors"]))
    assert all(torch.equal(survivor["params"][k], rejoined["params"][k]) for k in survivor["params"])


FRAGMENTS = dict(fragments=2, local_sgd_sync_interval=4, use_step_weight=True)
"""The relaunch with fragments: the first interval H/F = 2 steps, then a sync every 2 s."""


@pytest.mark.timeout(2 * TIMEOUT)
def test_a_relaunched_a_edit_worker_with_fragments_takes_the_fragments_counts_from_its_heal(tmp_path):
    """As above with 2 streaming fragments (a sync every 2 s, each exchanging one fragment in
    turn, the final one every fragment; step weights on). The relaunched worker joins worker 0's
    sync after step 6 and heals there: it takes the round-robin's count and every worker's steps at
    each fragment's last sync (by worker id) with the anchor, exchanges the fragment worker 0
    exchanges and weighs 0 there (it brings no steps); at each later sync it weighs its steps
    since its join, every fragment counting from there. The two take the same syncs to the end,
    use the budget (30 iterations) exactly and end bit-identical."""
    ctl = str(tmp_path)
    with ft_jobs.jobs_and_lighthouse(min_replicas=2, heartbeat_timeout_ms=3000, join_timeout_ms=60000) as (
            server, start):
        addr = server.address()
        first = [start(_relaunch_job, 1, w, addr, ctl, False, FRAGMENTS, 30, timeout=2 * TIMEOUT - 60) for w in range(2)]
        while first[1].procs[0].exitcode is None:  # its crash after step 5
            time.sleep(0.1)
        joiner = start(_relaunch_job, 1, 1, addr, ctl, True, FRAGMENTS, 30, timeout=2 * TIMEOUT - 60)
        survivor, rejoined = ft_jobs.all_results([first[0], joiner])
        survivor, rejoined = survivor[0], rejoined[0]
    assert first[1].procs[0].exitcode == -9
    assert rejoined["joined"]["healed"] and rejoined["joined"]["step"] == 6
    # (step, fragment, step weights): worker 0's first syncs, the join's at its step 6
    assert survivor["fragment_syncs"][:3] == [(2, 1, [2.0, 2.0]), (6, 0, [6.0, 0.0]), (8, 1, [6.0, 4.0])]
    after = [s[1:] for s in survivor["fragment_syncs"][2:]]
    # Worker 1's (its own steps, 4 in its first interval after the join): fragment 1 at its step
    # 10 weighs worker 0's 6 steps since 2 and its 4 since the join, fragment 0 at its 13 its 7
    # steps since the join's 6 (and worker 0's 4 since its 6)
    assert rejoined["fragment_syncs"][:2] == [(10, 1, [6.0, 4.0]), (13, 0, [4.0, 7.0])]
    assert after == [s[1:] for s in rejoined["fragment_syncs"]]  # the same syncs, fragments and weights
    assert after[-1][0] is None  # the final sync: every fragment
    for run in (survivor, rejoined):
        assert run["last_sync"].final and run["last_sync"].global_progress == 30  # the budget (60 worker-steps), exactly
    assert all(torch.equal(x, y) for x, y in zip(survivor["anchors"], rejoined["anchors"]))
    assert all(torch.equal(survivor["params"][k], rejoined["params"][k]) for k in survivor["params"])


SPEEDS = {0: 1.0, 1: 2.0, 2: 1.0}
"""Fake seconds a step of each worker takes in the 3 x 2 run (worker 1 half as fast)."""


def _three_by_two_job(rank, world_size, worker, lighthouse, ctl, joiner):
    """Worker ``worker``'s job (2 ranks): A-EDiT over torchft, step-end sync, a budget of 20
    iterations, a fake clock of :data:`SPEEDS`. The first job of worker 2 writes a file after its
    step 5 and stops (the test SIGKILLs it); once it has, the others wait before each step until
    the relaunched job (``joiner``) asks for its join round's quorum. Returns this rank's
    counters where it joined and at the end, its reports and its parameters."""
    import megatron_edit as me

    import checkpoint_runs as cr
    from edit_runs import MICRO_BATCH
    from gpt_utils import make_batches, rank_micro_batches, train_step

    _worker_world()
    if joiner:
        ft_jobs.announce_quorum_requests(os.path.join(ctl, f"joiner-in-quorum-{rank}"), lighthouse)
    else:  # all three workers in the first quorum (a late worker 2 would heal past its step 5)
        ft_jobs.first_round_together(os.path.join(ctl, "start"), f"w{worker}-r{rank}", 6)
    local = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, min_total_global_steps=1,
                 sync_mode="step_end", sync_backend="torchft", replica_id=worker, lighthouse=lighthouse,
                 sync_timeout=120.0)
    ddp, opt, c = cr._setup(local, instances=1)
    joined = dict(steps_done=c.steps_done, last_sync_step=c._last_sync_step, progress=c.global_progress,
                  healed=c.sync_group.healed)
    me.set_train_iters(opt, 20)
    now = [0.0]
    c.clock = lambda: now[0]
    batches = make_batches(128, 6 * MICRO_BATCH, seed=0)
    dead = os.path.join(ctl, "victim-dead")
    reports = []
    while not c.finished:
        step = c.steps_done + 1
        if worker != 2 and os.path.exists(dead):
            ft_jobs.wait_file(os.path.join(ctl, "joiner-in-quorum-0"), timeout=240.0)
        now[0] += SPEEDS[worker]
        train_step(ddp, opt, rank_micro_batches(batches[step - 1], worker * world_size + rank, 6))
        if step == 5 and worker == 2 and not joiner:
            open(os.path.join(ctl, f"victim-at-5-{rank}"), "w").close()
            time.sleep(600)
        reports += [(r.step, r.workers, r.committed, r.final) for r in c.drain_reports()]
    out = cr._state(ddp, opt, c)
    out.update(reports=reports, joined=joined)
    c.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return out


@pytest.mark.timeout(3 * TIMEOUT)
def test_a_relaunched_a_edit_worker_of_two_ranks_takes_its_counters_from_one_peer(tmp_path):
    """A-EDiT, 3 workers x 2 ranks, worker 1 half as fast as the others (so the workers' step
    counts differ). Worker 2's job is SIGKILLed after its step 5 and a fresh one joins the others'
    next sync, healing there: torchft serves its rank r from up-to-date worker (2 + r) mod 2, one
    rank from worker 0 and the other from worker 1, whose steps, last sync and progress differ.
    Both ranks take the counters of one peer: the same steps done, last-sync step and global
    progress where they joined, the same reports after, and the three workers end bit-identical
    at the final sync."""
    ctl = str(tmp_path)
    with ft_jobs.jobs_and_lighthouse(min_replicas=2, heartbeat_timeout_ms=3000, join_timeout_ms=60000) as (
            server, start):
        addr = server.address()
        first = [start(_three_by_two_job, 2, w, addr, ctl, False, timeout=3 * TIMEOUT - 60) for w in range(3)]
        for r in range(2):
            ft_jobs.wait_file(os.path.join(ctl, f"victim-at-5-{r}"), timeout=3 * TIMEOUT - 60, jobs=first)
        first[2].kill()
        open(os.path.join(ctl, "victim-dead"), "w").close()
        joiner = start(_three_by_two_job, 2, 2, addr, ctl, True, timeout=3 * TIMEOUT - 60)
        runs = ft_jobs.all_results([first[0], first[1], joiner])
    new = runs[2]
    assert new[0]["joined"]["healed"] and new[1]["joined"]["healed"]
    assert new[0]["joined"] == new[1]["joined"]
    assert new[0]["reports"] == new[1]["reports"] and new[0]["reports"][-1][3]  # its final sync
    for key in ("steps_done", "last_sync_step", "global_progress"):
        assert new[0][key] == new[1][key]
    assert runs[0][0]["steps_done"] != runs[1][0]["steps_done"]  # the peers' own counts differ
    for r in range(2):  # one model: each rank's parameters and anchors on every worker
        for w in (1, 2):
            assert all(torch.equal(runs[0][r]["params"][k], runs[w][r]["params"][k]) for k in runs[0][r]["params"])
            assert all(torch.equal(x, y) for x, y in zip(runs[0][r]["anchors"], runs[w][r]["anchors"]))


def _final_victim_job(rank, world_size, worker, lighthouse, ctl, delay=0):
    """Worker ``worker``'s job (1 rank): A-EDiT over torchft, step-end, fake clock (1 s a step for
    both), a budget of 10 iterations (20 worker-steps). Worker 1 stops inside its exchange of the
    final sync (the test SIGKILLs it there). ``delay``: A-EDiT's delayed outer step (tau)."""
    import megatron_edit as me
    from megatron_edit.exchange.fault_tolerant import FaultTolerantSyncGroup

    import checkpoint_runs as cr
    from edit_runs import MICRO_BATCH
    from gpt_utils import make_batches, rank_micro_batches, train_step

    _worker_world()
    ft_jobs.first_round_together(os.path.join(ctl, "join"), f"w{worker}", 2)  # both Managers up first
    local = dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2, min_total_global_steps=1,
                 sync_mode="step_end", sync_backend="torchft", replica_id=worker, lighthouse=lighthouse,
                 sync_timeout=120.0, outer_step_delay=delay)
    ddp, opt, c = cr._setup(local, instances=1)
    me.set_train_iters(opt, 10)
    if worker == 1:
        reduce = FaultTolerantSyncGroup.all_reduce_sum

        def stuck(self, tensor, async_op=True):
            if c.async_plan.finished:  # inside the final sync's exchange: the test kills the job here
                open(os.path.join(ctl, "victim-in-final"), "w").close()
                time.sleep(600)
            return reduce(self, tensor, async_op)

        FaultTolerantSyncGroup.all_reduce_sum = stuck
    now = [0.0]
    c.clock = lambda: now[0]
    batches = make_batches(64, 2 * MICRO_BATCH, seed=0)
    reports = []
    while not c.finished:
        step = c.steps_done + 1
        now[0] += 1.0
        train_step(ddp, opt, rank_micro_batches(batches[step - 1], worker, 2))
        reports += [(r.step, r.workers, r.committed, r.final) for r in c.drain_reports()]
    out = cr._state(ddp, opt, c)
    out.update(reports=reports, last_sync=c.last_sync,
               at_anchor=all(torch.equal(m, s.anchor) for m, s in zip(out["mains"], c.shards)))
    c.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return out


@pytest.mark.timeout(2 * TIMEOUT)
@pytest.mark.parametrize("delay", [0, 1], ids=["blocking", "delayed"])
def test_a_edits_final_sync_whose_peer_dies_inside_it_is_planned_again_and_the_budget_used(tmp_path, delay):
    """2 workers of one rank, 1 s a step each, a budget of 10 iterations (20 worker-steps): after
    the sync at step 2 they plan the final interval. Worker 1 is SIGKILLed inside that final sync's
    exchange: worker 0's final sync does not commit, and it tries it again at once, alone. Planned
    again, it is not the last: worker 1's steps since step 2 are lost, so the worker-steps in the
    anchor are short of the budget; worker 0 trains the rest alone and its final sync then applies
    exactly 20 worker-steps; it ends at its anchor. ``delayed``: with A-EDiT's delayed outer step
    (tau 1: the sync at step 2 applied after step 3), whose final sync is blocking and tried
    again the same way (issue 60)."""
    ctl = str(tmp_path)
    with ft_jobs.jobs_and_lighthouse(heartbeat_timeout_ms=3000, join_timeout_ms=60000) as (server, start):
        addr = server.address()
        survivor = start(_final_victim_job, 1, 0, addr, ctl, delay, timeout=2 * TIMEOUT - 60)
        victim = start(_final_victim_job, 1, 1, addr, ctl, delay, timeout=2 * TIMEOUT - 60)
        ft_jobs.wait_file(os.path.join(ctl, "victim-in-final"), timeout=2 * TIMEOUT - 60, jobs=[survivor, victim])
        victim.kill()
        (out,) = survivor.results()
    reports = out["reports"]
    assert len(reports) >= 3 and reports[0] == (2 + delay, 2, True, False), reports
    final_step = reports[1][0]
    assert reports[1] == (final_step, 2, False, True)  # the final sync, not committed
    assert reports[2] == (final_step, 1, True, False)  # planned again alone: not the last
    assert reports[-1][1:] == (1, True, True) and reports[-1][0] > final_step
    assert out["last_sync"].final and out["last_sync"].global_progress * 2 == pytest.approx(20.0)
    assert out["at_anchor"]
