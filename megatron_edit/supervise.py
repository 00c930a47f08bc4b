"""Supervise a run of the torchft sync backend on one node: a Lighthouse, N worker jobs, and a
fresh job for any worker that dies (torchrun's in-place restart does not work with gloo here).

    python -m megatron_edit.supervise --workers 3 -- \\
        torchrun --standalone --nproc-per-node 2 my_train.py --local-sgd-replica-id {replica_id}

The command after ``--`` is one worker's job; ``{replica_id}`` becomes the worker's id (0 ..
N-1, kept by its relaunches). Every job gets ``TORCHFT_LIGHTHOUSE`` (the Lighthouse this process
runs, torchft's ``LighthouseServer``; ``--local-sgd-lighthouse`` defaults to it) and runs in a
session of its own, so a job is stopped as a whole. A job that exits with 0 is done; another exit
is logged in one line and the job is started again, up to ``--max-relaunches`` times in all
(then every job is stopped and this exits 1); exit code 2 (refused flags) stops the run at once.
A job that ends after some worker has passed the run's last sync is not relaunched (it would
train alone), and the run exits 1 once the others end. It exits 0 once every worker's job has,
with one model: each job's ranks record the digest of the model they end with in this process's
store, and differing models (a worker that trained on alone) exit 1, naming the workers.

A run starts with all its workers: every job also gets ``MEGATRON_EDIT_FT_START_GATE`` (a TCP
store of this process), where each worker's controller waits, once its torchft Manager is up and
before its first quorum, until every worker has arrived (up to ``--start-timeout-s``), so the
first quorum holds all N. A relaunched worker finds them arrived, goes on at once and heals from
the others at their next sync. Needs torchft (``pip install torchft==0.2.0``).

Several nodes (a worker's job spans nodes, or the workers run on different ones): the jobs are
started and restarted by the cluster's scheduler, and this process only serves the Lighthouse
and the start gate:

    python -m megatron_edit.supervise --workers 3 --bind 0.0.0.0:29510 --serve --env-file run.env

prints (and writes to ``--env-file``) the two ``export`` lines every worker's job needs, and
runs until it is stopped (SIGTERM or SIGINT: exit 0).

``--status-port N`` also serves the run's status page and ``/metrics`` (:mod:`megatron_edit.status`)
at ``--bind``'s host from the workers' ``--local-sgd-sync-record``, and tells it of jobs that exit.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from typing import List, NoReturn, Optional, Tuple
from urllib.parse import urlparse

PLACEHOLDER = "{replica_id}"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_edit.supervise", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, required=True, help="worker jobs to run (replica ids 0 .. N-1)")
    p.add_argument("--bind", default="127.0.0.1:0",
                   help="the Lighthouse's address (default: 127.0.0.1 and a port the OS picks)")
    p.add_argument("--heartbeat-timeout-ms", type=int, default=5000,
                   help="a worker silent this long leaves the quorum (default: %(default)s)")
    p.add_argument("--join-timeout-ms", type=int, default=60000,
                   help="how long a quorum waits for workers whose Managers are up (default: %(default)s)")
    p.add_argument("--max-relaunches", type=int, default=10,
                   help="relaunches of dead worker jobs in all before the run stops (default: %(default)s)")
    p.add_argument("--start-timeout-s", type=float, default=600.0,
                   help="how long the first sync waits for every worker to start (default: %(default)s)")
    p.add_argument("--serve", action="store_true",
                   help="several nodes: serve only the Lighthouse and the start gate (the jobs are the cluster's), "
                        "print the environment every worker's job needs, run until stopped")
    p.add_argument("--env-file", default=None,
                   help="with --serve: also write that environment to this file, as export lines")
    p.add_argument("--status-port", type=int, default=None,
                   help="also serve the run's status page and /metrics at this port (0: one the OS picks) of "
                        "--bind's host, from the records of the workers' --local-sgd-sync-record")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then one worker's job, with {replica_id}")
    return p


def bind_problem(bind: str) -> Optional[str]:
    """Why the Lighthouse cannot listen at ``--bind`` (host:port), in one line; None when it can."""
    import socket

    host, sep, port = bind.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        return (f"--bind {bind}: give host:port, e.g. 0.0.0.0:29510 (every interface) or 127.0.0.1:0 (a port "
                "the OS picks).")
    host = host.strip("[]")
    if int(port) == 0:
        return None
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except OSError as e:
        return f"--bind {bind}: the host {host!r} does not resolve ({e.strerror or e})."
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as e:
            return (f"--bind {bind}: cannot listen there ({e.strerror or e}); choose another port, or "
                    "stop what holds it.")
    return None


def served_address(bind: str, address: str) -> str:
    """The Lighthouse's address the workers are told: torchft's own (``address``, with this
    host's name) with ``--bind``'s host where that names one (not 0.0.0.0 / ::): a host name
    that resolves to a loopback address, as in many containers, is unreachable from other nodes,
    and a Lighthouse bound to one address is not reachable at another."""
    host = bind.rsplit(":", 1)[0].strip("[]") if ":" in bind else bind
    if host in ("", "0.0.0.0", "::"):
        return address
    parsed = urlparse(address)
    return parsed._replace(netloc=f"[{host}]:{parsed.port}" if ":" in host else f"{host}:{parsed.port}").geturl()


def flag_in(command: List[str], field: str) -> Tuple[str, Optional[str]]:
    """(the flag of ``LocalSGDConfig``'s ``field``, its value in the workers' ``command`` or None)."""
    from .config import LocalSGDConfig
    from .flags import flag_names

    name = flag_names(LocalSGDConfig)[field]
    for i, part in enumerate(command):
        value = part.split("=", 1)[1] if part.startswith(f"{name}=") else (
            command[i + 1] if part == name and i + 1 < len(command) else None)
        if value is not None:
            return name, value
    return name, None


def min_replicas_of(command: List[str]) -> int:
    """The workers' ``--local-sgd-min-replicas`` in their command (1 where it has none): the
    Lighthouse forms no quorum with fewer workers."""
    name, value = flag_in(command, "min_replicas")
    if value is None:
        return 1
    try:
        return max(1, int(value))
    except ValueError:
        _fail(f"{name} {value!r} in the worker's command is not an integer.")


def status_pattern(args: argparse.Namespace) -> str:
    """``--status-port``'s records: the glob of the workers' ``--local-sgd-sync-record`` (refused
    in one line, naming both flags, where the command has none)."""
    from .status.supervised import Refused, records_of

    try:
        return records_of(*flag_in(args.command, "sync_record"), args.serve, args.status_port)
    except Refused as e:
        _fail(str(e))


def _status_server(args: argparse.Namespace, prog: str):
    """``--status-port``'s server at ``--bind``'s host, started (None without the flag)."""
    from .status.supervised import Refused, start_server

    try:
        return None if getattr(args, "status_port", None) is None else start_server(
            status_pattern(args), args.bind.rpartition(":")[0] or "127.0.0.1", args.status_port, prog)
    except Refused as e:
        _fail(str(e))


def _fail(line: str) -> NoReturn:
    print(f"megatron_edit.supervise: {line}", file=sys.stderr, flush=True)
    sys.exit(2)


class Worker:
    """One worker's job: its command, its process (a session of its own), its starts."""

    def __init__(self, replica_id: int, command: List[str], env: dict):
        self.replica_id = replica_id
        self.command = [part.replace(PLACEHOLDER, str(replica_id)) for part in command]
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.started = 0.0
        self.starts = 0
        self.done = False

    @property
    def tag(self) -> str:
        """The current job's tag (:data:`~megatron_edit.exchange.job_processes.JOB_ENV`)."""
        return f"{os.getpid()}.{self.replica_id}.{self.starts}"

    def start(self) -> None:
        """Start the job once no process of its previous one lives (:meth:`stop` saw to it)."""
        from .exchange.job_processes import JOB_ENV, watched_env

        self.starts += 1
        env = watched_env(dict(self.env, **{JOB_ENV: self.tag}))  # its ranks end if this process dies
        self.proc = subprocess.Popen(self.command, env=env, start_new_session=True)
        self.started = time.monotonic()

    def stop(self) -> List[int]:
        """SIGTERM the job's session, SIGKILL what is left after 10 s (at once when the job's
        leader has ended), then every process of the job wherever it is (torchrun starts each
        rank in a session of its own, which outlives a launcher that was SIGKILLed alone).
        Returns the processes of the job still alive 30 s later (none, unless one cannot be killed)."""
        from .exchange.job_processes import end_job

        if self.proc is None:
            return []
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return end_job(self.tag)


def supervise(args: argparse.Namespace, prog: str = "megatron_edit.supervise") -> int:
    """Run ``args.command`` (one worker's job, with ``{replica_id}``) as ``args.workers`` jobs
    (``args``: this module's flags, see :func:`_parser`); ``prog`` begins its lines."""
    from datetime import timedelta

    import torch.distributed as dist

    # torchft's Lighthouse (here) and Managers (the jobs inherit it): no INFO line per quorum,
    # unless RUST_LOG says otherwise.
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft._torchft import LighthouseServer

    from .exchange.addresses import is_loopback
    from .exchange.record import RUN_ID_ENV, new_run_id
    from .exchange.run_gate import START_GATE_ENV, past_the_last_sync, refusal, release_claim, start_gate_value

    status = _status_server(args, prog)  # (before anything starts: a port it cannot have is refused)
    try:
        lighthouse = LighthouseServer(bind=args.bind, min_replicas=min_replicas_of(args.command),
                                      join_timeout_ms=args.join_timeout_ms,
                                      heartbeat_timeout_ms=args.heartbeat_timeout_ms)
    except RuntimeError as e:  # torchft's own message (taken between the check and the start)
        _fail(f"--bind {args.bind}: the Lighthouse cannot listen there ({e}).")
    address = served_address(args.bind, lighthouse.address())
    # The start gate's store listens on every interface; the workers reach it at the host the
    # Lighthouse's address names.
    host = urlparse(address).hostname or "127.0.0.1"
    if getattr(args, "serve", False) and is_loopback(host):
        print(f"{prog}: warning: --serve tells the workers {address}, a loopback address of this host: jobs on other "
              "nodes cannot reach it; give --bind <this host's address>:<port>.", file=sys.stderr, flush=True)
    gate = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    run_env = {"TORCHFT_LIGHTHOUSE": address,
               START_GATE_ENV: start_gate_value(host, gate.port, args.workers, args.start_timeout_s),
               RUN_ID_ENV: os.environ.get(RUN_ID_ENV) or new_run_id()}  # every worker's sync record
    if getattr(args, "serve", False):
        return _serve(args, prog, run_env, gate, lighthouse)
    print(f"{prog}: Lighthouse at {address}; starting {args.workers} worker job(s)", flush=True)
    env = dict(os.environ, **run_env)
    workers = [Worker(w, args.command, env) for w in range(args.workers)]
    relaunches, lost = 0, []  # lost: jobs that ended after the run's last sync (not relaunched)

    def stop_all(signum=None, frame=None):
        for worker in workers:
            worker.stop()
        lighthouse.shutdown()
        if status is not None:
            status.close()
        if signum is not None:
            sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop_all)
    signal.signal(signal.SIGINT, stop_all)
    try:
        for worker in workers:
            worker.start()
        while not all(w.done or w.replica_id in lost for w in workers):
            time.sleep(0.2)
            for worker in workers:
                if worker.done or worker.replica_id in lost or worker.proc.poll() is None:
                    continue
                code, alive = worker.proc.returncode, time.monotonic() - worker.started
                if code == 0:
                    worker.done = True
                    continue
                if status is not None:
                    status.job_exited(run_env[RUN_ID_ENV], worker.replica_id, code)
                left = worker.stop()  # what is left of it: none may share its replica id with the relaunch
                release_claim(gate, worker.replica_id)
                if left:
                    print(f"{prog}: worker {worker.replica_id}'s job exited with code {code}, and its processes "
                          f"{left} could not be ended within 30 s: a relaunch would share their replica id; "
                          "stopping.", file=sys.stderr, flush=True)
                    return 1
                finished = [w.replica_id for w in workers if w.done]
                passed = sorted({*finished, *past_the_last_sync(gate, args.workers)})
                if passed:  # a fresh job would train alone (its start gate refuses it); the others end as they do
                    lost.append(worker.replica_id)
                    what = "finished the run" if passed == finished else "passed the run's last sync"
                    print(f"{prog}: worker {worker.replica_id} exited with code {code} after {alive:.1f} s, when "
                          f"worker(s) {passed} had {what}: not relaunched (it would train alone); the run exits 1 once "
                          "the other jobs end.", file=sys.stderr, flush=True)
                    continue
                if code == 2 or refusal(gate, worker.tag):  # its flags were refused (it printed the line),
                    # or its Lighthouse could not be reached: a relaunch would be too
                    print(f"{prog}: worker {worker.replica_id} exited with code {code}, refusing to run (its line "
                          "is above): stopping the run.", file=sys.stderr, flush=True)
                    return 2
                if relaunches >= args.max_relaunches:
                    print(f"{prog}: worker {worker.replica_id} exited with code {code} after "
                          f"{alive:.1f} s and the {args.max_relaunches} relaunch(es) of --max-relaunches are "
                          "used: stopping the run.", file=sys.stderr, flush=True)
                    return 1
                relaunches += 1
                print(f"{prog}: worker {worker.replica_id} exited with code {code} after "
                      f"{alive:.1f} s; relaunching it as a fresh job (relaunch {relaunches} of "
                      f"{args.max_relaunches}): it heals from a live worker at their next sync.", flush=True)
                worker.start()
        return 1 if lost else _one_model_at_the_end(gate, args.workers, prog)
    finally:
        stop_all()


