"""Elastic resume through Megatron-LM's own --save / --load (pretrain_gpt.py, torch_dist), end to
end on 4 CPU processes: another worker count, another TP layout, synchronous <-> EDiT.

Needs a Megatron-LM checkout at core_v0.16.1 in MEGATRON_LM_DIR (skipped otherwise, saying so).
The numbers of each resume are checked on the megatron-core route
(tests/mcore/checkpoint/test_checkpoint_resume.py); here the whole Megatron-LM flow: the load, its log
line, Megatron's own replica-hash check right after the load (every worker identical: at
start-up Megatron compares all data-parallel replicas) and after the next sync, and the loss
going on within noise of the uninterrupted run.
"""

import re

import pytest

from test_megatron_lm import CHECKOUT, HAVE_CHECKOUT, HOW_TO_RUN, TINY, _field, _hash_checks, _lines, _torchrun

H, W, ITERS, SAVE_AT = 4, 4, 14, 10  # syncs at 8 and 12; the EDiT checkpoint is taken between them
DISTOPT = "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather".split()
EDIT = f"--use-local-sgd --local-sgd-sync-interval {H} --local-sgd-warmup-steps {W}".split()
# --vocab-size 255: 256 tokens with the end-of-document one, a padded vocabulary of 256 for TP 1
# and 2 alike (Megatron pads to a multiple of 128 x TP; rows a TP change adds start at zero and
# take probability mass from the trained ones, EDiT or not).
COMMON = TINY + DISTOPT + ["--vocab-size", "255", "--train-iters", str(ITERS), "--ckpt-format", "torch_dist"]
HASH = ["--check-weight-hash-across-dp-replicas-interval", str(H)]
# The loss moves by up to ~0.1 from one iteration to the next here (tiny model, mock data, and
# with EDiT the logged loss is the last rank's worker's own); a resume that lost the saved
# progress would start again near the initial 5.96.
NOISE = 0.15

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not HAVE_CHECKOUT, reason=HOW_TO_RUN)]


def _run(workdir, *args):
    return _torchrun(CHECKOUT / "pretrain_gpt.py", COMMON + list(args), workdir)


