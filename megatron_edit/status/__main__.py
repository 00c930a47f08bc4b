"""Serve the status page and ``/metrics`` of a run from its record files:

    python -m megatron_edit.status 'runs/edit/syncs-{worker}.jsonl' --port 8000
    python -m megatron_edit.status 'runs/edit/*.jsonl' --bind 0.0.0.0 --port 0

Each argument is a ``--local-sgd-sync-record`` path (``{worker}`` in it: every worker's file), a
file or a glob; files that appear later (a worker's first record) are read too. Runs until
stopped (Ctrl-C or SIGTERM: exit 0). The page: docs/watching-a-run.md.
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from typing import List, Optional

PROG = "megatron_edit.status"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"python -m {PROG}", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("records", nargs="+", metavar="RECORD_PATH_OR_GLOB",
                   help="the run's --local-sgd-sync-record path (with {worker}), a record file or a glob")
    p.add_argument("--port", type=int, default=8000,
                   help="the port to serve at (0: one the OS picks; default: %(default)s)")
    p.add_argument("--bind", default="127.0.0.1",
                   help="the address to serve at (default: %(default)s, this host only; 0.0.0.0: every interface)")
    return p


def _fail(line: str) -> int:
    print(f"{PROG}: {line}", file=sys.stderr, flush=True)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    from .tail import pattern_of, pattern_problem

    args = _parser().parse_args(argv)
    if not 0 <= args.port <= 65535:
        return _fail(f"--port {args.port}: give a port from 1 to 65535, or 0 for one the OS picks.")
    patterns = [pattern_of(path) for path in args.records]
    for pattern in patterns:
        problem = pattern_problem(pattern, "RECORD_PATH_OR_GLOB")
        if problem:
            return _fail(problem)
    from .server import StatusServer

    try:
        server = StatusServer(patterns, args.bind, args.port, prog=PROG)
    except OSError as e:
        return _fail(f"--bind {args.bind} --port {args.port}: cannot listen there ({e.strerror or e}); choose "
                     "another --port (0: one the OS picks) or --bind.")
    server.refresh()  # (what is there now: said below)
    files = server.files
    print(f"{PROG}: serving {server.url} (/state.json, /metrics) from {len(files.paths)} record file(s) "
          f"matching {' '.join(patterns)}" + ("" if files.paths else "; none yet: read as they appear"), flush=True)
    stopped = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stopped.set())
    server.start()
    try:
        while not stopped.wait(0.5):
            pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
