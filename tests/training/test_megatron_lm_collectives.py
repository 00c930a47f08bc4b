"""Nothing crosses the sync group between syncs: Megatron-LM's per-step collectives with EDiT.

End to end, the unmodified ``pretrain_gpt.py`` runs through ``megatron_edit.launch`` under
``tests/training/megatron_lm_traffic_probe.py``, which records every ``torch.distributed`` collective with
its group, iteration and stack; a collective "crosses workers" when its group holds a rank
outside this rank's EDiT worker (Megatron's distributed-optimizer instance). The same run
without the ``worker-local-*`` patches shows what Megatron does by itself. Needs a Megatron-LM
checkout (MEGATRON_LM_DIR, see tests/test_megatron_lm.py); without it those tests skip with the
same message. The option checks and the patches' decisions are also tested without it.
"""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_edit.config import ConfigError
from megatron_edit.mcore import compat
from megatron_edit.training.meetings import ChecksAtMeetings, workers_meet
from megatron_edit.training.validation import validate_local_sgd_args
from megatron_edit.training.worker_local import WorkerLocalCollectives
from test_megatron_lm import (
    run_probe,
    CHECKOUT,
    EDIT,
    H,
    LINE,
    MOE,
    MOE_LINES,
    PENALTY,
    HAVE_CHECKOUT,
    HAVE_TENSORBOARD,
    HOW_TO_RUN,
    REPO,
    TINY,
    W,
    _env,
    _field,
    _hash_checks,
    _lines,
    _megatron_like_args,
    _synced_steps,
    needs_checkout,
)

PROBE = REPO / "tests" / "training" / "megatron_lm_traffic_probe.py"
PACKED_STATS = compat.packed_sequence_stats_all_reduced()
SYNC = "megatron_edit/exchange/"  # the frames of a sync's exchange (megatron_edit.exchange)
PLAN_ASYNC = "megatron_edit/mcore/async_plan.py:plan:"  # A-EDiT's schedule


# ================================================================ without the checkout
@pytest.mark.parametrize(
    "argv, options, match",
    [
        ((), dict(exit_duration_in_mins=60), None),
        (("--local-sgd-async",), dict(exit_duration_in_mins=60, train_iters=100), None),
        ((), dict(exit_signal_handler=True), None),
        (("--local-sgd-async",), dict(exit_signal_handler=True, train_iters=100), "--exit-signal-handler"),
        ((), dict(log_straggler=True), "--log-straggler"),
        ((), dict(log_energy=True), "--log-energy"),
        ((), dict(rerun_mode="report_stats"), "report_stats"),
        ((), dict(rerun_mode="validate_results"), None),
        ((), dict(rerun_mode="disabled"), None),
        ((), dict(adlr_autoresume=True), "--adlr-autoresume"),
        ((), dict(log_params_norm=True, timing_log_level=2, log_timers_to_tensorboard=True), None),
        (("--local-sgd-async",), dict(log_params_norm=True, timing_log_level=2, train_iters=100), None),
        (("--local-sgd-async",), dict(train_iters=None, train_samples=1000), None),
        (("--local-sgd-async",), dict(train_iters=None, train_samples=None), "--train-iters or --train-samples"),
        (("--local-sgd-async",), dict(train_iters=100, step_batch_size_schedule="0:8 100:16"),
         "--step-batch-size-schedule"),
        (("--local-sgd-async",), dict(train_iters=100, save_interval=10, exit_interval=20), None),
        (("--local-sgd-async",), dict(train_iters=100, save_interval=10, async_save=True), None),
        # Packed sequences: a world all-reduce of their lengths every iteration since 0.18.
        ((), dict(sft=True), "--sft" if PACKED_STATS else None),
        ((), dict(dataloader_inter_document_masking=True),
         "--dataloader-inter-document-masking" if PACKED_STATS else None),
    ],
    ids=["exit-duration", "exit-duration-async", "signal-handler", "signal-handler-async", "straggler", "energy",
         "rerun-report-stats", "rerun-validate", "rerun-disabled", "adlr-autoresume",
         "worker-local-logging", "worker-local-logging-async", "async-train-samples", "async-needs-a-length", "async-step-batch-schedule",
         "async-save-exit-interval-at-syncs", "async-save", "sft", "inter-document-masking"],
)
def test_options_with_collectives_across_workers(argv, options, match):
    args = _megatron_like_args("--use-local-sgd", "--local-sgd-sync-interval", "4",
                               "--local-sgd-warmup-steps", "4", *argv, **options)
    if match is None:
        validate_local_sgd_args(args)
    else:
        with pytest.raises(ConfigError, match=match) as raised:
            validate_local_sgd_args(args)
        assert "--use-local-sgd" in str(raised.value) or "--local-sgd-async" in str(raised.value)


def test_refusals_only_with_local_sgd():
    validate_local_sgd_args(_megatron_like_args(log_straggler=True,
                                                log_energy=True, rerun_mode="report_stats"))


class _Controller:
    """What the patches read of an EDiT object (LocalSGD): its config and step count."""

    def __init__(self, steps_done, warmup=W, interval=H, use_async=False, at_sync=False):
        self.steps_done, self.at_sync = steps_done, at_sync
        self.config = SimpleNamespace(local_sgd_warmup_steps=warmup, local_sgd_sync_interval=interval,
                                      use_async=use_async)

    @property
    def grads_are_local(self):
        return self.steps_done >= self.config.local_sgd_warmup_steps


