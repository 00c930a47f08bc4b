"""Arrival checks at a sync (megatron_edit.exchange.arrival) on a real torch.distributed store,
with a fake clock: a missing worker is reported while it is awaited and named when the time is
up; present workers pass; keys of old syncs are removed."""

import logging
import threading

import pytest
import torch.distributed as dist

from megatron_edit.exchange.arrival import Arrivals, SyncTimeout


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def wait_for(self, keys, seconds):
        self.now += min(seconds, 0.5)  # a wait in the store that returns within half a second


def test_a_missing_worker_is_reported_then_named_with_the_step(caplog):
    store, clock = dist.HashStore(), FakeClock()
    me = Arrivals(store, "t", ranks=[0, 4, 8], me=0, timeout=10.0, report_every=3.0, clock=clock,
                  wait_for=clock.wait_for)
    store.set("t/0/4", "7")  # worker 1 arrived; worker 2 (global rank 8) never does
    with caplog.at_level(logging.WARNING, logger="megatron_edit"):
        with pytest.raises(SyncTimeout) as err:
            me.wait(step=7)
    message = str(err.value)
    assert "worker 0 waited 10 s at the sync after its step 7" in message
    assert "for worker 2 (global rank 8)" in message and "--local-sgd-sync-timeout (10 s)" in message
    reports = [r.getMessage() for r in caplog.records]
    assert len(reports) == 3 and all("for worker 2" in r for r in reports)  # at 3, 6 and 9 s
    assert 10.0 <= clock.now < 11.0


def test_workers_that_arrive_pass_and_old_keys_are_removed():
    store = dist.HashStore()
    # real clock: a generous timeout, so a loaded machine never trips it
    workers = [Arrivals(store, "t", ranks=[0, 1], me=w, timeout=600.0) for w in range(2)]
    waited = [[] for _ in workers]

    def run(w):
        for step in (3, 5, 7):
            waited[w].append(workers[w].wait(step))

    threads = [threading.Thread(target=run, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert all(len(x) == 3 for x in waited)
    assert workers[0].index == workers[1].index == 3
    assert not store.check(["t/0/0"]) and not store.check(["t/0/1"])  # deleted at the third sync
    assert store.check(["t/2/0"]) and store.check(["t/2/1"])


def test_the_last_arrival_wakes_one_blocking_wait():
    """The waiting worker blocks in the store until the other worker's key appears (no loop of
    polls with a growing interval, which saw the last arrival up to 50 ms late). The other
    worker arrives 0.2 s after the wait began (a timer started inside it, so the machine's load
    cannot make it arrive first)."""
    store = dist.HashStore()
    me = Arrivals(store, "t", ranks=[0, 1], me=0, timeout=600.0)
    calls, timers = [], []
    original = me.wait_for

    def recording(keys, seconds):
        calls.append((list(keys), seconds))
        if not timers:
            timers.append(threading.Timer(0.2, lambda: store.set("t/0/1", "3")))
            timers[0].start()
        original(keys, seconds)

    me.wait_for = recording
    waited = me.wait(step=3)
    timers[0].join()
    assert waited >= 0.2 and len(calls) == 1  # one wait, woken by the key (the next report: 60 s)
    assert calls[0][0] == ["t/0/1"] and 0 < calls[0][1] <= 60  # up to the next report
