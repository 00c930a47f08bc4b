"""A live run's status page watched in a real browser (issue 59): ``python -m megatron_edit.status``
on the run's record files, the page loaded ONCE in headless Chromium (tests/cdp.py), and a thread
reading what the page shows every 0.25 s while the run goes on.

    with PageWatch(str(tmp_path / "record-*.jsonl")) as watch:
        ... run ...
        watch.until(lambda seen: ..., "both workers finished")
    watch.seen  # what the page showed, in order

Every process it starts (the status server, Chromium and its children) is ended on exit.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from cdp import chromium

ROOT = Path(__file__).resolve().parents[2]

SHOWN = """!(window.statusLoad && document.body) ? "{}" : JSON.stringify({
  load: window.statusLoad, updates: +document.body.dataset.updates, syncs: +document.body.dataset.syncs,
  error: document.body.dataset.error || null,
  workers: [...document.querySelectorAll('#workers tbody tr')].map((r) => ({worker: +r.dataset.worker,
    state: r.dataset.state, heals: +r.dataset.heals, syncs: +r.dataset.syncs, history: r.dataset.history.split(' '),
    shown: r.innerText}))})"""
"""What the page shows: its load's id (the same until it is reloaded), its updates, the run's sync
records, an error it met drawing them (null: none), and per worker row its state, heals, syncs
and the history column."""


class PageWatch:
    def __init__(self, pattern: str, every: float = 0.25):
        self.pattern, self.every = pattern, every
        self.seen: list = []
        self.url = None
        self._stack = contextlib.ExitStack()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._error = None

    def __enter__(self) -> "PageWatch":
        try:
            self._serve()
            browser = self._stack.enter_context(chromium())
            self.page = browser.open(self.url)
            self._thread = threading.Thread(target=self._watch, name="page-watch", daemon=True)
            self._thread.start()
            self._stack.callback(self._thread.join, 30)
            self._stack.callback(self._stop.set)
            self.until(lambda seen: seen[-1]["updates"] >= 1, "the page's first update")
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _serve(self) -> None:
        server = subprocess.Popen([sys.executable, "-m", "megatron_edit.status", self.pattern, "--port", "0"],
                                  cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def stop():
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait(timeout=30)
            server.stdout.close()

        self._stack.callback(stop)
        line = server.stdout.readline()  # "megatron_edit.status: serving http://127.0.0.1:PORT/ ..."
        if "serving http://" not in line:
            raise RuntimeError(f"python -m megatron_edit.status did not serve: {line}{server.stdout.read()}")
        self.url = line.split("serving ", 1)[1].split()[0]

    def _watch(self) -> None:
        while not self._stop.is_set():
            try:
                shown = json.loads(self.page.evaluate(SHOWN))
            except Exception as error:  # noqa: BLE001 (said by until(), in the test's thread)
                self._error = error
                return
            if shown:  # (before, the browser was still on its blank tab or loading the page)
                with self._lock:
                    self.seen.append(dict(shown, at=time.monotonic()))
            self._stop.wait(self.every)

    def until(self, predicate, what: str, timeout: float = 300.0) -> None:
        """Wait until ``predicate(seen)`` holds of what the page showed so far (it has shown something)."""
        end = time.monotonic() + timeout
        while True:
            if self._error is not None:
                raise RuntimeError(f"reading the page failed: {self._error!r}")
            with self._lock:
                seen = list(self.seen)
            if seen and predicate(seen):
                return
            if time.monotonic() > end:
                raise TimeoutError(f"waited {timeout}s for the page to show {what}; it last showed "
                                   f"{seen[-1] if seen else 'nothing'}")
            time.sleep(0.1)

    def screenshot(self, path: str) -> None:
        """The page as it is now, as a PNG (the watching stops first: one caller of the page at a time)."""
        self._stop.set()
        self._thread.join(30)
        self.page.screenshot(path)