def _worker_local(controller=None):
    runtime = SimpleNamespace(controllers={} if controller is None else {object(): controller})
    return WorkerLocalCollectives(lambda: runtime)


def test_workers_meet_after_warmup_steps_and_syncs_only():
    meet = [s for s in range(1, 17) if workers_meet([_Controller(s)])]
    assert meet == [1, 2, 3, 4, 8, 12, 16]
    assert not workers_meet([])


def test_a_edit_workers_meet_at_warmup_steps_and_at_the_step_of_each_sync():
    # A-EDiT syncs at different iterations per worker; the step of each sync is the one point
    # all workers share (LocalSGD.at_sync), whichever iteration it is.
    assert workers_meet([_Controller(3, use_async=True)])
    assert not workers_meet([_Controller(8, use_async=True)])
    assert workers_meet([_Controller(7, use_async=True, at_sync=True)])


def test_async_save_check_runs_only_where_workers_meet():
    calls = []

    def original(blocking=False, terminate=False):
        calls.append((blocking, terminate))

    for controller, blocking, terminate, runs in [
        (None, False, False, True),  # before the optimizer exists: as Megatron has it
        (_Controller(3, use_async=True), False, False, True),  # a synchronous warmup step
        (_Controller(9, use_async=True), False, False, False),  # between syncs: deferred
        (_Controller(9, use_async=True, at_sync=True), False, False, True),  # right after a sync
        (_Controller(9, use_async=True), True, False, True),  # blocking (every worker is there)
        (_Controller(9, use_async=True), True, True, True),  # the end of training
        (_Controller(10), False, False, False),  # EDiT, between syncs
        (_Controller(12), False, False, True),  # EDiT, on the sync grid
    ]:
        runtime = SimpleNamespace(controllers={} if controller is None else {object(): controller})
        saves = ChecksAtMeetings(lambda: runtime)
        calls.clear()
        assert saves.wrap_maybe_finalize_async_save(original)(blocking, terminate=terminate) is None
        assert calls == ([(blocking, terminate)] if runs else []), (controller and vars(controller), blocking)
        assert saves.deferred == (0 if runs else 1)


def test_exit_duration_is_asked_only_where_edit_workers_meet(monkeypatch):
    from megatron_edit.training import meetings

    args = SimpleNamespace(exit_duration_in_mins=30)
    monkeypatch.setattr(meetings, "_get_args", lambda: args)
    seen = []

    def original(*call):  # Megatron's checkpoint_and_decide_exit / evaluate
        seen.append(args.exit_duration_in_mins)
        return False

    for controller, asked in [(None, 30), (_Controller(3), 30), (_Controller(10), None), (_Controller(12), 30)]:
        runtime = SimpleNamespace(controllers={} if controller is None else {object(): controller})
        checks = ChecksAtMeetings(lambda: runtime)
        seen.clear()
        checks.wrap_checkpoint_and_decide_exit(original)(*[None] * 7)
        assert seen == [asked] and args.exit_duration_in_mins == 30, controller and controller.steps_done
        seen.clear()
        checks.wrap_evaluate(original)()  # every evaluation iteration: never with EDiT
        assert seen == [30 if controller is None else None]


def test_replica_hash_check_owed_at_each_multiple_is_made_at_the_next_sync(monkeypatch):
    from megatron_edit.training import meetings

    args = SimpleNamespace(check_weight_hash_across_dp_replicas_interval=6)
    monkeypatch.setattr(meetings, "_get_args", lambda: args)
    checked = []

    def original(model, optimizer, scheduler, iteration, prof, flops, nsys=None):  # Megatron's
        interval = args.check_weight_hash_across_dp_replicas_interval
        if interval is not None and iteration % interval == 0:
            checked.append(iteration)
        return flops

    controller = _Controller(0)  # EDiT, warmup 4, H 4: syncs at 8, 12, 16
    checks = ChecksAtMeetings(lambda: SimpleNamespace(controllers={object(): controller}))
    wrapped = checks.wrap_post_training_step_callbacks(original)
    for step in range(1, 21):
        controller.steps_done = step
        assert wrapped(None, None, None, step, None, 1.5) == 1.5
    assert checked == [8, 12, 20]  # owed at 6 -> 8, 12 -> 12, 18 -> 20 (never between syncs)
    assert args.check_weight_hash_across_dp_replicas_interval == 6

    # A-EDiT: owed when global progress (agreed at real syncs) passes a multiple of 4.
    args.check_weight_hash_across_dp_replicas_interval = 4
    controller = _Controller(0, use_async=True)
    checks = ChecksAtMeetings(lambda: SimpleNamespace(controllers={object(): controller}))
    wrapped, checked[:] = checks.wrap_post_training_step_callbacks(original), []
    for step, progress, skipped in [(5, 3.0, False), (7, 4.5, True), (9, 5.0, False), (10, None, None),
                                    (13, 7.5, False), (16, 9.0, False)]:
        controller.steps_done, controller.at_sync = step, progress is not None
        controller.last_sync = SimpleNamespace(global_progress=progress, skipped=skipped)
        wrapped(None, None, None, step, None, 0.0)
    assert checked == [9, 16]  # 4.5 was a skipped sync (replicas differ): made at the next real one


