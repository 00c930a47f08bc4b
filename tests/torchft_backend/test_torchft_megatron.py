"""The torchft sync backend on real megatron-core (CPU, gloo): each worker its own job (a 2-rank
world, ``num_distributed_optimizer_instances`` 1) and a torchft Lighthouse in the test process.
With no fault it computes what the torch backend (one 4-rank world of 2 workers) computes on the
same data and config, to 1e-6.

torchft is the optional ``ft`` extra: installed in CI's default lane, skipped where it is not."""

import contextlib
import json
import os
import shutil

import pytest
import torch

pytest.importorskip("torchft")

import ft_jobs  # noqa: E402
from compare import max_difference  # noqa: E402
from dist import run_ranks  # noqa: E402
from edit_runs import default_spec, megatron_runs  # noqa: E402

WORKERS, RANKS = 2, 2
TIMEOUT = 400


def _ft_worker(rank, world_size, worker, lighthouse, spec):
    """One worker's job: the spec's run with the torchft backend, on the micro-batches its ranks
    have in the one-world run."""
    return _ft_worker_n(rank, world_size, worker, lighthouse, spec, WORKERS)


def _both_backends(local_sgd, steps=8, **spec_kwargs):
    spec = default_spec(steps=steps, local_sgd=local_sgd, **spec_kwargs)
    reference = [r["runs"][0] for r in run_ranks(megatron_runs, WORKERS * RANKS, [spec], timeout=TIMEOUT)]
    # min_replicas: the Lighthouse's first quorum waits for both workers (a run that starts together)
    with ft_jobs.jobs_and_lighthouse(min_replicas=WORKERS) as (server, start):
        jobs = [start(_ft_worker, RANKS, w, server.address(), spec, timeout=TIMEOUT) for w in range(WORKERS)]
        ft = [out for outs in ft_jobs.all_results(jobs) for out in outs]  # worker-major: rank w * RANKS + r
    return reference, ft


def _check_equal(reference, ft, syncs):
    for g, (ref, run) in enumerate(zip(reference, ft)):
        assert run["worker"] == 0 and ref["worker"] == g // RANKS  # its own job / one world
        assert max_difference(ref["params"], run["params"]) <= 1e-6, f"rank {g}"
        assert max(abs(x - y) for x, y in zip(ref["losses"], run["losses"])) <= 1e-6, f"rank {g}"
        assert [r.step for r in run["reports"]] == [r.step for r in ref["reports"]] == syncs
        assert all(r.committed and r.workers == WORKERS for r in run["reports"])
    # after the last sync every rank holds the same model (the torch backend's too)
    for run in ft[1:]:
        assert max_difference(ft[0]["params"], run["params"]) == 0.0


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


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_torchft_equals_torch_backend_topk_int2_layerwise():
    """The sparse exchange (an all-gather of the workers' top-k payloads) over torchft."""
    reference, ft = _both_backends(dict(local_sgd_sync_interval=3, exchange_topk_density=0.05,
                                        exchange_topk_chunk=256, exchange_dtype="int2"), steps=6)
    _check_equal(reference, ft, [3, 6])
    assert all(r.quantization_error is not None for run in ft for r in run["reports"])


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_torchft_equals_torch_backend_with_the_penalty_step_end():
    """Norm-weighted averaging and anomaly exclusion over torchft: worker 1 goes wrong after
    step 5 and is excluded at the sync after step 6 (the statistics are warm after the syncs
    at 2 and 4; the join round, where nobody trained, does not count), as on the torch backend."""
    penalty = dict(local_sgd_sync_interval=2, pseudo_gradnorm_reduce=True, weight_softmax_temperature=0.02,
                   skip_anomaly=True, ewma_warmup_steps=1, ewma_threshold=0.5, ewma_alpha=0.5, sync_mode="step_end")
    reference, ft = _both_backends(penalty, steps=6, faults=[dict(workers=[1], steps=[5], kind="scale", factor=1.5)])
    _check_equal(reference, ft, [2, 4, 6])
    for ref, run in zip(reference, ft):
        for a, b in zip(ref["reports"], run["reports"]):
            assert torch.equal(a.excluded, b.excluded)
            assert torch.allclose(a.weights, b.weights, atol=1e-9, rtol=0)
    excluded = ft[0]["reports"][-1].excluded
    assert excluded[1].any() and not excluded[0].any(), excluded  # the test exercised the exclusion
    assert (ft[0]["reports"][0].weights - 0.5).abs().max() > 0.05  # and the weighting


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_torchft_equals_torch_backend_with_gta():
    """GTA (random sparsification seeded per worker, sign consensus by count, int8 masks) over
    torchft: the same model as the torch backend; the seed follows the worker's id."""
    gta = dict(reducer="gta", consensus_method="count", sparsification_method="rescaled_random", density=0.5,
               int8_mask=True)
    reference, ft = _both_backends(dict(local_sgd_sync_interval=2, sync_mode="step_end"), steps=4, gta=gta)
    _check_equal(reference, ft, [2, 4])


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_torchft_equals_torch_backend_with_streaming_fragments():
    """2 fragments, H = 4: a fragment's sync every 2 steps, each its own torchft round; the
    run's known last step (8) syncs every shard, so the workers end identical."""
    reference, ft = _both_backends(dict(local_sgd_sync_interval=4, fragments=2, sync_mode="layerwise"), steps=8,
                                   last_step=8)
    _check_equal(reference, ft, [2, 4, 6, 8])
    assert [r.fragment for r in ft[0]["reports"]] == [r.fragment for r in reference[0]["reports"]]


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_torchft_equals_torch_backend_with_a_delay_and_int8():
    """The delayed outer step over torchft: the sync after step 4 is one torchft round from its
    launch after step 2 (the quorum, the decisions, the int8 exchange's first phase; its second
    one step later, behind training) to its apply after step 4 (the commit, then the lerp merge
    with alpha 0.5); the last step's sync (8) is blocking."""
    reference, ft = _both_backends(dict(local_sgd_sync_interval=4, outer_step_delay=2, outer_merge_alpha=0.5,
                                        exchange_dtype="int8", exchange_error_feedback=True,
                                        sync_mode="layerwise"), steps=8, last_step=8)
    _check_equal(reference, ft, [4, 8])
    assert [r.delay for r in ft[0]["reports"]] == [2, 0]


# ---------------------------------------------------------------------- a worker dies and comes back
HEAL_TOTAL, HEAL_H = 12, 2


def _anchor_digest(controller) -> str:
    """Exact: the float64 sum of this rank's anchors, as a hex float."""
    return float(sum(s.anchor.double().sum() for s in controller.shards)).hex()


_wait_file = ft_jobs.wait_file


