"""A-EDiT's global budget in Megatron-LM's training loop (megatron_edit.training.global_budget).

End to end (needs MEGATRON_LM_DIR, see tests/training/test_megatron_lm.py; skipped with that
message otherwise): the unmodified ``pretrain_gpt.py`` through ``megatron_edit.launch`` on 2 CPU
processes over gloo, 2 A-EDiT workers of one rank each, worker 1 slowed down (it sleeps in every
optimizer step, ``tests/training/megatron_lm_traffic_probe.py``). The fast worker runs more than
``--train-iters`` steps, the slow one fewer, together exactly the budget; both leave the loop at
the final sync, report the common iteration, and checkpoints land at syncs with a common label.
The decisions themselves are tested without the checkout.
"""

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from megatron_edit.config import ConfigError
from megatron_edit.training import global_budget as gb
from megatron_edit.training.validation import validate_local_sgd_args
from test_megatron_lm import CHECKOUT, HAVE_CHECKOUT, HOW_TO_RUN, REPO, TINY, _env, _megatron_like_args, run_job

PROBE = REPO / "tests" / "training" / "megatron_lm_traffic_probe.py"


# ================================================================ without the checkout
def test_intervals_count_global_progress():
    assert gb.crossed(4.0, 8.0, 6) and not gb.crossed(6.0, 11.5, 6) and gb.crossed(11.5, 12.0, 6)
    assert not gb.crossed(0.0, 100.0, None) and not gb.crossed(0.0, 100.0, 0)
    assert gb.checkpoint_iteration(12.999) == 12 and gb.checkpoint_iteration(16.0) == 16


@pytest.mark.parametrize("flag, options", [
    ("--non-persistent-save-interval", dict(non_persistent_save_interval=5)),
    ("--rampup-batch-size", dict(rampup_batch_size=["4", "4", "100"])),
])
def test_saves_at_a_workers_own_iteration_are_refused(flag, options):
    args = _megatron_like_args("--use-local-sgd", "--local-sgd-async", train_iters=100, **options)
    with pytest.raises(ConfigError, match=flag):
        validate_local_sgd_args(args)


def test_save_and_exit_intervals_are_accepted_with_a_edit():
    validate_local_sgd_args(_megatron_like_args(
        "--use-local-sgd", "--local-sgd-async", train_iters=100, save_interval=10, exit_interval=50))
    # Asynchronous saves are taken at syncs too; their completion is checked where workers meet.
    validate_local_sgd_args(_megatron_like_args(
        "--use-local-sgd", "--local-sgd-async", train_iters=100, save="ckpt", save_interval=10,
        async_save=True))


@pytest.mark.parametrize("option", ["save_interval", "exit_interval", "exit_duration_in_mins"])
def test_a_delay_with_a_edit_refuses_saves_and_stops_at_its_syncs(option):
    """A-EDiT saves and stops at a sync, where a delayed exchange has just been launched (issue 60):
    a checkpoint with it in flight is not built for A-EDiT, so the flags are refused at start-up."""
    args = _megatron_like_args("--use-local-sgd", "--local-sgd-async", "--local-sgd-outer-step-delay", "2",
                               train_iters=100, **{option: 10})
    with pytest.raises(ConfigError, match=f"--{option.replace('_', '-')} with --local-sgd-async and "
                                          "--local-sgd-outer-step-delay is not supported yet"):
        validate_local_sgd_args(args)
    validate_local_sgd_args(_megatron_like_args(  # without them: accepted
        "--use-local-sgd", "--local-sgd-async", "--local-sgd-outer-step-delay", "2", train_iters=100))
    # the automatic overlap may choose a delay (A-EDiT included, issue 60): refused alike
    args = _megatron_like_args("--use-local-sgd", "--local-sgd-async", "--local-sgd-auto-overlap",
                               train_iters=100, **{option: 10})
    with pytest.raises(ConfigError, match=f"--{option.replace('_', '-')} with --local-sgd-async and "
                                          "--local-sgd-auto-overlap is not supported yet.*or --local-sgd-auto-overlap"):
        validate_local_sgd_args(args)