def test_during_warmup_only_the_model_norm_is_taken_over_the_worker():
    """Warmup: the logged losses keep Megatron's groups (the workers step together), but the
    model's norm (in bf16: summed from the distributed optimizer's shards of the main parameters,
    which the worker's ranks hold whole) is taken over the worker: over every data-parallel rank
    it counted the model once per worker, and it crossed workers between syncs."""
    warmup = _worker_local(_Controller(2))  # warmup 4: gradients still cross workers
    seen = []
    warmup.wrap_reporting_region(lambda: seen.append(warmup.in_reporting()))()
    warmup.wrap_model_norm_region(lambda: seen.append(warmup.in_reporting()))()
    # Nested: a norm taken inside train_step's region, and the region after it.
    warmup.wrap_reporting_region(lambda: (
        warmup.wrap_model_norm_region(lambda: seen.append(warmup.in_reporting()))(),
        seen.append(warmup.in_reporting())))()
    assert seen == [False, True, True, False]
    after = _worker_local(_Controller(6))
    seen.clear()
    after.wrap_reporting_region(lambda: seen.append(after.in_reporting()))()
    after.wrap_model_norm_region(lambda: seen.append(after.in_reporting()))()
    assert seen == [True, True]
    off = _worker_local()  # local SGD off: nothing changes
    seen.clear()
    off.wrap_model_norm_region(lambda: seen.append(off.in_reporting()))()
    assert seen == [False]


def _dp_0_16(with_context_parallel=False, partial_data_parallel=False, independent_all_gather=False):
    return dict(cp=with_context_parallel, partial=partial_data_parallel, independent=independent_all_gather)


def _dp_0_18(with_context_parallel=False, partial_data_parallel=False):
    return dict(cp=with_context_parallel, partial=partial_data_parallel)


def _dp_0_19(with_context_parallel=False, with_gtp_remat=True, partial_data_parallel=False):
    return dict(cp=with_context_parallel, gtp=with_gtp_remat, partial=partial_data_parallel)


@pytest.mark.parametrize("getter", [_dp_0_16, _dp_0_18, _dp_0_19], ids=["0.16-0.17", "0.18", "0.19"])
def test_inside_a_reporting_region_the_full_data_parallel_group_is_the_workers(monkeypatch, getter):
    """parallel_state.get_data_parallel_group of each release (compat.SIGNATURES): inside a
    reporting region the full group becomes the worker's (partial) one; the caller's other
    arguments pass through by name."""
    import megatron_edit.training.worker_local as tp

    monkeypatch.setattr(tp, "_context_parallel_size", lambda: 1)
    wl = _worker_local(_Controller(6))
    get = wl.wrap_get_data_parallel_group(getter)
    worker = getter(with_context_parallel=True, partial_data_parallel=True)
    assert get(with_context_parallel=True) == getter(with_context_parallel=True)  # outside: unchanged
    assert get(True) == getter(True)
    seen = []
    calls = [dict(with_context_parallel=True), dict(), dict(with_context_parallel=True, partial_data_parallel=True)]
    if getter is _dp_0_16:
        calls.append(dict(with_context_parallel=True, independent_all_gather=True))
    if getter is _dp_0_19:
        calls.append(dict(with_context_parallel=True, with_gtp_remat=False))  # calc_params_l2_norm's
    region = wl.wrap_reporting_region(lambda: seen.extend(get(**kwargs) for kwargs in calls))
    region()
    assert seen[:3] == [worker, worker, worker]
    if getter is _dp_0_16:  # Megatron's own independent group is left alone
        assert seen[3] == getter(with_context_parallel=True, independent_all_gather=True)
    if getter is _dp_0_19:
        assert seen[3] == getter(with_context_parallel=True, with_gtp_remat=False, partial_data_parallel=True)
    monkeypatch.setattr(tp, "_context_parallel_size", lambda: 2)  # DP without CP: no worker group
    seen.clear()
    region()
    assert seen[1] == getter()
    # Local SGD off (no EDiT optimizer): the region changes nothing.
    seen.clear()
    off = _worker_local()
    off.wrap_reporting_region(lambda: seen.append(off.in_reporting()))()
    assert seen == [False]


def test_moe_metrics_are_averaged_over_the_worker(monkeypatch):
    """track_moe_metrics (every iteration in training_log) averages the tracked MoE losses over
    the data-parallel group: with EDiT running, the worker's (a copy of the collection; with
    none given, parallel_state's pipeline group and the worker's); without EDiT, untouched."""
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_data_parallel_group",
                        lambda **kwargs: "worker" if kwargs.get("partial_data_parallel") else "all dp")
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_group", lambda: "pp")
    seen = []
    original = lambda names=None, pg_collection=None: seen.append((names, pg_collection))  # noqa: E731
    collection = SimpleNamespace(pp="pp", dp="all dp", tp="tp")
    wl = _worker_local(_Controller(6))
    reduce = wl.wrap_reduce_aux_losses(original)
    reduce(["load_balancing_loss"], pg_collection=collection)
    reduce(None)
    assert seen[0][0] == ["load_balancing_loss"] and (seen[0][1].dp, seen[0][1].pp, seen[0][1].tp) == ("worker", "pp", "tp")
    assert collection.dp == "all dp"  # the caller's collection is untouched
    assert (seen[1][1].dp, seen[1][1].pp) == ("worker", "pp")
    plain = WorkerLocalCollectives(lambda: None).wrap_reduce_aux_losses(original)
    plain(None, pg_collection=collection)
    assert seen[2][1] is collection


