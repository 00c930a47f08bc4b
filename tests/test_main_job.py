"""The main job, scripts/train_gpt_edit.py: its flags refused at start-up in one line, and runs
through torchrun (4 CPU processes) that end, count every sync and tell the truth.

Flag checks run in-process (they end before Megatron is imported or the process group exists);
the runs start ``torchrun --nproc_per_node 4`` with a free port and a hard timeout that kills
the whole process group, so a hang fails the test instead of the suite.
"""

import argparse
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "train_gpt_edit.py"
# Small runs: first sync after step 4, then every 2 steps.
SHORT = ["--local-sgd-warmup-steps", "2", "--local-sgd-sync-interval", "2", "--lr-warmup-steps", "2",
         "--log-interval", "1"]


@pytest.fixture(scope="module")
def job():
    spec = importlib.util.spec_from_file_location("train_gpt_edit_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _refusal(job, monkeypatch, capsys, argv, rank="0", world="4"):
    """Run main(argv) as torchrun's rank ``rank`` would: expect exit code 2 before anything
    heavy, and return what it printed."""
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("LOCAL_RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", world)
    monkeypatch.setattr(job.dist, "init_process_group", lambda *a, **k: pytest.fail("got past the checks"))
    with pytest.raises(SystemExit) as info:
        job.main(argv)
    assert info.value.code == 2
    captured = capsys.readouterr()
    return captured.out + captured.err


def _fsdp_here() -> bool:
    from megatron_edit.mcore import compat
    from megatron_edit.mcore.releases import FSDP_SUPPORTED

    return FSDP_SUPPORTED.contains(compat.megatron_core_version())


_FSDP_HERE = _fsdp_here()
REFUSED = [
    # (argv, what the one line must say). Before: ZeroDivisionError (the interval ones after
    # step 1), a bare AssertionError from Megatron's scheduler, or a run that exits 0.
    (["--workers", "0"], "argument --workers: must be an integer >= 1 (got 0)"),
    (["--workers", "3"], "--workers 3 must divide the number of processes (4"),
    (["--local-sgd-sync-backend", "torchft", "--local-sgd-replica-id", "0", "--local-sgd-min-replicas", "3"],
     "--local-sgd-min-replicas 3 is more than --workers 2: no sync could ever commit"),
    (["--local-sgd-sync-backend", "torchft", "--local-sgd-replica-id", "0", "--mode", "both"],
     "--mode both with --local-sgd-sync-backend torchft: the synchronous run needs every worker in one job"),
    (["--eval-interval", "0"], "argument --eval-interval: must be an integer >= 1"),
    (["--log-interval", "0"], "argument --log-interval: must be an integer >= 1"),
    (["--steps", "0"], "argument --steps: must be an integer >= 1"),
    (["--steps", "5"], "--lr-warmup-steps 10 must be below --steps 5"),
    (["--lr", "nan"], "argument --lr: must be a finite number > 0"),
    (["--compute-sleep-ms", "-5"], "argument --compute-sleep-ms: must be a finite number >= 0"),
    (["--hidden", "66"], "--hidden 66 must be a multiple of --heads 4"),
    (["--eval-samples", "4"], "--eval-samples 4 is fewer than one validation batch"),
    (["--outer-optimizer-kwargs", "{lr: 1}"], "argument --outer-optimizer-kwargs: not JSON"),
    (["--outer-optimizer-lr", "inf"], "lr must be a finite number > 0 (got inf)"),
    (["--outer-optimizer-lr", "-1"], "lr must be a finite number > 0 (got -1.0)"),
    (["--outer-optimizer-momentum", "nan"], "momentum must be a finite number"),
    (["--outer-optimizer-momentum", "1.5"], "momentum must be in [0, 1) (got 1.5)"),
    (["--outer-optimizer", "adam", "--outer-optimizer-momentum", "0.5"],
     "--outer-optimizer-momentum is for the SGD outer optimizer"),
    (["--outer-optimizer", "adam"], "--outer-optimizer adam needs --outer-optimizer-lr"),
    (["--local-sgd-sync-time", "1"], "--local-sgd-sync-time does nothing without --local-sgd-async"),
    (["--local-sgd-ewma-threshold", "2"], "--local-sgd-ewma-threshold does nothing without --local-sgd-skip-anomaly"),
    (["--mode", "baseline", "--local-sgd-sync-interval", "4", "--local-sgd-debug"],
     "--local-sgd-sync-interval, --local-sgd-debug do nothing with --mode baseline"),
    (["--use-local-sgd"], "--use-local-sgd is Megatron-LM's switch"),
    (["--local-sgd-warmup-steps", "120"], "EDiT would never train locally"),
    (["--steps", "20", "--local-sgd-sync-interval", "13"], "ends before the first sync, after step 21"),
    (["--local-sgd-sync-interval", "two"], "argument --local-sgd-sync-interval: invalid int value: 'two'"),
    # the main job's own flag names, and --data-dir checked before any rank starts
    (["--local-sgd-time-budget", "60"], "synchronous EDiT ends at --steps"),
    (["--local-sgd-gradient-accumulation-steps", "2"], "set --micro-batch-size instead"),
    (["--data-dir", str(SCRIPT)], f"--data-dir {SCRIPT} is a file, not a folder"),
    (["--data-dir", f"{SCRIPT}/sub"], f"--data-dir {SCRIPT}/sub cannot be created"),
    (["--no-gta-normalize"], "only used with reducer='gta'"),
    (["--outer-optimizer", "adam", "--outer-optimizer-lr", "1e-3", "--outer-optimizer-kwargs", '{"betas": [0.9]}'],
     "betas must be a pair of numbers in [0, 1) for Adam"),
    (["--outer-optimizer-lr", "0.5", "--outer-optimizer-nesterov"], "Nesterov momentum needs momentum > 0"),
    (["--nproc-per-node", "2"], "--nproc-per-node 2 differs from torchrun's --nproc_per_node 4"),
    # MoE
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size 2 needs a MoE model: pass --num-experts"),
    (["--num-experts", "4", "--expert-model-parallel-size", "3"], "--expert-model-parallel-size 3 must divide --num-experts 4"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4"], "and --workers 2 the quotient"),
    (["--num-experts", "1"], "argument --num-experts: must be an integer >= 2"),
    # Before: a prefix of a flag was taken for it (argparse's abbreviations): F = 4 fragments.
    (["--local-sgd-fragment", "4"], "unrecognized arguments: --local-sgd-fragment 4"),
    # Before: accepted and ignored (nothing to merge without a delay), as alpha is refused.
    (["--local-sgd-outer-merge-rule", "lerp"], "the merge only follows a delayed outer step; add "
                                               "--local-sgd-outer-step-delay"),
    # Before: refused only once the model was built, naming Megatron-LM's --ddp-bucket-size.
    (["--local-sgd-sync-interval", "8", "--local-sgd-fragments", "8"],
     "--local-sgd-fragments 8 needs at least 8 DDP buckets, but --bucket-size 20000 makes at most 7"),
    # Before: ran with no word (first contact, round four); other releases refuse the flag itself
    (["--use-megatron-fsdp", "--local-sgd-cpu-offload"],
     "--local-sgd-cpu-offload with EDiT on Megatron-FSDP (--use-megatron-fsdp) is not supported yet"
     if _FSDP_HERE else "--use-megatron-fsdp: this job runs Megatron-FSDP on megatron-core"),
    (["--use-megatron-fsdp", "--bucket-size", "5000"], "--bucket-size 5000 does nothing with --use-megatron-fsdp"
     if _FSDP_HERE else "--use-megatron-fsdp: this job runs Megatron-FSDP on megatron-core"),
    (["--local-sgd-sync-record", "/nonexistent/dir/syncs.jsonl"],
     "--local-sgd-sync-record): cannot write /nonexistent/dir/syncs.jsonl: the directory /nonexistent/dir does not exist"),
    (["--mode", "baseline", "--local-sgd-sync-record", "syncs.jsonl"],
     "--local-sgd-sync-record does nothing with --mode baseline"),
    # Before: refused after the data was loaded (14-27 s)
    (["--local-sgd-exchange-topk-density", "0.2", "--local-sgd-exchange-dtype", "int2", "--workers", "4"],
     "an all-gather of 4 workers' payloads sends more bytes than the dense int4 exchange"),
]


@pytest.mark.parametrize("argv, fragment", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_bad_flag_is_refused_in_one_line_by_rank_0(job, monkeypatch, capsys, argv, fragment):
    text = _refusal(job, monkeypatch, capsys, argv)
    assert text.count("\n") == 1 and text.startswith(f"{SCRIPT.name}: error: "), text
    assert fragment in text, text


def test_other_ranks_wait_for_rank_0_before_they_print(job, monkeypatch, capsys):
    # Before: they exited at once and silently, and under load torchrun could stop rank 0 for
    # the first of them before rank 0 printed its line: no message at all. Now they wait for
    # the launcher to end them; one still running after the wait prints the error itself.
    from megatron_edit import arguments

    waits = []
    monkeypatch.setattr(arguments.time, "sleep", waits.append)
    assert _refusal(job, monkeypatch, capsys, ["--workers", "0"], rank="3") == (
        f"{SCRIPT.name}: error: argument --workers: must be an integer >= 1 (got 0)\n")
    assert waits == [arguments.Rank0ArgumentParser.peer_wait_s] and waits[0] >= 30
    text = _refusal(job, monkeypatch, capsys, ["--local-sgd-sync-time", "1"], rank="1")
    assert text.count("\n") == 1 and "--local-sgd-sync-time" in text, text
    assert len(waits) == 2
    assert _refusal(job, monkeypatch, capsys, ["--workers", "0"], rank="0").count("\n") == 1
    assert len(waits) == 2  # rank 0 does not wait


# Started with python (no torchrun): the flags are checked before torch is imported, so a
# mistake costs one line, exit code 2 and a fraction of a second (before, a typo
# cost torchrun's ~50-line ChildFailedError report, exit code 1 and 6-17 s).
LAUNCHER_REFUSED = [
    (["--local-sgd-sync-intervl", "8"], "unrecognized arguments: --local-sgd-sync-intervl 8"),
    (["--workers", "3"], "--workers 3 must divide the number of processes (4, --nproc-per-node)"),
    (["--nproc-per-node", "6", "--workers", "4"], "--workers 4 must divide the number of processes (6"),
    (["--outer-optimizer-momentum", "1.5"], "momentum must be in [0, 1) (got 1.5)"),
    (["--outer-optimizer", "adam", "--outer-optimizer-lr", "1e-3", "--outer-optimizer-kwargs",
      '{"betas": [0.9]}'], "betas must be a pair of numbers in [0, 1) for Adam"),
    (["--local-sgd-sync-time", "1"], "--local-sgd-sync-time does nothing without --local-sgd-async"),
    (["--data-dir", str(SCRIPT)], f"--data-dir {SCRIPT} is a file, not a folder"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4"], "and --workers 2 the quotient"),
    (["--local-sgd-fragment", "4"], "unrecognized arguments: --local-sgd-fragment 4"),
    (["--local-sgd-sync-interval", "8", "--local-sgd-fragments", "8", "--bucket-size", "100000"],
     "--local-sgd-fragments 8 needs at least 8 DDP buckets, but --bucket-size 100000 makes at most 2"),
    # --save / --load (scripts/main_job_checkpoint.py)
    (["--save-interval", "4"], "--save-interval needs --save DIR"),
    (["--ckpt-step", "4"], "--ckpt-step needs --load DIR"),
    (["--load", str(ROOT / "no-such-checkpoints")], f"--load {ROOT / 'no-such-checkpoints'}: no checkpoint of "
                                                     "this job's --save there."),
    (["--save", str(ROOT / "ckpt"), "--mode", "both"], "--save with --mode both: the main job checkpoints its "
                                                      "EDiT run"),
    (["--save", str(ROOT / "ckpt"), "--local-sgd-sync-backend", "torchft"], "--save with --local-sgd-sync-backend "
                                                                            "torchft"),
]


@pytest.mark.parametrize("argv, fragment", LAUNCHER_REFUSED, ids=[" ".join(a) for a, _ in LAUNCHER_REFUSED])
def test_a_mistake_costs_one_line_before_torch_is_imported(argv, fragment):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-X", "importtime", str(SCRIPT), *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:") and "|" in line]
    said = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert len(said) == 1 and said[0].startswith(f"{SCRIPT.name}: error: ") and fragment in said[0], said
    assert "megatron_edit.arguments" in imported  # what -X importtime lists is what was imported
    heavy = [m for m in imported if m.split(".")[0] in ("torch", "megatron", "numpy")]
    assert heavy == [], heavy


def _header(job, argv):
    from types import SimpleNamespace

    from megatron_edit.arguments import configs_from_args

    from main_job_report import describe_edit  # beside the script, which put scripts/ on sys.path

    args = job.build_parser().parse_args(argv)
    job.apply_outer_defaults(args)
    local, outer, _ = configs_from_args(argparse.Namespace(**{**vars(args), "use_local_sgd": True}))
    timeout = local.sync_timeout or 1800.0
    controller = SimpleNamespace(config=local, outer_config=outer, arrivals=SimpleNamespace(timeout=timeout),
                                 sync_shards=None)
    return describe_edit(controller, args)


def test_the_header_names_the_exchange_the_timeout_the_model_and_a_edits_budget(job):
    # Before: no exchange format, sync timeout or MoE, and A-EDiT's "the last at step 120"
    # (workers end at their own step counts).
    text = _header(job, [])
    assert text.splitlines()[1] == "exchange fp32; sync timeout 1800 s (torch's default; --local-sgd-sync-timeout); dense model"
    text = _header(job, ["--local-sgd-exchange-dtype", "int8", "--local-sgd-exchange-error-feedback",
                         "--local-sgd-sync-timeout", "90", "--num-experts", "4", "--expert-model-parallel-size", "2"])
    assert text.splitlines()[1] == ("exchange int8 (a scale per 256 values, error feedback); sync timeout 90 s; "
                                    "MoE: 4 experts per layer, top-2, expert parallelism 2")
    text = _header(job, ["--local-sgd-async", "--local-sgd-sync-time", "2"])
    assert "a budget of 240 worker-steps" in text and "the last at step" not in text
    # Before: "exchange int2 (a scale per 256 values)": no top-k, error feedback said off
    text = _header(job, ["--local-sgd-exchange-topk-density", "0.05", "--local-sgd-exchange-dtype", "int2"])
    assert text.splitlines()[1].startswith(
        "exchange top-k: the largest 0.05 of each chunk of 4096 values, sent in int2, error feedback; ")


def test_the_parameter_count_known_before_torch_is_the_models(job):
    """The fragments' bucket bound counts the model without building it: its vocabulary must be
    the data's, and its count the one the README's header prints for the default model."""
    from main_job_flags import VOCAB_SIZE, dense_parameters
    from megatron_edit.cpu import data

    assert VOCAB_SIZE == data.VOCAB_SIZE
    args = job.build_parser().parse_args([])
    assert dense_parameters(args)[0] == 137_088  # "137,088 parameters on this rank"


@pytest.mark.parametrize("argv", [[], ["--mode", "baseline"], ["--mode", "both"],
                                  ["--local-sgd-async", "--local-sgd-sync-time", "2"],
                                  ["--steps", "16"],  # the first sync is the last step
                                  ["--local-sgd-skip-anomaly", "--local-sgd-ewma-alpha", "0.1"],
                                  ["--num-experts", "4", "--expert-model-parallel-size", "2"],
                                  ["--mode", "baseline", "--compute-sleep-ms", "50"]])  # not an EDiT flag
def test_good_flags_pass_the_checks(job, argv):
    job.check_args(job.build_parser().parse_args(argv), job.build_parser())


def test_help_shows_the_defaults_the_job_uses(job, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as info:
        job.main(["--help"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    text = re.sub(r"(\w-) (\w)", r"\1\2", text)  # argparse wraps long flags at their hyphens
    for flag, default in [("--local-sgd-sync-interval", "8"), ("--local-sgd-warmup-steps", "8"),
                          ("--steps", "120"), ("--workers", "2"), ("--eval-interval", "40"),
                          ("--log-interval", "10"), ("--local-sgd-sync-time", "600.0"),
                          ("--outer-optimizer", "sgd"), ("--local-sgd-ewma-alpha", "0.02")]:
        assert re.search(rf"{re.escape(flag)} \S+ .*?\(default: {re.escape(default)}\)", text), flag
    assert "Momentum of the outer SGD, in [0, 1) (default in this job: 0.0; SGD only, other " \
           "optimizers take theirs in --outer-optimizer-kwargs). --outer" in text
    assert "(default in this job: 0.8 with SGD; required with another outer optimizer). --outer" in text
    assert "Nesterov momentum for the outer SGD (default in this job: off; SGD only)." in text


def test_outer_sgd_defaults_of_the_job_apply_only_where_unset(job):
    """The job's outer SGD (lr 0.8, no momentum): for SGD where neither a flag nor
    --outer-optimizer-kwargs sets the value; never with another optimizer or --mode baseline."""
    parse = job.build_parser().parse_args

    def outer(argv):
        args = parse(argv)
        job.apply_outer_defaults(args)
        return args.outer_optimizer_lr, args.outer_optimizer_momentum, args.outer_optimizer_nesterov

    assert outer([]) == (0.8, 0.0, False)
    assert outer(["--outer-optimizer-momentum", "0.9", "--outer-optimizer-nesterov"]) == (0.8, 0.9, True)
    assert outer(["--outer-optimizer-kwargs", '{"lr": 0.5}']) == (None, 0.0, False)
    assert outer(["--outer-optimizer", "adam", "--outer-optimizer-lr", "0.01"]) == (0.01, None, None)
    assert outer(["--mode", "baseline"]) == (None, None, None)
    args = parse([])
    job.apply_outer_defaults(args)
    job.check_args(args, job.build_parser())  # accepted: a valid outer SGD


@pytest.mark.parametrize("lead", [True, False])
def test_a_non_finite_value_is_printed_by_the_lead_first(job, monkeypatch, capsys, lead):
    # Once a rank ends at once (os._exit), a non-lead rank that stopped first had the
    # launcher stop the leads before they printed: no message. The lead prints at once; the
    # others wait for the launcher, and print only if still running after the wait.
    from main_job_run import stop_if_not_finite
    from megatron_edit.arguments import PEER_WAIT_S

    waits = []
    monkeypatch.setattr(job.time, "sleep", waits.append)
    args = argparse.Namespace(check_for_nan_in_loss_and_grad=True, outer_optimizer="sgd", lr=0.003)
    with pytest.raises(SystemExit) as info:
        stop_if_not_finite(args, "validation loss", float("nan"), 4, 1, lead, True)
    assert info.value.code == 1
    assert waits == ([] if lead else [PEER_WAIT_S])
    err = capsys.readouterr().err
    assert err.startswith("train_gpt_edit.py: error: step 4: worker 1's validation loss is nan; stopping.")
    stop_if_not_finite(args, "validation loss", 2.5, 4, 1, lead, True)  # finite: goes on


class _Ended(Exception):
    """Raised by the test's stand-in for os._exit."""


@pytest.mark.parametrize("raised, code, printed", [
    (SystemExit(1), 1, ""),  # stop_if_not_finite: its message is already printed
    (SystemExit("stopped: a reason"), 1, "stopped: a reason"),
    (RuntimeError("a failed sync"), 1, "RuntimeError: a failed sync"),
    # Ctrl-C: one line on rank 0 and exit code 130 (before: a traceback per rank, exit code 1)
    (KeyboardInterrupt(), 130, "train_gpt_edit.py: stopped by the user before the first step\n"),
    (SystemExit(0), 0, ""),
])
def test_a_rank_that_stops_ends_through_os_exit(job, monkeypatch, capsys, raised, code, printed):
    # After sys.exit(1) the interpreter's teardown of the rank's live gloo groups once
    # ended rank 1 with SIGABRT ("terminate called without an active exception"), so the job
    # reported signal 6, not exit code 1. Once the process group exists, a rank that stops ends
    # through os._exit after its message (before: the SystemExit propagated here).
    ended, err, _ = _ended_rank(job, monkeypatch, capsys, raised)
    assert ended == code
    assert (printed in err) if printed else err == "", err


def _ended_rank(job, monkeypatch, capsys, raised, rank="0"):
    """(exit code, stderr, sleeps) of a rank whose run raised ``raised`` (os._exit faked)."""
    from megatron_edit.cpu import adapter

    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.setenv(name, rank)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setattr(adapter, "activate", lambda: None)
    monkeypatch.setattr(job.dist, "init_process_group", lambda *a, **k: None)
    monkeypatch.setattr(job.torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(job, "setup_logging", lambda debug: None)
    monkeypatch.setattr(job, "quiet_upstream_warnings", lambda: None)
    monkeypatch.setattr(job.USER_STOP, "install", lambda: None)  # pytest keeps its Ctrl-C
    sleeps = []
    monkeypatch.setattr(job.time, "sleep", sleeps.append)

    def run_rank(args, world):
        raise raised

    def exit_now(status):
        raise _Ended(status)

    monkeypatch.setattr(job, "run_rank", run_rank)
    monkeypatch.setattr(job.os, "_exit", exit_now)
    with pytest.raises(_Ended) as ended:
        job.main([])
    return ended.value.args[0], capsys.readouterr().err, sleeps


@pytest.mark.parametrize("reporter", [True, False])
def test_a_sync_timeout_ends_every_rank_with_one_line_from_one_of_them(job, monkeypatch, capsys, reporter):
    """Every rank waiting at the sync raises SyncTimeout with the same line: the reporter prints
    it at once, the others wait for the launcher to stop them (before: a traceback per rank,
    each naming the rank its own sync group missed)."""
    from megatron_edit.arguments import PEER_WAIT_S
    from megatron_edit.exchange.arrival import SyncTimeout

    line = "megatron_edit: sync 3 (after step 7): worker 1 (global ranks 2, 3) did not arrive ..."
    code, err, sleeps = _ended_rank(job, monkeypatch, capsys, SyncTimeout(line, reporter=reporter), rank="1")
    assert code == 1 and err == line + "\n", err
    assert sleeps == ([] if reporter else [PEER_WAIT_S])


def test_a_config_error_at_build_is_one_line_in_the_jobs_terms(job, monkeypatch, capsys):
    """Found when EDiT is attached to the built model (the fragments against the real bucket
    count): one line naming the job's --bucket-size, exit code 2 (before: a traceback naming
    Megatron-LM's --ddp-bucket-size)."""
    from megatron_edit.config import ConfigError
    from megatron_edit.mcore.fragments import BUCKET_SIZE

    error = ConfigError(f"fragments (--local-sgd-fragments): 5 bucket groups cannot make 6 fragments "
                        f"on this rank's distributed optimizer; use fewer fragments, or smaller "
                        f"buckets ({BUCKET_SIZE}) so that the model has more bucket groups.")
    code, err, sleeps = _ended_rank(job, monkeypatch, capsys, error)
    assert code == 2 and err.count("\n") == 1 and sleeps == [], err
    assert err.startswith("train_gpt_edit.py: error: fragments") and "smaller buckets (--bucket-size)" in err


def test_help_is_printed_once(job, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(SystemExit):
        job.main(["--help"])
    assert capsys.readouterr().out == ""


# ---------------------------------------------------------------- runs through torchrun


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from megatron_edit.cpu import data

    directory = tmp_path_factory.mktemp("main-job-data")
    data.prepare_indexed_dataset(str(directory / "stdlib_docs"))
    return str(directory)


def torchrun(data_dir, *argv, timeout=240, python=False):
    """(exit code, combined output) of the main job on 4 processes, started by torchrun (or
    with ``python`` by the job itself, as the README does); the whole process group is killed
    after ``timeout`` seconds (a hang fails the test, it does not hold the suite)."""
    launcher = [] if python else ["-m", "torch.distributed.run", "--nproc_per_node", "4",
                                  "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0"]
    command = [sys.executable, *launcher, str(SCRIPT), "--data-dir", data_dir, *argv]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # a torchft run's supervisor stops its worker jobs
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"the main job did not end within {timeout} s (hung?); its output:\n{out[-4000:]}")
    return proc.returncode, out


def _summary(out):
    """{run name: (valid losses per worker, syncs)} from the summary table."""
    table = out.split("=== summary", 1)[1].splitlines()[2:]
    rows = {}
    for line in table:
        m = re.match(r"(EDiT|synchronous)\s+([\d., na]+?)\s{2,}(\d+)", line)
        if m:
            rows[m.group(1)] = ([float(v) for v in m.group(2).split(", ")], int(m.group(3)))
    return rows


def _quiet(out):
    assert "FutureWarning" not in out and "CPU RNG state changed" not in out
    assert "Traceback" not in out, out[-3000:]


# The configurations that could hang before: the script's own validation all-gather
# across workers met a time-triggered sync's schedule all-reduce on another worker. Each runs
# with 2 workers of 2 ranks (validation's collectives inside a worker) or 4 of one (CI time:
# each config ran with both before, 100 s in all); workers' speeds vary with the machine's load,
# which is what exposed it.
HANGED = {
    "eval-5-sync-1s": ["--steps", "16", "--eval-interval", "5", "--local-sgd-async",
                       "--local-sgd-sync-time", "1", "--local-sgd-min-total-global-steps", "1"],
    "eval-20-sync-2s": ["--steps", "24", "--eval-interval", "20", "--local-sgd-async",
                        "--local-sgd-sync-time", "2"],
}


@pytest.mark.one_lane
@pytest.mark.timeout(300)
# CI runs the first config (2 workers of 2 ranks); the second (4 workers of one, 40 s on 2
# cores; the same hang) is slow: pytest -m slow.
@pytest.mark.parametrize("config, workers", [("eval-5-sync-1s", "2"),
                                             pytest.param("eval-20-sync-2s", "4", marks=pytest.mark.slow)])
def test_a_edit_with_frequent_validation_ends(data_dir, config, workers):
    code, out = torchrun(data_dir, *HANGED[config], *SHORT, "--workers", workers)
    assert code == 0, out[-4000:]
    _quiet(out)
    (losses, syncs), = _summary(out).values()
    assert len(losses) == int(workers) and syncs >= 1
    # A-EDiT ends with a sync at the last step on every worker: identical final models.
    assert len(set(losses)) == 1, losses
    # Validation is worker-local: each worker's first rank prints its own line.
    for w in range(int(workers)):
        assert re.search(rf"validation after step \d+: worker {w} \d", out), w


@pytest.mark.one_lane
@pytest.mark.timeout(300)
def test_the_auto_overlap_says_where_it_starts_and_what_it_decides(data_dir, tmp_path):
    """--local-sgd-auto-overlap started with --local-sgd-outer-step-delay 1 (H = 4, 16 steps, 2
    workers x 2 ranks): the description names the start and what is chosen from it; the first
    two syncs (after 4 and 8) run with the delay 1, each exchange launched one step early; the
    decision after 8 is one line with its measurements; the run ends with one model on both
    workers (its last sync blocks). With --compute-sleep-ms 60 (a device's compute, bench_ft.py)
    every step, and the inner step the auto overlap measures, takes at least that long. The sync
    record (--local-sgd-sync-record) agrees with the summary line."""
    record = tmp_path / "syncs-{worker}.jsonl"
    code, out = torchrun(data_dir, "--steps", "16", "--local-sgd-warmup-steps", "0", "--local-sgd-sync-interval", "4",
                         "--lr-warmup-steps", "2", "--log-interval", "1", "--local-sgd-auto-overlap",
                         "--local-sgd-auto-formats", "fp32,int8", "--local-sgd-outer-step-delay", "1",
                         "--compute-sleep-ms", "60", "--local-sgd-sync-record", str(record))
    assert code == 0, out[-4000:]
    _quiet(out)
    assert "each exchange launched 1 steps early" in out
    assert ("auto overlap: the delay, format (fp32,int8) and fragments (1) chosen from the first 2 syncs, "
            "timed with the settings above, and again every 20 syncs") in out
    assert len(re.findall(r"megatron_edit: auto overlap after step 8: inner step [\d.]+ ms, exchange fp32 [\d.]+ ms, "
                          r"int8 [\d.]+ ms \(slowest rank\)", out)) == 1, out[-4000:]
    step_ms = [float(x) for x in re.findall(r"step +\d+ \| worker \d loss [\d.]+ \| lr \S+ \| +([\d.]+) ms", out)]
    assert len(step_ms) == 16 and min(step_ms) >= 60, step_ms
    assert float(re.search(r"auto overlap after step 8: inner step ([\d.]+) ms", out).group(1)) >= 60
    (losses, syncs), = _summary(out).values()
    assert len(losses) == 2 and len(set(losses)) == 1 and syncs == 4, (losses, syncs)
    # The summary counts rank 0's bytes (no warmup: the syncs' only); a record the worker's, 2
    # ranks holding equal shards.
    megabytes = float(re.search(r"^EDiT\s+[\d., ]+?\s{2,}\d+\s+([\d.]+)\s", out.split("=== summary", 1)[1],
                                re.M).group(1))
    for worker in (0, 1):
        records = [json.loads(line) for line in open(str(record).format(worker=worker))]
        assert [(r["kind"], r["step"], r["worker"], r["ranks"]) for r in records] == [
            ("sync", s, worker, 2) for s in (4, 8, 12, 16)]
        assert [r["delay"] for r in records][:2] == [1, 1] and records[-1]["delay"] == 0  # the last blocks
        assert all(r["auto_overlap"] and r["missing_ranks"] == [] for r in records)
        assert abs(sum(r["bytes_sent"] for r in records) / 2 / 1e6 - megabytes) <= 0.0005, (records, megabytes)


PENALTY = ["--steps", "8", "--eval-interval", "4", "--local-sgd-skip-anomaly",
           "--local-sgd-ewma-warmup-steps", "1", "--local-sgd-pseudo-gradnorm-reduce",
           "--local-sgd-clip-pseudo-grad", "0.5"]


@pytest.fixture(scope="module")
def layerwise_and_step_end(data_dir):
    return {mode: torchrun(data_dir, *PENALTY, *SHORT, "--local-sgd-sync-mode", mode,
                           *(["--local-sgd-debug"] if mode == "layerwise" else []))
            for mode in ("layerwise", "step_end")}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_every_sync_is_counted_the_same_in_both_modes(layerwise_and_step_end):
    summaries = {}
    for mode, (code, out) in layerwise_and_step_end.items():
        assert code == 0, out[-4000:]
        _quiet(out)
        summaries[mode] = _summary(out)["EDiT"]
        # Syncs after steps 4, 6 and 8; layer-wise completes the last one in the final validation.
        assert re.findall(r"sync (\d) after step (\d)", out) == [("1", "4"), ("2", "6"), ("3", "8")], mode
    # Bit-identical runs (a test in tests/mcore checks the parameters): the same count and losses.
    assert summaries["layerwise"] == summaries["step_end"]
    assert summaries["layerwise"][1] == 3


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_penalty_decisions_and_debug_lines_are_printed(layerwise_and_step_end):
    code, out = layerwise_and_step_end["layerwise"]
    assert "\npenalty: anomaly elimination (EWMA alpha 0.02, after 1 syncs, z > 3.0), weights " \
           "softmax(-norm / 1), clip at 0.5\n" in out
    penalty = [line.strip() for line in out.splitlines() if line.startswith(" ") and "penalty: " in line]
    assert len(penalty) == 3, out[-3000:]
    for line in penalty:
        assert re.search(r"(no worker excluded|excluded worker \d from)", line), line
        assert re.search(r"weights worker 0 \d\.\d{3}-\d\.\d{3}, worker 1 ", line), line
        assert re.search(r"clip factor min \d\.\d{3} \(\d of \d+ layers clipped\)", line), line
    # --local-sgd-debug: every rank logs every sync (before: nothing, logging was never set up).
    for rank in range(4):
        assert len(re.findall(rf"^rank {rank}: sync after step \d \(layerwise\)", out, re.M)) == 3, rank
    assert "rank 0: sync" not in layerwise_and_step_end["step_end"][1]


@pytest.mark.one_lane  # the main job's process handling (its own check of the loss)
@pytest.mark.timeout(300)
def test_a_non_finite_loss_stops_the_job(data_dir):
    # Before: loss NaN from the first sync on, and exit code 0.
    code, out = torchrun(data_dir, "--steps", "8", "--eval-interval", "4", *SHORT,
                         "--outer-optimizer-lr", "1e30", python=True)
    assert code == 1
    # Started with python: the launcher's report is one line, not torchrun's ChildFailedError.
    assert re.search(rf"^{SCRIPT.name}: rank \d ended with exit code 1 \(its output is above\); the "
                     r"other ranks were stopped\.$", out.rstrip().splitlines()[-1]), out[-2000:]
    assert "ChildFailedError" not in out and "Root Cause" not in out
    errors = [line for line in out.splitlines() if line.startswith(f"{SCRIPT.name}: error: ")]
    assert errors and all(re.search(r"worker \d's (training loss|gradient norm|validation loss) is "
                                    r"(nan|inf)", e) and "--outer-optimizer-lr" in e for e in errors), out[-3000:]
    assert "[rank0]: Traceback" not in out


@pytest.mark.one_lane
@pytest.mark.timeout(400)
def test_ctrl_c_stops_the_job_with_one_line_and_exit_code_130(data_dir):
    """SIGINT to the job's process group, as a terminal's Ctrl-C sends it, once training runs.
    Before: about 180 lines, 8 tracebacks (a KeyboardInterrupt per rank, the peers' closed
    connections, the launcher's own) and exit code 1."""
    import threading

    command = [sys.executable, str(SCRIPT), "--data-dir", data_dir, "--steps", "2000", "--log-interval", "1",
               "--eval-interval", "1000", "--lr-warmup-steps", "2"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    lines, training = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("step    3 |"):
                training.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert training.wait(300), "".join(lines)[-3000:]
        os.killpg(proc.pid, signal.SIGINT)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    reader.join(30)
    out = "".join(lines)
    after = out.split("step    3 |", 1)[1].splitlines()[1:]
    said = [line for line in after if not line.startswith("step ")]
    assert code == 130, out[-3000:]
    assert len(said) == 1 and re.fullmatch(rf"{SCRIPT.name}: stopped by the user at step \d+", said[0]), said


@pytest.mark.one_lane
@pytest.mark.timeout(360)
def test_a_flag_error_under_torchrun_is_one_line(data_dir):
    code, out = torchrun(data_dir, "--workers", "0", timeout=300)
    assert code != 0
    errors = [line for line in out.splitlines() if "error:" in line and "--workers" in line]
    assert errors == [f"{SCRIPT.name}: error: argument --workers: must be an integer >= 1 (got 0)"], out
    assert "[rank" not in out  # no per-rank tracebacks


def _as_text(value):
    """A default as the README writes it."""
    if value is None or isinstance(value, bool):
        return {True: "on", False: "off", None: "none"}[value]
    return str(value)


def test_flag_table_matches_both_parsers(job):
    """The configuration reference's table (docs/reference/configuration.md, generated by
    scripts/dev/gen_docs.py): every EDiT flag, its package default and the main job's."""
    import re as _re

    from main_job_flags import MAIN_JOB_DEFAULTS, MAIN_JOB_FT_WARMUP, MAIN_JOB_OUTER_SGD
    from megatron_edit.arguments import SGD_DEFAULTS, local_sgd_args_provider

    page = (ROOT / "docs" / "reference" / "configuration.md").read_text()
    table = page.split("| flag | default | main job | takes | config field |", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for line in table.strip().splitlines()[1:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        flag = _re.search(r"`(--[^`]+)`", cells[0]).group(1).replace("[no-]", "")
        rows[flag] = [c.strip("`") for c in cells[1:3]]
    package = local_sgd_args_provider(__import__("argparse").ArgumentParser())
    main = job.build_parser()
    flags = {a.option_strings[0]: a.dest for a in package._actions if a.option_strings and a.dest != "help"}
    assert set(rows) == set(flags)
    for flag, dest in flags.items():
        default, main_job = rows[flag]
        key = dest.replace("outer_optimizer_", "")
        expected = package.get_default(dest)
        if expected is None and key in SGD_DEFAULTS:
            assert default == f"{_as_text(SGD_DEFAULTS[key])} with SGD", flag
        else:
            assert default.split(" (")[0] == _as_text(expected), (flag, default, expected)
        if flag == "--use-local-sgd":
            assert main_job.startswith("refused"), main_job
        elif flag == "--local-sgd-warmup-steps":  # resolved per sync backend
            assert main_job == (f"{MAIN_JOB_DEFAULTS['local_sgd_warmup_steps']} "
                                f"({MAIN_JOB_FT_WARMUP} with torchft)"), main_job
        elif key in MAIN_JOB_OUTER_SGD:
            assert main_job == f"{_as_text(MAIN_JOB_OUTER_SGD[key])} with SGD", (flag, main_job)
        elif main.get_default(dest) == expected:
            assert main_job == "=", (flag, main_job)
        else:
            assert main_job == _as_text(main.get_default(dest)), (flag, main_job)


@pytest.mark.slow  # (CI time, 40 s: the backends' equality is tests/torchft_backend's; the main job over
# torchft runs in CI in the heal and cross-site tests)
@pytest.mark.timeout(600)
def test_the_torchft_backend_trains_what_the_torch_backend_does(data_dir):
    """--local-sgd-sync-backend torchft started with python: a Lighthouse and one job per worker
    (2 x 2 ranks), each on its worker's slice of every global batch; the same validation losses
    as the torch backend's one job on the same flags (warmup 0: its default with torchft)."""
    pytest.importorskip("torchft")
    flags = ["--steps", "8", "--eval-interval", "8", "--local-sgd-sync-interval", "4", "--lr-warmup-steps", "2"]
    code, out = torchrun(data_dir, *flags, "--local-sgd-warmup-steps", "0", "--mode", "edit")
    assert code == 0, out[-3000:]
    (reference, syncs), = _summary(out).values()
    code, out = torchrun(data_dir, *flags, "--local-sgd-sync-backend", "torchft", python=True, timeout=420)
    assert code == 0, out[-3000:]
    assert "every worker's job ended with code 0" in out and "relaunch" not in out
    tables = ["=== summary" + part for part in out.split("=== summary")[1:]]
    ft = sorted(v for table in tables for v in _summary(table)["EDiT"][0])
    assert len(tables) == 2 and ft == sorted(reference) and all(_summary(t)["EDiT"][1] == syncs for t in tables)
    assert "torchft::" not in out  # torchft's INFO lines are off in the main job


def _fsdp_supported() -> bool:
    from megatron_edit.mcore import compat
    from megatron_edit.mcore.releases import FSDP_SUPPORTED

    return FSDP_SUPPORTED.contains(compat.megatron_core_version())


def test_megatron_fsdp_where_the_job_does_not_run_it_is_one_line(job, monkeypatch, capsys):
    """--use-megatron-fsdp: on a megatron-core release outside 0.16.1-0.19.x, with expert parallelism, or with the
    torchft backend, one line before anything starts (EDiT settings Megatron-FSDP does not run
    are refused when its model is built: test_a_config_error_at_build_is_one_line_in_the_jobs_terms)."""
    if not _fsdp_supported():
        text = _refusal(job, monkeypatch, capsys, ["--use-megatron-fsdp"])
        assert text.count("\n") == 1 and "--use-megatron-fsdp: this job runs Megatron-FSDP on megatron-core" in text
        return
    from megatron_edit.mcore import compat
    from megatron_edit.mcore.releases import FSDP_EXPERT_PARALLEL

    if not FSDP_EXPERT_PARALLEL.contains(compat.megatron_core_version()):
        text = _refusal(job, monkeypatch, capsys, ["--use-megatron-fsdp", "--num-experts", "4",
                                                   "--expert-model-parallel-size", "2"])
        assert text.count("\n") == 1 and "its HSDP has no expert parallelism (0.17+ has)" in text, text
    text = _refusal(job, monkeypatch, capsys, ["--use-megatron-fsdp", "--local-sgd-sync-backend", "torchft",
                                               "--local-sgd-replica-id", "0"])
    assert text.count("\n") == 1, text
    assert "--use-megatron-fsdp with --local-sgd-sync-backend torchft is not supported yet" in text, text


# slow (not in CI) until the cause of an intermittent abort is known: in 3 of about 20 runs here
# under pytest (none of 17 started by hand) one rank of the Megatron-FSDP job died by SIGABRT in
# gloo (a read error) mid-run; the failure message now carries the ranks' own error lines.
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", [[], ["--num-experts", "4"], ["--num-experts", "4", "--expert-model-parallel-size", "2"]],
                         ids=["dense", "moe", "moe-ep2"])
def test_megatron_fsdp_trains_what_ddp_and_the_distributed_optimizer_do(data_dir, model):
    """--use-megatron-fsdp (HSDP: 2 workers of 2 fully sharded ranks): EDiT ends with the
    validation losses and syncs of DDP + the distributed optimizer on the same flags (fp32 on
    CPU; megatron-core 0.16.1-0.19.x, the releases EDiT on Megatron-FSDP runs on); dense and MoE
    (4 experts, expert parallelism 1, and 2 where Megatron-FSDP's HSDP has it)."""
    if not _fsdp_supported():
        pytest.skip("EDiT on Megatron-FSDP runs on megatron-core 0.16.1-0.19.x (this lane: refused, tested above)")
    from megatron_edit.mcore import compat
    from megatron_edit.mcore.releases import FSDP_EXPERT_PARALLEL

    if "--expert-model-parallel-size" in model and not FSDP_EXPERT_PARALLEL.contains(compat.megatron_core_version()):
        pytest.skip(f"Megatron-FSDP's HSDP has expert parallelism on megatron-core {FSDP_EXPERT_PARALLEL} (refused above)")
    flags = ["--steps", "8", "--eval-interval", "8", *SHORT, *model]
    code, fsdp = torchrun(data_dir, *flags, "--use-megatron-fsdp")
    # a rank's own last words first (the tail is torchrun's report)
    assert code == 0, "\n".join(line for line in fsdp.splitlines() if re.search(
        r"terminate called|what\(\)|Error|error:|Signal", line))[-2000:] + "\n" + fsdp[-2000:]
    _quiet(fsdp)
    assert "(Megatron-FSDP) ===" in fsdp and "instead of the current device" not in fsdp
    code, ddp = torchrun(data_dir, *flags)
    assert code == 0, ddp[-3000:]
    assert _summary(fsdp) == _summary(ddp) and _summary(fsdp)["EDiT"][1] == 3  # after steps 4, 6, 8


@pytest.mark.slow  # (CI time, 22 s: it waits out the connection's timeout)
@pytest.mark.timeout(300)
def test_an_unreachable_lighthouse_is_one_line_per_worker_and_stops_the_run(data_dir):
    """A wrong --local-sgd-lighthouse (nothing listens there): a worker's job says so in one line
    within about 20 s of trying (here 5 s: the sync timeout's, when shorter), with exit code 2, and the supervisor stops the run instead of
    relaunching the jobs in a loop."""
    pytest.importorskip("torchft")
    code, out = torchrun(data_dir, "--local-sgd-sync-backend", "torchft", "--local-sgd-lighthouse",
                         "http://127.0.0.1:1", "--local-sgd-sync-timeout", "5", python=True, timeout=240)
    assert code == 2, out[-3000:]
    said = [line for line in out.splitlines() if "could not start with the Lighthouse at http://127.0.0.1:1" in line]
    # (the other worker's job may be stopped before it prints its own)
    assert len(said) in (1, 2) and all(line.startswith(f"{SCRIPT.name}: error: megatron_edit: ") for line in said), out
    assert "refusing to run (its line is above): stopping the run" in out and "relaunch" not in out
    assert "Traceback" not in out


CHAOS_HOOKS = ROOT / "scripts" / "bench" / "chaos_hooks"


def _kill_job_of(worker: int, mark: str) -> int:
    """SIGKILL every process of worker ``worker``'s job of the run carrying ``mark`` (-1: of every
    job; scripts/fault_matrix.py's marks)."""
    spec = importlib.util.spec_from_file_location("fault_matrix_marks", ROOT / "scripts" / "fault_matrix.py")
    marks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(marks)
    return marks.kill_marked(mark, b"" if worker < 0 else f"--local-sgd-replica-id\0{worker}\0".encode())


def _wait_for(predicate, timeout: float, what: str) -> None:
    import time

    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            pytest.fail(f"waited {timeout:g} s for {what}")
        time.sleep(0.2)


def _kill_while_held(chaos, mark: str, worker: int = 1, held: int = 0) -> None:
    """SIGKILL ``worker``'s job while ``held``'s ranks wait before their next quorum
    (scripts/bench/chaos_hooks: ``hold-<held>``), released once the supervisor's relaunch of
    ``worker`` is in its join round (so that it joins that quorum)."""
    (chaos / f"hold-{held}").touch()
    first = set(chaos.glob(f"begun-{worker}-*"))
    assert _kill_job_of(worker, mark) > 0
    _wait_for(lambda: set(chaos.glob(f"begun-{worker}-*")) - first, 300, "the relaunched job's join round")
    (chaos / f"hold-{held}").unlink()


@contextlib.contextmanager
def _chaos_job(tmp_path, flags, triggers=()):
    """The main job with the chaos hooks (scripts/bench/chaos_hooks) armed by ``triggers`` in its
    chaos folder: yields (the chaos folder, the log, the process); ended (its process group, then
    every job the run started) however the test goes."""
    import uuid

    chaos, log = tmp_path / "chaos", tmp_path / "out.log"
    chaos.mkdir()
    for trigger in triggers:
        (chaos / trigger).touch()
    mark = uuid.uuid4().hex
    env = dict(os.environ, MEGATRON_EDIT_CHAOS_DIR=str(chaos), MEGATRON_EDIT_FAULT_MATRIX_RUN=mark,
               PYTHONPATH=os.pathsep.join([str(CHAOS_HOOKS), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(log, "w") as sink:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), *flags], cwd=ROOT, env=env, stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield chaos, log, proc, mark
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        _kill_job_of(-1, mark)


@pytest.mark.slow  # (CI time, 64 s; the partial heal: test_torchft_megatron, the loop at the peer's step: test_megatron_lm_torchft)
@pytest.mark.timeout(600)
def test_a_torchft_worker_healed_at_a_later_sync_trains_on_from_the_others_step(data_dir, tmp_path):
    """The main job over torchft (2 workers x 2 ranks, the supervisor). Worker 1's job is
    SIGKILLed after its sync 2 while worker 0 waits before its next quorum; the relaunch's rank 1
    fails its heal transfer at the join (scripts/bench/chaos_hooks: a partial heal, nothing
    loaded: the worker stays at step 0), so it heals at its next sync, to worker 0's step. Its
    loop and data go on from there, and the run ends with one model, exit 0 (before: it counted
    its own steps, trained alone past worker 0's end and the supervisor's end check failed the
    run). 40 steps and a 30 s sync timeout (worker 0's round with the relaunched worker's failed
    heal waits it out): CI time."""
    pytest.importorskip("torchft")
    flags = ["--data-dir", data_dir, "--steps", "40", "--eval-interval", "40", "--local-sgd-sync-interval", "4",
             "--log-interval", "4", "--lr-warmup-steps", "2", "--local-sgd-sync-backend", "torchft",
             "--local-sgd-sync-timeout", "30"]
    with _chaos_job(tmp_path, flags) as (chaos, log, proc, mark):
        _wait_for(lambda: "worker 1 sync 2 after" in log.read_text(), 300, "worker 1's sync 2")
        (chaos / "heal-1").touch()
        _kill_while_held(chaos, mark)
        proc.wait(timeout=300)
    out = log.read_text()
    assert list(chaos.glob("heal-1.taken-*")), out[-3000:]
    assert "worker 1's heal reached some of its ranks only" in out, out[-3000:]
    assert re.search(r"worker 1 healed at its sync after step \d+: it is at the others' step \d+", out), out[-3000:]
    assert proc.returncode == 0 and "all 2 with one model" in out, out[-3000:]


@pytest.mark.slow  # (CI time, 28 s; a worker arriving after the run's end: tests/torchft_backend/test_supervise.py)
@pytest.mark.timeout(300)
def test_a_torchft_relaunch_after_the_runs_last_sync_does_not_train_alone(data_dir, tmp_path):
    """The main job over torchft (2 workers x 1 rank, the supervisor), the window of a slow
    relaunch (seen: 85 s at load 30-50), armed before it starts (scripts/bench/chaos_hooks): worker
    1's job is SIGKILLed inside its first exchange, its relaunch held before its Manager starts until
    worker 0, alone, has passed the run's last sync and holds at its end, before recording it.
    The relaunch stops there in one line, worker 0 ends, and the run exits 1 without another
    relaunch. Before: the relaunch passed the start gate (worker 0 had recorded no end yet),
    joined a quorum of its own and trained the whole run alone from step 0 (exit 1 only at the
    end, from the check of the models)."""
    pytest.importorskip("torchft")
    flags = ["--data-dir", data_dir, "--nproc-per-node", "2", "--steps", "12", "--eval-interval", "12",
             "--eval-samples", "8", "--local-sgd-sync-interval", "4", "--log-interval", "4", "--lr-warmup-steps",
             "2", "--local-sgd-sync-backend", "torchft"]
    with _chaos_job(tmp_path, flags, ("hold-end-0", "hold-relaunch-1", "exchange-1")) as (chaos, log, proc, mark):
        _wait_for(lambda: list(chaos.glob("starting-1-*")), 200, "worker 1's relaunch at the start gate")
        relaunch = {p.name.rsplit("-", 1)[1] for p in chaos.glob("starting-1-*")}
        _wait_for(lambda: list(chaos.glob("ending-0-*")), 200, "worker 0's end, after the run's last sync")
        (chaos / "hold-relaunch-1").unlink()  # the relaunch comes now: worker 0 has not recorded its end
        _wait_for(lambda: "not relaunched" in log.read_text() or any(
            p.name.rsplit("-", 1)[1] in relaunch for p in chaos.glob("begun-1-*")), 200,
            "the relaunch to stop or to join")
        (chaos / "hold-end-0").unlink()
        proc.wait(timeout=200)
    out = log.read_text()
    alone = re.findall(r"worker 1 sync \d+ after step \d+.*", out)
    assert list(chaos.glob("exchange-1.taken-*")) and not alone, out[-3000:]  # (worker 1 never synced)
    assert not any(p.name.rsplit("-", 1)[1] in relaunch for p in chaos.glob("begun-1-*")), out[-3000:]
    assert "worker 1 arrives after the run's last sync (worker(s) [0] passed it)" in out, out[-3000:]
    assert "when worker(s) [0] had passed the run's last sync: not relaunched" in out, out[-3000:]
    assert proc.returncode == 1 and out.count("relaunching it") == 1, out[-3000:]


@pytest.mark.one_lane  # the main job's own checkpoints (megatron-core's are checked in every lane)
@pytest.mark.timeout(400)
def test_save_then_resume_exactly_and_elastically(data_dir, tmp_path):
    """2 processes (CI time). --save with --save-interval 5 (12 steps, syncs after 4, 6, ...: step
    5 is between two) and --load --ckpt-step 5: with the saved 2 workers the resumed steps repeat
    the saving run's losses bit for bit (its last line says so); with 1 worker the load takes one
    outer step over the 2 saved (every worker starts from one model); a --ckpt-step not saved is
    one line naming the saved steps, and --steps at or below the saved step leaves nothing to
    train."""
    ckpt = str(tmp_path / "ckpt")
    run = ["--steps", "12", *SHORT, "--eval-interval", "12", "--nproc-per-node", "2"]
    code, out = torchrun(data_dir, *run, "--save", ckpt, "--save-interval", "5", python=True)
    assert code == 0, out[-3000:]
    assert "saved step 5 to" in out and "saved step 12 to" in out
    code, out = torchrun(data_dir, *run, "--load", ckpt, "--ckpt-step", "5", python=True)
    assert code == 0, out[-3000:]
    _quiet(out)
    assert out.strip().splitlines()[-1] == (f"resumed step 5 of {ckpt} (2 workers saved, 2 now): steps 6-12 "
                                            "repeat the saving run's losses bit for bit: yes"), out[-2000:]
    losses = tmp_path / "ckpt" / "losses.json"  # a saving run whose step 9 went otherwise: NO, exit code 1
    saved = json.loads(losses.read_text())
    saved["losses"]["9"]["0"] += 1e-6
    losses.write_text(json.dumps(saved))
    code, out = torchrun(data_dir, *run, "--load", ckpt, "--ckpt-step", "5", python=True)
    assert code == 1 and "steps 6-12 repeat the saving run's losses bit for bit: NO\n" in out, out[-2000:]
    code, out = torchrun(data_dir, *run, "--load", ckpt, "--ckpt-step", "5", "--workers", "1", python=True)
    assert code == 0, out[-3000:]
    assert out.strip().splitlines()[-1] == (f"resumed step 5 of {ckpt} (2 workers saved, 1 now) elastically: one "
                                            "outer step over the saved workers at load; every worker started "
                                            "from one model: yes"), out[-2000:]
    short = ["--steps", "5", *SHORT, "--nproc-per-node", "2"]
    for argv, said in [([*run, "--load", ckpt, "--ckpt-step", "6"], "no checkpoint of this job's --save there "
                                                                    "(steps saved: 5, 10, 12)."),
                       ([*short, "--load", ckpt, "--ckpt-step", "5"], f"--load {ckpt} holds step 5: --steps 5 "
                                                                      "leaves nothing to train")]:
        code, out = torchrun(data_dir, *argv, python=True)
        assert code == 2 and said in out and out.count("\n") == 1, out
