"""The per-sync record's content (megatron_edit.exchange.record): one rank's part of a sync and
the worker's record from its ranks' parts, a record's scalars, on known numbers."""

import math
from types import SimpleNamespace

import pytest
import torch

from megatron_edit.exchange.record import agreed, combine, membership_events, rank_part, scalars
from megatron_edit.exchange.report import SyncReport

NAN = float("nan")


def _report(norms, worker=0, payload=100, seconds=0.5, **kw):
    return SyncReport(step=8, mode="step_end", buckets=1, payload_bytes=payload, seconds=seconds, workers=len(norms),
                      worker=worker, norms=torch.tensor(norms, dtype=torch.float64), **kw)


def test_a_worker_of_two_stages_and_two_optimizers_pools_its_ranks_parts():
    """Worker 1 of 3 (torchft: worker 2 just healed and did not train), 2 ranks, each with a
    dense and an expert optimizer; rank 0 represents both optimizers' layers, rank 1 none (the
    same shard group): bytes add up, the worker shows its slowest rank's seconds and waits,
    norms pool (median over every layer), exclusions keep why, residuals add in squares."""
    ids, trained = [4, 1, 2], [True, True, False]
    excluded = torch.tensor([[True, False, False], [False, False, False], [True, True, False]])
    dense = _report([[9.0, 1.0, 1.0], [1.0, 3.0, NAN], [0.0, 0.0, 0.0]], worker=1, excluded=excluded,
                    clip_coef=torch.tensor([1.0, 0.5, 1.0]), skipped=torch.tensor([False, False, True]),
                    residual_norm=torch.tensor(3.0), quantization_error=torch.tensor(1.0),
                    layers=torch.tensor([True, True, True]))
    expert = _report([[1.0, 2.0], [4.0, 5.0], [0.0, 0.0]], worker=1, payload=50, seconds=0.25, delay=1,
                     exposed_wait_seconds=0.125, residual_norm=torch.tensor(4.0),
                     layers=torch.tensor([False, True]))  # a fragment: its second layer only
    heal = dict(from_worker=4, bytes=1000, seconds=2.0)
    rank0 = [rank_part(dense, trained, ids, True, 0.25, heal), rank_part(expert, trained, ids, True, 0.5, None)]
    rank1 = [rank_part(dense, trained, ids, False, 0.75, dict(heal, from_worker=2, seconds=3.0)),
             rank_part(expert, trained, ids, False, None, None)]
    out = combine({0: rank0, 3: rank1})
    assert out["bytes_sent"] == out["bytes_received"] == 300
    assert out["exchange_seconds"] == 0.75 and out["exchange_seconds_sum"] == 1.5
    assert out["exposed_wait_seconds"] == 0.625  # the dense sync's whole time + the delayed expert's wait
    assert out["arrival_wait_seconds"] == 0.75
    assert out["record_seconds"] == 0.0  # (no part timed its record: began not given)
    # dense 1.0, 3.0, NaN; expert 5.0 (the fragment's layer)
    assert out["layer_norms"] == dict(layers=4, min=1.0, median=3.0, max=5.0, non_finite=1, clipped=1, skipped=1)
    assert out["pseudo_grad_norm"] == pytest.approx(math.sqrt(1 + 9 + 25), rel=1e-5)
    # worker 4 anomalous in one layer; worker 2 (did not train) from two layers (rank 0's dense part only)
    assert out["excluded"] == [dict(worker=2, layers=2, anomalous=0, non_finite=0, not_trained=2),
                               dict(worker=4, layers=1, anomalous=1, non_finite=0, not_trained=0)]
    assert out["residual_norm"] == pytest.approx(math.sqrt(2 * 9 + 2 * 16), rel=1e-5)
    assert out["residual_ratio"] == pytest.approx(math.sqrt(50 / 35), rel=1e-5)
    assert out["exchange_error_norm"] == pytest.approx(math.sqrt(2), rel=1e-5)
    assert out["events"] == [dict(event="heal", from_workers=[2, 4], ranks=2, bytes=2000, seconds=3.0)]


