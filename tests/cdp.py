"""Headless Chromium driven over the DevTools protocol, for the tests of the status page: the
standard library only (a minimal websocket client: text frames, the client's masked, no
extensions).

    with chromium() as browser:
        page = browser.open("http://127.0.0.1:8000/")
        page.evaluate("document.title")
        page.screenshot("page.png")

:func:`chromium` starts ``chromium --headless=new --remote-debugging-port=0`` in a session of its
own with a fresh profile, reads the port it chose from the profile's ``DevToolsActivePort``, and
kills the whole session and removes the profile on exit, however the block ends.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
import urllib.request
from typing import Optional

INSTALL = "apt-get update -qq && apt-get install -y -qq chromium"


def chromium_path() -> Optional[str]:
    """The Chromium executable (None: not installed; :data:`INSTALL` installs it on Debian)."""
    return shutil.which("chromium") or shutil.which("chromium-browser")


class WebSocket:
    """One websocket connection (RFC 6455): :meth:`send` and :meth:`recv` whole text messages."""

    def __init__(self, url: str, timeout: float = 60.0):
        host_port, _, path = url[len("ws://"):].partition("/")
        host, _, port = host_port.partition(":")
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET /{path} HTTP/1.1\r\nHost: {host_port}\r\nUpgrade: websocket\r\n"
                           f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n")
                          .encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = self.sock.recv(1)
            if not chunk:
                raise ConnectionError(f"{url}: closed during the handshake")
            head += chunk
        if not head.startswith(b"HTTP/1.1 101"):
            raise ConnectionError(f"{url}: handshake refused: {head.decode(errors='replace').splitlines()[0]}")

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("the browser closed the connection")
            data += chunk
        return data

    def send(self, text: str) -> None:
        payload = text.encode()
        n = len(payload)
        head = bytes([0x81]) + (bytes([0x80 | n]) if n < 126 else
                                bytes([0x80 | 126]) + struct.pack(">H", n) if n < 65536 else
                                bytes([0x80 | 127]) + struct.pack(">Q", n))
        mask = os.urandom(4)
        self.sock.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload)))

    def recv(self) -> str:
        message = b""
        while True:
            first, second = self._exactly(2)
            n = second & 0x7F
            if n == 126:
                n = struct.unpack(">H", self._exactly(2))[0]
            elif n == 127:
                n = struct.unpack(">Q", self._exactly(8))[0]
            payload = self._exactly(n)  # (a server's frames are not masked)
            opcode = first & 0x0F
            if opcode == 0x8:
                raise ConnectionError("the browser closed the connection")
            if opcode in (0x9, 0xA):  # ping, pong: not part of a message
                continue
            message += payload
            if first & 0x80:
                return message.decode()

    def close(self) -> None:
        self.sock.close()


class Page:
    """One tab, over its own DevTools websocket."""

    def __init__(self, url: str):
        self.ws = WebSocket(url)
        self._id = 0

    def call(self, method: str, **params) -> dict:
        self._id += 1
        self.ws.send(json.dumps(dict(id=self._id, method=method, params=params)))
        while True:
            answer = json.loads(self.ws.recv())
            if answer.get("id") == self._id:  # (events, if any, are not ours)
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]

    def evaluate(self, expression: str):
        """The value of a JavaScript expression in the page (JSON-able), or a RuntimeError."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails'].get('exception', result)}")
        return result["result"].get("value")

    def screenshot(self, path: str, width: int = 1400) -> None:
        """The whole page as a PNG, ``width`` CSS pixels wide."""
        height = int(self.evaluate("document.documentElement.scrollHeight"))
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))


class Browser:
    def __init__(self, port: int):
        self.port = port

    def open(self, url: str, width: int = 1400, height: int = 1000) -> Page:
        """A new tab at ``url``, ``width`` x ``height`` CSS pixels."""
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/json/new?about:blank", method="PUT")
        with urllib.request.urlopen(request, timeout=30) as answer:
            target = json.loads(answer.read())
        page = Page(target["webSocketDebuggerUrl"])
        page.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)
        page.call("Page.navigate", url=url)
        return page


@contextlib.contextmanager
def chromium(timeout: float = 60.0):
    """A headless Chromium (see the module); a RuntimeError when it does not start."""
    executable = chromium_path()
    if executable is None:
        raise RuntimeError(f"chromium is not installed: {INSTALL}")
    profile = tempfile.mkdtemp(prefix="megatron_edit_chromium_")
    flags = ["--headless=new", "--remote-debugging-port=0", f"--user-data-dir={profile}", "--no-first-run",
             "--no-default-browser-check", "--disable-gpu", "--disable-extensions", "--disable-dev-shm-usage"]
    if os.geteuid() == 0:
        flags.append("--no-sandbox")  # (Chromium refuses to run as root with its sandbox)
    log = open(os.path.join(profile, "chromium.log"), "w")
    proc = subprocess.Popen([executable, *flags, "about:blank"], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        active = os.path.join(profile, "DevToolsActivePort")
        deadline = time.monotonic() + timeout
        while not (os.path.exists(active) and open(active).read().count("\n") >= 1):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.flush()
                raise RuntimeError(f"chromium did not start (exit {proc.poll()}): "
                                   f"{open(os.path.join(profile, 'chromium.log')).read()[-2000:]}")
            time.sleep(0.1)
        yield Browser(int(open(active).read().split()[0]))
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the browser and every process it started
        proc.wait(timeout=30)
        end = time.monotonic() + 30
        while _group(proc.pid) and time.monotonic() < end:  # (its children, reaped by whoever adopted them)
            time.sleep(0.1)
        log.close()
        shutil.rmtree(profile, ignore_errors=True)


def _group(pgid: int) -> list:
    """The processes of process group ``pgid`` still running (not zombies)."""
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                found.append(int(entry))
    return found