def _healing_worker(rank, world_size, worker, lighthouse, ctl, joiner, grow=False, failed_heal=False):
    """One worker's job: EDiT H=2 over torchft for HEAL_TOTAL steps, every sync logged (one JSON
    line per sync in ``ctl``). The first jobs stop before step 5 until the test has killed worker
    1 (it is killed there, between its syncs 4 and 6); worker 0 then stops before step 7 until the
    relaunched worker 1 (``joiner``) waits in its join round's quorum. ``failed_heal``: the
    joiner's rank 1's first heal transfer raises (its rank 0's succeeds). ``grow``: nobody is killed;
    the first jobs (workers 0 and 1) stop before step 5 until a new worker 2 (``joiner``) waits in
    its join round's quorum, so that it joins them at their sync 6; with the penalty on
    (norm-weighted averaging and anomaly exclusion), whose statistics a joiner heals with, and
    the delayed outer step (tau 1: each sync's round from its launch one step early to its
    apply)."""
    import json

    import megatron_edit as me
    from megatron.core import parallel_state as ps

    from edit_runs import MICRO_BATCH, _build
    from gpt_utils import make_batches, named_params, rank_micro_batches, train_step

    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    os.environ["MEGATRON_EDIT_RUN_ID"] = "heal"  # (what the supervisor sets: one run id for every job)
    ps.initialize_model_parallel(num_distributed_optimizer_instances=1)
    # The death and heal with streaming fragments (2 of them, H = 4: a fragment's sync every 2
    # steps, the same steps as H = 2 without), the join with the penalty.
    fragments = 1 if grow else 2
    me.patch_megatron_for_local_sgd(
        me.LocalSGDConfig(local_sgd_sync_interval=HEAL_H * fragments, fragments=fragments, sync_mode="step_end",
                          sync_backend="torchft", replica_id=worker, lighthouse=lighthouse,
                          sync_timeout=120.0 if grow else 30.0,  # the failed heal's round: worker 0 waits it out
                          skip_anomaly=grow, pseudo_gradnorm_reduce=grow, outer_step_delay=int(grow),
                          sync_record=os.path.join(ctl, "record-{worker}.jsonl")),  # (checked by _records)
        me.OuterOptimizerConfig())
    if joiner:  # tell the test when this job's join round's quorum request has arrived
        ft_jobs.announce_quorum_requests(os.path.join(ctl, f"joiner-in-quorum-{rank}"), lighthouse)
    else:  # the first jobs ask for their join round's quorum together, every Manager already
        # heartbeating: one quorum of both workers. (A worker that asked alone, before the
        # other's Manager was up, got a quorum of one and then waited at the start gate, while
        # the other's quorum could not form: torchft needs more than half of the heartbeating
        # workers in it.)
        ft_jobs.first_round_together(os.path.join(ctl, "join"), f"w{worker}-r{rank}", WORKERS * world_size)
    if failed_heal and rank == 1:
        ft_jobs.fail_first_heal_transfer()
    ddp, optimizer = _build(default_spec(instances=1), 1, 1)  # the join round runs in here
    (c,) = me.get_local_sgd(optimizer)
    me.set_train_iters(optimizer, HEAL_TOTAL)  # the last step syncs every shard: identical workers at the end
    log = open(os.path.join(ctl, f"w{worker}-r{rank}-{os.getpid()}.jsonl"), "a", buffering=1)
    log.write(json.dumps(dict(ev="joined", step=c.steps_done, healed=c.sync_group.healed,
                              anchor=_anchor_digest(c), manager_step=c.sync_group.step)) + "\n")
    if not joiner:  # the first jobs start training together: a job slower to start (imports under
        # load) would otherwise find the other's first syncs done alone
        ft_jobs.gate(os.path.join(ctl, "start"), f"w{worker}-r{rank}", WORKERS * world_size, timeout=300.0)
    shares = (WORKERS + grow) * world_size  # every worker's ranks, the one that joins included
    batches = make_batches(HEAL_TOTAL, shares * MICRO_BATCH, seed=0)
    while c.steps_done < HEAL_TOTAL:
        step = c.steps_done + 1
        if step == 5 and not joiner:
            _wait_file(os.path.join(ctl, f"joiner-in-quorum-{rank}" if grow else "killed"))
        if step == 7 and worker == 0 and not grow:
            _wait_file(os.path.join(ctl, f"joiner-in-quorum-{rank}"))
        train_step(ddp, optimizer, rank_micro_batches(batches[step - 1], worker * world_size + rank, shares))
        for r in c.drain_reports():
            log.write(json.dumps(dict(ev="sync", step=r.step, workers=r.workers, committed=r.committed,
                                      fragment=r.fragment, delay=r.delay, anchor=_anchor_digest(c))) + "\n")
    ddp.start_param_sync(force_sync=True)
    momentum = [c.outer_optimizer.state[a]["momentum_buffer"].clone() for a in c.outer_optimizer.param_groups[0]["params"]]
    out = dict(params=named_params(ddp), anchors=[s.anchor.clone() for s in c.shards], momentum=momentum,
               steps=c.steps_done, manager_step=c.sync_group.step, pid=os.getpid(),
               counters=(c.steps_done, c._last_sync_step, c.last_step, c.global_progress),
               partial_heals=c.backend.group.partial_heals,
               ewma={w: stats.state_dict() for w, stats in c.sync.decisions.ewma_by_worker.items()})
    c.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return out


_events, _until = ft_jobs.events, ft_jobs.until


def _records(ctl, worker):
    """Worker ``worker``'s sync records (--local-sgd-sync-record; every job of it appends)."""
    import json

    with open(os.path.join(ctl, f"record-{worker}.jsonl")) as f:
        records = [json.loads(line) for line in f]
    assert {r["run_id"] for r in records} == {"heal"} and all(r["missing_ranks"] == [] for r in records)
    return records


def _event(record, kind):
    return [e for e in record["events"] if e["event"] == kind]


def _kill_and_heal(ctl):
    """The run of :func:`test_a_killed_worker_is_relaunched_and_heals_as_one_while_the_other_goes_on`
    (see it), its jobs logging in ``ctl``: each worker's last jobs' results."""
    synced = lambda w, step, **kw: all(  # noqa: E731
        any(e["ev"] == "sync" and e["step"] == step and all(e[k] == v for k, v in kw.items())
            for e in _events(ctl, w, r)) for r in range(RANKS))
    # heartbeat 3 s: a dead worker leaves the quorum 3 s after its death (a live one is not taken
    # for dead under load); join timeout 60 s: a quorum waits for a worker whose Manager is up.
    with ft_jobs.jobs_and_lighthouse(heartbeat_timeout_ms=3000, join_timeout_ms=60000) as (server, start):
        addr = server.address()
        survivor = start(_healing_worker, RANKS, 0, addr, ctl, False, timeout=3 * TIMEOUT - 60)
        victim = start(_healing_worker, RANKS, 1, addr, ctl, False, timeout=3 * TIMEOUT - 60)
        _until(lambda: synced(0, 4, workers=2) and synced(1, 4, workers=2), "the joint sync 4")
        victim.kill()  # every rank of the job: what torchrun's agent does when one dies
        open(os.path.join(ctl, "killed"), "w").close()
        _until(lambda: synced(0, 6, workers=1, committed=True), "worker 0's sync 6 alone")
        joiner = start(_healing_worker, RANKS, 1, addr, ctl, True, False, True, timeout=2 * TIMEOUT)
        return ft_jobs.all_results([survivor, joiner])


STATUS_PAGE_TEST = "test_the_status_page_shows_the_kill_and_the_heal_live_in_a_browser"
UPDATE_DOCS_IMAGE = "MEGATRON_EDIT_UPDATE_DOCS_IMAGE"
"""Set to 1: the status page test's screenshot replaces docs/img/status_page.png."""


@pytest.fixture(scope="module")
def killed_and_healed(request, tmp_path_factory):
    """The kill-and-heal run, once for the tests of it: (its folder, each worker's last job's
    results, what its status page showed). Where :data:`STATUS_PAGE_TEST` is selected and
    Chromium installed, the page of its records (``python -m megatron_edit.status``) is loaded
    once, before the jobs start, and watched in the browser until both workers have finished
    (:class:`page_watch.PageWatch`; its screenshot at the end); else nothing watches (None)."""
    from cdp import chromium_path
    from page_watch import ROOT, PageWatch

    ctl = str(tmp_path_factory.mktemp("kill_and_heal"))
    watched = chromium_path() is not None and any(item.name == STATUS_PAGE_TEST for item in request.session.items)
    if not watched:
        return ctl, _kill_and_heal(ctl), None
    with PageWatch(os.path.join(ctl, "record-*.jsonl")) as watch:
        finals = _kill_and_heal(ctl)
        watch.until(lambda seen: [w["state"] for w in seen[-1]["workers"]] == ["finished"] * 2,
                    "both workers finished", timeout=120)
        watch.screenshot(os.path.join(ctl, "status_page.png"))
    with open(os.path.join(ctl, "status_page_seen.json"), "w") as f:  # (what it showed: for a failure's reader)
        json.dump(watch.seen, f)
    if os.environ.get(UPDATE_DOCS_IMAGE) == "1":
        shutil.copyfile(os.path.join(ctl, "status_page.png"), ROOT / "docs" / "img" / "status_page.png")
    return ctl, finals, watch.seen


