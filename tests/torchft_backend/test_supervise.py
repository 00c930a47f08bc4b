"""megatron_edit.supervise: a Lighthouse and N worker jobs on one node; a job that dies is
relaunched fresh with the same replica id; the run stops when the relaunches are used up; bad
input is one line. The worker jobs here are tiny scripts (the torchft training itself is tested
in tests/torchft_backend/test_torchft_megatron.py)."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchft")

pytestmark = pytest.mark.one_lane  # (what megatron-core's release does not change)

ROOT = Path(__file__).resolve().parents[2]
WORKER = """
import os, sys, time
rid, folder, mode = sys.argv[1], sys.argv[2], sys.argv[3]
n = len([f for f in os.listdir(folder) if f.startswith(f"r{rid}-")])
with open(os.path.join(folder, f"r{rid}-{n}"), "w") as f:
    f.write(os.environ.get("TORCHFT_LIGHTHOUSE", ""))
if mode == "die-once" and rid == "1" and n == 0:
    os._exit(9)
if mode in ("die-once", "die-after-the-end") and rid == "0":  # ends once worker 1 has been relaunched
    end = time.time() + 60
    while not os.path.exists(os.path.join(folder, "r1-1")) and time.time() < end:
        time.sleep(0.05)
if mode == "die-always" and rid == "1":
    sys.exit(3)
if mode == "die-always":
    time.sleep(60)
    open(os.path.join(folder, "r0-finished"), "w").close()
if mode == "die-after-the-end" and rid == "1":
    if n == 0:
        os._exit(9)
    while not os.path.exists(os.path.join(folder, "r0-done")):  # worker 0's pid, once it ends
        time.sleep(0.05)
    pid = int(open(os.path.join(folder, "r0-done")).read() or 0)
    while pid and os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z":
        time.sleep(0.05)  # dies only once worker 0 has ended (the supervisor looks at worker 0 first)
    os._exit(9)
if mode == "die-after-the-end" and rid == "0":
    with open(os.path.join(folder, "r0-done.tmp"), "w") as f:
        f.write(str(os.getpid()))
    os.replace(os.path.join(folder, "r0-done.tmp"), os.path.join(folder, "r0-done"))
if mode == "refused" and rid == "1":
    sys.exit(2)
if mode == "refused":
    time.sleep(60)
if mode in ("one-model", "two-models"):  # each job's rank 0 records the model it ends with
    from megatron_edit.exchange.run_gate import START_GATE_ENV, record_end
    digest = "aaaa" if mode == "one-model" or rid == "0" else "bbbb"
    record_end(os.environ[START_GATE_ENV], int(rid), 0, 1, digest)
if mode == "after-the-end":  # worker 1 comes to the start gate once worker 0 has ended the run
    from megatron_edit.exchange.run_gate import START_GATE_ENV, record_end, start_gate
    if rid == "0":
        record_end(os.environ[START_GATE_ENV], 0, 0, 1, "aaaa")
        open(os.path.join(folder, "r0-ended"), "w").close()
    else:
        while not os.path.exists(os.path.join(folder, "r0-ended")):
            time.sleep(0.05)
        start_gate(os.environ[START_GATE_ENV], 1, 0)
        open(os.path.join(folder, "r1-trained"), "w").close()
if mode == "gate":  # worker 1 starts late; the first sync's gate holds worker 0 until it arrives
    from megatron_edit.exchange.run_gate import START_GATE_ENV, start_gate
    if rid == "1":  # arrives 1 s after worker 0 has
        while not os.path.exists(os.path.join(folder, "gate0-arrived")):
            time.sleep(0.05)
        time.sleep(1.0)
    arrived = time.time()
    if rid == "0":
        open(os.path.join(folder, "gate0-arrived"), "w").close()
    start_gate(os.environ[START_GATE_ENV], int(rid), 0)
    with open(os.path.join(folder, f"gate{rid}"), "w") as f:
        f.write(f"{arrived} {time.time()}")
