"""The per-sync record (issue 59, megatron_edit.mcore.sync_record): one JSON line per sync per
worker, written by the worker's first rank from the parts its ranks leave in the job's store.

* the store protocol in one process (a HashStore, ranks as objects): a record waits for a late
  rank's part without anyone waiting, is written at a later sync in order, and a rank whose part
  never comes is named at the end; the writer of each worker is its first rank; a reader (Megatron-LM's
  logging rank) takes its worker's records as they are written, through the store or in its process;
* real megatron-core on CPU / gloo, 2 workers x 2 ranks: step-end, layer-wise (with clipping), a
  delayed outer step, streaming fragments, int8 with error feedback and top-k in one job: one
  record per worker per sync, the settings in force, and bytes equal to what a wrapped
  torch.distributed counted on the wire (within 1%); A-EDiT (a skipped sync, steps per worker,
  the final sync);
* the documented fields (docs/reference/sync-record.md) are the fields written.

The torchft backend's records (a kill, a relaunch, a heal) are checked in
tests/mcore/test_torchft_megatron.py, the main job's against its summary in tests/test_main_job.py.
"""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from dist import run_ranks
from edit_runs import async_runs, default_spec, megatron_runs
from megatron_edit.exchange.record import FIELDS, agreed, rank_part
from megatron_edit.exchange.report import SyncReport
from megatron_edit.mcore import compat
from megatron_edit.mcore.sync_record import SyncRecord
from test_edit_megatron import OUTER

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference" / "sync-record.md"


def _lines(path):
    return [json.loads(line) for line in Path(path).read_text().splitlines()] if Path(path).exists() else []


def _rank(store, path, rank, world, worker, worker_is_world=True, reader=False):
    record = SyncRecord(str(path), worker, "torch", store, rank, world, worker_is_world, session=7, end_wait=0.2,
                        reader=reader)
    backend = SimpleNamespace(sync_group=SimpleNamespace(), joining=False, last_heal=None, arrival_wait=None)
    layout = SimpleNamespace(intra_rank=rank % 2, tp_group=None)
    return record, record.feed(SimpleNamespace(layout=layout, backend=backend, arrivals=None,
                                               config=SimpleNamespace(exchange_topk_density=None)))


def _sync(feed, step, payload):
    report = SyncReport(step=step, mode="step_end", buckets=1, payload_bytes=payload, seconds=0.5, workers=2,
                        norms=torch.ones(2, 3, dtype=torch.float64))
    feed(report, last_step=None)


def test_a_late_ranks_part_is_waited_for_by_nobody_and_a_missing_one_is_named(tmp_path):
    store, path = dist.HashStore(), tmp_path / "r.jsonl"
    (first, feed0), (second, feed1) = _rank(store, path, 0, 2, 0), _rank(store, path, 1, 2, 0)
    assert first.run_id == second.run_id  # agreed in the store
    _sync(feed0, 2, 100)
    assert _lines(path) == []  # rank 1's part is not there yet: nothing written, nothing waited for
    _sync(feed1, 2, 100)
    _sync(feed0, 4, 100)  # the writer's next sync: sync 1 is complete, sync 2 not yet
    (one,) = _lines(path)
    assert (one["sync"], one["step"], one["bytes_sent"], one["ranks"], one["missing_ranks"]) == (1, 2, 200, 2, [])
    assert list(one) == list(FIELDS)
    assert not store.check(["megatron_edit/record/7/0/0/1"])  # read, then deleted
    assert not store.check(["megatron_edit/record/7/0/0/0"]) and not store.check(["megatron_edit/record/7/0/1/0"])  # the writer keeps its own parts
    assert 0 <= one["record_seconds"] < 1
    first.close()  # rank 1 never reports its sync 2: the record names it
    second.close()
    two = _lines(path)[1]
    assert (two["sync"], two["step"], two["bytes_sent"], two["missing_ranks"]) == (2, 4, 100, [1])
    assert first.latest == two and second.latest is None  # (the writer's last, for a reader in its process)