@pytest.mark.timeout(3 * TIMEOUT)
def test_a_killed_worker_is_relaunched_and_heals_as_one_while_the_other_goes_on(killed_and_healed):
    """2 workers x 2 ranks, 2 streaming fragments. Worker 1's job is SIGKILLed between its
    syncs 4 and 6; worker 0 commits sync 6 alone (nothing restarts). A fresh job for worker 1
    joins at sync 8, where its rank 1's heal transfer fails and its rank 0's succeeds: neither
    loads its heal, the round fails on both (worker 0's sync 8 is not committed once its
    collectives time out; worker 0 never crashes), and both ranks stay behind. At the joiner's
    next sync (after its own step 2) both heal into worker 0's sync 10 together, and from then on
    the joiner is bit-identical to worker 0 (anchors, outer momentum, torchft steps, step counters,
    parameters after the last step's sync of every shard)."""
    ctl, (final0, final1), _ = killed_and_healed
    for r in range(RANKS):
        ev0 = [e for e in _events(ctl, 0, r) if e["ev"] == "sync"]
        assert [(e["step"], e["committed"], e["fragment"]) for e in ev0] == [
            (2, True, 1), (4, True, 0), (6, True, 1), (8, False, 0), (10, True, 1),
            (12, True, None)]  # the last step: every shard
        assert [e["workers"] for e in ev0 if e["step"] != 8] == [2, 2, 1, 2, 2]
        assert ev0[3]["anchor"] == ev0[2]["anchor"]  # sync 8: nothing applied
        assert len({e["pid"] for e in _events(ctl, 0, r)}) == 1  # the survivor never restarted
        new = [e for e in _events(ctl, 1, r) if e["pid"] == final1[r]["pid"]]
        joined, *syncs = new
        # the join round was worker 0's sync 8: a partial heal, loaded by neither rank
        assert joined["ev"] == "joined" and not joined["healed"] and joined["step"] == 0
        assert [(e["step"], e["workers"]) for e in syncs] == [(10, 2), (12, 2)]
        assert [e["anchor"] for e in syncs] == [e["anchor"] for e in ev0[-2:]]
        a, b = final0[r], final1[r]
        assert (a["partial_heals"], b["partial_heals"]) == (0, 1)
        assert (a["steps"], b["steps"]) == (HEAL_TOTAL, HEAL_TOTAL) and a["manager_step"] == b["manager_step"]
        assert a["counters"] == b["counters"] == final1[0]["counters"]
        assert all(torch.equal(x, y) for x, y in zip(a["anchors"], b["anchors"]))
        assert all(torch.equal(x, y) for x, y in zip(a["momentum"], b["momentum"]))
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    # The sync record: one line per sync of each worker (2 ranks each), the kill and the heal as events.
    survivor = _records(ctl, 0)
    assert [(r["kind"], r["step"]) for r in survivor] == [("join", 0)] + [("sync", s) for s in range(2, 13, 2)]
    syncs = {r["step"]: r for r in survivor}
    assert _event(syncs[6], "left") == [dict(event="left", workers=[1])] and syncs[6]["participants"] == [0]
    assert [s for s in (8, 10) if _event(syncs[s], "joined") == [dict(event="joined", workers=[1])]], survivor
    assert not syncs[8]["committed"] and all(syncs[s]["committed"] for s in (2, 4, 6, 10, 12))
    assert [r["last_sync"] for r in survivor] == [False] * 6 + [True]  # (set_train_iters: the run's last step)
    assert all(r["arrival_wait_seconds"] >= 0 for r in survivor)  # (its rounds' quorums)
    victim = _records(ctl, 1)
    relaunched = len(victim) - 1 - [r["kind"] for r in victim][::-1].index("join")
    # (its sync 4 is written only if its rank 1's part was in when rank 0 ended that sync: the kill
    # takes what a worker had not written yet)
    assert [(r["kind"], r["step"]) for r in victim[:relaunched]] in (
        [("join", 0), ("sync", 2)], [("join", 0), ("sync", 2), ("sync", 4)])
    joined, *after = victim[relaunched:]
    assert joined["step"] == 0 and not joined["committed"] and joined["events"] == []  # the partial heal: none
    assert [(r["step"], r["sync"]) for r in after] == [(10, 1), (12, 2)]
    (heal,) = _event(after[0], "heal")
    assert heal["from_workers"] == [0] and heal["ranks"] == RANKS and heal["bytes"] > 0 and heal["seconds"] > 0
    assert after[0]["trained"] == [0] and after[0]["participants"] == [0, 1]  # (it healed: it brought nothing)


@pytest.fixture(scope="module")
def chromium_installed():
    """Skips where Chromium is not installed, before the run starts (listed first)."""
    from cdp import INSTALL, chromium_path

    if chromium_path() is None:
        pytest.skip(f"needs Chromium for the status page in a browser: {INSTALL}")


@pytest.mark.one_lane  # (the page, not megatron-core; and the default lane installs Chromium)
@pytest.mark.timeout(3 * TIMEOUT)
def test_the_status_page_shows_the_kill_and_the_heal_live_in_a_browser(chromium_installed, killed_and_healed):
    """The status page (python -m megatron_edit.status on the run's record files) in headless
    Chromium, loaded once before the kill-and-heal run starts: without a reload it shows both
    workers and a count of syncs that grows, then worker 1 dead (its state, or its history when
    the record that says it came with the relaunch's), then healed (a heal, training again), and
    at the end both finished. Its screenshot is the docs' (docs/img/status_page.png, with
    MEGATRON_EDIT_UPDATE_DOCS_IMAGE=1)."""
    ctl, _, seen = killed_and_healed
    assert {shown["load"] for shown in seen} == {seen[0]["load"]} and seen[-1]["updates"] > seen[0]["updates"]
    assert seen[0]["syncs"] == 0 and [shown["error"] for shown in seen] == [None] * len(seen)  # (loaded first)
    counts = sorted({shown["syncs"] for shown in seen})
    assert len(counts) >= 3 and counts[-1] == len(_records(ctl, 0)) + len(_records(ctl, 1)) - 3  # (3 join rounds)
    both = next(i for i, shown in enumerate(seen) if [w["worker"] for w in shown["workers"]] == [0, 1])
    worker1 = [(i, next(w for w in shown["workers"] if w["worker"] == 1)) for i, shown in enumerate(seen)
               if i >= both]
    dead = next(i for i, w in worker1 if w["state"] == "dead" or "dead" in w["history"])
    healed = next(i for i, w in worker1 if i >= dead and w["heals"] == 1 and w["state"] in ("training", "finished"))
    history = dict(worker1)[healed]["history"]
    assert history[:history.index("dead") + 1] == ["training", "dead"] and "training" in history[history.index("dead"):]
    assert [(w["worker"], w["state"], w["heals"]) for w in seen[-1]["workers"]] == [(0, "finished", 0),
                                                                                   (1, "finished", 1)]
    assert os.path.getsize(os.path.join(ctl, "status_page.png")) > 10_000


