"""What the benchmarks read from the per-sync record (scripts/bench/bench_common.py's reader,
bench_ft's worker-steps in the anchor and time to the first sync after a fault), on record
lines written by hand; the runs themselves are the benchmarks' (not timed here)."""

import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "scripts" / "bench"
sys.path.insert(0, str(BENCH))

import bench_common as bc  # noqa: E402
from bench_ft import anchored_steps, first_sync_after  # noqa: E402


def _record(worker, step, time, committed=True, trained=(0, 1), kind="sync", **fields):
    return dict(kind=kind, worker=worker, step=step, time=time, committed=committed, trained=list(trained),
                bytes_sent=100 * (worker + 1), exposed_wait_seconds=0.01 * step, **fields)


def _write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_records_are_read_in_order_summed_per_worker_and_taken_per_step(tmp_path):
    path = _write(tmp_path / "r.jsonl", [_record(0, 4, 10.0), _record(1, 4, 10.1), _record(0, 0, 9.0, kind="join"),
                                         _record(0, 8, 20.0), _record(1, 8, 20.2)])
    records = bc.read_records(path)
    assert [(r["worker"], r["step"]) for r in records] == [(0, 4), (1, 4), (0, 8), (1, 8)]  # no join
    assert len(bc.read_records(path, kind=None)) == 5
    assert bc.per_worker(records, "bytes_sent") == {0: 200, 1: 400}
    assert bc.by_step(records, "exposed_wait_seconds") == {4: 0.04, 8: 0.08}


def test_a_missing_record_or_a_line_that_is_not_one_stops_with_one_line(tmp_path):
    with pytest.raises(SystemExit, match="no sync record at .*missing.jsonl: the run wrote none"):
        bc.read_records(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(_record(0, 4, 1.0)) + "\n{not json\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl:2 is not a sync record"):
        bc.read_records(str(bad))


def test_worker_steps_in_the_anchor_count_each_committed_sync_once():
    """Worker 1 killed after step 8 and healed at step 12 (it did not train: not in ``trained``);
    the sync at 16 not committed: its steps count at 20. Worker 1's last records are lost with it:
    worker 0's say the same."""
    records = [_record(w, 4, 1.0 + w) for w in (0, 1)] + [_record(0, 8, 2.0), _record(1, 8, 2.1)]
    records += [_record(0, 12, 3.0, trained=[0]), _record(1, 12, 3.1, trained=[0])]
    records += [_record(0, 16, 4.0, committed=False), _record(0, 20, 5.0), _record(1, 20, 5.2)]
    assert anchored_steps(records) == 2 * 4 + 2 * 4 + 1 * 4 + 2 * 8
    assert first_sync_after(records, 1, 2.5) == pytest.approx(0.6)  # its first sync after the kill
    assert first_sync_after(records, 1, 6.0) is None
