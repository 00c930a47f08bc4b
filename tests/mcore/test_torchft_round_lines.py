"""What a torchft round says when it does not commit (fakes for the group and the controller;
the rounds themselves run in tests/mcore/test_torchft_megatron.py)."""

import logging
from types import SimpleNamespace

import pytest

from megatron_edit.mcore import torchft_round


class _Group:
    size, contributors = 2, 2

    def __init__(self):
        self.manager = SimpleNamespace(errored=lambda: None)

    def commit(self):
        return False


def _round_with_one_member(last_step, step, final=False):
    shards = []
    sync = SimpleNamespace(finish_exchange=lambda: None, decide=lambda applied: None, final=final)
    controller = SimpleNamespace(sync=sync, shards=shards, last_step=last_step,
                                 config=SimpleNamespace(replica_id=1, min_replicas=1))
    member = SimpleNamespace(controller=controller)
    r = torchft_round.TorchftRound.__new__(torchft_round.TorchftRound)
    r.group, r.members, r.started, r.deferred, r.step = _Group(), [member], [member], [], step
    r.residuals_before = {}
    return r


@pytest.mark.parametrize("last_step, step, final, said", [
    (12, 8, False, "keeps its local progress for the next sync"),
    (12, 12, False, "did not commit the run's last sync (after step 12): it ends with its own model"),
    (None, 9, True, "did not commit the run's last sync (after step 9)"),  # A-EDiT's final sync
])
def test_an_uncommitted_round_says_whether_it_was_the_runs_last(monkeypatch, caplog, last_step, step, final, said):
    monkeypatch.setattr(torchft_round.dist, "get_rank", lambda: 0)
    r = _round_with_one_member(last_step, step, final)
    with caplog.at_level(logging.WARNING, logger=torchft_round.__name__):
        assert r.commit() is False
    assert len(caplog.records) == 1 and said in caplog.records[0].getMessage()
