"""Synchronous EDiT's last sync where Megatron-LM's run ends (megatron_edit.training.run_length):
``--train-samples`` (Megatron computes the iterations while it builds the scheduler, after the
optimizer) and ``--iterations-to-skip`` (a skipped iteration takes no optimizer step). The
decisions, without the checkout."""

from types import SimpleNamespace

from megatron_edit.training import run_length as rl


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


def test_iterations_to_skip_end_the_run_at_its_last_optimizer_step(monkeypatch):
    """--train-iters 12 with iterations 2 and 9 skipped, resumed after 6 iterations (5 optimizer
    steps): the run ends after optimizer step 10, not 12 (which it never reaches)."""
    args = SimpleNamespace(train_iters=12, iteration=6, iterations_to_skip=[2, 9], rank=0)
    controllers = [_Controller(steps_done=5), _Controller(steps_done=5)]  # MoE: dense and expert
    _wrapped(controllers, monkeypatch, args, lambda: None)()
    assert [c.last_step for c in controllers] == [10, 10]


def test_a_edit_is_left_to_its_global_budget(monkeypatch):
    args = SimpleNamespace(train_iters=12, iteration=0, iterations_to_skip=[2], rank=0)
    controller = _Controller(use_async=True)
    _wrapped([controller], monkeypatch, args, lambda: None)()
    assert controller.last_step is None and controller.budget_steps is None