def _one_model_at_the_end(gate, workers: int, prog: str) -> int:
    """Every worker's job ended with code 0: whether they ended with one model (the digests each
    job's ranks recorded at their end, :func:`~megatron_edit.exchange.run_gate.record_end`).
    A job that recorded nothing ran no EDiT controller over torchft (nothing to compare)."""
    from .exchange.run_gate import models_at_the_end

    ended = models_at_the_end(gate, workers)
    if not ended:
        print(f"{prog}: every worker's job ended with code 0", flush=True)
        return 0
    groups = {digests: [w for w in ended if ended[w] == digests] for digests in ended.values()}
    missing = [w for w in range(workers) if w not in ended]
    if len(groups) == 1 and not missing:
        print(f"{prog}: every worker's job ended with code 0, all {workers} with one model", flush=True)
        return 0
    found = "; ".join(f"worker(s) {ws} with one" for ws in sorted(groups.values()))
    print(f"{prog}: the workers did not end with one model ({found}"
          f"{f'; worker(s) {missing} recorded none' if missing else ''}): a worker trained on alone (it came back "
          "after the others' end, or its last sync did not commit); exit 1.", file=sys.stderr, flush=True)
    return 1


def _serve(args: argparse.Namespace, prog: str, run_env: dict, gate, lighthouse) -> int:
    """``--serve``: the Lighthouse and the start gate (``gate``, kept alive here) until SIGTERM
    or SIGINT; the environment of the workers' jobs printed and, with ``--env-file``, written."""
    lines = [f"export {key}={value}" for key, value in run_env.items()]
    if args.env_file:
        with open(args.env_file + ".tmp", "w") as f:
            f.write("\n".join(lines) + "\n")
        os.replace(args.env_file + ".tmp", args.env_file)  # whole or absent for a job that reads it
    print(f"{prog}: serving the Lighthouse and the start gate of {args.workers} workers until stopped; "
          "every worker's job (started by the cluster, --local-sgd-replica-id 0 .. "
          f"{args.workers - 1}) needs:", flush=True)
    print("\n".join(lines), flush=True)
    stopped = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: stopped.append(signum))
    try:
        while not stopped:
            time.sleep(0.2)
    finally:
        lighthouse.shutdown()
    print(f"{prog}: stopped", flush=True)
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    args = _parser().parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.serve and command:
        _fail("--serve runs no job (the cluster starts them): drop the command after --, or drop --serve.")
    if args.env_file and not args.serve:
        _fail("--env-file is for --serve (this process starts the jobs and gives them the environment itself).")
    if args.serve:
        command = []
    elif not command:
        _fail("give one worker's job after --, e.g. -- torchrun --standalone --nproc-per-node 2 train.py "
              "--local-sgd-replica-id {replica_id}")
    if not args.serve and not any(PLACEHOLDER in part for part in command):
        _fail("the worker's command needs {replica_id} (e.g. --local-sgd-replica-id {replica_id}): every worker "
              "needs its own id.")
    if args.workers < 1 or args.max_relaunches < 0:
        _fail("--workers must be >= 1 and --max-relaunches >= 0.")
    problem = bind_problem(args.bind)
    if problem:
        _fail(problem)
    try:
        import torchft  # noqa: F401
    except ImportError:
        _fail("torchft is not installed; pip install torchft==0.2.0 (in a checkout: pip install -e '.[ft]').")
    args.command = command
    if args.status_port is not None:
        status_pattern(args)  # (refused before anything starts)
    return supervise(args)


if __name__ == "__main__":
    sys.exit(main())