class _Controller:
    def __init__(self, workers=2):
        self.config = SimpleNamespace(use_async=True)
        self.budget_workers = workers
        self.budget_steps = 1  # known (--train-iters)
        self.global_progress = 0.0
        self.finished = False
        self.last_sync = None
        self.at_sync = False
        self.backend = SimpleNamespace(healed_sync_step=None)  # (the sync backend's interface: no heal)


def _budget(controller, monkeypatch, args):
    monkeypatch.setattr(gb, "_get_args", lambda: args)
    runtime = SimpleNamespace(controllers={object(): controller})
    return gb.GlobalBudget(lambda: runtime)


def test_loop_cap_end_and_common_iteration(monkeypatch):
    controller = _Controller()
    args = SimpleNamespace(train_iters=10, iteration=0, rank=0, curr_iteration=None)
    budget = _budget(controller, monkeypatch, args)
    budget.wrap_setup_model_and_optimizer(lambda: "built")()
    assert args.train_iters == 20 and budget.train_iters == 10  # T x W, after the scheduler
    controller.at_sync, controller.last_sync = False, None
    args.save, args.save_interval, args.exit_interval = None, None, None
    decide = budget.wrap_checkpoint_and_decide_exit(lambda *call: False)
    assert decide(None, None, None, 13, 0.0, None, None) is False and args.train_iters == 20
    controller.finished = True
    decide(None, None, None, 13, 0.0, None, None)
    assert args.train_iters == 13  # the loop ends after this iteration (the final sync's)
    assert budget.wrap_train(lambda: (13, 1.5))() == (10, 1.5)
    assert args.train_iters == 10
    controller.finished = False
    with pytest.raises(RuntimeError, match="before A-EDiT's final sync"):
        budget.wrap_train(lambda: (20, 0.0))()


def test_saves_and_exits_only_at_real_syncs(monkeypatch):
    controller = _Controller()
    args = SimpleNamespace(train_iters=16, iteration=0, rank=0, save="ckpt", save_interval=6,
                           exit_interval=None)
    budget = _budget(controller, monkeypatch, args)
    budget.wrap_setup_model_and_optimizer(lambda: None)()
    saved, seen = [], []
    monkeypatch.setattr(budget, "save", lambda label, *a: saved.append(label))

    def original(*call):  # Megatron's own: must not see the intervals
        seen.append((args.save_interval, args.exit_interval))
        return False

    decide = budget.wrap_checkpoint_and_decide_exit(original)

    def at(progress, steps, skipped=False, final=False, sync=True):
        controller.at_sync = sync
        controller.last_sync = SimpleNamespace(global_progress=progress, skipped=skipped, final=final)
        return decide(*[None] * 7)

    assert not at(3.0, 6, sync=False)  # between syncs: never
    assert not at(5.0, 10) and saved == []
    assert not at(7.5, 15, skipped=True) and saved == []  # a skipped sync: replicas differ
    assert not at(8.0, 16) and saved == [8]  # past 6: the first real sync after it
    assert not at(11.0, 22) and saved == [8]
    assert not at(16.0, 32, final=True) and saved == [8]  # 16 % 6: Megatron saves after the loop
    assert set(seen) == {(None, None)} and args.save_interval == 6
    args.exit_interval = 12
    budget._progress_at_last_sync = 8.0
    assert at(12.5, 25) and saved == [8, 12]  # exit (with a save) at the sync past 12


