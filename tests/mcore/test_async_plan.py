"""megatron_edit.mcore.async_plan (A-EDiT's schedule) and how the controller feeds it: the interval
a worker measures ends when it arrives at the sync, not after it waited for the others.

A regression caught end to end through Megatron-LM (tests/training/test_global_budget.py, a worker
slowed down 3 s per step): the sync's arrival check (the sync timeout) ran before the plan read the
clock, so a fast worker's interval included its wait for the slow one, both workers measured the
same speed, and A-EDiT gave them equal steps (the fast worker 11 of 24, the straggler 13)."""

import types

import torch

from megatron_edit.config import LocalSGDConfig
from megatron_edit.mcore.async_plan import AsyncPlan
from megatron_edit.mcore.async_sync import AsyncFragments
from megatron_edit.mcore.controller import LocalSGD


class _OneWorker:
    """A sync group of one worker: the max all-reduce is the identity."""

    size, rank = 1, 0
    counters = types.SimpleNamespace(payload_bytes=0)

    def all_reduce_max_everywhere(self, message, group=None):
        return message


class _Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _plan(clock):
    plan = AsyncPlan(LocalSGDConfig(use_async=True, local_sgd_sync_time=10.0, min_total_global_steps=0),
                     _OneWorker(), clock=clock)
    plan.start_clock(0)
    return plan


def test_the_interval_ends_at_the_given_arrival_time():
    clock = _Clock()
    plan = _plan(clock)
    clock.now = 25.0  # the sync's collectives ran until now; the worker arrived at 4.0
    schedule, skip, final = plan.plan(step=8, last_sync_step=0, device=torch.device("cpu"), arrived=4.0)
    assert schedule.interval_seconds.tolist() == [4.0] and schedule.interval_steps.tolist() == [8.0]
    assert plan.rate_history[-1][1].tolist() == [4.0]
    # 2 steps per second, a sync every 10 s: 20 steps planned.
    assert plan.next_sync_at == 8 + 20
    assert plan.interval_start == 25.0  # the next interval starts after the sync


def test_without_an_arrival_time_the_interval_ends_now():
    clock = _Clock()
    plan = _plan(clock)
    clock.now = 8.0
    schedule, _, _ = plan.plan(step=8, last_sync_step=0, device=torch.device("cpu"))
    assert schedule.interval_seconds.tolist() == [8.0] and plan.next_sync_at == 8 + 10


def test_the_controller_reads_the_clock_before_waiting_for_the_others():
    """LocalSGD.start_sync with its collaborators faked: the arrival check takes 20 s (the
    others were slower); the plan must see the 4 s of this worker's own interval."""
    clock = _Clock()
    plan = _plan(clock)
    clock.now = 4.0
    waited = []

    def wait(step):
        waited.append(step)
        clock.now += 20.0

    ctl = LocalSGD.__new__(LocalSGD)
    ctl.config = plan.config
    ctl.async_plan = plan
    ctl.arrivals = types.SimpleNamespace(wait=wait)
    ctl.backend = types.SimpleNamespace(dynamic=False, begin=lambda step: None, close_skipped=lambda: None)  # the torch backend
    ctl.sync_group = _OneWorker()
    ctl.shards = []
    ctl._last_sync_step = 0
    ctl.expert_biases = None  # (a MoE model's router biases, averaged at each sync)
    ctl.auto = None  # (no automatic overlap)
    ctl.async_fragments, ctl.sync_shards, ctl.layer_names = AsyncFragments(), types.SimpleNamespace(fragments=[[]]), []
    started = {}
    ctl.sync = types.SimpleNamespace(start=lambda *a, **k: started.setdefault("kwargs", k) is not None)
    assert ctl.start_sync(8)
    assert waited == [8]
    assert plan.rate_history[-1][1].tolist() == [4.0]  # before the fix: 24.0
    assert started["kwargs"]["worker_seconds"].tolist() == [4.0]  # the report's interval seconds