def test_each_workers_first_rank_writes_its_record(tmp_path):
    """Two workers of two ranks in one store (the torch backend): the ranks tell their worker in
    the store; ranks 0 and 2 write, each its worker's ranks' parts."""
    store, path = dist.HashStore(), tmp_path / "r-{worker}.jsonl"
    ranks = [_rank(store, path, r, 4, r // 2, worker_is_world=False) for r in range(4)]
    for (record, feed), payload in zip(ranks, (1, 2, 30, 40)):
        _sync(feed, 2, payload)
    for record, feed in ranks:
        record.flush(0.0)
    assert [[(r["worker"], r["bytes_sent"], r["ranks"]) for r in _lines(tmp_path / f"r-{w}.jsonl")] for w in (0, 1)] \
        == [[(0, 3, 2)], [(1, 70, 2)]]
    assert [record._writer for record, _ in ranks] == [True, False, True, False]
    # every part read and deleted, the writers' own too (set before they knew they write)
    assert not any(store.check([f"megatron_edit/record/7/{r // 2}/0/{r}"]) for r in range(4))
    for (record, feed), payload in zip(ranks, (1, 2, 30, 40)):  # a second sync: the writers keep theirs
        _sync(feed, 4, payload)
    assert not store.check(["megatron_edit/record/7/0/1/0"]) and store.check(["megatron_edit/record/7/0/1/1"])
    for record, feed in ranks:
        record.flush(0.0)
    assert [len(_lines(tmp_path / f"r-{w}.jsonl")) for w in (0, 1)] == [2, 2]
    assert not store.check(["megatron_edit/record/7/0/1/1"])


def test_the_rank_that_logs_takes_its_workers_records_as_written_without_waiting(tmp_path):
    """Two workers of two ranks; rank 3 (worker 1's second, Megatron-LM's logging rank) reads:
    worker 1's first rank hands it each record it writes, in the store; worker 0's writer hands
    nothing over (nobody of its worker reads), and takes nothing."""
    store, path = dist.HashStore(), tmp_path / "r.jsonl"
    ranks = [_rank(store, path, r, 4, r // 2, worker_is_world=False, reader=r == 3) for r in range(4)]
    reader = ranks[3][0]
    for step in (2, 4):
        for (record, feed), payload in zip(ranks, (1, 2, 30, 40)):
            _sync(feed, step, payload)
    assert reader.take() == [line for line in _lines(path) if line["worker"] == 1]  # sync 1's, written at sync 2
    assert [r["step"] for r in reader.take()] == []  # nothing new
    assert ranks[0][0].take() == [] and not store.check(["megatron_edit/record/7/read/0/0"])
    for record, _ in ranks[:3]:
        record.close()  # the run's end: every record written
    rest = reader.take(wait=0.2)
    assert [(r["worker"], r["step"], r["bytes_sent"]) for r in rest] == [(1, 4, 70)]
    reader.close()
    assert rest[0] == [line for line in _lines(path) if line["worker"] == 1][-1]


def test_a_reader_that_is_its_workers_writer_takes_its_records_in_its_process(tmp_path):
    store, path = dist.HashStore(), tmp_path / "r.jsonl"
    (first, feed0), (second, feed1) = _rank(store, path, 0, 2, 0, reader=True), _rank(store, path, 1, 2, 0)
    _sync(feed0, 2, 5)
    _sync(feed1, 2, 5)
    _sync(feed0, 4, 5)
    assert [(r["step"], r["bytes_sent"]) for r in first.take()] == [(2, 10)]
    assert not store.check(["megatron_edit/record/7/read/0/0"])  # nothing through the store
    # the end: rank 1's part of sync 2 never comes; the record is written naming it, and taken
    assert [(r["step"], r["missing_ranks"]) for r in first.take(wait=0.2)] == [(4, [1])]
    first.close()
    second.close()


def test_a_reader_names_the_records_that_did_not_come_by_the_end(tmp_path, caplog):
    store, path = dist.HashStore(), tmp_path / "r.jsonl"
    (first, _), (second, feed1) = _rank(store, path, 0, 2, 0), _rank(store, path, 1, 2, 0, reader=True)
    _sync(feed1, 2, 5)  # the writer never reports its sync: no record is written before its close
    assert second.take(wait=0.2) == []
    assert "rank 1 did not get 1 of worker 0's sync records (from its sync 1 on) within 0.2 s" in caplog.text
    first.close()
    second.close()


# ---------------------------------------------------------------------- real megatron-core
MODES = {
    "step_end": dict(local_sgd_sync_interval=2, sync_mode="step_end"),
    "layerwise": dict(local_sgd_sync_interval=2, sync_mode="layerwise", clip_pseudo_grad=0.05),
    "delayed": dict(local_sgd_sync_interval=2, outer_step_delay=1, sync_mode="layerwise"),
    "fragments": dict(local_sgd_sync_interval=4, fragments=2, sync_mode="step_end"),
    "int8": dict(local_sgd_sync_interval=2, exchange_dtype="int8", exchange_error_feedback=True, sync_mode="step_end"),
    "topk": dict(local_sgd_sync_interval=2, exchange_topk_density=0.05, exchange_topk_chunk=256, exchange_dtype="int2"),
}
STEPS = 4


def _by_worker(results, run):
    """worker -> the run's result on each of its ranks."""
    out = {}
    for r in results:
        out.setdefault(r["runs"][run]["worker"], []).append(r["runs"][run])
    return out


@pytest.mark.timeout(400)
def test_one_record_per_worker_per_sync_with_the_bytes_on_the_wire(tmp_path):
    specs = [default_spec(steps=STEPS, last_step=STEPS, traffic=True, outer=OUTER,
                          local_sgd=dict(local, sync_record=str(tmp_path / f"{name}.jsonl")))
             for name, local in MODES.items()]
    results = run_ranks(megatron_runs, 4, specs, timeout=360)
    run_ids = set()
    for i, name in enumerate(MODES):
        records = _lines(tmp_path / f"{name}.jsonl")
        for worker, ranks in _by_worker(results, i).items():
            mine = [r for r in records if r["worker"] == worker]
            reports = [run["reports"] for run in ranks]  # per rank of the worker
            assert [r["step"] for r in mine] == [rep.step for rep in reports[0]], name
            assert all(list(r) == list(FIELDS) and r["kind"] == "sync" and r["ranks"] == 2 and r["missing_ranks"] == []
                       and r["participants"] == [0, 1] == r["trained"] and r["committed"] for r in mine), name
            assert [r["sync"] for r in mine] == list(range(1, len(mine) + 1))
            assert [r["last_sync"] for r in mine] == [False] * (len(mine) - 1) + [True]  # (the run's last step)
            for k, r in enumerate(mine):
                assert r["bytes_sent"] == r["bytes_received"] == sum(rep[k].payload_bytes for rep in reports), name
                assert r["exchange_seconds"] >= 0.0 and r["exposed_wait_seconds"] >= 0.0
                assert r["arrival_wait_seconds"] is not None and r["layer_norms"]["layers"] >= 1
            # an independent count: the bytes handed to torch.distributed across workers
            wire = [b for run in ranks for _, b in run["wire_bytes"]]
            assert -1 not in wire and wire, name
            assert abs(sum(r["bytes_sent"] for r in mine) - sum(wire)) <= 0.01 * sum(wire), name
            run_ids.update(r["run_id"] for r in mine)
            _check_settings(name, mine)
    assert len(run_ids) == 1  # one job, one run id (agreed in its store)


def _check_settings(name, records):
    """The settings in force, as each mode sets them."""
    steps = [r["step"] for r in records]
    if name == "layerwise":
        assert any(r["layer_norms"]["clipped"] for r in records)
    if name == "delayed":
        assert [(r["step"], r["delay"]) for r in records] == [(2, 1), (4, 0)]  # the last step's: blocking
    elif name == "fragments":
        assert [(r["fragment"], r["fragments"]) for r in records] == [(1, 2), (None, 2)]  # the last: every shard
    else:
        assert steps == [2, 4]
    if name in ("int8", "topk"):
        assert all(r["residual_norm"] > 0 and 0 < r["residual_ratio"] and r["exchange_error_norm"] > 0
                   for r in records)
        assert records[0]["exchange_dtype"] == ("int8" if name == "int8" else "int2")
        assert records[0]["topk_density"] == (0.05 if name == "topk" else None)
    else:
        assert all(r["residual_norm"] is None and r["exchange_error_norm"] is None for r in records)


MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", add_bias_linear=False)


@pytest.mark.one_lane  # a variant of what other tests check in every lane (CI time; see conftest)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", [dict(pp=2), pytest.param(dict(ep=2), marks=pytest.mark.skipif(
    not compat.version_at_least("0.16.0"), reason="MoE with EDiT needs megatron-core 0.16+"))], ids=["pp2", "moe-ep2"])