def test_exit_duration_is_asked_at_real_syncs_and_saves_there(monkeypatch):
    # --exit-duration-in-mins with A-EDiT: Megatron's own check (an all-reduce over all ranks at
    # each worker's own iteration) never runs; the time is asked at real syncs, all ranks at
    # once, and the exit saves there with the sync's common label.
    controller = _Controller()
    args = SimpleNamespace(train_iters=16, iteration=0, rank=0, save="ckpt", save_interval=None,
                           exit_interval=None, exit_duration_in_mins=30)
    budget = _budget(controller, monkeypatch, args)
    budget.wrap_setup_model_and_optimizer(lambda: None)()
    saved, seen, asked, up = [], [], [], [False]
    monkeypatch.setattr(budget, "save", lambda label, *a: saved.append(label))
    monkeypatch.setattr(gb.GlobalBudget, "_time_is_up", staticmethod(lambda a: asked.append(1) or up[0]))

    def original(*call):
        seen.append(args.exit_duration_in_mins)
        return False

    decide = budget.wrap_checkpoint_and_decide_exit(original)

    def at(progress, skipped=False, sync=True):
        controller.at_sync = sync
        controller.last_sync = SimpleNamespace(global_progress=progress, skipped=skipped, final=False)
        return decide(*[None] * 7)

    assert not at(3.0, sync=False) and asked == []  # between syncs: not asked
    assert not at(4.0, skipped=True) and asked == []  # a skipped sync: no checkpoint there
    assert not at(5.0) and len(asked) == 1 and saved == []
    up[0] = True
    assert at(6.5) and saved == [6]  # time is up: leave, saving at the sync
    assert set(seen) == {None} and args.exit_duration_in_mins == 30


# ================================================================ with the checkout
# The slow worker sleeps SLOW_SECONDS per step on top of the step itself, so it is clearly the
# slower one even on a loaded machine (2-4 s per step here at load 50 on 2 cores).
T = 12
WARMUP, H = 2, 2
SLOW_SECONDS = 3.0
SYNC_SECONDS = 10
SAVE_INTERVAL = 4  # the first sync after warmup is at global iteration WARMUP + H = 4, always


@pytest.fixture(scope="module")
def straggler_run(tmp_path_factory):
    if not HAVE_CHECKOUT:
        pytest.skip(HOW_TO_RUN)
    workdir = tmp_path_factory.mktemp("budget")
    log, ranks = _a_edit_run(workdir)
    return SimpleNamespace(log=log, ranks=ranks, workdir=workdir)


