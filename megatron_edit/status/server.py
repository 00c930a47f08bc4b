"""The status server (issue 59): an HTTP server in a thread of its own serving a run's state read
from its record files (:mod:`.tail`, :mod:`.state`):

* ``/``: the page (``page.html``: plain HTML and JavaScript, nothing fetched from elsewhere), which
  asks for ``/state.json`` every second and redraws in place;
* ``/state.json``: every run's summary and one run's view (``?run=RUN_ID``; default the newest);
* ``/metrics``: Prometheus' text format (:mod:`.metrics`); without ``prometheus_client`` a 501
  naming ``pip install megatron_edit[metrics]``, said once on stderr too (the page still works).

The files are read again at each request (only what was appended since). Used by
``python -m megatron_edit.status`` and by the supervisor's ``--status-port``; the supervisor also
tells it when a worker's job exits (:meth:`StatusServer.job_exited`).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import List, Optional
from urllib.parse import parse_qs, urlparse

from .metrics import StatusCollector, exposition, prometheus_missing, registry_of
from .state import Status
from .tail import RecordFiles

PAGE = Path(__file__).with_name("page.html")


class StatusServer:
    """Serves the records of ``patterns`` (paths or globs) at ``bind``:``port`` (0: a port the OS
    picks; :attr:`url` says which). :meth:`start` starts its thread, :meth:`close` ends it."""

    def __init__(self, patterns: List[str], bind: str = "127.0.0.1", port: int = 0,
                 prog: str = "megatron_edit.status"):
        self.files = RecordFiles(patterns)
        self.status = Status()
        self.prog = prog
        self._lock = threading.Lock()
        self._page = PAGE.read_bytes()
        self._said_missing = False
        self._registry = None
        self._thread: Optional[threading.Thread] = None
        self.httpd = ThreadingHTTPServer((bind, port), _handler(self))  # OSError: the caller says which flag
        self.httpd.daemon_threads = True

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://[{host}]:{port}/" if ":" in host else f"http://{host}:{port}/"

    def start(self) -> "StatusServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="megatron_edit-status", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()

    # ------------------------------------------------------------------ what it serves
    def refresh(self) -> None:
        """Read what the files gained since the last request."""
        with self._lock:
            self.status.add(self.files.read())

    def job_exited(self, run_id: str, worker: int, code: Optional[int]) -> None:
        """The supervisor's word: ``worker``'s job exited with ``code`` (the page shows it dead)."""
        with self._lock:
            self.status.add_exit(run_id, worker, time.time(), code)

    def state(self, run_id: Optional[str] = None) -> dict:
        self.refresh()
        with self._lock:
            view = self.status.view(time.time(), run_id)
            view["sources"] = dict(patterns=self.files.patterns, files=self.files.paths,
                                   problems=self.files.problems[-20:] + view.pop("rejected")[-20:],
                                   skipped=self.files.skipped + len(self.status.rejected))
        return view

    def metrics(self) -> tuple:
        """(HTTP status, content type, body) of ``/metrics``."""
        missing = prometheus_missing()
        if missing:
            if not self._said_missing:
                self._said_missing = True
                print(f"{self.prog}: {missing}; the page still works.", file=sys.stderr, flush=True)
            return 501, "text/plain; charset=utf-8", (missing + "\n").encode()
        if self._registry is None:
            self._registry = registry_of(StatusCollector(self._views, lambda: self.files.skipped
                                                         + len(self.status.rejected)))
        self.refresh()
        with self._lock:
            body = exposition(self._registry)
        return 200, "text/plain; version=0.0.4; charset=utf-8", body

    def _views(self) -> List[dict]:
        """Every run's view (the collector's; called with the lock held)."""
        now = time.time()
        return [run.view(now) for run in self.status.runs.values() if run.last is not None]

    def page(self) -> bytes:
        return self._page


def _handler(server: StatusServer):
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            url = urlparse(self.path)
            if url.path in ("/", "/index.html"):
                self._send(200, "text/html; charset=utf-8", server.page())
            elif url.path == "/state.json":
                run = parse_qs(url.query).get("run", [None])[0]
                self._send(200, "application/json", json.dumps(server.state(run)).encode())
            elif url.path == "/metrics":
                self._send(*server.metrics())
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found: / (the page), /state.json, /metrics\n")

        def _send(self, code: int, content_type: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args):  # noqa: A002 (one line per request would drown the run's)
            pass

    return Handler