def test_moe_metrics_tracker_averages_over_the_worker(monkeypatch):
    """0.19: MoEMetricsTracker.report (every iteration in training_log) averages the MoE metrics
    over pg_collection.dp_cp_gtp_remat (every data-parallel rank without a collection): with
    EDiT running, over the worker's (a copy of the collection); without EDiT, untouched.
    An entry averaged over a group of its own that spans the workers (the router's z-loss, over
    tensor x data x context parallel) is averaged over the whole worker during the call."""
    import torch.distributed
    from megatron.core import parallel_state

    monkeypatch.setattr(parallel_state, "get_data_parallel_group",
                        lambda **kwargs: "worker" if kwargs.get("partial_data_parallel") else "all dp")
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_group", lambda: "pp")
    monkeypatch.setattr(parallel_state, "get_intra_distributed_optimizer_instance_group",
                        lambda **kwargs: "whole worker", raising=False)
    members = {"whole worker": [0, 1, 2, 3], "tp_dp_cp": [0, 1, 4, 5], "tp_cp": [0, 1]}
    monkeypatch.setattr(torch.distributed, "get_process_group_ranks", members.__getitem__)
    seen = []

    def original(tracker, names, pg_collection=None):
        seen.append((tracker, names, pg_collection, {n: e.avg_group for n, e in tracker._metrics.items()}))

    tracker = SimpleNamespace(_metrics={"load_balancing_loss": SimpleNamespace(avg_group=None),
                                        "z_loss": SimpleNamespace(avg_group="tp_dp_cp"),
                                        "seq_load_balancing_loss": SimpleNamespace(avg_group="tp_cp")})
    collection = SimpleNamespace(pp="pp", dp_cp_gtp_remat="all dp", tp="tp")
    sync = _worker_local(_Controller(6)).wrap_moe_sync_metrics(original)
    sync(tracker, ["load_balancing_loss"], collection)
    sync(tracker, ["z_loss", "seq_load_balancing_loss"])
    assert seen[0][:2] == (tracker, ["load_balancing_loss"])
    assert (seen[0][2].dp_cp_gtp_remat, seen[0][2].pp, seen[0][2].tp) == ("worker", "pp", "tp")
    assert collection.dp_cp_gtp_remat == "all dp"  # the caller's collection is untouched
    assert (seen[1][2].dp_cp_gtp_remat, seen[1][2].pp) == ("worker", "pp")
    assert seen[1][3] == {"load_balancing_loss": None, "z_loss": "whole worker", "seq_load_balancing_loss": "tp_cp"}
    assert tracker._metrics["z_loss"].avg_group == "tp_dp_cp"  # restored after the call
    WorkerLocalCollectives(lambda: None).wrap_moe_sync_metrics(original)(tracker, ["z_loss"], collection)
    assert seen[2][2] is collection and seen[2][3]["z_loss"] == "tp_dp_cp"


def test_inside_a_reporting_region_the_expert_group_and_the_models_groups_are_the_workers(monkeypatch):
    """0.19: calc_params_l2_norm reduces over the expert data-parallel group, train_step and
    evaluate over the model's pg_collection.dp_cp: both become the worker's in the region."""
    from megatron.core import parallel_state

    def expert(check_initialized=True, with_gtp_remat=True, partial_expert_data_parallel=False):
        return ("expert", with_gtp_remat, partial_expert_data_parallel)

    collection = SimpleNamespace(dp_cp="all dp", dp_cp_gtp_remat="all dp", tp="tp", intra_dp_cp="worker")
    model = SimpleNamespace(pg_collection=collection)
    monkeypatch.setattr(parallel_state, "get_data_parallel_group",
                        lambda **kwargs: "worker" if kwargs.get("partial_data_parallel") else "all dp")
    wl = _worker_local(_Controller(6))
    get_expert = wl.wrap_get_expert_data_parallel_group(expert)
    get_attr = wl.wrap_get_attr_wrapped_model(lambda m, attr, *a, **k: getattr(m, attr, None))
    assert get_expert(with_gtp_remat=False) == ("expert", False, False)
    assert get_attr(model, "pg_collection") is collection
    seen = []
    wl.wrap_reporting_region(lambda: seen.extend([
        get_expert(with_gtp_remat=False), get_expert(False, False),
        get_attr(model, "pg_collection"), get_attr(model, "tp_group")]))()
    assert seen[0] == seen[1] == ("expert", False, True)
    local = seen[2]
    assert local is not collection and (local.dp_cp, local.dp_cp_gtp_remat, local.tp) == ("worker", "worker", "tp")
    assert collection.dp_cp == "all dp"  # the model's own collection is untouched
    assert seen[3] is None


def test_packed_sequence_statistics_are_refused_with_local_sgd(monkeypatch):
    import megatron_edit.training.worker_local as tp

    training = SimpleNamespace(_seqlen_stats_active=True)
    monkeypatch.setitem(sys.modules, tp._TRAINING, training)
    consume = lambda: (1.0, 2.0)  # noqa: E731
    with pytest.raises(ConfigError, match="--sft, --dataloader-inter-document-masking"):
        _worker_local(_Controller(6)).wrap_consume_seqlen_stats(consume)()
    assert _worker_local().wrap_consume_seqlen_stats(consume)() == (1.0, 2.0)  # local SGD off
    training._seqlen_stats_active = False
    assert _worker_local(_Controller(6)).wrap_consume_seqlen_stats(consume)() == (1.0, 2.0)