@pytest.mark.timeout(2 * TIMEOUT)
def test_a_new_worker_joins_a_running_job(tmp_path):
    """2 -> 3 workers (one rank each), the penalty and a delay of 1 on: a job for a new worker 2
    starts while workers 0 and 1 train; it joins the round of their sync 6 (launched after their
    step 5; healing from them: it trained nothing yet, so it is excluded from that sync and has
    no statistics yet). From then on all three hold the same anchors after every sync (their
    parameters differ between syncs by the lerp merge's local part, as any workers' do with a
    delay) and the same statistics of every worker (each under its id); the last step's blocking
    sync leaves them bit-identical."""
    ctl = str(tmp_path)
    with ft_jobs.jobs_and_lighthouse(heartbeat_timeout_ms=3000, join_timeout_ms=60000) as (server, start):
        addr = server.address()
        first = [start(_healing_worker, 1, w, addr, ctl, False, True, timeout=2 * TIMEOUT - 60) for w in range(2)]
        _until(lambda: all(any(e["ev"] == "sync" and e["step"] == 4 for e in _events(ctl, w, 0)) for w in range(2)),
               "the first workers' sync 4")  # they wait before step 5 for the new one's join round
        new = start(_healing_worker, 1, 2, addr, ctl, True, True, timeout=2 * TIMEOUT - 60)
        finals = [out[0] for out in ft_jobs.all_results([*first, new])]
    logs = [[e for e in _events(ctl, w, 0)] for w in range(3)]
    for w in (0, 1):  # the first workers: never restarted; their sync 6 held the new one
        assert len({e["pid"] for e in logs[w]}) == 1
        assert [(e["step"], e["workers"], e["committed"]) for e in logs[w] if e["ev"] == "sync"] == [
            (2, 2, True), (4, 2, True), (6, 3, True), (8, 3, True), (10, 3, True), (12, 3, True)]
        assert [e["delay"] for e in logs[w] if e["ev"] == "sync"] == [1, 1, 1, 1, 1, 0]  # the last: blocking
    joined, *syncs = logs[2]
    assert joined["ev"] == "joined" and joined["healed"] and joined["step"] == 6
    assert joined["anchor"] == next(e["anchor"] for e in logs[0] if e["ev"] == "sync" and e["step"] == 6)
    assert [(e["step"], e["workers"]) for e in syncs] == [(8, 3), (10, 3), (12, 3)]
    assert [e["anchor"] for e in syncs] == [e["anchor"] for e in logs[0] if e["ev"] == "sync"][-3:]
    for other in finals[1:]:
        assert all(torch.equal(x, y) for x, y in zip(finals[0]["anchors"], other["anchors"]))
        assert all(torch.equal(finals[0]["params"][k], other["params"][k]) for k in finals[0]["params"])
    # The sync record: the new worker's join healed from a live one, the others saw it join and
    # excluded it from the sync where it brought nothing (the penalty's weights).
    (join, *new_syncs) = _records(ctl, 2)
    assert join["kind"] == "join" and join["step"] == 6
    (heal,) = _event(join, "heal")
    assert heal["from_workers"] and set(heal["from_workers"]) <= {0, 1} and heal["bytes"] > 0
    assert [r["step"] for r in new_syncs] == [8, 10, 12]
    for w in (0, 1):
        at6 = next(r for r in _records(ctl, w) if r["step"] == 6)
        assert _event(at6, "joined") == [dict(event="joined", workers=[2])] and at6["trained"] == [0, 1]
        assert [(e["worker"], e["not_trained"]) for e in at6["excluded"]] == [(2, at6["layer_norms"]["layers"])]
    ewma = finals[0]["ewma"]
    assert sorted(ewma) == [0, 1, 2]
    assert [int(ewma[w]["count"].min()) for w in range(3)] == [6, 6, 3]  # syncs 2-12; 8-12 for worker 2
    for other in finals[1:]:
        assert sorted(other["ewma"]) == [0, 1, 2]
        assert all(torch.equal(ewma[w][k], other["ewma"][w][k]) for w in ewma for k in ewma[w])


@pytest.mark.timeout(2 * TIMEOUT + 120)
def test_three_one_rank_workers_equal_the_torch_backend():
    """3 workers (one rank each): the sum over a quorum of 3, in the workers' order."""
    spec = default_spec(steps=4, local_sgd=dict(local_sgd_sync_interval=2), instances=3)
    reference = [r["runs"][0] for r in run_ranks(megatron_runs, 3, [spec], timeout=TIMEOUT)]
    with ft_jobs.jobs_and_lighthouse(min_replicas=3) as (server, start):
        jobs = [start(_ft_worker_n, 1, w, server.address(), spec, 3, timeout=TIMEOUT) for w in range(3)]
        ft = [out[0] for out in ft_jobs.all_results(jobs)]
    for g, (ref, run) in enumerate(zip(reference, ft)):
        assert max_difference(ref["params"], run["params"]) <= 1e-6, f"worker {g}"
        assert max(abs(x - y) for x, y in zip(ref["losses"], run["losses"])) <= 1e-6
        assert [(r.step, r.workers, r.committed) for r in run["reports"]] == [(2, 3, True), (4, 3, True)]
    assert all(max_difference(ft[0]["params"], run["params"]) == 0.0 for run in ft[1:])


def _ft_worker_n(rank, world_size, worker, lighthouse, spec, workers):
    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    local = dict(dict(sync_timeout=120.0), **spec["local_sgd"], sync_backend="torchft", replica_id=worker,
                 lighthouse=lighthouse)
    # A fault of worker w of the one-world run is worker 0's of its own job.
    faults = [dict(f, workers=[0] if worker in f["workers"] else []) for f in spec.get("faults", ())]
    spec = dict(spec, instances=1, data_dp=workers * world_size, data_rank_offset=worker * world_size,
                local_sgd=local, faults=faults)
    return megatron_runs(rank, world_size, [spec])["runs"][0]


def _torchft_in_one_world(rank, world_size):
    spec = default_spec(steps=1, instances=2, local_sgd=dict(
        sync_backend="torchft", replica_id=0, lighthouse="http://127.0.0.1:1"))  # never contacted
    try:
        megatron_runs(rank, world_size, [spec])
    except RuntimeError as error:
        return str(error)
    return None


@pytest.mark.timeout(TIMEOUT)
def test_torchft_with_two_workers_in_one_world_is_refused():
    messages = run_ranks(_torchft_in_one_world, 2, timeout=TIMEOUT - 30)
    for message in messages:
        assert message is not None and "\n" not in message
        assert "num_distributed_optimizer_instances 1 (got 2)" in message and "own job" in message


