"""What a torchft round says when it does not commit (fakes for the group and the controller;
the rounds themselves run in tests/torchft_backend/test_torchft_megatron.py)."""

import logging
from types import SimpleNamespace

from megatron_edit.mcore import torchft_round


class _Group:
    size, contributors = 2, 2

    def __init__(self):
        self.manager = SimpleNamespace(errored=lambda: None)

    def commit(self):
        return False


def _round_with_one_member(last_step, step, final=False, use_async=False):
    shards = []
    sync = SimpleNamespace(finish_exchange=lambda: None, decide=lambda applied: None, final=final)
    controller = SimpleNamespace(sync=sync, shards=shards, last_step=last_step, delayed=None,
                                 config=SimpleNamespace(replica_id=1, min_replicas=1, use_async=use_async,
                                                        sync_timeout=30.0))
    member = SimpleNamespace(controller=controller)
    r = torchft_round.TorchftRound.__new__(torchft_round.TorchftRound)
    r.group, r.members, r.started, r.deferred, r.step = _Group(), [member], [member], [], step
    r.residuals_before, r.run_end = {}, None  # (no supervisor)

    def sync_again():  # the same round again: it does not commit either
        r.started = [member]
        r.commit()

    controller.sync_again = sync_again
    return r


def test_a_round_before_the_last_keeps_the_local_progress(monkeypatch, caplog):
    monkeypatch.setattr(torchft_round.dist, "get_rank", lambda: 0)
    r = _round_with_one_member(12, 8)
    with caplog.at_level(logging.WARNING, logger=torchft_round.__name__):
        assert r.commit() is False
        r.settle_last_sync()
    assert [m.getMessage() for m in caplog.records] == [
        "megatron_edit: worker 1 did not commit the sync after step 8 (2 worker(s) in it, --local-sgd-min-replicas "
        "1): it keeps its local progress for the next sync."]


def test_the_runs_last_sync_is_tried_again_then_said_to_end_apart(monkeypatch, caplog):
    monkeypatch.setattr(torchft_round.dist, "get_rank", lambda: 0)
    r = _round_with_one_member(12, 12)
    with caplog.at_level(logging.WARNING, logger=torchft_round.__name__):
        assert r.commit() is False
        r.settle_last_sync()
    said = [m.getMessage() for m in caplog.records]
    tries = torchft_round.LAST_SYNC_TRIES
    assert said[:-1] == [f"megatron_edit: worker 1 did not commit the run's last sync (after step 12, 2 worker(s) "
                         f"in it): trying it again ({k} of {tries})." for k in range(1, tries + 1)]
    assert said[-1].startswith(f"megatron_edit: worker 1 did not commit the run's last sync (after step 12, tried "
                               f"{tries + 1} times): it ends with its own model")


def test_a_delayed_last_sync_is_not_tried_again_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(torchft_round.dist, "get_rank", lambda: 0)
    r = _round_with_one_member(12, 12)
    r.members[0].controller.delayed = object()  # a delayed outer step's last sync
    with caplog.at_level(logging.WARNING, logger=torchft_round.__name__):
        assert r.commit() is False
        r.settle_last_sync()
    (record,) = caplog.records
    assert "did not commit the run's last sync (after step 12; a delayed sync is not tried again): it ends " \
           "with its own model" in record.getMessage()
