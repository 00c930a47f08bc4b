"""The run's length for megatron-core users: ``megatron_edit.set_train_iters(optimizer, n)`` /
``LocalSGD.set_train_iters`` (validated; the multi-rank runs of tests/edit_runs.py set it through
the public function, e.g. tests/mcore/test_edit_megatron.py's sync at the last step)."""

from types import SimpleNamespace

import pytest

import megatron_edit as me
from megatron_edit.mcore.controller import LocalSGD


def _controller(steps_done=0, use_async=False, workers=2):
    return SimpleNamespace(config=SimpleNamespace(use_async=use_async), steps_done=steps_done, num_workers=workers,
                           budget_workers=workers, last_step=None, budget_steps=None, backend=None)  # (no torchft)


def test_edit_ends_at_the_given_step_and_a_edit_gets_the_budget():
    c = _controller(steps_done=3)
    LocalSGD.set_train_iters(c, 9)
    assert c.last_step == 9 and c.budget_steps is None
    a = _controller(use_async=True, workers=4)
    LocalSGD.set_train_iters(a, 9)
    assert a.budget_steps == 36 and a.last_step is None


@pytest.mark.parametrize("value, match", [
    (0, "number of optimizer steps >= 1"), (True, "number of optimizer steps >= 1"),
    (9.0, "number of optimizer steps >= 1"), ("9", "number of optimizer steps >= 1"),
    (2, "has taken 3 optimizer steps already"),
])
def test_a_bad_run_length_is_refused(value, match):
    with pytest.raises(ValueError, match=match):
        LocalSGD.set_train_iters(_controller(steps_done=3), value)


def test_an_optimizer_without_edit_is_refused():
    with pytest.raises(RuntimeError, match="has no EDiT state"):
        me.set_train_iters(object(), 9)
