"""megatron_edit.status.state and .tail: a run's state from hand-written records (issue 59): a
kill, a relaunch and a heal, in any order of reading; a silent worker; the supervisor's word; a
worker joining with and without a heal; exclusions; several runs; files read while they grow."""

import json
import random

from megatron_edit.status.state import WAIT_FLOOR_S, Status
from megatron_edit.status.tail import RecordFiles, pattern_of, pattern_problem
from records import T0, heal, joined, kill_and_heal, lines, rec


def _view(records, at, run=None):
    status = Status()
    status.add(records)
    return status.view(T0 + at, run)["run"]


def _states(view):
    return {w["worker"]: w["state"] for w in view["workers"]}


def _history(view, worker):
    (row,) = [w for w in view["workers"] if w["worker"] == worker]
    return [(h["event"], h["state"], h["step"]) for h in row["history"]]


def test_a_killed_worker_is_dead_then_healing_then_healed_whatever_order_the_files_are_read_in():
    records = kill_and_heal()
    upto = lambda t: [r for r in records if r["time"] <= T0 + t]  # noqa: E731 (the records written by then)
    assert _states(_view(upto(21), 21)) == {0: "training", 1: "training"}
    at_31 = _view(upto(31), 31)
    assert _states(at_31) == {0: "training", 1: "dead"}  # worker 0's sync 6 went on without it
    (one,) = [w for w in at_31["workers"] if w["worker"] == 1]
    assert "worker 0's sync at step 6" in one["why"] and one["step"] == 4
    assert _states(_view(upto(39), 39))[1] == "healing"  # relaunched: its join round at step 0, behind the run
    assert _states(_view(upto(45), 45))[1] == "healing"  # (its join round healed nothing)
    at_55 = _view(upto(55), 55)
    assert _states(at_55) == {0: "training", 1: "training"}
    (one,) = [w for w in at_55["workers"] if w["worker"] == 1]
    assert (one["heals"], one["heal_bytes"], one["step"], one["sync"]) == (1, 4096, 10, 1)
    end = _view(records, 61)
    assert _states(end) == {0: "finished", 1: "finished"}
    expected = [("started", "training", 0), ("left", "dead", 6), ("joined", "healing", 0),
                ("healed", "training", 10), ("finished", "finished", 12)]
    assert _history(end, 1) == expected
    assert _history(end, 0) == [("started", "training", 0), ("finished", "finished", 12)]
    # worker 1's file read first, then worker 0's (a relaunch's join before the death that
    # preceded it): the same states
    by_file = sorted(records, key=lambda r: -r["worker"])
    assert _history(_view(by_file, 61), 1) == expected
    random.Random(0).shuffle(by_file)
    assert _history(_view(by_file, 61), 1) == expected
    # the timeline: every worker's history, in time order
    assert [(h["worker"], h["event"]) for h in end["timeline"]] == [
        (0, "started"), (1, "started"), (1, "left"), (1, "joined"), (1, "healed"), (0, "finished"),
        (1, "finished")]


def test_the_syncs_hold_each_quorum_and_each_workers_figures():
    view = _view(kill_and_heal(), 61)
    syncs = {s["step"]: s for s in view["syncs"]}
    assert sorted(syncs) == [2, 4, 6, 8, 10, 12]  # (join rounds are not syncs)
    assert syncs[6]["participants"] == [0] and sorted(syncs[6]["workers"]) == ["0"]
    assert not syncs[8]["committed"] and syncs[8]["participants"] is None  # failed before they could say
    assert syncs[10]["participants"] == [0, 1] and syncs[10]["committed"]
    assert syncs[4]["workers"]["1"] == dict(bytes_sent=1000, exchange_seconds=0.5, exposed_wait_seconds=0.2,
                                            arrival_wait_seconds=0.1, committed=True)
    rows = {w["worker"]: w for w in view["workers"]}
    assert (rows[0]["syncs"], rows[0]["joins"], rows[0]["not_committed"]) == (6, 1, 1)
    assert (rows[1]["syncs"], rows[1]["joins"], rows[1]["not_committed"]) == (4, 2, 0)  # (join rounds: not syncs)
    assert rows[0]["totals"]["bytes_sent"] == 6000
    assert rows[1]["totals"]["exchange_seconds"] == 3.0  # (its join rounds' too)
    assert view["syncs_recorded"] == 10 and view["interval"] == 10.0