def _refusals_before_connecting(rank, world_size):
    """What the supervisor's worker count refuses, before any Manager starts (the Lighthouse's
    address is never contacted)."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps
    from megatron_edit.exchange.run_gate import START_GATE_ENV, start_gate_value

    messages = []
    for workers, extra in ((2, dict(min_replicas=3)),
                           (29, dict(exchange_topk_density=0.02, exchange_dtype="int2"))):
        os.environ[START_GATE_ENV] = start_gate_value("127.0.0.1", 1, workers, 10.0)
        spec = default_spec(steps=1, instances=1, local_sgd=dict(
            sync_backend="torchft", replica_id=0, lighthouse="http://127.0.0.1:1", **extra))
        try:
            megatron_runs(rank, world_size, [spec])
            messages.append(None)
        except (RuntimeError, me.ConfigError) as error:
            messages.append(str(error))
        finally:
            me.unpatch_megatron_for_local_sgd()
            ps.destroy_model_parallel()
    return messages


@pytest.mark.timeout(TIMEOUT)
def test_settings_the_supervisors_workers_cannot_run_are_refused_before_connecting():
    """--local-sgd-min-replicas above the supervisor's --workers (no sync could commit), and a
    top-k exchange at a worker count where dense int4 sends fewer bytes: one line each."""
    ((min_replicas, topk),) = run_ranks(_refusals_before_connecting, 1, timeout=TIMEOUT - 30)
    assert min_replicas is not None and "\n" not in min_replicas
    assert "--local-sgd-min-replicas 3 is more than the supervisor's 2 workers" in min_replicas
    assert topk is not None and "\n" not in topk and "from 29 workers" in topk, topk


# ---------------------------------------------------------------------- checkpoints
RESUME_STEPS, RESUME_AT = 8, 4


PLAIN = dict(local_sgd_sync_interval=2, sync_mode="step_end")  # EDiT H=2 without the penalty


def _ft_checkpoint_job(rank, world_size, worker, lighthouse, folder, load_at=None, delay=0, save_at=RESUME_AT,
                       torch_checkpoint=None):
    """Worker ``worker``'s job (1 rank): EDiT H=2 over torchft on its slice of the data for
    RESUME_STEPS steps, saving its own checkpoint after step ``save_at`` (Megatron's
    dist_checkpointing, as Megatron-LM's --save), or resuming from it (``load_at``); ``delay``:
    the delayed outer step's tau. ``torch_checkpoint``: resume from the checkpoint
    ``folder/<torch_checkpoint><load_at>`` of :func:`_one_world_job` instead (EDiT without the
    penalty)."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    import checkpoint_runs as cr
    from edit_runs import MICRO_BATCH
    from gpt_utils import make_batches, rank_micro_batches, train_step

    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    ps.initialize_model_parallel(num_distributed_optimizer_instances=1)
    penalty = {} if torch_checkpoint else dict(skip_anomaly=True, pseudo_gradnorm_reduce=True)
    local = dict(PLAIN, sync_backend="torchft", replica_id=worker, lighthouse=lighthouse, sync_timeout=120.0,
                 outer_step_delay=delay, **penalty)
    ddp, opt, ctl = cr._setup(local, instances=1)
    path = os.path.join(folder, f"{torch_checkpoint}{load_at}" if torch_checkpoint else f"worker{worker}")
    first = 1
    loaded = None
    if load_at is not None:
        cr._load(ddp, opt, path)
        first = load_at + 1
        loaded = cr._state(ddp, opt, ctl, gather=False)
        loaded["manager"] = ctl.backend.group.manager.state_dict()
    shares = WORKERS * world_size
    batches = make_batches(RESUME_STEPS, shares * MICRO_BATCH, seed=0)
    for step in range(first, RESUME_STEPS + 1):
        train_step(ddp, opt, rank_micro_batches(batches[step - 1], worker * world_size + rank, shares))
        if step == save_at and load_at is None:
            cr._save(ddp, opt, path)
    out = cr._state(ddp, opt, ctl)
    out.update(manager=ctl.backend.group.manager.state_dict(), loaded=loaded,
               reports=[(r.step, r.workers, r.committed) for r in ctl.drain_reports()],
               ewma={w: st.state_dict() for w, st in ctl.sync.decisions.ewma_by_worker.items()})
    ctl.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return out


def _ft_checkpoint_runs(folder, load_at=None, **kwargs):
    with ft_jobs.jobs_and_lighthouse(min_replicas=WORKERS) as (server, start):
        jobs = [start(_ft_checkpoint_job, 1, w, server.address(), folder, load_at, timeout=TIMEOUT, **kwargs)
                for w in range(WORKERS)]
        return [out[0] for out in ft_jobs.all_results(jobs)]


@pytest.mark.timeout(2 * TIMEOUT + 120)
@pytest.mark.parametrize("delay", [0, 1], ids=["blocking", "delay-in-flight"])
def test_each_worker_resumes_from_its_own_checkpoint_exactly(tmp_path, delay):
    """Each worker saves its own checkpoint after step 4 (Megatron's dist_checkpointing); fresh jobs
    resuming from them end bit-identical to the run that went on (parameters, Adam, anchors,
    outer momentum, counters, the torchft Manager's committed syncs, every worker's penalty
    statistics); the torch backend resumes from worker 0's checkpoint (1 worker -> 2) with its
    anchor, outer momentum and counters. ``delay`` 1: the checkpoint after step 3, with the sync
    of step 4 in flight (launched after step 3): its exchange is finished and committed at the
    save, and the resumed jobs apply it after their step 4 without a round of their own."""
    save_at = RESUME_AT - delay
    straight = _ft_checkpoint_runs(str(tmp_path), delay=delay, save_at=save_at)
    resumed = _ft_checkpoint_runs(str(tmp_path), load_at=save_at, delay=delay, save_at=save_at)
    for a, b in zip(straight, resumed):
        assert [r[0] for r in a["reports"]] == [2, 4, 6, 8]
        assert [r[0] for r in b["reports"]] == ([4, 6, 8] if delay else [6, 8])
        assert a["manager"] == b["manager"] and a["manager"]["step"] == 5  # the join round and 4 syncs
        assert (a["steps_done"], a["last_sync_step"]) == (b["steps_done"], b["last_sync_step"]) == (8, 8)
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        assert all(torch.equal(x, y) for x, y in zip(a["anchors"], b["anchors"]))
        assert all(torch.equal(x[k], y[k]) for x, y in zip(a["outer"], b["outer"]) for k in x)
        assert all(torch.equal(x[k], y[k]) for x, y in zip(a["adam"], b["adam"]) for k in x if torch.is_tensor(x[k]))
        assert sorted(a["ewma"]) == sorted(b["ewma"]) == [0, 1]
        assert all(torch.equal(a["ewma"][w][k], b["ewma"][w][k]) for w in a["ewma"] for k in a["ewma"][w])
    if delay:
        return
    # The torch backend resumes from a torchft worker's checkpoint (its 1 worker -> 2, saved at a
    # sync): both workers from its anchor, outer momentum and counters; replicas after a sync.
    back = run_ranks(_one_world_job, WORKERS, str(tmp_path), "", load_at=save_at,
                     load_path=os.path.join(str(tmp_path), "worker0"), timeout=TIMEOUT)
    own = resumed[0]["loaded"]  # worker 0's job right after loading the same checkpoint
    for run in back:
        assert run["loaded"]["steps_done"] == own["steps_done"] == save_at
        assert all(torch.equal(run["loaded"]["params"][k], own["params"][k]) for k in own["params"])
        assert all(torch.equal(x, y) for x, y in zip(run["loaded"]["anchors"], own["anchors"]))
        assert all(torch.equal(x[k], y[k]) for x, y in zip(run["loaded"]["outer"], own["outer"]) for k in x)
    assert max_difference(back[0]["final"]["params"], back[1]["final"]["params"]) == 0.0


def _one_world_job(rank, world_size, folder, name, saves=(), load_at=None, last=RESUME_STEPS, edit=True,
                   load_path=None):
    """The run of :func:`_ft_checkpoint_job` (EDiT H=2 without the penalty) with the torch
    backend (``edit`` False: plain synchronous Megatron): ``world_size`` workers of 1 rank in one
    world, each on its slice of the data, to step ``last``, saving after the steps in ``saves``
    (``folder/<name><step>``), or resuming from ``folder/<name><load_at>`` (or ``load_path``);
    the state right after the load and at the end."""
    import megatron_edit as me
    from megatron.core import parallel_state as ps

    import checkpoint_runs as cr
    from edit_runs import MICRO_BATCH
    from gpt_utils import make_batches, rank_micro_batches, train_step

    ps.initialize_model_parallel(num_distributed_optimizer_instances=world_size)
    ddp, opt, ctl = cr._setup(dict(PLAIN) if edit else None, instances=world_size)
    first, loaded = 1, None
    if load_at is not None:
        cr._load(ddp, opt, load_path or os.path.join(folder, f"{name}{load_at}"))
        first, loaded = load_at + 1, cr._state(ddp, opt, ctl, gather=False)
    batches = make_batches(RESUME_STEPS, WORKERS * MICRO_BATCH, seed=0)
    for step in range(first, last + 1):
        train_step(ddp, opt, rank_micro_batches(batches[step - 1], rank, WORKERS))
        if step in saves:
            cr._save(ddp, opt, os.path.join(folder, f"{name}{step}"))
    out = dict(final=cr._state(ddp, opt, ctl), loaded=loaded)
    me.unpatch_megatron_for_local_sgd()
    return out


@pytest.mark.timeout(3 * TIMEOUT)
def test_torchft_workers_resume_from_a_torch_backend_checkpoint(tmp_path):
    """2 workers of the torch backend (one world) save after steps 3 and 4 (H=2: 4 is a sync); each
    torchft worker's job resumes from one of them as one worker.

    After step 4, where the workers are identical: each job takes the saved anchor, outer
    momentum and its own worker's Adam state (replica id mod the saved workers), its Manager
    counts one committed round (as after a fresh run's join: no worker heals), and the torchft
    run ends bit-for-bit where the torch run that went on ends (to 1e-6). After step 3 (mid-
    interval): each job computes the outer step over both saved workers' parameters alone, in
    saved-worker order: the two jobs load the same bytes, which are what the torch backend's own
    elastic resume (2 -> 1 worker) loads."""
    folder = str(tmp_path)
    straight = [r["final"] for r in run_ranks(_one_world_job, WORKERS, folder, "torch", (3, 4), timeout=TIMEOUT)]
    for load_at in (4, 3):
        resumed = _ft_checkpoint_runs(folder, load_at=load_at, torch_checkpoint="torch")
        for w, (ref, run) in enumerate(zip(straight, resumed)):
            syncs = [s for s in (4, 6, 8) if s > load_at]
            assert run["loaded"]["manager"]["step"] == 1 and run["manager"]["step"] == 1 + len(syncs)  # + the join
            assert [r[0] for r in run["reports"]] == syncs and all(r[1:] == (WORKERS, True) for r in run["reports"])
            assert (run["steps_done"], run["last_sync_step"]) == (8, 8)
            if load_at == 4:
                assert max_difference(ref["params"], run["params"]) <= 1e-6, w
                assert max(float((x - y).abs().max()) for x, y in zip(ref["anchors"], run["anchors"])) <= 1e-6
        a, b = (r["loaded"] for r in resumed)
        assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
        assert all(torch.equal(x, y) for x, y in zip(a["anchors"], b["anchors"]))
        if load_at == 3:
            (one,) = [r["loaded"] for r in run_ranks(_one_world_job, 1, folder, "torch", load_at=3, last=3,
                                                      timeout=TIMEOUT)]
            assert all(torch.equal(one["params"][k], a["params"][k]) for k in a["params"])
            assert all(torch.equal(x, y) for x, y in zip(one["anchors"], a["anchors"]))
            assert all(torch.equal(x[k], y[k]) for x, y in zip(one["outer"], a["outer"]) for k in x)
        # each its own saved worker's Adam moments (the equality after step 8 needs them too)
        assert any(not torch.equal(x["exp_avg"], y["exp_avg"]) for x, y in zip(a["adam"], b["adam"]))
        for run in resumed[1:]:  # replicas after the last sync
            assert max_difference(resumed[0]["params"], run["params"]) == 0.0


def _alone_below_min_replicas(rank, world_size, lighthouse):
    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    local = dict(local_sgd_sync_interval=2, sync_backend="torchft", replica_id=0, lighthouse=lighthouse,
                 min_replicas=2, sync_timeout=60.0)
    edit, plain = (default_spec(steps=6, instances=1, local_sgd=sgd) for sgd in (local, None))
    return megatron_runs(rank, world_size, [edit, plain])["runs"]


@pytest.mark.timeout(TIMEOUT)
def test_a_sync_that_is_not_committed_keeps_the_local_progress():
    """One worker alone with --local-sgd-min-replicas 2: no sync commits, so no outer step is
    applied and the worker keeps training from its own parameters: bit for bit the plain
    (non-EDiT) run on the same data."""
    with ft_jobs.jobs_and_lighthouse() as (server, start):
        ((edit, plain),) = start(_alone_below_min_replicas, 1, server.address(), timeout=TIMEOUT - 30).results()
    assert [(r.step, r.workers, r.committed) for r in edit["reports"]] == [(2, 1, False), (4, 1, False),
                                                                             (6, 1, False)]
    assert max_difference(edit["params"], plain["params"]) == 0.0
    assert edit["losses"] == plain["losses"]


# ---------------------------------------------------------------------- killed inside a save
@contextlib.contextmanager
def _one_rank_pair_with_victim_killed(fn, ctl, marker):
    """Jobs of ``fn`` for workers 0 and 1 (one rank each) under a Lighthouse (heartbeat 3 s: a
    dead worker leaves the quorum 3 s after its death; join timeout 60 s: a quorum waits for a
    worker whose Manager is up); worker 1's job is SIGKILLed once it has written ``marker`` in
    ``ctl``. Yields (the Lighthouse's address, ``start``, worker 0's job)."""
    with ft_jobs.jobs_and_lighthouse(heartbeat_timeout_ms=3000, join_timeout_ms=60000) as (server, start):
        addr = server.address()
        survivor = start(fn, 1, 0, addr, ctl, timeout=2 * TIMEOUT - 60)
        victim = start(fn, 1, 1, addr, ctl, timeout=2 * TIMEOUT - 60)
        _wait_file(os.path.join(ctl, marker), jobs=[survivor, victim])  # (a job that fails first: its traceback)
        victim.kill()
        yield addr, start, survivor

OLD_TOTAL = 16


def _older_checkpoint_worker(rank, world_size, worker, lighthouse, ctl, relaunched=False):
    """One worker's job (1 rank): 2 streaming fragments, H = 4 (a fragment's sync every 2 steps,
    step-end), OLD_TOTAL steps; each job saves its own checkpoint after step 4. Worker 1's first
    job is SIGKILLed inside its next save (after step 6: the test kills it while Megatron's save
    builds EDiT's state). Its relaunched job (``relaunched``) joins worker 0's sync 10 (worker 0
    waits before step 9 for it), then loads its last complete checkpoint (step 4): it is behind
    by the Manager's count again, trains its steps 5 and 6 and, at its own sync 6 (fragment 1),
    heals into worker 0's sync 12 (fragment 0): it goes on with worker 0's step and fragment."""
    import json
    import time

    import megatron_edit as me
    from megatron.core import parallel_state as ps
    from megatron_edit.mcore.fault_tolerant import TorchftBackend

    import checkpoint_runs as cr
    from edit_runs import MICRO_BATCH
    from gpt_utils import make_batches, rank_micro_batches, train_step

    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    ps.initialize_model_parallel(num_distributed_optimizer_instances=1)
    if relaunched:  # tell the test and worker 0 where this job's quorum requests have arrived
        ft_jobs.announce_quorum_requests(os.path.join(ctl, "relaunched-begin-{n}"), lighthouse, count=2)
    else:  # the first jobs' join round: together (see _healing_worker)
        ft_jobs.first_round_together(os.path.join(ctl, "join"), f"w{worker}", WORKERS)
    local = dict(local_sgd_sync_interval=4, fragments=2, sync_mode="step_end", sync_backend="torchft",
                 replica_id=worker, lighthouse=lighthouse, sync_timeout=120.0)
    ddp, opt, c = cr._setup(local, instances=1)  # the join round runs in here
    me.set_train_iters(opt, OLD_TOTAL)
    log = open(os.path.join(ctl, f"w{worker}-r{rank}-{os.getpid()}.jsonl"), "a", buffering=1)
    log.write(json.dumps(dict(ev="joined", step=c.steps_done, healed=c.sync_group.healed,
                              anchor=_anchor_digest(c))) + "\n")
    if relaunched:
        cr._load(ddp, opt, os.path.join(ctl, f"worker{worker}-step4"))
        log.write(json.dumps(dict(ev="loaded", step=c.steps_done, manager_step=c.sync_group.step)) + "\n")
    batches = make_batches(OLD_TOTAL, WORKERS * MICRO_BATCH, seed=0)
    while c.steps_done < OLD_TOTAL:
        step = c.steps_done + 1
        if worker == 0 and step == 7:
            _wait_file(os.path.join(ctl, "killed"))  # worker 1 is stuck in its save after step 6
        if worker == 0 and step == 9:
            _wait_file(os.path.join(ctl, "relaunched-begin-1"))  # the relaunched job's join round
        if worker == 0 and step == 11:  # its own sync 6 (after its load and 2 steps), however slow:
            _wait_file(os.path.join(ctl, "relaunched-begin-2"))  # not left to the join timeout
        train_step(ddp, opt, rank_micro_batches(batches[step - 1], worker, WORKERS))
        for r in c.drain_reports():
            log.write(json.dumps(dict(ev="sync", step=r.step, workers=r.workers, trained=r.trained,
                                      fragment=r.fragment, anchor=_anchor_digest(c))) + "\n")
        if step == 4 and not relaunched:
            cr._save(ddp, opt, os.path.join(ctl, f"worker{worker}-step4"))
        if step == 6 and worker == 1 and not relaunched:
            def stuck(self):  # Megatron's save is building EDiT's state: the test kills the job here
                open(os.path.join(ctl, "victim-in-save"), "w").close()
                time.sleep(600)

            TorchftBackend.state_dict = stuck
            cr._save(ddp, opt, os.path.join(ctl, f"worker{worker}-step6"))
    ddp.start_param_sync(force_sync=True)
    out = dict(state=cr._state(ddp, opt, c), pid=os.getpid(), manager_step=c.sync_group.step)
    c.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return out


@pytest.mark.timeout(2 * TIMEOUT)
def test_a_worker_killed_in_its_save_resumes_from_its_older_checkpoint_and_heals(tmp_path):
    """Worker 1's job is SIGKILLed inside a checkpoint save; worker 0 goes on alone (it never
    restarts, nothing waits for worker 1). The relaunched job resumes from its last complete
    checkpoint (step 4), older than worker 0's state: it heals at its first sync into worker 0's
    (at another step and fragment) and is bit-identical to worker 0 from then on."""
    ctl = str(tmp_path)
    with _one_rank_pair_with_victim_killed(_older_checkpoint_worker, ctl, "victim-in-save") as (addr, start, survivor):
        open(os.path.join(ctl, "killed"), "w").close()
        _until(lambda: any(e["ev"] == "sync" and e["step"] == 8 for e in _events(ctl, 0, 0)), "worker 0's sync 8")
        relaunched = start(_older_checkpoint_worker, 1, 1, addr, ctl, True, timeout=2 * TIMEOUT - 60)
        final0, final1 = (out[0] for out in ft_jobs.all_results([survivor, relaunched]))
    ev0 = [e for e in _events(ctl, 0, 0) if e["ev"] == "sync"]
    assert len({e["pid"] for e in _events(ctl, 0, 0)}) == 1  # the survivor never restarted
    assert [(e["step"], e["workers"], e["trained"], e["fragment"]) for e in ev0] == [
        (2, 2, 2, 1), (4, 2, 2, 0), (6, 2, 2, 1), (8, 1, 1, 0),  # 8: alone (worker 1 died in its save)
        (10, 2, 1, 1),  # the relaunched job's join round
        (12, 2, 1, 0),  # worker 1, back at its step 6 from its step-4 checkpoint, heals here again
        (14, 2, 2, 1), (16, 2, 2, None)]
    new = [e for e in _events(ctl, 1, 0) if e["pid"] == final1["pid"]]
    joined, loaded, *syncs = new
    assert joined["ev"] == "joined" and joined["healed"] and joined["step"] == 10
    assert loaded["ev"] == "loaded" and loaded["step"] == 4 and loaded["manager_step"] < final0["manager_step"] - 3
    assert [(e["step"], e["fragment"]) for e in syncs] == [(12, 0), (14, 1), (16, None)]
    assert [e["anchor"] for e in syncs] == [e["anchor"] for e in ev0[-3:]]
    a, b = final0["state"], final1["state"]
    assert a["steps_done"] == b["steps_done"] == OLD_TOTAL and final0["manager_step"] == final1["manager_step"]
    assert all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])
    assert all(torch.equal(x, y) for x, y in zip(a["anchors"], b["anchors"]))


