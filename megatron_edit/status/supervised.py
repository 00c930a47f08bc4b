"""The supervisor's ``--status-port`` (:mod:`megatron_edit.supervise`): the status server of the
run it supervises, on the records of its workers' ``--local-sgd-sync-record``. What cannot work
is refused in one line (:class:`Refused`) before anything starts."""

from __future__ import annotations

from typing import Optional

from .server import StatusServer
from .tail import pattern_of, pattern_problem


class Refused(Exception):
    """``--status-port`` cannot work: the one line that says why and what to do."""


def records_of(flag: str, path: Optional[str], serve: bool, port: int) -> str:
    """The glob of the workers' records: ``path``, the value of ``flag`` (``--local-sgd-sync-record``)
    in their command (None: it has none); ``serve``: the supervisor's ``--serve`` (no command)."""
    if serve:
        raise Refused("--status-port with --serve: the jobs are the cluster's; run python -m megatron_edit.status "
                      "'<their --local-sgd-sync-record path>' where their record files can be read.")
    if path is None:
        raise Refused(f"--status-port needs {flag} PATH in the worker's command (the page reads the run's records): "
                      f"add {flag} runs/syncs-{{worker}}.jsonl to it, or drop --status-port.")
    if not 0 <= port <= 65535:
        raise Refused(f"--status-port {port}: give a port from 1 to 65535, or 0 for one the OS picks.")
    pattern = pattern_of(path)
    problem = pattern_problem(pattern, flag)
    if problem:
        raise Refused(f"--status-port: the worker's {problem}")
    return pattern


def start_server(pattern: str, host: str, port: int, prog: str) -> StatusServer:
    """The server of ``pattern`` at ``host``:``port``, started, its address said in one line."""
    host = host.strip("[]")
    try:
        server = StatusServer([pattern], host, port, prog=prog)
    except OSError as e:
        raise Refused(f"--status-port {port}: cannot listen at {host} ({e.strerror or e}); choose another port "
                      "(0: one the OS picks).") from None
    print(f"{prog}: the run's status page at {server.url} (and /metrics)", flush=True)
    return server.start()
