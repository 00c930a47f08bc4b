"""Megatron-LM's per-iteration checks across all ranks held to where EDiT workers meet
(megatron_edit.training.meetings), end to end through pretrain_gpt.py (needs MEGATRON_LM_DIR, see
tests/training/test_megatron_lm.py; skipped with that message otherwise). The decisions are
tested without the checkout in tests/training/test_megatron_lm_collectives.py and
tests/training/test_global_budget.py; --async-save with A-EDiT end to end in the latter.

``--exit-duration-in-mins 1`` with the wall clock of one rank (worker 1's) moved 2 minutes ahead
from iteration 5 on (the probe's ``MEGATRON_EDIT_PROBE_CLOCK_JUMP``) makes the stop deterministic: Megatron alone would
stop after iteration 5; with EDiT every worker stops at the first sync after it (warmup 0, syncs
every 4: iteration 8); with A-EDiT (the clock moved in its warmup) at its first sync, saving there
with the sync's common label.
"""

import re
import sys

import pytest

from test_global_budget import H as A_H, PROBE, WARMUP as A_WARMUP, _a_edit_run
from test_megatron_lm import CHECKOUT, HAVE_CHECKOUT, HOW_TO_RUN, TINY, _env, _hash_checks, _lines, _torchrun, run_job

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAVE_CHECKOUT, reason=HOW_TO_RUN)]
H = 4
EXIT = ["--exit-duration-in-mins", "1"]
# 2 minutes ahead from iteration 5 on, on rank 1 only (worker 1): Megatron stops every rank when
# any one is past the time
CLOCK = {"MEGATRON_EDIT_PROBE_CLOCK_JUMP": "4:120:1"}


@pytest.mark.timeout(600)
def test_edit_exits_on_time_at_the_next_sync_with_a_checkpoint(tmp_path):
    out = tmp_path / "traffic"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(PROBE), str(out), "--cpu", str(CHECKOUT / "pretrain_gpt.py"), *TINY,
           "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2", "--overlap-grad-reduce",
           "--overlap-param-gather", "--use-local-sgd", "--local-sgd-sync-interval", str(H),
           "--local-sgd-warmup-steps", "0", "--train-iters", "20", "--save", "ckpt", "--save-interval", "100",
           "--ckpt-format", "torch_dist", *EXIT]
    proc = run_job(cmd, tmp_path, {**_env(), **CLOCK}, 600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    assert sorted(_lines(log)) == list(range(1, 2 * H + 1)), sorted(_lines(log))
    assert "exiting program after" in log, log[-3000:]
    assert re.search(rf"saved checkpoint from iteration\s+{2 * H} ", log), log[-3000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(2 * H)


@pytest.mark.timeout(900)
def test_a_edit_exits_on_time_at_the_next_real_sync_with_a_common_label(tmp_path):
    # The clock jumps in the synchronous warmup (iterations 1-2): Megatron alone would stop after
    # iteration 2, each worker at its own; A-EDiT stops at its first sync, global iteration 4.
    # (on rank 1 only: the slow worker's time is up, and the fast one stops with it)
    log, ranks = _a_edit_run(tmp_path, *EXIT, env={"MEGATRON_EDIT_PROBE_CLOCK_JUMP": "1:120:1"})
    assert "exiting at A-EDiT's sync after" in log, log[-3000:]
    label = A_WARMUP + A_H
    assert re.search(rf"saved checkpoint from iteration\s+{label} ", log), log[-3000:]
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(label)
    for data in ranks:  # every rank left right after the first sync, at its own iteration
        plans = sorted({r["iteration"] for r in data["records"]
                        if any("async_plan.py:plan:" in f for f in r["stack"])})
        last = max(r["iteration"] for r in data["records"] if r["iteration"] is not None)
        assert plans == [last], (data["rank"], plans, last)


@pytest.mark.timeout(600)
def test_edit_replica_hash_check_off_the_sync_grid_is_made_at_the_next_sync(tmp_path):
    """--check-weight-hash-across-dp-replicas-interval 6 with syncs every 4 steps after a warmup
    of 4 (refused before: replicas differ between syncs). Megatron's own check (hashes gathered
    over every data-parallel rank, an assertion that they match) runs at the start and at the
    first sync at or after each multiple of 6, and passes there."""
    log = _torchrun(CHECKOUT / "pretrain_gpt.py", TINY + [
        "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2", "--overlap-grad-reduce",
        "--overlap-param-gather", "--use-local-sgd", "--local-sgd-sync-interval", str(H),
        "--local-sgd-warmup-steps", "4", "--train-iters", "14",
        "--check-weight-hash-across-dp-replicas-interval", "6"], tmp_path)
    assert _hash_checks(log) == [0, 8, 12], _hash_checks(log)


@pytest.mark.timeout(900)
def test_a_edit_replica_hash_check_at_real_syncs(tmp_path):
    """The same with A-EDiT (refused before: its workers never hold equal replicas at one
    iteration): checked at the real syncs where global progress passes a multiple of 4, at
    each worker's own iteration, and passing there."""
    log, ranks = _a_edit_run(tmp_path, "--check-weight-hash-across-dp-replicas-interval", "4")
    checks = _hash_checks(log)
    assert len(checks) >= 3 and checks[0] == 0, checks  # the start, global iterations 4 (first sync) and 12
    plans = {r["iteration"] for r in ranks[0]["records"] if any("async_plan.py:plan:" in f for f in r["stack"])}
    assert set(checks[1:]) <= plans, (checks, sorted(plans))  # rank 0's own iterations of its syncs


@pytest.mark.timeout(900)
def test_edit_resumed_between_syncs_makes_megatrons_start_check_at_the_first_sync(tmp_path):
    """--check-weight-hash-across-dp-replicas-interval with a checkpoint taken between syncs
    (refused before: Megatron checks the replicas before its loop, where each worker holds its
    own model). Saved at iteration 6 (syncs every 4), resumed there: the check before the loop
    is made at the sync of iteration 8, and passes, as do the later ones."""
    flags = TINY + [
        "--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2", "--overlap-grad-reduce",
        "--overlap-param-gather", "--use-local-sgd", "--local-sgd-sync-interval", str(H),
        "--local-sgd-warmup-steps", "0", "--train-iters", "12", "--save", "ckpt", "--save-interval", "6",
        "--ckpt-format", "torch_dist", "--check-weight-hash-across-dp-replicas-interval", str(H)]
    first = _torchrun(CHECKOUT / "pretrain_gpt.py", flags, tmp_path)
    assert _hash_checks(first) == [0, 4, 8, 12], _hash_checks(first)
    resumed = _torchrun(CHECKOUT / "pretrain_gpt.py", flags + ["--load", "ckpt", "--ckpt-step", "6"], tmp_path)
    assert sorted(_lines(resumed)) == list(range(7, 13)), sorted(_lines(resumed))
    assert _hash_checks(resumed) == [8, 12], _hash_checks(resumed)

