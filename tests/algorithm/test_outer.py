"""megatron_edit.algorithm.outer / .schedule on tiny tensors, and exchange.groups.SyncGroup(None)."""

import pytest
import torch

from megatron_edit.exchange.groups import SyncGroup
from megatron_edit.algorithm.outer import mean_from_sum, outer_step, pseudo_gradient
from megatron_edit.algorithm.schedule import grads_are_local, is_sync_step


def _t(*values):
    return torch.tensor(values, dtype=torch.float64)


def test_sync_steps_after_warmup():
    syncs = [s for s in range(0, 13) if is_sync_step(s, warmup_steps=2, sync_interval=3)]
    assert syncs == [5, 8, 11]


def test_no_sync_during_warmup():
    assert not any(is_sync_step(s, warmup_steps=10, sync_interval=1) for s in range(0, 11))
    assert is_sync_step(11, warmup_steps=10, sync_interval=1)


def test_interval_one_without_warmup_syncs_every_step():
    assert [is_sync_step(s, 0, 1) for s in range(0, 5)] == [False, True, True, True, True]


def test_grads_local_from_the_first_step_after_warmup():
    # steps_done = steps finished; the step now running is steps_done + 1.
    assert [grads_are_local(s, warmup_steps=2) for s in range(0, 5)] == [
        False, False, True, True, True
    ]
    assert grads_are_local(0, warmup_steps=0)


def test_first_sync_comes_after_h_local_steps():
    warmup, interval = 3, 4
    local_steps = [s + 1 for s in range(0, 20) if grads_are_local(s, warmup)]
    first_sync = next(s for s in range(1, 20) if is_sync_step(s, warmup, interval))
    assert first_sync == 7
    assert [s for s in local_steps if s <= first_sync] == [4, 5, 6, 7]


def test_pseudo_gradient_is_anchor_minus_current():
    anchor, current = _t(1.0, 2.0, -3.0), _t(0.5, 2.5, -1.0)
    out = torch.empty(3, dtype=torch.float64)
    assert pseudo_gradient(anchor, current, out) is out
    assert out.tolist() == [0.5, -0.5, -2.0]
    assert anchor.tolist() == [1.0, 2.0, -3.0]  # the anchor is untouched


def test_pseudo_gradient_in_place_over_current():
    anchor, current = _t(1.0, 2.0), _t(4.0, -1.0)
    result = pseudo_gradient(anchor, current, out=current)
    assert result is current
    assert current.tolist() == [-3.0, 3.0]


def test_mean_from_sum():
    summed = _t(3.0, -6.0, 1.5)
    assert mean_from_sum(summed, 3) is summed  # in place
    assert summed.tolist() == [1.0, -2.0, 0.5]
    one = _t(3.0, -6.0)
    assert mean_from_sum(one, 1) is one
    assert one.tolist() == [3.0, -6.0]


def test_outer_step_nesterov_sgd_two_calls():
    # torch SGD, Nesterov: buf = m*buf + g (buf = g the first time); update = g + m*buf;
    # p -= lr*update.  lr 0.7, m 0.9.
    anchor = torch.nn.Parameter(_t(1.0, 2.0))
    other = torch.nn.Parameter(_t(5.0, -5.0))  # another bucket's anchor, same optimizer
    opt = torch.optim.SGD([anchor, other], lr=0.7, momentum=0.9, nesterov=True)

    # call 1: g = [0.5, -1.0]; buf = [0.5, -1.0]; update = g + 0.9*buf = [0.95, -1.9]
    #         p = [1 - 0.7*0.95, 2 + 0.7*1.9] = [0.335, 3.33]
    g1 = _t(0.5, -1.0)
    outer_step(opt, [anchor], [g1])
    torch.testing.assert_close(anchor.detach(), _t(0.335, 3.33))
    assert anchor.grad is None  # the gradient is not left on the anchor
    assert g1.tolist() == [0.5, -1.0]

    # call 2: g = [0.1, 0.2]; buf = 0.9*[0.5, -1.0] + g = [0.55, -0.7]
    #         update = g + 0.9*buf = [0.595, -0.43]
    #         p = [0.335 - 0.7*0.595, 3.33 + 0.7*0.43] = [-0.0815, 3.631]
    outer_step(opt, [anchor], [_t(0.1, 0.2)])
    torch.testing.assert_close(anchor.detach(), _t(-0.0815, 3.631))
    torch.testing.assert_close(opt.state[anchor]["momentum_buffer"], _t(0.55, -0.7))

    # the anchor whose grad was None all along: unchanged, and no momentum state for it
    assert other.detach().tolist() == [5.0, -5.0]
    assert other.grad is None
    assert "momentum_buffer" not in opt.state.get(other, {})


def test_outer_step_buckets_one_at_a_time_equal_all_at_once():
    def run(split):
        a, b = torch.nn.Parameter(_t(1.0, -1.0)), torch.nn.Parameter(_t(2.0))
        opt = torch.optim.SGD([a, b], lr=0.7, momentum=0.9, nesterov=True)
        for ga, gb in ((_t(0.3, 0.1), _t(-0.2)), (_t(-0.4, 0.6), _t(0.5))):
            if split:
                outer_step(opt, [a], [ga])
                outer_step(opt, [b], [gb])
            else:
                outer_step(opt, [a, b], [ga, gb])
        return a.detach().tolist() + b.detach().tolist()

    together, apart = run(split=False), run(split=True)
    assert together == pytest.approx(apart, abs=0, rel=0)
    assert together != [1.0, -1.0, 2.0]


def test_plain_averaging_is_sgd_lr_one():
    anchor = torch.nn.Parameter(_t(1.0, 2.0))
    opt = torch.optim.SGD([anchor], lr=1.0)
    # mean pseudo-gradient of two workers at [0.6, 2.2] and [0.8, 1.4]: anchor - mean(theta_i)
    delta = mean_from_sum(_t(1.0 - 0.6, 2.0 - 2.2) + _t(1.0 - 0.8, 2.0 - 1.4), 2)
    outer_step(opt, [anchor], [delta])
    torch.testing.assert_close(anchor.detach(), _t(0.7, 1.8))


def test_sync_group_of_one_worker():
    group = SyncGroup(None)
    assert (group.size, group.rank) == (1, 0)
    tensor = _t(1.0, 2.0)
    handle = group.all_reduce_sum(tensor)
    assert handle.wait() is True
    assert group.all_reduce_sum(tensor, async_op=False).wait() is True
    assert tensor.tolist() == [1.0, 2.0]
    assert (group.counters.collectives, group.counters.payload_bytes) == (0, 0)


def test_comm_counters_reset():
    group = SyncGroup(None)
    group.counters.collectives, group.counters.payload_bytes = 3, 96
    group.counters.reset()
    assert (group.counters.collectives, group.counters.payload_bytes) == (0, 0)