def test_signal_check_waits_for_the_next_warmup_step_or_sync():
    checks = []
    for steps in range(1, 13):
        wl = _worker_local(_Controller(steps))
        if wl.wrap_signals_received(lambda handler: [False])(None) != []:
            checks.append(steps)
    assert checks == [1, 2, 3, 4, 8, 12]
    assert _worker_local().wrap_signals_received(lambda handler: [True])(None) == [True]


def test_rerun_vote_is_the_worlds_during_warmup_and_a_worker_verdict_needing_all_raises():
    from megatron.core.rerun_state_machine import RerunState

    machine = SimpleNamespace(state=RerunState.INITIAL_RUN, current_iteration=3)
    warmup = _worker_local(_Controller(2))
    assert warmup.wrap_rerun_reduce_any(lambda m, v: ("world", v))(machine, True) == ("world", True)
    verdict = lambda m: (True, True, 16)  # noqa: E731 - save a checkpoint and exit
    assert warmup.wrap_rerun_should_checkpoint_and_exit(verdict)(machine) == (True, True, 16)
    local = _worker_local(_Controller(6))
    machine.state = RerunState.RERUNNING_IN_PLACE
    with pytest.raises(RuntimeError, match="checkpoint and a clean exit need every worker"):
        local.wrap_rerun_should_checkpoint_and_exit(verdict)(machine)
    assert local.wrap_rerun_should_checkpoint_and_exit(lambda m: (False, False, 0))(machine) == (
        False, False, 0)
    # A state restored from a checkpoint was voted on by every rank: left to Megatron.
    machine.state = RerunState.RERUNNING_FROM_CHECKPOINT
    assert local.wrap_rerun_should_checkpoint_and_exit(verdict)(machine) == (True, True, 16)


# ================================================================ with the checkout
@pytest.fixture(scope="module")
def probe_cases(tmp_path_factory):
    """Megatron-LM's real parse_args / validate_args (tests/megatron_lm_probe.py)."""
    base = TINY + EDIT
    spec = {
        "script_case": base,
        "cases": {
            "defaults": base,
            "worker-local-logging": base + ["--log-params-norm", "--timing-log-level", "2",
                                            "--log-timers-to-tensorboard", "--exit-signal-handler",
                                            "--eval-iters", "2"],
            "exit-duration": base + ["--exit-duration-in-mins", "60"],
            "signal-handler-async": base + ["--exit-signal-handler", "--local-sgd-async"],
            "straggler": base + ["--log-straggler"],
            "energy": base + ["--log-energy"],
            "rerun-report-stats": base + ["--rerun-mode", "report_stats"],
            "adlr-autoresume": base + ["--adlr-autoresume"],
            "rerun-report-stats-without-edit": TINY + ["--rerun-mode", "report_stats"],
        },
        "sizes": {},
    }
    return run_probe(spec, tmp_path_factory.mktemp("probe"))


@needs_checkout
@pytest.mark.timeout(400)
def test_megatrons_validate_args_refuses_options_that_cross_workers(probe_cases):
    cases = probe_cases["cases"]
    for ok in ("defaults", "worker-local-logging", "rerun-report-stats-without-edit", "exit-duration"):
        assert cases[ok] is None, (ok, cases[ok])
    for name, flag in [("signal-handler-async", "--exit-signal-handler"),
                       ("straggler", "--log-straggler"), ("energy", "--log-energy"),
                       ("rerun-report-stats", "--rerun-mode report_stats"),
                       ("adlr-autoresume", "--adlr-autoresume")]:
        assert cases[name] is not None and cases[name][0] == "ConfigError", (name, cases[name])
        assert flag in cases[name][1], (name, cases[name][1])


@needs_checkout
@pytest.mark.timeout(400)
def test_worker_local_patches_are_applied_and_reverted(probe_cases):
    since = lambda version: compat.version_at_least(version)  # noqa: E731
    ids = ["worker-local-train-step", "worker-local-evaluate", "worker-local-params-norm",
           "worker-local-dp-group",
           *(["worker-local-expert-dp-group", "worker-local-pg-collection"] if since("0.19.0") else []),
           *(["worker-local-moe-metrics"] if not since("0.17.0") else []),
           *(["worker-local-moe-metrics-tracker"] if since("0.19.0") else []),
           *(["worker-local-seqlen-stats"] if since("0.18.0") else []),
           "worker-local-timer-barrier", "worker-local-timers-gather",
           "worker-local-rerun-vote", "worker-local-rerun-exit", "worker-local-signal-check"]
    assert [p for p in probe_cases["patches"] if p.startswith("worker-local-")] == ids
    assert set(ids) <= set(probe_cases["reverted"])


# ---------------------------------------------------------------- end to end
ITERS = 14
# The grid's syncs, and the run's last step (--train-iters known: the run ends with a sync there,
# off the grid too, so every worker ends with one model).
SYNC_STEPS = sorted(set(range(W + H, ITERS + 1, H)) | {ITERS})  # 8, 12, 14
SAVE_AT = 8
EVAL_AT = 6
# Iterations after warmup at which no sync is due or completing (a layer-wise sync due after s
# completes in the forward pass of s + 1).
LOCAL_ITERATIONS = [i for i in range(W + 1, ITERS + 1)
                    if i not in SYNC_STEPS and i - 1 not in SYNC_STEPS]  # 5, 6, 7, 10, 11