# ---------------------------------------------------------------------- killed inside an exchange
def _exchange_victim_worker(rank, world_size, worker, lighthouse, ctl, stuck_at=4):
    """One worker's job (1 rank): EDiT H=2 over torchft, 8 steps, layer-wise. Worker 1 stops
    inside its exchange of the sync after step ``stuck_at`` (after the quorum and the decisions,
    before its first all-reduce) and the test SIGKILLs its job there; worker 0's all-reduce of
    that sync then fails (its peer is gone) and the round is not committed. Worker 0 returns
    whether its parameters end equal to its anchor (one model: its last sync applied)."""
    import json
    import time

    import megatron_edit as me
    from megatron.core import parallel_state as ps
    from megatron_edit.exchange.fault_tolerant import FaultTolerantSyncGroup

    import checkpoint_runs as cr
    from edit_runs import MICRO_BATCH
    from gpt_utils import make_batches, rank_micro_batches, train_step

    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    ps.initialize_model_parallel(num_distributed_optimizer_instances=1)
    ft_jobs.first_round_together(os.path.join(ctl, "join"), f"w{worker}", WORKERS)  # both Managers up first
    local = dict(local_sgd_sync_interval=2, sync_mode="layerwise", sync_backend="torchft", replica_id=worker,
                 lighthouse=lighthouse, sync_timeout=120.0)
    ddp, opt, c = cr._setup(local, instances=1)
    me.set_train_iters(opt, 8)
    if worker == 1:
        reduce = FaultTolerantSyncGroup.all_reduce_sum

        def stuck(self, tensor, async_op=True):
            if c.steps_done == stuck_at:  # inside that sync's exchange: the test kills the job here
                open(os.path.join(ctl, "victim-in-exchange"), "w").close()
                time.sleep(600)
            return reduce(self, tensor, async_op)

        FaultTolerantSyncGroup.all_reduce_sum = stuck
    log = open(os.path.join(ctl, f"w{worker}-r{rank}-{os.getpid()}.jsonl"), "a", buffering=1)
    batches = make_batches(8, WORKERS * MICRO_BATCH, seed=0)
    while c.steps_done < 8:
        train_step(ddp, opt, rank_micro_batches(batches[c.steps_done], worker, WORKERS))
        for r in c.drain_reports():
            log.write(json.dumps(dict(ev="sync", step=r.step, workers=r.workers, committed=r.committed,
                                      since=r.steps_since_last, anchor=_anchor_digest(c))) + "\n")
    at_anchor = all(torch.equal(s.read_current(torch.empty_like(s.anchor)), s.anchor) for s in c.shards)
    c.backend.close()
    me.unpatch_megatron_for_local_sgd()
    return os.getpid(), at_anchor


