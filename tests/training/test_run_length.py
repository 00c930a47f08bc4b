"""Synchronous EDiT's last sync where Megatron-LM's run ends (megatron_edit.training.run_length):
``--train-samples`` (Megatron computes the iterations while it builds the scheduler, after the
optimizer) and ``--iterations-to-skip`` (a skipped iteration takes no optimizer step). The
decisions without the checkout; end to end through Megatron-LM's pretrain_gpt.py with it
(MEGATRON_LM_DIR, see tests/training/test_megatron_lm.py; skipped with that message otherwise)."""

from types import SimpleNamespace

import pytest

from megatron_edit.training import run_length as rl
from test_megatron_lm import CHECKOUT, EDIT, HAVE_CHECKOUT, HOW_TO_RUN, TINY, _synced_steps, _torchrun


class _Controller:
    def __init__(self, steps_done=0, use_async=False):
        self.config = SimpleNamespace(use_async=use_async)
        self.steps_done = steps_done
        self.last_step = None
        self.budget_steps = None

    def set_train_iters(self, n):
        from megatron_edit.mcore.controller import LocalSGD

        LocalSGD.set_train_iters(self, n)


def _wrapped(controllers, monkeypatch, args, original):
    monkeypatch.setattr(rl, "_get_args", lambda: args)
    runtime = SimpleNamespace(controllers={object(): c for c in controllers})
    return rl.RunLength(lambda: runtime).wrap_setup_model_and_optimizer(original)


def test_last_step_counts_optimizer_steps():
    assert rl.last_step(0, 0, 12) == 12
    assert rl.last_step(0, 0, 12, [3, 5, 40]) == 10  # iterations 4 and 6 take no optimizer step
    assert rl.last_step(7, 8, 12, [3, 9]) == 10  # resumed: one skipped before, one still ahead
    assert rl.last_step(0, 0, 12, [12], base=1) == 11  # 0.19 counts from 1: the last iteration
    assert rl.last_step(0, 0, 12, [0], base=1) == 12  # ... and 0 names none


def test_train_samples_sets_the_last_step_once_megatron_knows_the_iterations(monkeypatch):
    """--train-samples 96, --global-batch-size 8: args.train_iters is None while the optimizer
    is built (no last step then) and 12 once the scheduler is; the controller ends at 12."""
    args = SimpleNamespace(train_iters=None, train_samples=96, global_batch_size=8, iteration=0,
                           iterations_to_skip=[], rank=0)
    controller = _Controller()

    def setup_model_and_optimizer():  # as Megatron: update_train_iters while the scheduler is built
        assert controller.last_step is None
        args.train_iters = args.train_samples // args.global_batch_size
        return "built"

    assert _wrapped([controller], monkeypatch, args, setup_model_and_optimizer)() == "built"
    assert controller.last_step == 12


@pytest.mark.parametrize("base, skipped, end", [(0, [2, 12], 11), (1, [2, 12], 10)], ids=["0.16", "0.19"])
def test_iterations_to_skip_end_the_run_at_its_last_optimizer_step(monkeypatch, base, skipped, end):
    """--train-iters 12 with --iterations-to-skip 2 12, resumed after 6 iterations (5 optimizer
    steps): the run ends after optimizer step 11 on 0.16 (it reads the list 0-based: 12 names
    no iteration of the run), 10 on 0.19 (1-based: 12 is its last iteration)."""
    monkeypatch.setattr(rl.compat, "skipped_iteration_base", lambda: base)
    args = SimpleNamespace(train_iters=12, iteration=6, iterations_to_skip=skipped, rank=0)
    controllers = [_Controller(steps_done=5), _Controller(steps_done=5)]  # MoE: dense and expert
    _wrapped(controllers, monkeypatch, args, lambda: None)()
    assert [c.last_step for c in controllers] == [end, end]


def test_iterations_to_skip_on_a_release_not_checked_is_refused(monkeypatch):
    monkeypatch.setattr(rl.compat, "skipped_iteration_base", lambda: None)
    args = SimpleNamespace(train_iters=12, iteration=0, iterations_to_skip=[3], rank=0)
    with pytest.raises(RuntimeError, match="--iterations-to-skip with --use-local-sgd is not checked"):
        _wrapped([_Controller()], monkeypatch, args, lambda: None)()


def test_a_edit_is_left_to_its_global_budget(monkeypatch):
    args = SimpleNamespace(train_iters=12, iteration=0, iterations_to_skip=[2], rank=0)
    controller = _Controller(use_async=True)
    _wrapped([controller], monkeypatch, args, lambda: None)()
    assert controller.last_step is None and controller.budget_steps is None



# ================================================================ end to end (needs the checkout)
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(not HAVE_CHECKOUT, reason=HOW_TO_RUN)
def test_e2e_train_samples_and_skipped_iterations_end_with_a_sync(tmp_path):
    """pretrain_gpt.py through the launcher, 2 workers x 2 ranks, W = 4, H = 4: --train-samples
    120 at 8 a batch (Megatron computes 15 iterations while it builds the scheduler, after the
    optimizer) with --iterations-to-skip 9 (one iteration without an optimizer step): 14 optimizer
    steps, so syncs after steps 8 and 12 and the run's last sync after step 14, off the grid
    (before: none there, the workers ended with different models)."""
    tiny = list(TINY)
    at = tiny.index("--lr-warmup-iters")
    tiny[at:at + 2] = ["--lr-warmup-samples", "16"]
    log = _torchrun(CHECKOUT / "pretrain_gpt.py",
                    tiny + EDIT + ["--train-samples", "120", "--iterations-to-skip", "9"], tmp_path)
    assert _synced_steps(log) == [8, 12, 14], log[-4000:]
