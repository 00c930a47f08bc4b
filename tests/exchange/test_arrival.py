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
    assert message.startswith("megatron_edit: sync 1 (after step 7): worker 2 (global rank 8) did not arrive")
    assert "--local-sgd-sync-timeout (10 s; worker 0 waited 10 s for it)" in message
    assert "\n" not in message and err.value.reporter and err.value.missing == [8]
    reports = [r.getMessage() for r in caplog.records]
    assert len(reports) == 3 and all("for worker 2" in r for r in reports)  # at 3, 6 and 9 s
    assert 10.0 <= clock.now < 11.0


def test_the_ranks_that_did_not_arrive_are_named_by_every_waiting_rank_and_one_reports():
    """2 workers x 2 shards (sync groups {0, 2} and {1, 3}): global rank 2 stops, and rank 3,
    held up by it in worker 1's own collectives, never arrives either. Before, rank 1 (waiting
    in its sync group for rank 3) named only "worker 1 (global rank 3)", a healthy rank, and
    both waiting ranks printed. Now each names every rank of the job that did not arrive, with
    its worker, and only the lowest rank that arrived is the reporter."""
    store = dist.HashStore()
    groups = {0: [0, 2], 1: [1, 3], 2: [0, 2], 3: [1, 3]}
    clocks = {r: FakeClock() for r in range(4)}
    checks = {r: Arrivals(store, "t", ranks=groups[r], me=groups[r].index(r), timeout=10.0,
                          clock=clocks[r], wait_for=clocks[r].wait_for, job_ranks=range(4))
              for r in range(4)}
    errors = {}
    store.set("t/0/0", "3")  # rank 0 arrives while rank 1 waits (one thread: set by hand)
    for r in (1, 0):  # ranks 2 and 3 never arrive
        with pytest.raises(SyncTimeout) as err:
            checks[r].wait(step=3)
        errors[r] = err.value
    for r, error in errors.items():
        assert str(error).startswith(
            "megatron_edit: sync 1 (after step 3): worker 1 (global ranks 2, 3) did not arrive"), str(error)
        assert error.missing == [2, 3] and "\n" not in str(error)
    assert errors[0].reporter and not errors[1].reporter


def test_a_short_timeout_is_warned_about_at_start():
    from megatron_edit.exchange.arrival import SHORT_TIMEOUT_S, short_timeout_warning

    assert "--local-sgd-sync-timeout 2 s is below" in short_timeout_warning(2.0)
    assert short_timeout_warning(SHORT_TIMEOUT_S) is None


def test_a_wait_close_to_the_timeout_is_warned_about_once(caplog):
    store, clock = dist.HashStore(), FakeClock()
    me = Arrivals(store, "t", ranks=[0, 1], me=0, timeout=4.0, report_every=60.0, clock=clock,
                  wait_for=clock.wait_for)
    with caplog.at_level(logging.WARNING, logger="megatron_edit"):
        for index, step in enumerate((2, 4)):
            clock.wait_for = lambda keys, seconds, i=index: (clock.__setattr__("now", clock.now + 3.0),
                                                             store.set(f"t/{i}/1", "x"))
            me.wait_for = clock.wait_for
            me.wait(step)
    (record,) = [r for r in caplog.records if "more than half" in r.getMessage()]
    assert "worker 0 waited 3.0 s" in record.getMessage()


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