OPTIONS = [
    "--train-iters", str(ITERS), "--log-params-norm", "--timing-log-level", "2",
    "--log-throughput", "--log-num-zeros-in-grad", "--exit-signal-handler",
    "--check-for-spiky-loss", "--check-for-large-grads",
    "--check-weight-hash-across-dp-replicas-interval", str(H),
    "--eval-iters", "2", "--eval-interval", str(EVAL_AT),
    "--save", "ckpt", "--save-interval", str(SAVE_AT), "--ckpt-format", "torch_dist",
]
if HAVE_TENSORBOARD:
    OPTIONS += ["--tensorboard-dir", "tb", "--log-timers-to-tensorboard"]


def _traffic_run(workdir, extra, env=None, timeout=900):
    """pretrain_gpt.py under the traffic probe on 4 CPU processes (2 workers x 2 shards). The
    timeout only guards against hangs: a run takes 1-2 minutes, much longer on a loaded machine."""
    out = workdir / "traffic"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
           str(PROBE), str(out), "--cpu", str(CHECKOUT / "pretrain_gpt.py"), *TINY, *EDIT, *extra]
    proc = subprocess.run(cmd, cwd=workdir, env={**_env(), **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)}\n...\n{log[-8000:]}"
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    return SimpleNamespace(log=log, ranks=ranks)


def _frames(record):
    return record["stack"]


def _has(record, *names):
    return any(name in frame for frame in _frames(record) for name in names)


def _in_training_loop(record, first_step):
    """Inside Megatron's ``train`` once iterations run. Before the first ``train_step`` it is
    start-up, also where Megatron already counts iteration 1 (core_v0.19 sets the iteration
    before its start-of-training barrier and replica check)."""
    return record["iteration"] is not None and record["time"] >= first_step and any(
        frame.startswith("training/training.py:train:") for frame in _frames(record))


def _crossing(run):
    """(rank, record) of every collective inside the training loop whose group spans workers."""
    found = []
    for data in run.ranks:
        worker = set(data["worker_ranks"])
        assert len(worker) == 2, data["worker_ranks"]
        first_step = min(r["time"] for r in data["records"] if _has(r, "training/training.py:train_step:"))
        for record in data["records"]:
            assert "error" not in record, record
            if _in_training_loop(record, first_step) and set(record["ranks"]) - worker:
                found.append((data["rank"], record))
    return found


def _where(record):
    """The Megatron / megatron_edit function that issued it (innermost frame, no line)."""
    return record["stack"][-1].rsplit(":", 1)[0]


def _why_allowed(record, sync_steps, warmup):
    """Why a collective across workers is expected at its iteration, or None."""
    it = record["iteration"]
    if it <= warmup and _has(record, "param_and_grad_buffer.py:start_grad_sync",
                             "param_and_grad_buffer.py:finish_grad_sync"):
        return "warmup: gradients are reduced across workers"
    if it <= warmup and _has(record, "rerun_state_machine.py:_reduce_any"):
        return "warmup: a re-run redoes that reduction, every worker votes"
    if it <= warmup and _where(record) == "training/training.py:train_step":
        # (WorkerLocalCollectives.in_reporting: the workers step together, their gradients and
        # token counts are everyone's, and so is the logged loss)
        return "warmup: the logged loss is averaged over every data-parallel rank, as the gradients are"
    if (it in sync_steps or it - 1 in sync_steps) and _has(record, SYNC):
        return "the sync exchange (completes in the next forward pass)"
    synced = it <= warmup or it in sync_steps
    if synced and _has(record, "dist_signal_handler.py:signals_received"):
        return "--exit-signal-handler, checked when workers meet"
    if synced and it % H == 0 and (_has(record, "check_param_hashes_across_dp_replicas")
                                   or _where(record) == "training/training.py:post_training_step_callbacks"):
        return "--check-weight-hash-across-dp-replicas-interval (multiple of H): replicas equal"
    if it in sync_steps and it % SAVE_AT == 0 and _has(record, "save_checkpoint"):
        return "checkpoint save (a multiple of H)"
    return None


def _grad_norms(log):
    return {int(m.group(1)): m.group(2) for m in re.finditer(
        r"\] iteration\s+(\d+)/\s*\d+ \|.*? grad norm: ([0-9.]+) \|", log)}