def test_a_worker_of_two_stages_or_two_optimizers_writes_one_record_of_all_its_ranks(tmp_path, layout):
    """2 workers of 2 ranks: two pipeline stages (a controller each), or a MoE model with expert
    parallelism (a dense and an expert controller on each rank). Each worker's record holds the
    bytes of every controller of every rank, and the layers of every stage and optimizer."""
    path = tmp_path / "r.jsonl"
    moe = "ep" in layout
    spec = default_spec(steps=4, last_step=4, outer=OUTER, model=MOE if moe else {},
                        local_sgd=dict(local_sgd_sync_interval=2, sync_mode="step_end", sync_record=str(path)))
    results = run_ranks(megatron_runs, 4, [spec], timeout=250, **layout)
    records = _lines(path)
    for worker, ranks in _by_worker(results, 0).items():
        mine = [r for r in records if r["worker"] == worker]
        controllers = [c for run in ranks for c in run["per_controller"]]
        assert len(controllers) == (4 if moe else 2) and [r["step"] for r in mine] == [2, 4]
        for k, r in enumerate(mine):
            assert r["bytes_sent"] == sum(c["reports"][k].payload_bytes for c in controllers)
            assert r["ranks"] == 2 and r["missing_ranks"] == []
        # every layer once: the stages' (pp) or the dense and expert optimizers' (moe) layers
        layers = (len(ranks[0]["per_controller"][0]["layer_names"]) + len(ranks[0]["per_controller"][1]["layer_names"])
                  if moe else sum(len(run["per_controller"][0]["layer_names"]) for run in ranks))
        assert all(r["layer_norms"]["layers"] == layers for r in mine), (layers, mine[0]["layer_norms"])