@pytest.mark.timeout(2 * TIMEOUT)
def test_a_worker_killed_inside_an_exchange_fails_that_round_only(tmp_path):
    """Worker 1's job is SIGKILLed inside its exchange of sync 4. Worker 0 does not wait beyond
    the failed collective: its sync 4 is not committed (its anchor stays that of sync 2, its
    parameters keep their local progress), and its sync 6 commits alone, its pseudo-gradient
    covering the 4 steps since sync 2; it never restarts."""
    ctl = str(tmp_path)
    with _one_rank_pair_with_victim_killed(_exchange_victim_worker, ctl, "victim-in-exchange") as (_, _, survivor):
        ((pid, _),) = survivor.results()
    ev0 = [e for e in _events(ctl, 0, 0) if e["ev"] == "sync"]
    assert {e["pid"] for e in ev0} == {pid}
    assert [(e["step"], e["workers"], e["committed"], e["since"]) for e in ev0] == [
        (2, 2, True, 2), (4, 2, False, 2), (6, 1, True, 4), (8, 1, True, 2)]
    assert ev0[1]["anchor"] == ev0[0]["anchor"] != ev0[2]["anchor"]  # sync 4: nothing applied


@pytest.mark.timeout(2 * TIMEOUT)
def test_the_last_sync_whose_peer_dies_inside_its_exchange_is_tried_again_until_it_commits(tmp_path):
    """Worker 1's job is SIGKILLed inside its exchange of the run's last sync (after step 8).
    Worker 0's sync 8 does not commit; it tries the sync again (a new quorum, without the dead
    worker) and commits it alone: its last report is committed, its model is its anchor (the
    last sync applied, not its local progress), and it never restarted."""
    from functools import partial

    ctl = str(tmp_path)
    fn = partial(_exchange_victim_worker, stuck_at=8)
    with _one_rank_pair_with_victim_killed(fn, ctl, "victim-in-exchange") as (_, _, survivor):
        ((pid, at_anchor),) = survivor.results()
    ev0 = [e for e in _events(ctl, 0, 0) if e["ev"] == "sync"]
    assert {e["pid"] for e in ev0} == {pid}
    assert [(e["step"], e["workers"], e["committed"], e["since"]) for e in ev0] == [
        (2, 2, True, 2), (4, 2, True, 2), (6, 2, True, 2), (8, 2, False, 2), (8, 1, True, 2)]
    assert ev0[4]["anchor"] != ev0[2]["anchor"]  # (both reports of sync 8 are read after its step)
    assert at_anchor