"""


def _supervise(tmp_path, *args, mode="die-once", timeout=120):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    folder = tmp_path / "runs"
    folder.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-m", "megatron_edit.supervise", *args, "--", sys.executable, str(script), "{replica_id}",
         str(folder), mode], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return result, folder


@pytest.mark.timeout(180)
def test_a_dead_worker_job_is_relaunched_with_its_id(tmp_path):
    result, folder = _supervise(tmp_path, "--workers", "2")
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(os.listdir(folder)) == ["r0-0", "r1-0", "r1-1"]
    assert {(folder / f).read_text() for f in os.listdir(folder)} == {
        result.stdout.split("Lighthouse at ")[1].split(";")[0]}
    assert "worker 1 exited with code 9" in result.stdout and "relaunch 1 of 10" in result.stdout


@pytest.mark.timeout(180)
def test_the_run_stops_when_the_relaunches_are_used(tmp_path):
    result, folder = _supervise(tmp_path, "--workers", "2", "--max-relaunches", "1", mode="die-always")
    assert result.returncode == 1
    assert "worker 1 exited with code 3" in result.stderr and "stopping the run" in result.stderr
    assert sorted(os.listdir(folder)) == ["r0-0", "r1-0", "r1-1"]  # worker 0 stopped before it finished


def test_a_command_without_replica_id_is_one_line(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "megatron_edit.supervise", "--workers", "2", "--",
                             sys.executable, "train.py"], capture_output=True, text=True, timeout=60, env=env)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "{replica_id}" in result.stderr



@pytest.mark.timeout(180)
def test_a_flag_refused_by_a_worker_stops_the_run_at_once(tmp_path):
    result, folder = _supervise(tmp_path, "--workers", "2", mode="refused")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "worker 1 exited with code 2" in result.stderr and "relaunch" not in result.stdout
    assert sorted(os.listdir(folder)) == ["r0-0", "r1-0"]


@pytest.mark.timeout(180)
def test_the_first_sync_waits_for_every_worker(tmp_path):
    result, folder = _supervise(tmp_path, "--workers", "2", mode="gate")
    assert result.returncode == 0, result.stdout + result.stderr
    (arrived0, passed0), (arrived1, _) = [map(float, (folder / f"gate{w}").read_text().split()) for w in "01"]
    assert arrived1 > arrived0 and passed0 >= arrived1  # worker 0 waited at the gate for worker 1


@pytest.mark.timeout(180)
def test_a_worker_that_dies_after_another_finished_is_not_relaunched(tmp_path):
    result, folder = _supervise(tmp_path, "--workers", "2", mode="die-after-the-end")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "worker 1 exited with code 9" in result.stderr and "[0] had finished the run: not relaunched" in result.stderr
    assert sorted(os.listdir(folder)) == ["r0-0", "r0-done", "r1-0", "r1-1"]


@pytest.mark.timeout(180)
def test_serve_gives_jobs_started_elsewhere_the_lighthouse_and_the_start_gate(tmp_path):
    """Several nodes: --serve runs no job; the environment it writes to --env-file is what the
    cluster's jobs need (here two plain processes: the first sync's gate holds worker 0 until
    worker 1 arrives); SIGTERM ends it with 0. A command with --serve is one line."""
    import signal
    import time

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    folder = tmp_path / "runs"
    folder.mkdir()
    env_file = tmp_path / "run.env"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    server = subprocess.Popen([sys.executable, "-m", "megatron_edit.supervise", "--workers", "2", "--serve",
                               "--env-file", str(env_file)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, env=env, cwd=ROOT)
    try:
        end = time.monotonic() + 120
        while not env_file.exists():
            assert server.poll() is None and time.monotonic() < end, "no --env-file from the server"
            time.sleep(0.1)
        exported = dict(line.removeprefix("export ").split("=", 1) for line in env_file.read_text().splitlines())
        assert sorted(exported) == ["MEGATRON_EDIT_FT_START_GATE", "MEGATRON_EDIT_RUN_ID", "TORCHFT_LIGHTHOUSE"]
        assert exported["MEGATRON_EDIT_FT_START_GATE"].endswith(":2:600")
        jobs = [subprocess.Popen([sys.executable, str(script), rid, str(folder), "gate"], env=dict(env, **exported),
                                 cwd=ROOT) for rid in "01"]
        assert [job.wait(timeout=120) for job in jobs] == [0, 0]
        assert [(folder / f"r{rid}-0").read_text() for rid in "01"] == [exported["TORCHFT_LIGHTHOUSE"]] * 2
        (arrived0, passed0), (arrived1, _) = [map(float, (folder / f"gate{w}").read_text().split()) for w in "01"]
        assert arrived1 > arrived0 and passed0 >= arrived1  # worker 0 waited at the gate for worker 1
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=60)
        assert server.returncode == 0, out
        assert "export TORCHFT_LIGHTHOUSE=" in out and "stopped" in out
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    result = subprocess.run([sys.executable, "-m", "megatron_edit.supervise", "--workers", "2", "--serve", "--",
                             "echo", "{replica_id}"], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "--serve runs no job" in result.stderr


@pytest.mark.parametrize("bind, told", [
    ("10.201.0.1:29510", "http://10.201.0.1:4321"), ("127.0.0.1:0", "http://127.0.0.1:4321"),
    ("0.0.0.0:29510", "http://node7:4321"), ("[::]:29510", "http://node7:4321"),
    ("[fd00::1]:29510", "http://[fd00::1]:4321"),
])
def test_the_workers_are_told_the_lighthouse_at_the_bound_address(bind, told):
    """torchft's Lighthouse names this host by its host name, which may resolve to a loopback
    address (containers) or to another interface than the one --bind names: a bound address is
    what the workers are told."""
    from megatron_edit.supervise import served_address

    assert served_address(bind, "http://node7:4321") == told


TWO_NODES = Path(__file__).resolve().parents[2] / "scripts" / "dev" / "ft_two_nodes.sh"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("ip"), reason="needs root and iproute2 (network namespaces)")
def test_two_nodes_train_together_and_a_dead_node_heals_over_the_link(tmp_path):
    """scripts/dev/ft_two_nodes.sh: the supervisor's --serve and worker 0 on node a, worker 1 on
    node b (network namespaces joined by one link, nothing else reachable); every process of node
    b is SIGKILLed mid-run and worker 1 started again there: worker 0 goes on alone, the new job
    heals from it over the link, and both end with the same validation loss."""
    # (--compute-ms: worker 0 trains long enough for the relaunched worker 1 to come back before its end)
    result = subprocess.run(["bash", str(TWO_NODES), "--out", str(tmp_path), "--steps", "1500", "--kill-after", "35",
                             "--compute-ms", "60",
                             "--python", sys.executable], capture_output=True, text=True, timeout=560)
    w0, w1 = (tmp_path / "w0.log").read_text(), (tmp_path / "w1.log").read_text()
    assert result.returncode == 0, result.stdout + result.stderr + w0[-3000:] + w1[-3000:]
    assert "http://10.201.0.1:29510" in (tmp_path / "run.env").read_text()
    assert "(1 workers)" in w0  # it went on without node b
    assert re.search(r"worker 1 rank 0 joined a running job: healed from a live worker to step \d+", w1), w1[-3000:]
    loss = [re.findall(r"validation after step 1500: worker \d ([0-9.]+)", log)[-1] for log in (w0, w1)]
    assert loss[0] == loss[1], loss


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode, code", [("one-model", 0), ("two-models", 1)])
def test_the_run_exits_0_only_when_its_workers_end_with_one_model(tmp_path, mode, code):
    # Each job's ranks record the digest of the model they end with (TorchftRound.record_end):
    # workers that ended with different models (one trained on alone) fail the run, named.
    result, _ = _supervise(tmp_path, "--workers", "2", mode=mode)
    assert result.returncode == code, result.stdout + result.stderr
    if code == 0:
        assert "all 2 with one model" in result.stdout
    else:
        assert "did not end with one model (worker(s) [0] with one; worker(s) [1] with one)" in result.stderr


@pytest.mark.timeout(180)
def test_a_worker_arriving_after_the_runs_end_does_not_train_alone(tmp_path):
    # Worker 1 reaches the start gate after worker 0 ended the run (the supervisor's relaunch
    # of a worker that died near the end): it stops there in one line instead of training alone.
    result, folder = _supervise(tmp_path, "--workers", "2", "--start-timeout-s", "60", mode="after-the-end")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "worker 1 arrives after the run's end (worker(s) [0] ended it)" in result.stderr
    assert not (folder / "r1-trained").exists()



# ---------------------------------------------------------------------- a launcher dies alone
RANK = """
import os, sys, time
folder, watch = sys.argv[1], sys.argv[2] == "watch"
if watch:
    from megatron_edit.exchange.job_processes import watch_launcher
    watch_launcher(interval=0.2)