@pytest.mark.one_lane  # a variant of what other tests check in every lane (CI time; see conftest)
@pytest.mark.timeout(300)
def test_a_edit_records_its_skipped_syncs_the_steps_per_worker_and_the_final_sync(tmp_path):
    """The budget run of tests/mcore/test_async.py (workers at 1 s and 0.25 s per step): its first
    sync is skipped, then each worker's steps differ; the final sync ends the record."""
    path = tmp_path / "a-edit.jsonl"
    spec = default_spec(local_sgd=dict(use_async=True, local_sgd_sync_time=4.0, local_sgd_sync_interval=2,
                                       local_sgd_warmup_steps=1, min_total_global_steps=10, sync_mode="step_end",
                                       sync_record=str(path)),
                        outer=OUTER, seconds_per_step=[1.0, 0.25], max_steps=64, train_iters=20)
    results = run_ranks(async_runs, 4, spec, timeout=250)
    records = _lines(path)
    for r in results:
        mine = [x for x in records if x["worker"] == r["worker"]]
        assert [x["step"] for x in mine] == [rep.step for rep in r["reports"]]
        assert [x["exchanged"] for x in mine] == [not rep.skipped_sync for rep in r["reports"]] == [False, True, True]
        assert [x["worker_steps"] for x in mine] == [rep.worker_steps.tolist() for rep in r["reports"]]
        assert [x["final"] for x in mine] == [False, False, True]
        assert mine[0]["layer_norms"] is None and mine[0]["bytes_sent"] > 0  # the schedule only
        assert all(x["missing_ranks"] == [] and x["ranks"] == 2 for x in mine)


def test_the_documented_fields_are_the_fields_written():
    """docs/reference/sync-record.md's table names every field of :data:`FIELDS`, in order (the
    runs above check that a record's keys are :data:`FIELDS`)."""
    table = DOCS.read_text().split("| field | type | meaning |", 1)[1].split("\n\n", 1)[0]
    documented = re.findall(r"^\| `(\w+)` \|", table, re.M)
    assert documented == list(FIELDS)
    report = SyncReport(step=2, mode="step_end", buckets=1, payload_bytes=1, seconds=0.1, workers=2)
    written = {**agreed(report, [0, 1], [True, True], None), "join": False}
    assert set(written) - {"join"} <= set(FIELDS)
    assert "layers" not in rank_part(report, [True, True], [0, 1], True, None, None)  # (no norms: no layers)