@pytest.mark.timeout(3 * TIMEOUT)
def test_torchft_workers_start_from_a_checkpoint_of_synchronous_training(tmp_path):
    """Plain Megatron (2 data-parallel ranks in one world) saves after step 4; each torchft
    worker's job loads it with its Adam state, takes its anchor there and counts the 4 steps as
    done (its Manager: one committed round, as after a fresh run's join), and the torchft run
    ends where the torch backend's run from the same checkpoint ends (1e-6), with identical
    replicas after the last sync."""
    folder = str(tmp_path)
    run_ranks(_one_world_job, WORKERS, folder, "sync", (4,), last=4, edit=False, timeout=TIMEOUT)
    reference = run_ranks(_one_world_job, WORKERS, folder, "sync", load_at=4, timeout=TIMEOUT)
    resumed = _ft_checkpoint_runs(folder, load_at=4, torch_checkpoint="sync")
    for w, (ref, run) in enumerate(zip(reference, resumed)):
        assert all(torch.equal(ref["loaded"]["params"][k], run["loaded"]["params"][k]) for k in run["loaded"]["params"])
        assert all(torch.equal(x, y) for x, y in zip(run["loaded"]["anchors"], run["loaded"]["mains"]))
        assert run["loaded"]["steps_done"] == 4 and run["loaded"]["manager"]["step"] == 1
        assert [r[0] for r in run["reports"]] == [6, 8] and run["manager"]["step"] == 3
        assert max_difference(ref["final"]["params"], run["params"]) <= 1e-6, w
    assert max_difference(resumed[0]["params"], resumed[1]["params"]) == 0.0


def _one_uncommitted_round(rank, world_size, lighthouse):
    """One worker of one rank alone (min replicas 1: its rounds commit), top-k 1% with error
    feedback, step-end syncs after steps 2, 4 and 6; torchft's vote of the round of step 4 says
    no (as when a peer dies inside it)."""
    from megatron_edit.exchange.fault_tolerant import FaultTolerantSyncGroup
    from megatron_edit.mcore.process_state import PROCESS

    vote = FaultTolerantSyncGroup.commit

    def commit(self):
        ok = vote(self)
        return ok and getattr(PROCESS.torchft_round, "step", None) != 4

    FaultTolerantSyncGroup.commit = commit
    host, port = ft_jobs.job_store_address()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    local = dict(local_sgd_sync_interval=2, sync_backend="torchft", replica_id=0, lighthouse=lighthouse,
                 sync_mode="step_end", exchange_topk_density=0.01, exchange_dtype="int2",
                 exchange_error_feedback=True)
    spec = default_spec(steps=6, instances=1, local_sgd=local, record_shards_at_steps=(2, 4, 6))
    return megatron_runs(rank, world_size, [spec])["runs"][0]


@pytest.mark.timeout(TIMEOUT)
def test_a_round_that_does_not_commit_keeps_the_error_feedback_residual_from_before_it():
    """The exchange rewrites the residual in place; a round that does not commit used to drop
    it (set it to None), losing the unsent part of every interval before it (at 1% top-k about
    2.7 intervals' worth). Now the residual after the failed round is the one before it, bit for
    bit, and the next committed round sends it."""
    with ft_jobs.jobs_and_lighthouse() as (server, start):
        (edit,) = start(_one_uncommitted_round, 1, server.address(), timeout=TIMEOUT - 30).results()
    assert [(r.step, r.committed) for r in edit["reports"]] == [(2, True), (4, False), (6, True)]
    before, after, later = (edit["shard_records"][s]["residual"] for s in (2, 4, 6))
    assert all(r is not None for r in before) and any(r.abs().sum() > 0 for r in before)
    assert all(a is not None and torch.equal(a, b) for a, b in zip(after, before))
    assert any(not torch.equal(c, b) for c, b in zip(later, before))  # the next round used it


# ---------------------------------------------------------------------- one rank's vote lost
def _vote_reply_lost(rank, world_size, worker, lighthouse, spec):
    """``_ft_worker``, where rank 1 of worker 1 loses torchft's reply to its vote of the round
    of step 4 (the vote was counted: its worker's rank 0 hears "commit")."""
    from torchft import Manager

    from megatron_edit.mcore.process_state import PROCESS

    class Client:  # the Manager's client of its worker's Manager server (torchft's Rust class)
        def __init__(self, client):
            self.client = client

        def __getattr__(self, name):
            return getattr(self.client, name)

        def should_commit(self, *args, **kwargs):
            out = self.client.should_commit(*args, **kwargs)
            if getattr(PROCESS.torchft_round, "step", None) == 4:
                raise TimeoutError("injected: the reply to rank 1's vote was lost")
            return out

    vote = Manager.should_commit

    def lost(self, *args, **kwargs):
        if worker == 1 and rank == 1 and not isinstance(self._client, Client):
            self._client = Client(self._client)
        return vote(self, *args, **kwargs)

    Manager.should_commit = lost
    return _ft_worker(rank, world_size, worker, lighthouse, spec)


@pytest.mark.timeout(2 * TIMEOUT)
def test_a_vote_lost_on_one_rank_fails_the_round_for_its_whole_worker():
    """2 workers x 2 ranks, H = 2, 8 steps. torchft's reply to one rank's vote of the round of
    step 4 is lost (``should_commit`` raises TimeoutError on rank 1 of worker 1, after its vote
    was counted). That rank does not die, and its worker does not split: neither of its ranks
    applies sync 4 (the one that heard "commit" sets its torchft step back), worker 0 applies it,
    and at sync 6 both ranks of worker 1 heal from worker 0 together; the run ends with one model
    on every rank of both workers."""
    spec = default_spec(steps=8, local_sgd=dict(local_sgd_sync_interval=2))
    with ft_jobs.jobs_and_lighthouse(min_replicas=WORKERS) as (server, start):
        jobs = [start(_vote_reply_lost, RANKS, w, server.address(), spec, timeout=TIMEOUT) for w in range(WORKERS)]
        ft = [out for outs in ft_jobs.all_results(jobs) for out in outs]  # worker-major
    committed = [[(r.step, r.committed) for r in run["reports"]] for run in ft]
    assert committed[:RANKS] == [[(2, True), (4, True), (6, True), (8, True)]] * RANKS
    assert committed[RANKS:] == [[(2, True), (4, False), (6, True), (8, True)]] * RANKS
    for r in range(RANKS):
        assert max_difference(ft[r]["params"], ft[RANKS + r]["params"]) == 0.0, f"rank {r}"