start = int(os.environ.get("MEGATRON_EDIT_JOB", "0.0.1").rsplit(".", 1)[1]) - 1  # the supervisor's start: 0, 1, ...
rank = os.environ["LOCAL_RANK"]
if rank == "0" and start == 0:
    with open(os.path.join(folder, "launcher-0.tmp"), "w") as f:
        f.write(str(os.getppid()))
    os.replace(os.path.join(folder, "launcher-0.tmp"), os.path.join(folder, "launcher-0"))
if start > 0:  # the relaunch: none of the first job's ranks may live
    with open(os.path.join(folder, f"rank{rank}-0")) as f:
        pid = int(f.read())
    alive = os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z"
    with open(os.path.join(folder, f"relaunch-rank{rank}"), "w") as f:
        f.write("alive" if alive else "gone")
    sys.exit(0)
with open(os.path.join(folder, f"rank{rank}-0.tmp"), "w") as f:
    f.write(str(os.getpid()))
os.replace(os.path.join(folder, f"rank{rank}-0.tmp"), os.path.join(folder, f"rank{rank}-0"))
time.sleep(120)  # until the test kills its launcher alone, and the rank ends with it (or is ended)
"""


def _alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def _wait(predicate, timeout: float, what: str) -> float:
    import time

    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"waited {timeout} s for {what}"
        time.sleep(0.1)
    return time.monotonic() - start


def _torchrun_ranks(tmp_path, watch: bool):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    folder = tmp_path / "runs"
    folder.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
               str(folder), "watch" if watch else "plain"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    return command, env, folder


@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="Linux: the test reads /proc")
def test_a_rank_ends_within_seconds_of_its_launchers_death(tmp_path):
    # torchrun starts each rank in a session of its own: SIGKILL of torchrun alone (a node
    # agent, an OOM killer) used to leave its ranks running. A rank that watches its launcher
    # (the torchft backend, megatron_edit.launch and the main job's ranks do) ends with it.
    import signal

    command, env, folder = _torchrun_ranks(tmp_path, watch=True)
    launcher = subprocess.Popen(command, env=env, cwd=ROOT, start_new_session=True)
    ranks = []
    try:
        _wait(lambda: all((folder / f"rank{r}-0").exists() for r in range(2)), 120, "both ranks")
        ranks = [int((folder / f"rank{r}-0").read_text()) for r in range(2)]
        os.kill(launcher.pid, signal.SIGKILL)
        _wait(lambda: not any(_alive(p) for p in ranks), 30, "the ranks to end")  # (the bound)
    finally:
        for pid in ranks + [launcher.pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        launcher.wait()


@pytest.mark.timeout(180)
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="Linux: the test reads /proc")
def test_the_supervisor_relaunches_a_worker_only_once_every_process_of_its_job_is_gone(tmp_path):
    # Ranks that do not watch their launcher (any training script) outlive a launcher SIGKILLed
    # alone; the supervisor finds every process of the job (its tag in their environment) and
    # ends them before the relaunch, which would otherwise share their replica id.
    import signal

    command, env, folder = _torchrun_ranks(tmp_path, watch=False)
    command.append("{replica_id}")  # (the supervisor's placeholder; the script ignores it)
    sup = subprocess.Popen([sys.executable, "-m", "megatron_edit.supervise", "--workers", "1", "--", *command],
                           env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: (folder / "launcher-0").exists() and all((folder / f"rank{r}-0").exists() for r in range(2)),
              120, "the first job's ranks")
        os.kill(int((folder / "launcher-0").read_text()), signal.SIGKILL)
        out, err = sup.communicate(timeout=120)
    finally:
        if sup.poll() is None:
            sup.kill()
            sup.wait()
    assert sup.returncode == 0, out + err
    assert "relaunching it as a fresh job" in out
    assert [(folder / f"relaunch-rank{r}").read_text() for r in range(2)] == ["gone", "gone"]


@pytest.mark.parametrize("bind, fragment", [
    ("localhost", "--bind localhost: give host:port"),
    ("127.0.0.1:http", "--bind 127.0.0.1:http: give host:port"),
    ("127.0.0.1:70000", "--bind 127.0.0.1:70000: give host:port"),
    ("held", "cannot listen there (Address already in use); choose another port"),
])
def test_a_bind_address_it_cannot_listen_at_is_one_line_naming_bind(bind, fragment, capsys):
    """Before: a Rust traceback ("invalid socket address", "Address already in use (os error
    98)") naming neither --bind nor the port."""
    import socket

    from megatron_edit import supervise

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        if bind == "held":
            bind = f"127.0.0.1:{held.getsockname()[1]}"
        with pytest.raises(SystemExit) as info:
            supervise.main(["--workers", "2", "--bind", bind, "--serve"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err and err.startswith("megatron_edit.supervise: --bind"), err


def test_the_lighthouse_takes_the_workers_min_replicas():
    from megatron_edit.supervise import min_replicas_of

    assert min_replicas_of(["torchrun", "train.py", "--local-sgd-replica-id", "{replica_id}"]) == 1
    assert min_replicas_of(["train.py", "--local-sgd-min-replicas", "3"]) == 3
    assert min_replicas_of(["train.py", "--local-sgd-min-replicas=2"]) == 2
    with pytest.raises(SystemExit):
        min_replicas_of(["train.py", "--local-sgd-min-replicas", "two"])


@pytest.mark.timeout(180)
def test_a_refusal_under_torchrun_stops_the_run_instead_of_a_relaunch(tmp_path):
    # torchrun ends with exit code 1 whatever its ranks' codes: a rank that refuses to run
    # (exit code 2: a bad flag, an unreachable Lighthouse) tells the supervisor through its
    # store, and the run stops at once instead of relaunching the job until --max-relaunches.
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('not reached: megatron_edit.launch refuses the flag first')\n")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
               "megatron_edit.launch", "--cpu", str(script), "--use-local-sgd", "--local-sgd-sync-interval", "0",
               "--local-sgd-replica-id", "{replica_id}"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "megatron_edit.supervise", "--workers", "2", "--", *command],
                            capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "megatron_edit: error: " in result.stderr and "--local-sgd-sync-interval" in result.stderr
    assert "refusing to run (its line is above): stopping the run" in result.stderr
    assert "relaunching" not in result.stdout


STATUS_WORKER = """
import json, os, sys, time
from megatron_edit.exchange.record import FIELDS
rid, folder, path = int(sys.argv[1]), sys.argv[2], sys.argv[sys.argv.index("--local-sgd-sync-record") + 1]
starts = len([f for f in os.listdir(folder) if f.startswith(f"start{rid}-")])
open(os.path.join(folder, f"start{rid}-{starts}"), "w").close()

def record(kind, step, last=False):  # what a worker's first rank appends (docs/reference/sync-record.md)
    r = dict.fromkeys(FIELDS)
    r.update(schema=1, kind=kind, run_id=os.environ["MEGATRON_EDIT_RUN_ID"], worker=rid, step=step, time=time.time(),
             committed=kind == "sync", participants=[0, 1], events=[], excluded=[], missing_ranks=[], last_sync=last)
    with open(path, "a") as f:
        f.write(json.dumps(r) + "\\n")

record("join", 0)
if starts == 0:
    record("sync", 2)
if rid == 1 and starts == 0:
    os._exit(9)  # killed: the supervisor relaunches it (which joins and waits)
end = time.time() + 120
while not os.path.exists(os.path.join(folder, "seen")) and time.time() < end:
    time.sleep(0.05)
record("sync", 4, last=True)
"""


@pytest.mark.timeout(180)
def test_status_port_serves_the_runs_page_and_hears_of_a_dead_job(tmp_path):
    """--status-port: the page of the run's records (the workers' --local-sgd-sync-record, with
    {replica_id}) at --bind's host while the run goes on; worker 1's job exits once and is
    relaunched: the page says it exited (the supervisor's word) and joined again. The server ends
    with the supervisor."""
    import json
    import time
    import urllib.error
    import urllib.request

    script = tmp_path / "worker.py"
    script.write_text(STATUS_WORKER)
    folder = tmp_path / "runs"
    folder.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("MEGATRON_EDIT_RUN_ID", None)
    supervisor = subprocess.Popen(
        [sys.executable, "-m", "megatron_edit.supervise", "--workers", "2", "--status-port", "0", "--",
         sys.executable, str(script), "{replica_id}", str(folder), "--local-sgd-sync-record",
         str(folder / "syncs-{replica_id}.jsonl")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env=env, cwd=ROOT)
    try:
        line = supervisor.stdout.readline()
        assert "the run's status page at http://127.0.0.1:" in line, line + supervisor.stdout.read()
        url = line.split(" at ", 1)[1].split()[0]
        end = time.monotonic() + 120
        while True:
            with urllib.request.urlopen(url + "state.json", timeout=30) as answer:
                run = json.loads(answer.read())["run"]
            events = {w["worker"]: [h["event"] for h in w["history"]] for w in (run or {}).get("workers", ())}
            if events.get(1, [])[-2:] == ["exited", "joined"] and 0 in events:
                break
            assert supervisor.poll() is None and time.monotonic() < end, f"the page showed {run}"
            time.sleep(0.2)
        (one,) = [w for w in run["workers"] if w["worker"] == 1]
        assert one["state"] == "healing" and "code 9" in one["history"][-2]["why"]
        (folder / "seen").touch()
        out, _ = supervisor.communicate(timeout=120)
        assert supervisor.returncode == 0, out
        with pytest.raises(urllib.error.URLError):  # (ended with the supervisor)
            urllib.request.urlopen(url + "state.json", timeout=10)
    finally:
        if supervisor.poll() is None:
            supervisor.kill()
            supervisor.wait()


def test_status_port_without_the_record_in_the_command_is_one_line_before_anything_starts():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "megatron_edit.supervise", "--workers", "2", "--status-port", "0",
                             "--", sys.executable, "train.py", "--local-sgd-replica-id", "{replica_id}"],
                            capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert result.returncode == 2 and result.stdout == ""  # (no Lighthouse, no job)
    assert result.stderr == (
        "megatron_edit.supervise: --status-port needs --local-sgd-sync-record PATH in the worker's command (the "
        "page reads the run's records): add --local-sgd-sync-record runs/syncs-{worker}.jsonl to it, or drop "
        "--status-port.\n")