def test_the_record_seconds_are_the_slowest_ranks_sum_over_its_optimizers():
    report = _report([[1.0], [1.0]])
    parts = {r: [dict(rank_part(report, [True, True], [0, 1], r == 0, None, None), record=t) for t in times]
             for r, times in ((0, (0.25, 0.5)), (1, (1.0, None)))}
    assert combine(parts)["record_seconds"] == 1.0
    assert rank_part(report, [True, True], [0, 1], True, None, None, began=0.0)["record"] > 0


def test_an_exclusion_for_a_non_finite_norm_says_so():
    report = _report([[1.0, 2.0], [NAN, 2.0]], excluded=torch.tensor([[False, False], [True, False]]))
    out = combine({0: [rank_part(report, [True, True], [0, 1], True, None, None)]})
    assert out["excluded"] == [dict(worker=1, layers=1, anomalous=0, non_finite=1, not_trained=0)]
    assert out["residual_norm"] is None and out["residual_ratio"] is None and out["events"] == []


def test_a_skipped_a_edit_sync_has_no_layers_and_the_agreed_fields_follow_the_participants():
    report = SyncReport(step=3, mode="layerwise", buckets=1, payload_bytes=72, seconds=0.1, workers=2,
                        skipped_sync=True, worker_steps=torch.tensor([2, 6]))
    out = combine({0: [rank_part(report, [True, True], [0, 1], True, None, None)]})
    assert out["layer_norms"] is None and out["pseudo_grad_norm"] is None and out["excluded"] == []
    fields = agreed(report, [0, 1], [True, False], None)
    assert fields["exchanged"] is False and fields["worker_steps"] == [2, 6] and fields["trained"] == [0]


def test_membership_events_name_who_left_and_who_joined():
    assert membership_events(None, [0, 1]) == []
    assert membership_events([0, 1], [0]) == [dict(event="left", workers=[1])]
    assert membership_events([0], [0, 1, 2]) == [dict(event="joined", workers=[1, 2])]
    assert membership_events([0, 1], [0, 1]) == []


def test_a_report_without_a_record_field_reads_as_none():
    part = rank_part(SimpleNamespace(payload_bytes=8, seconds=0.5, delay=0, exposed_wait_seconds=0.0,
                                     quantization_error=None, norms=None), [True], [0], True, None, None)
    assert part["residual_sq"] is None and "layers" not in part


def test_a_records_scalars_are_its_worker_level_figures_without_its_nulls():
    record = dict(kind="sync", worker=1, step=8, participants=[0, 1, 2], trained=[0, 1], committed=True,
                  exchanged=True, bytes_sent=300, bytes_received=300, exchange_seconds=0.75,
                  exposed_wait_seconds=0.5, arrival_wait_seconds=None, residual_ratio=0.25,
                  excluded=[dict(worker=2, layers=2, anomalous=0, non_finite=0, not_trained=2)], missing_ranks=[],
                  delay=1, fragments=2, topk_density=None, worker_steps=[4, 6, 0],
                  events=[dict(event="left", workers=[3]),
                          dict(event="heal", from_workers=[0], ranks=2, bytes=1000, seconds=2.0)])
    assert scalars(record) == {f"local-sgd-record/{tag}": value for tag, value in dict(
        worker=1.0, **{"heal-bytes": 1000.0, "heal-seconds": 2.0, "bytes-sent": 300.0, "bytes-received": 300.0,
                       "participants": 3.0, "trained": 2.0, "committed": 1.0, "exchanged": 1.0,
                       "exchange-seconds": 0.75, "exposed-wait-seconds": 0.5, "residual-ratio": 0.25,
                       "excluded-workers": 1.0, "missing-ranks": 0.0, "delay": 1.0, "fragments": 2.0,
                       "worker-steps/0": 4.0, "worker-steps/1": 6.0, "worker-steps/2": 0.0}).items()}
    join = dict(record, kind="join", events=[])
    assert scalars(join) == {"local-sgd-record/worker": 1.0, "local-sgd-record/heal-bytes": 0.0,
                             "local-sgd-record/heal-seconds": 0.0}
    failed = dict(record, participants=None, trained=None, worker_steps=None, topk_density=0.05)
    out = scalars(failed)
    assert "local-sgd-record/participants" not in out and out["local-sgd-record/topk-density"] == 0.05
