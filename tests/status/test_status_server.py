"""megatron_edit.status's server and CLI (issue 59): ``/metrics`` read back with Prometheus' own
text parser; without prometheus_client a 501 naming the extra, said once, the page still served;
``/state.json``; the CLI serving a glob, and its refusals in one line. The page in a browser, on
a live torchft run: tests/torchft_backend/test_torchft_megatron.py."""

import json
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from megatron_edit.status.__main__ import main
from megatron_edit.status.server import StatusServer
from records import T0, kill_and_heal, lines, rec

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run_files(tmp_path):
    """The kill-and-heal run (a file per worker; at the last sync the penalty excluded worker 1 and
    the residual was a quarter of the pseudo-gradient) and an older run of one sync in worker 0's file."""
    excluded = [dict(worker=1, layers=2, anomalous=2, non_finite=0, not_trained=0)]
    records = [dict(r, excluded=excluded, residual_ratio=0.25) if r["step"] == 12 else r for r in kill_and_heal()]
    older = [rec(0, 2, -100, run="older", sync=1, participants=(0,), bytes_sent=7)]
    for worker in (0, 1):
        mine = [r for r in records if r["worker"] == worker]
        (tmp_path / f"syncs-{worker}.jsonl").write_text(lines((older if worker == 0 else []) + mine))
    return str(tmp_path / "syncs-{worker}.jsonl").replace("{worker}", "*")


@pytest.fixture
def server(run_files):
    server = StatusServer([run_files]).start()
    yield server
    server.close()


def _get(url):
    with urllib.request.urlopen(url, timeout=30) as answer:
        return answer.status, answer.headers["Content-Type"], answer.read()


def test_metrics_are_prometheus_text_with_each_workers_figures(server):
    pytest.importorskip("prometheus_client", reason="the metrics extra is not installed: "
                        "EXTRAS=metrics bash scripts/setup_env.sh (CI installs it)")
    from prometheus_client.parser import text_string_to_metric_families

    status, content_type, body = _get(server.url + "metrics")
    assert status == 200 and content_type.startswith("text/plain; version=0.0.4")
    samples = {(s.name, s.labels.get("run_id"), s.labels.get("worker"), s.labels.get("state")): s.value
               for family in text_string_to_metric_families(body.decode()) for s in family.samples}
    def one(name, worker, run="run-a", state=None):
        return samples[(f"megatron_edit_{name}", run, str(worker), state)]

    assert (one("syncs_total", 0), one("syncs_total", 1)) == (6, 4)
    assert (one("syncs_not_committed_total", 0), one("syncs_not_committed_total", 1)) == (1, 0)
    assert (one("bytes_sent_total", 0), one("bytes_received_total", 1)) == (6000, 4000)
    assert one("exchange_seconds_total", 0) == pytest.approx(3.5)
    assert one("exposed_wait_seconds_total", 1) == pytest.approx(1.2)
    assert one("arrival_wait_seconds_total", 0) == pytest.approx(0.7) and one("arrival_wait_last_seconds", 1) == 0.1
    assert (one("heals_total", 0), one("heals_total", 1), one("heal_bytes_total", 1)) == (0, 1, 4096)
    assert (one("step", 0), one("participants", 1), one("last_record_timestamp_seconds", 1)) == (12, 2, T0 + 60.1)
    assert (one("excluded_workers", 0), one("excluded_total", 0), one("excluded_total", 1)) == (1, 0, 1)
    assert one("residual_ratio", 1) == 0.25
    assert one("worker_state", 1, state="finished") == 1 and one("worker_state", 1, state="dead") == 0
    assert ("megatron_edit_residual_ratio", "older", "0", None) not in samples  # (null: no error feedback)
    assert one("syncs_total", 0, run="older") == 1 and one("bytes_sent_total", 0, run="older") == 7
    assert samples[("megatron_edit_status_lines_skipped_total", None, None, None)] == 0


def test_without_prometheus_client_metrics_names_the_extra_once_and_the_page_still_works(server, monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # (import prometheus_client raises ImportError)
    for _ in range(2):
        with pytest.raises(urllib.error.HTTPError) as answer:
            _get(server.url + "metrics")
        assert answer.value.code == 501 and b"pip install megatron_edit[metrics]" in answer.value.read()
    assert capfd.readouterr().err.count("pip install megatron_edit[metrics]") == 1
    status, content_type, page = _get(server.url)
    assert status == 200 and content_type.startswith("text/html") and b"state.json" in page
    assert set(re.findall(rb"https?://[^\"' ]*", page)) == {b"http://www.w3.org/2000/svg"}  # nothing from elsewhere
    state = json.loads(_get(server.url + "state.json")[2])
    assert state["run"]["run_id"] == "run-a" and [r["run_id"] for r in state["runs"]] == ["run-a", "older"]


def test_state_json_shows_the_chosen_run_and_what_it_read(server, run_files):
    state = json.loads(_get(server.url + "state.json?run=older")[2])
    assert state["run"]["run_id"] == "older" and [w["worker"] for w in state["run"]["workers"]] == [0]
    assert state["sources"]["patterns"] == [run_files] and len(state["sources"]["files"]) == 2
    with pytest.raises(urllib.error.HTTPError) as answer:
        _get(server.url + "nothing")
    assert answer.value.code == 404


def test_the_cli_serves_a_glob_until_stopped(run_files):
    proc = subprocess.Popen([sys.executable, "-m", "megatron_edit.status", run_files, "--port", "0"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert "from 2 record file(s)" in line, line + proc.stderr.read()
        url = line.split("serving ", 1)[1].split()[0]
        assert json.loads(_get(url + "state.json")[2])["run"]["syncs_recorded"] == 10
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0


def test_the_cli_refuses_in_one_line_before_serving(tmp_path, capsys):
    assert main([str(tmp_path / "none" / "syncs-{worker}.jsonl")]) == 2
    assert capsys.readouterr().err == (f"megatron_edit.status: RECORD_PATH_OR_GLOB {tmp_path}/none/syncs-*.jsonl: "
                                       f"the directory {tmp_path}/none does not exist; give the run's record path.\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main([str(tmp_path / "*.jsonl"), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"megatron_edit.status: --bind 127.0.0.1 --port {port}: cannot listen")
    assert main([str(tmp_path / "*.jsonl"), "--port", "70000"]) == 2  # (refused before binding)
    assert "--port 70000: give a port from 1 to 65535" in capsys.readouterr().err
