"""A worker's processes live and die together: a worker is one job of many processes (a
launcher, torchrun's, and its ranks, each in a session of its own), and a run of the torchft
backend is one worker to the others only while all of them live.

* A rank ends within seconds of its launcher's death (:func:`watch_launcher`: a node agent or
  an OOM killer that SIGKILLs torchrun alone leaves ranks that torchrun would have ended), and of
  the death of any process named in :data:`WATCH_ENV` (the supervisor, the main job: a
  ``kill -9`` of them leaves no rank behind).
* The supervisor tags each job it starts (:data:`JOB_ENV`, inherited by every process of the job)
  and relaunches a worker only once no process of its previous job lives
  (:func:`end_job`), so a relaunch never shares a replica id with a rank of the job before it.

Linux's ``/proc``; elsewhere a rank only watches its parent and the supervisor only its job's
leader.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import List, Optional

JOB_ENV = "MEGATRON_EDIT_JOB"
"""Set by the supervisor for each job it starts (``<its pid>.<replica id>.<start>``): every process of the
job inherits it, which is how the supervisor finds them after their launcher has died."""
WATCH_ENV = "MEGATRON_EDIT_WATCH_PIDS"
"""Comma-separated process ids whose death ends a rank (the supervisor's, the main job's)."""

_watching: List[int] = []


def _alive(pid: int) -> bool:
    """Whether process ``pid`` lives (a zombie does not)."""
    if os.path.isdir("/proc"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, IndexError):
            return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def watch_launcher(interval: float = 1.0) -> None:
    """End this process (exit code 1, one line) within ``interval`` seconds of the death of
    its parent (its launcher) or of a process of :data:`WATCH_ENV`; once per process."""
    if _watching:
        return
    parent = os.getppid()
    others = [int(p) for p in os.environ.get(WATCH_ENV, "").split(",") if p.strip().isdigit()]
    _watching.extend([parent, *others])

    def watch() -> None:
        while True:
            time.sleep(interval)
            gone = parent if os.getppid() != parent else next((p for p in others if not _alive(p)), None)
            if gone is not None:
                sys.stderr.write(f"megatron_edit: this rank's launcher or supervisor (pid {gone}) has died: "
                                 f"ending this rank (pid {os.getpid()}) with it.\n")
                sys.stderr.flush()
                os._exit(1)

    threading.Thread(target=watch, name="megatron_edit-watch-launcher", daemon=True).start()


def watched_env(env: dict, pid: Optional[int] = None) -> dict:
    """``env`` with process ``pid`` (default: this one) added to :data:`WATCH_ENV`."""
    pids = [p for p in env.get(WATCH_ENV, "").split(",") if p] + [str(pid or os.getpid())]
    return dict(env, **{WATCH_ENV: ",".join(pids)})


def job_processes(tag: str) -> List[int]:
    """The live processes whose environment carries ``JOB_ENV=tag`` (Linux; else none)."""
    needle = f"{JOB_ENV}={tag}".encode() + b"\0"
    found = []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                if needle in f.read() + b"\0" and _alive(int(entry)):
                    found.append(int(entry))
        except OSError:
            continue
    return found


def end_job(tag: str, timeout: float = 30.0) -> List[int]:
    """SIGKILL every process of the job ``tag`` and wait until none lives (up to ``timeout``
    seconds); returns those that still live then (none, unless one cannot be killed)."""
    end = time.monotonic() + timeout
    while True:
        left = job_processes(tag)
        if not left or time.monotonic() > end:
            return left
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.1)