def _a_edit_run(workdir, *extra, env=None, length=("--train-iters", str(T))):
    """The straggler run of 2 A-EDiT workers through pretrain_gpt.py in ``workdir`` (checkpoints
    in ckpt/; ``extra``: more Megatron flags): (its log, each rank's recorded collectives)."""
    out = workdir / "traffic"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(PROBE), str(out), "--cpu", str(CHECKOUT / "pretrain_gpt.py"), *TINY,
           "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2",
           "--overlap-grad-reduce", "--overlap-param-gather", "--use-local-sgd",
           "--local-sgd-sync-interval", str(H), "--local-sgd-warmup-steps", str(WARMUP),
           "--local-sgd-async", "--local-sgd-sync-time", str(SYNC_SECONDS),
           "--local-sgd-min-total-global-steps", "0", *length,
           "--save", "ckpt", "--save-interval", str(SAVE_INTERVAL), "--ckpt-format", "torch_dist",
           "--local-sgd-debug", *extra]
    env = {**_env(), "MEGATRON_EDIT_PROBE_SLOW": f"1:{SLOW_SECONDS}", **(env or {})}
    try:
        proc = run_job(cmd, workdir, env, 600)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"A-EDiT through pretrain_gpt.py hung (no exit in {e.timeout} s):\n"
                    f"{(e.stdout or '')[-4000:]}\n{(e.stderr or '')[-4000:]}")
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(cmd)}\n...\n{log[-8000:]}"
    return log, [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


def _steps_per_worker(run):
    """Each rank's last training iteration (the probe records Megatron's 1-based iteration)."""
    return [max(r["iteration"] for r in data["records"] if r["iteration"] is not None)
            for data in run.ranks]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_e2e_a_edit_shares_the_budget_and_ends_together(straggler_run):
    run = straggler_run
    fast, slow = _steps_per_worker(run)
    assert fast > T > slow, (fast, slow)  # the fast worker used the slow one's share
    assert fast + slow == T * 2, (fast, slow)  # the budget exactly: T x workers worker-steps
    # Both workers reached the final sync (the last schedule all-reduce is at each one's last
    # step), and nothing after it hung.
    for data, last in zip(run.ranks, (fast, slow)):
        plans = [r["iteration"] for r in data["records"] if any("async_plan.py:plan:" in f for f in r["stack"])]
        assert plans and plans[-1] == last, (data["rank"], plans, last)
    # Megatron's log (the last rank: the slow worker) is sane: iterations count up to its own
    # last step over the loop's cap T x W, and the global iteration reaches T.
    lines = re.findall(r"\] iteration\s+(\d+)/\s*(\d+) \|.*?global iteration: ([0-9.]+)/(\d+) \|",
                       run.log)
    assert [int(i) for i, *_ in lines] == list(range(1, slow + 1))
    assert {int(cap) for _, cap, _, _ in lines} <= {2 * T, slow}
    progress = [float(p) for _, _, p, _ in lines]
    assert progress == sorted(progress) and progress[-1] == pytest.approx(T)
    assert {int(t) for *_, t in lines} == {T}
    # The common iteration: Megatron's final save and evaluation after the loop use T.
    assert re.search(rf"saved checkpoint from iteration\s+{T} ", run.log), run.log[-3000:]
    assert (run.workdir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(T)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_e2e_checkpoints_at_syncs_with_a_common_label(straggler_run):
    run = straggler_run
    saved = sorted({int(i) for i in re.findall(r"saved checkpoint from iteration\s+(\d+) ", run.log)})
    # At the first sync (global iteration 4) and at the final one (12, a multiple of 4); any in
    # between at the first real sync past a multiple of 4, labelled with its global iteration.
    assert saved[0] == WARMUP + H and saved[-1] == T, saved
    for label in saved:
        assert (run.workdir / "ckpt" / f"iter_{label:07d}").is_dir(), label
    # Each save is an all-ranks collective right after a sync, at each worker's own iteration.
    for data in run.ranks:
        saves = sorted({r["iteration"] for r in data["records"]
                        if any("save_checkpoint" in f for f in r["stack"])})
        plans = {r["iteration"] for r in data["records"] if any("async_plan.py:plan:" in f for f in r["stack"])}
        assert saves and set(saves) <= plans | {None}, (data["rank"], saves, plans)


def _first_training_iteration(data):
    return min(r["iteration"] for r in data["records"]
               if r["iteration"] is not None and any("training.py:train_step:" in f for f in r["stack"]))


@pytest.fixture(scope="module")
def resumed_run(straggler_run, tmp_path_factory):
    """The straggler run resumed through ``--load`` from its last checkpoint before the end
    (written by ``--save-interval`` at a sync, where the workers' step counts differ)."""
    import shutil

    run = straggler_run
    labels = sorted({int(i) for i in re.findall(r"saved checkpoint from iteration\s+(\d+) ", run.log)})
    label = max(i for i in labels if i < T)
    # Each rank's own step count at each save (the saves are collectives of every rank, in order).
    own = []
    for data in run.ranks:
        saves = sorted({r["iteration"] for r in data["records"] if r["iteration"] is not None
                        and any("save_checkpoint" in f for f in r["stack"])})
        own.append(dict(zip([i for i in labels if i < T], saves))[label])
    workdir = tmp_path_factory.mktemp("budget-resumed")
    shutil.copytree(run.workdir / "ckpt", workdir / "ckpt")
    for later in (i for i in labels if i > label):
        shutil.rmtree(workdir / "ckpt" / f"iter_{later:07d}")
    (workdir / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(label))
    log, ranks = _a_edit_run(workdir, "--load", "ckpt")
    return SimpleNamespace(log=log, ranks=ranks, workdir=workdir, label=label, saved_steps=own)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_e2e_a_edit_resumes_each_worker_at_its_own_step_and_keeps_the_budget(resumed_run):
    # A checkpoint written through --save-interval at an A-EDiT sync, resumed end to
    # end. Each worker goes on from its own step count at the save (they differ: the fast worker
    # had taken more steps), and the run still ends at the same global budget, T x workers.
    run = resumed_run
    starts = [_first_training_iteration(data) for data in run.ranks]
    assert starts == [s + 1 for s in run.saved_steps], (starts, run.saved_steps, run.label)
    fast, slow = _steps_per_worker(run)
    assert fast + slow == T * 2, (fast, slow)
    assert re.search(rf"loading (distributed )?checkpoint from ckpt at iteration {run.label}", run.log) or \
        f"iteration {run.label}" in run.log, run.log[-3000:]
    assert re.search(rf"saved checkpoint from iteration\s+{T} ", run.log), run.log[-3000:]


@pytest.fixture(scope="module")
def async_save_run(tmp_path_factory):
    """The straggler run with Megatron's asynchronous save (written by a persistent background
    worker; Megatron asks every rank whether the write has finished)."""
    if not HAVE_CHECKOUT:
        pytest.skip(HOW_TO_RUN)
    workdir = tmp_path_factory.mktemp("budget-async-save")
    log, ranks = _a_edit_run(workdir, "--async-save", "--use-persistent-ckpt-worker")
    return SimpleNamespace(log=log, ranks=ranks, workdir=workdir)


def _async_finalize_iterations(data):
    """The iterations at which this rank took part in Megatron's asynchronous-save check (the
    world all-reduces of megatron-core's AsyncCallsQueue; None: outside the loop)."""
    return [r["iteration"] for r in data["records"]
            if any("dist_checkpointing/strategies/async_utils.py" in f for f in r["stack"])]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_e2e_a_edit_async_save_is_checked_and_finalized_at_syncs(async_save_run):
    """--async-save with A-EDiT (refused before: its per-iteration completion check is an
    all-reduce over all ranks, which A-EDiT workers reach at different iterations): the run ends
    on the budget, every checkpoint is written at a sync and finalized, and each rank joins the
    check only at warmup steps and at its own syncs, the points all workers share."""
    run = async_save_run
    fast, slow = _steps_per_worker(run)
    assert fast > T > slow and fast + slow == T * 2, (fast, slow)
    saved = sorted({int(i) for i in re.findall(r"checkpoint from iteration\s+(\d+) ", run.log)})
    assert saved and saved[0] == WARMUP + H and saved[-1] == T, saved
    for label in saved:  # finalized: Megatron's metadata written next to the shards
        assert (run.workdir / "ckpt" / f"iter_{label:07d}" / "metadata.json").is_file(), label
    assert (run.workdir / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(T)
    counts = set()
    for data in run.ranks:
        plans = {r["iteration"] for r in data["records"] if any("async_plan.py:plan:" in f for f in r["stack"])}
        checks = _async_finalize_iterations(data)
        assert checks, data["rank"]  # the check ran (the saves were asynchronous)
        off = sorted({i for i in checks if i is not None and i > WARMUP and i not in plans})
        assert not off, (data["rank"], off, sorted(plans))
        counts.add(len(checks))
    assert len(counts) == 1, counts  # every rank the same number of checks, in the same order


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_e2e_a_edit_with_train_samples_shares_the_same_budget(tmp_path):
    """--train-samples T x the global batch size instead of --train-iters T (refused before):
    the same budget, shared by speed, both workers ending at the final sync, global iteration T."""
    if not HAVE_CHECKOUT:
        pytest.skip(HOW_TO_RUN)
    log, ranks = _a_edit_run(tmp_path, length=("--train-samples", str(T * 8), "--lr-warmup-iters", "0",
                                                "--lr-warmup-samples", "16"))  # global batch 8
    run = SimpleNamespace(log=log, ranks=ranks)
    fast, slow = _steps_per_worker(run)
    assert fast > T > slow and fast + slow == T * 2, (fast, slow)
    for data, last in zip(ranks, (fast, slow)):
        plans = [r["iteration"] for r in data["records"] if any("async_plan.py:plan:" in f for f in r["stack"])]
        assert plans and plans[-1] == last, (data["rank"], plans, last)
    assert re.search(rf"saved checkpoint from iteration\s+{T} ", log), log[-3000:]