def _losses(log):
    return {i: _field(line, "lm loss") for i, line in _lines(log).items()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """2 workers x 2 shards to ITERS (the uninterrupted run), saving at SAVE_AT in Megatron's
    fully reshardable optimizer format (needed for TP changes); and plain synchronous Megatron
    saving at iteration 8."""
    workdir = tmp_path_factory.mktemp("mlm_elastic")
    edit = _run(workdir, *EDIT, "--num-distributed-optimizer-instances", "2", "--save", "edit",
                "--save-interval", str(SAVE_AT), "--dist-ckpt-optim-fully-reshardable")
    plain = _run(workdir, "--num-distributed-optimizer-instances", "2", "--save", "plain", "--save-interval", "8")
    return dict(workdir=workdir, edit=edit, plain=plain)


def _assert_loss_goes_on(resumed, uninterrupted, first):
    got, ref = _losses(resumed), _losses(uninterrupted)
    assert sorted(got) == list(range(first, ITERS + 1))
    for i in got:
        assert abs(got[i] - ref[i]) < NOISE, (i, got[i], ref[i])


@pytest.mark.timeout(900)
@pytest.mark.parametrize("layout", [["--num-distributed-optimizer-instances", "1"],
                                    ["--num-distributed-optimizer-instances", "4"],
                                    ["--num-distributed-optimizer-instances", "1", "--tensor-model-parallel-size", "2"]],
                         ids=["1x4", "4x1", "1x2-TP2"])
def test_edit_checkpoint_resumes_with_another_layout(saved, layout):
    """Saved by 2 workers x 2 shards between syncs; resumed by 1 worker x 4, 4 x 1, or 1 x 2 with
    TP 2: one outer step over the saved workers at load, every data-parallel replica identical
    right after the load (Megatron's hash check at start-up) and after the next sync."""
    log = _run(saved["workdir"], *EDIT, *layout, *HASH, "--load", "edit", "--ckpt-step", str(SAVE_AT))
    assert re.search(rf"resumed EDiT at step {SAVE_AT}, \d worker\(s\), from a checkpoint of 2 worker\(s\) "
                     rf"\(workers 2 -> \d.*\): one outer step over the saved workers at load", log), log[-3000:]
    assert _hash_checks(log) == [SAVE_AT, 12]
    _assert_loss_goes_on(log, saved["edit"], SAVE_AT + 1)


@pytest.mark.timeout(900)
def test_synchronous_checkpoint_resumes_edit(saved):
    """Plain Megatron saved at iteration 8 (past the warmup): EDiT loads it with the optimizer,
    takes its anchor there and syncs at 12; replicas identical at the load and after the sync."""
    log = _run(saved["workdir"], *EDIT, "--num-distributed-optimizer-instances", "2", *HASH,
               "--load", "plain", "--ckpt-step", "8")
    assert "resumed EDiT at step 8, 2 worker(s), from a checkpoint of synchronous training: Adam state kept, " \
           "anchor taken there" in log, log[-3000:]
    assert _hash_checks(log) == [8, 12]
    synced = [i for i, line in _lines(log).items() if (_field(line, "local sgd syncs") or 0) > 0]
    # the layer-wise sync due after 12 completes in 13's forward pass; the run's last step (14)
    # ends with a sync of every shard (megatron_edit.training.run_length)
    assert synced == [13, 14]
    _assert_loss_goes_on(log, saved["plain"], 9)


@pytest.mark.timeout(900)
def test_edit_checkpoint_loads_into_plain_megatron(saved):
    """The EDiT checkpoint taken between syncs, loaded by plain Megatron-LM (no --use-local-sgd,
    through megatron_edit.launch, which brings megatron-core 0.16.1's load fixes) with its
    optimizer: every replica gets worker 0's state."""
    log = _run(saved["workdir"], "--num-distributed-optimizer-instances", "2", *HASH, "--load", "edit",
               "--ckpt-step", str(SAVE_AT))
    assert "successfully loaded checkpoint from edit" in log
    assert _hash_checks(log) == [SAVE_AT, 12]
    _assert_loss_goes_on(log, saved["edit"], SAVE_AT + 1)


# A delayed outer step (tau 2, keep_local: syncs at 8 and 12, launched after 6 and 10).
CONSTANT = ["--ckpt-assume-constant-structure", "--local-sgd-outer-step-delay", "2",
            "--local-sgd-outer-merge-rule", "keep_local", "--num-distributed-optimizer-instances", "2"]


@pytest.mark.timeout(900)
def test_constant_structure_checkpoints_resume_exactly(tmp_path):
    """--ckpt-assume-constant-structure (Megatron's cached save plan, reused once two saves had the
    same), saving at every iteration: in the warmup (1-3), with the anchor (4-), while a delayed
    exchange is in flight (6, 7, 10, 11). Resumed from 7 (in flight, no outer momentum yet) and
    saving again with the loaded metadata plugged in, the losses are the uninterrupted run's.
    Before, the plan of the warmup's saves left the anchor and the exchange out of the later
    checkpoints, whose load was refused."""
    whole = _run(tmp_path, *EDIT, *CONSTANT, "--save", "ckpt", "--save-interval", "1")
    log = _run(tmp_path, *EDIT, *CONSTANT, "--load", "ckpt", "--ckpt-step", "7", "--save", "again",
               "--save-interval", "1")
    assert re.search(r"resumed EDiT at step 7, 2 worker\(s\), from a checkpoint of 2 worker\(s\): each worker "
                     r"its own state", log), log[-3000:]
    got, ref = _losses(log), _losses(whole)
    assert sorted(got) == list(range(8, ITERS + 1)), sorted(got)
    # Iteration 9's logged loss (right after the apply at 8) differs after this resume with or
    # without the flag (seen 2026-12: 5.128073 resumed, 5.092366 uninterrupted; every other
    # iteration equal): a logging difference of the delayed resume, not the checkpoint's content.
    assert {i: got[i] for i in got if i != 9} == {i: ref[i] for i in got if i != 9}
    assert abs(got[9] - ref[9]) < NOISE