@pytest.fixture(scope="module")
def edit_runs(tmp_path_factory):
    if not HAVE_CHECKOUT:
        pytest.skip(HOW_TO_RUN)
    runs = {}
    for name, env in (("after", {}), ("before", {"MEGATRON_EDIT_PROBE_NO_WORKER_LOCAL": "1"})):
        workdir = tmp_path_factory.mktemp(name)
        runs[name] = _traffic_run(workdir, OPTIONS, env)
    return runs


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_e2e_edit_nothing_crosses_workers_between_syncs(edit_runs):
    run = edit_runs["after"]
    crossing = _crossing(run)
    unexpected = [(rank, r["iteration"], r["op"], r["ranks"], r["stack"][-4:])
                  for rank, r in crossing if _why_allowed(r, SYNC_STEPS, W) is None]
    assert not unexpected, "\n".join(map(str, unexpected))
    assert not [r for _, r in crossing if r["iteration"] in LOCAL_ITERATIONS]
    # The recorder does see traffic across workers: warmup gradients and every sync.
    reasons = {(_why_allowed(r, SYNC_STEPS, W), r["iteration"]) for _, r in crossing}
    assert ("warmup: gradients are reduced across workers", 1) in reasons
    for step in SYNC_STEPS:
        assert ("the sync exchange (completes in the next forward pass)", step) in reasons
    assert ("checkpoint save (a multiple of H)", SAVE_AT) in reasons
    # What became worker-local still ran: evaluation between syncs, the timers' report, the
    # params norm, Megatron's replica check after every sync.
    assert f"validation loss at iteration {EVAL_AT}" in run.log
    assert "(min, max) time across ranks (ms):" in run.log
    assert " params norm: " in run.log
    assert re.findall(r"Weight hashes match after (\d+) iterations", run.log) == [
        str(i) for i in range(0, ITERS + 1, H)]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_e2e_without_the_patches_megatron_crosses_workers_every_step(edit_runs):
    """What the worker-local patches remove: Megatron's own collectives across workers at
    iterations where EDiT exchanges nothing."""
    local = [r for _, r in _crossing(edit_runs["before"]) if r["iteration"] in LOCAL_ITERATIONS]
    where = {(_where(r), r["op"]) for r in local}
    assert {
        ("training/training.py:train_step", "all_reduce"),  # the logged loss
        ("core/rerun_state_machine.py:_reduce_any", "all_reduce"),  # the re-run vote
        ("core/timers.py:start", "barrier"),  # timers (interval timer, --timing-log-level)
        ("core/timers.py:_get_elapsed_time_all_ranks", "all_gather_into_tensor"),  # timer report
        ("training/dist_signal_handler.py:all_gather_item", "all_gather"),  # signal check
        ("training/training.py:evaluate", "all_reduce"),  # validation loss
    } <= where, sorted(where)
    # --log-params-norm: training/utils.py until core_v0.17, a package since (and in 0.19 also
    # over the expert data-parallel group).
    assert any(_has(r, "calc_params_l2_norm") and r["op"] == "all_reduce" for r in local), sorted(where)
    for iteration in LOCAL_ITERATIONS:
        assert any(r["iteration"] == iteration for r in local), iteration


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_e2e_training_numbers_do_not_change(edit_runs):
    """Only figures for the log became worker-local: the gradient norm (already per worker in
    Megatron) is the same at every iteration with and without the patches."""
    after, before = _grad_norms(edit_runs["after"].log), _grad_norms(edit_runs["before"].log)
    assert sorted(after) == list(range(1, ITERS + 1))
    assert after == before


# A-EDiT: workers of different speeds take their own number of steps between syncs, so a
# collective across workers at a fixed iteration is not only a barrier: it can meet another
# worker's sync and deadlock. One worker is slowed down (ranks 2, 3 sleep in every optimizer
# step). One time-based sync at W + H (the first interval is H steps for every worker); the
# next would be planned 1000 s later, beyond the budget (ASYNC_ITERS x 2 worker-steps), so it
# becomes the run's final sync, the remaining worker-steps split by speed: each worker reaches
# it at its own iteration (the fast one past ASYNC_ITERS) and leaves the loop there.
SLOW_SECONDS = 2.0  # well above a step's own time, also on a loaded 2-core machine
ASYNC_ITERS = 14


@pytest.fixture(scope="module")
def async_run(tmp_path_factory):
    if not HAVE_CHECKOUT:
        pytest.skip(HOW_TO_RUN)
    options = ["--train-iters", str(ASYNC_ITERS), "--local-sgd-async", "--local-sgd-sync-time", "1000",
               "--local-sgd-min-total-global-steps", "0", "--log-params-norm", "--timing-log-level",
               "1", "--eval-iters", "1", "--eval-interval", "10"]
    return _traffic_run(tmp_path_factory.mktemp("async"), options,
                        {"MEGATRON_EDIT_PROBE_SLOW": f"2,3:{SLOW_SECONDS}"})


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_e2e_a_edit_workers_run_apart_between_syncs(async_run):
    sync_step = W + H
    final = {data["rank"]: max(r["iteration"] for r in data["records"]
                               if r["iteration"] is not None and _has(r, PLAN_ASYNC))
             for data in async_run.ranks}
    crossing = _crossing(async_run)
    unexpected = []
    for rank, r in crossing:
        syncing = r["iteration"] in (sync_step, sync_step + 1, final[rank]) and _has(r, SYNC)
        if not syncing and _why_allowed(r, [], W) is None and r["iteration"] != final[rank]:
            unexpected.append((rank, r["iteration"], r["op"], r["ranks"], r["stack"][-4:]))
    assert not unexpected, "\n".join(map(str, unexpected))
    assert any(_has(r, PLAN_ASYNC) for _, r in crossing)  # the A-EDiT schedule
    assert "validation loss at iteration 10" in async_run.log
    # Nothing holds the fast worker back between the syncs: it takes more steps than the slow
    # one before the final sync (with Megatron's per-step collectives both would take the same),
    # together the budget.
    assert final[0] == final[1] and final[2] == final[3], final
    assert final[0] > ASYNC_ITERS > final[2] and final[0] + final[2] == 2 * ASYNC_ITERS, final