def test_a_silent_worker_is_waiting_and_a_record_ends_it():
    records = [rec(w, s, s * 5 + w * 0.1, sync=s // 2) for s in (2, 4, 6) for w in (0, 1)]
    records.append(rec(0, 8, 40, sync=4))  # worker 1's sync 8 never comes
    assert _states(_view(records, 41)) == {0: "training", 1: "training"}
    late = 30.1 + WAIT_FLOOR_S + 1  # (10 s between syncs: the floor rules)
    view = _view(records, late)
    assert _states(view) == {0: "training", 1: "waiting"}
    (one,) = [w for w in view["workers"] if w["worker"] == 1]
    assert one["why"].startswith("no record for") and one["silent"] > WAIT_FLOOR_S
    assert _states(_view(records + [rec(1, 8, late - 1, sync=4)], late)) == {0: "training", 1: "training"}
    # the run's last sync ends it: finished, never waiting (A-EDiT's final sync too)
    ended = records + [rec(1, 8, 40.1, sync=4, final=True)]
    ended = [dict(r, last_sync=True) if (r["step"], r["worker"]) == (8, 0) else r for r in ended]
    assert _states(_view(ended, late)) == {0: "finished", 1: "finished"}


def test_the_supervisor_saying_a_job_exited_makes_its_worker_dead_until_its_next_record():
    records = [rec(w, s, s * 5 + w * 0.1, sync=s // 2) for s in (2, 4) for w in (0, 1)]
    status = Status()
    status.add(records)
    status.add_exit("run-a", 1, T0 + 21, -9)
    assert _states(status.view(T0 + 22)["run"]) == {0: "training", 1: "dead"}
    status.add([rec(1, 0, 25, kind="join", participants=None, committed=False)])  # its relaunch
    run = status.view(T0 + 26)["run"]
    assert [e for e, _, _ in _history(run, 1)] == ["started", "exited", "joined"] and _states(run)[1] == "healing"


def test_a_worker_that_joins_with_a_heal_trains_at_once_and_one_behind_without_heals_next():
    first = [rec(w, s, s * 5 + w * 0.1, sync=s // 2, participants=(0, 1)) for s in (2, 4) for w in (0, 1)]
    healed = rec(2, 6, 30, kind="join", participants=(0, 1, 2), events=[heal(0, 1)])
    view = _view(first + [healed, rec(0, 6, 30, participants=(0, 1, 2), events=[joined(2)], sync=3)], 31)
    assert _states(view)[2] == "training" and _history(view, 2) == [("healed", "training", 6)]
    behind = rec(2, 0, 30, kind="join", participants=(0, 1, 2), committed=False)
    assert _states(_view(first + [behind], 31))[2] == "healing"
    # a fresh run's first round: every worker at step 0, nobody behind
    start = [rec(w, 0, w * 0.1, kind="join", bytes_sent=0) for w in (0, 1, 2)]
    assert set(_states(_view(start, 1)).values()) == {"training"}


def test_an_excluded_worker_is_counted_and_named_in_its_sync():
    records = [rec(w, 2, w * 0.1, sync=1, excluded=[1]) for w in (0, 1)] + [rec(w, 4, 5, sync=2) for w in (0, 1)]
    view = _view(records, 6)
    syncs = {s["step"]: s for s in view["syncs"]}
    assert syncs[2]["excluded"] == [1] and syncs[4]["excluded"] == []
    rows = {w["worker"]: w for w in view["workers"]}
    assert (rows[0]["excluded"], rows[1]["excluded"]) == (0, 1)  # (each worker's own count)
    assert rows[1]["excluded_workers"] == []  # (at its latest sync: nobody)


def test_several_runs_are_kept_apart_and_the_newest_is_shown_unless_another_is_chosen():
    old = kill_and_heal(run="old")
    new = [dict(r, run_id="new", time=r["time"] + 1000) for r in kill_and_heal()[:4]]
    status = Status()
    status.add(new + old)
    view = status.view(T0 + 1100)
    assert [r["run_id"] for r in view["runs"]] == ["new", "old"] and view["run"]["run_id"] == "new"
    assert view["run"]["records"] == 4 and _states(view["run"]) == {0: "waiting", 1: "waiting"}
    chosen = status.view(T0 + 1100, "old")["run"]
    assert chosen["run_id"] == "old" and _states(chosen) == {0: "finished", 1: "finished"}
    assert status.view(T0 + 1100, "no-such-run")["run"]["run_id"] == "new"


def test_a_record_without_a_field_the_state_needs_is_left_out_and_said():
    status = Status()
    broken = rec(0, 2, 1, sync=1)
    del broken["committed"]
    status.add([broken, dict(rec(1, 2, 1), worker="1"), rec(0, 4, 2, sync=2)])
    view = status.view(T0 + 3)
    assert view["run"]["records"] == 1
    assert [p.split(": ", 1)[1] for p in view["rejected"]] == ["no committed field", "worker is '1', not int"]


def test_growing_files_are_read_from_where_they_stopped_and_a_partial_line_waits(tmp_path):
    records = kill_and_heal()
    path = tmp_path / "syncs-0.jsonl"
    text = lines(r for r in records if r["worker"] == 0)
    cut = text.index("\n", 10) + 40  # a line and the start of the next
    path.write_text(text[:cut])
    files = RecordFiles([pattern_of(str(tmp_path / "syncs-{worker}.jsonl"))])
    assert [r["step"] for r in files.read()] == [0]
    assert files.read() == []  # the partial line waits for its end
    with open(path, "a") as f:
        f.write(text[cut:])
    assert [r["step"] for r in files.read()] == [2, 4, 6, 8, 10, 12]
    (tmp_path / "syncs-1.jsonl").write_text(lines(r for r in records if r["worker"] == 1))  # a file appears
    assert [r["worker"] for r in files.read()] == [1] * 6 and files.problems == []
    with open(path, "a") as f:
        f.write("not json\n" + json.dumps(dict(records[0], schema=2)) + "\n" + json.dumps([1]) + "\n")
    assert files.read() == [] and files.skipped == 3
    assert [p.split(": ", 1)[1][:30] for p in files.problems] == [
        "a line that is not JSON (Expec", "a record of schema 2 left out:", "a line that is not a sync reco"]
    path.write_text(lines(records[:1]))  # replaced by a shorter file: read again from its start
    assert [r["step"] for r in files.read()] == [0] and "shrank" in files.problems[-1]


def test_a_record_path_becomes_its_glob_and_a_missing_directory_is_one_line(tmp_path):
    assert pattern_of("/runs/a[1]/syncs-{worker}.jsonl") == "/runs/a[[]1]/syncs-*.jsonl"
    assert pattern_of("/runs/s-{replica_id}-{{x}}.jsonl") == "/runs/s-*-{x}.jsonl"
    assert pattern_of("/runs/*.jsonl") == "/runs/*.jsonl"
    assert pattern_problem(str(tmp_path / "*.jsonl"), "X") is None
    assert pattern_problem(str(tmp_path / "no" / "*.jsonl"), "X") == (
        f"X {tmp_path}/no/*.jsonl: the directory {tmp_path}/no does not exist; give the run's record path.")
    assert "only the file name may hold a glob" in pattern_problem(str(tmp_path / "*" / "a.jsonl"), "X")