# MoE: a 4-expert top-2 GPT with expert parallelism 2 on 4 CPU ranks (2 workers, each with one
# copy of every expert), the penalty on, Megatron's replica check every H iterations.
MOE_ITERS = 12
MOE_SYNC_STEPS = [8, 12]
MOE_LOCAL_ITERATIONS = [5, 6, 7, 10, 11]
_MOE_LOGGING = ("moe_utils.py:reduce_aux_losses_tracker_across_ranks",  # 0.16
                "moe_logging.py:_sync_metrics")  # 0.19


def _skip_without_moe_route() -> None:
    """The MoE runs need the checkout, on a release whose MoE route is not refused."""
    if not HAVE_CHECKOUT:
        pytest.skip(HOW_TO_RUN)
    if LINE not in MOE_LINES:
        pytest.skip(f"MoE with --use-local-sgd through Megatron-LM is refused on megatron-core {LINE}")


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    _skip_without_moe_route()
    options = [*PENALTY, *MOE, "--moe-z-loss-coeff", "0.001", "--train-iters", str(MOE_ITERS),
               "--check-weight-hash-across-dp-replicas-interval", str(H)]
    return _traffic_run(tmp_path_factory.mktemp("moe"), options)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_e2e_moe_with_expert_parallelism_trains_with_edit(moe_run):
    """pretrain_gpt.py (core_v0.16.1 or core_v0.19.0) accepts the MoE flags with
    --use-local-sgd, the router runs without transformer-engine, the MoE auxiliary loss is
    logged every iteration, EDiT syncs on its grid, and every replica (experts included: Megatron
    hashes them over the expert data-parallel group, across the workers) is identical at every
    check: after warmup and after each sync."""
    lines = _lines(moe_run.log)
    assert sorted(lines) == list(range(1, MOE_ITERS + 1))
    assert all(_field(line, "load_balancing_loss") is not None for line in lines.values())
    assert all(_field(line, "z_loss") is not None for line in lines.values())
    losses = [_field(lines[i], "lm loss") for i in sorted(lines)]
    assert losses[-1] < losses[0] - 0.3, losses
    assert _synced_steps(moe_run.log) == MOE_SYNC_STEPS
    assert _hash_checks(moe_run.log) == list(range(0, MOE_ITERS + 1, H))


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_e2e_moe_nothing_crosses_workers_between_syncs(moe_run):
    """The recorder's count of collectives across workers at the iterations between syncs is 0
    (before the worker-local MoE logging patches, the MoE metrics' data-parallel average crossed
    at every iteration, and on 0.19 the router's z-loss over its tensor x data x context-parallel
    group); the MoE metrics are still reduced, inside the worker."""
    crossing = _crossing(moe_run)
    unexpected = [(rank, r["iteration"], r["op"], r["ranks"], r["stack"][-4:])
                  for rank, r in crossing if _why_allowed(r, MOE_SYNC_STEPS, W) is None]
    assert not unexpected, "\n".join(map(str, unexpected))
    assert [r for _, r in crossing if r["iteration"] in MOE_LOCAL_ITERATIONS] == []
    reasons = {(_why_allowed(r, MOE_SYNC_STEPS, W), r["iteration"]) for _, r in crossing}
    for step in MOE_SYNC_STEPS:
        assert ("the sync exchange (completes in the next forward pass)", step) in reasons
    for data in moe_run.ranks:
        moe_logging = [r for r in data["records"] if r["iteration"] in MOE_LOCAL_ITERATIONS
                       and _has(r, *_MOE_LOGGING)]
        assert moe_logging and all(set(r["ranks"]) <= set(data["worker_ranks"]) for r in moe_logging)


@pytest.fixture(scope="module")
def moe_async_run(tmp_path_factory):
    _skip_without_moe_route()
    options = ["--train-iters", str(ASYNC_ITERS), "--local-sgd-async", "--local-sgd-sync-time", "1000",
               "--local-sgd-min-total-global-steps", "0", *MOE]
    return _traffic_run(tmp_path_factory.mktemp("moe-async"), options,
                        {"MEGATRON_EDIT_PROBE_SLOW": f"2,3:{SLOW_SECONDS}"})


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_e2e_moe_a_edit_with_expert_parallelism(moe_async_run):
    """A-EDiT with EP=2 (the dense and the expert optimizers, one schedule), one worker slowed
    down as in the A-EDiT test above: nothing crosses workers between the syncs, the fast
    worker takes more steps, together the budget, and both halves of the model sync together
    (each rank plans every sync once: the expert controller follows the dense one's plan)."""
    sync_step = W + H
    final = {data["rank"]: max(r["iteration"] for r in data["records"]
                               if r["iteration"] is not None and _has(r, PLAN_ASYNC))
             for data in moe_async_run.ranks}
    unexpected = []
    for rank, r in _crossing(moe_async_run):
        syncing = r["iteration"] in (sync_step, sync_step + 1, final[rank]) and _has(r, SYNC)
        if not syncing and _why_allowed(r, [], W) is None and r["iteration"] != final[rank]:
            unexpected.append((rank, r["iteration"], r["op"], r["ranks"], r["stack"][-4:]))
    assert not unexpected, "\n".join(map(str, unexpected))
    assert final[0] == final[1] and final[2] == final[3], final
    assert final[0] > ASYNC_ITERS > final[2] and final[0] + final[2] == 2 * ASYNC_ITERS, final
    for data in moe_async_run.ranks:
        plans = [r["iteration"] for r in data["records"] if _has(r, PLAN_ASYNC)]
        assert plans == sorted(set(plans)), plans  # one schedule all-reduce per sync
