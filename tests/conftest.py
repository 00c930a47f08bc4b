"""Shared pytest setup: the repository root and tests/ on sys.path (spawned ranks inherit it),
the `slow`, `one_lane` and `cuda` markers.

The test folders mirror the package's layers (config/, algorithm/, exchange/, mcore/ with
mcore/checkpoint/, cpu/, training/); the torchft backend, which spans the layers, has its tests
in torchft_backend/ (its README). The helpers the folders share (dist.py: multi-rank runs;
gpt_utils.py, edit_runs.py, reference_runs.py, checkpoint_runs.py: tiny megatron-core GPT
runs; compare.py: one helper per comparison of their results) sit in tests/ itself.
Multi-rank tests use dist.run_ranks and carry a pytest-timeout mark; every process they start
checks its asynchronous collectives (MEGATRON_EDIT_COLLECTIVE_GUARD, below).

Every test ends what it starts: each process the tests start carries
``MEGATRON_EDIT_TEST_SESSION`` (set here, inherited by every child and grandchild, also by one
reparented away from pytest), and a test after which such a process is still alive fails
(:func:`no_process_left_behind`).
"""

import os
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest

_ROOT = str(Path(__file__).resolve().parents[1])
_TESTS = str(Path(__file__).resolve().parent)
for _path in (_TESTS, _ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")
    config.addinivalue_line(
        "markers", "one_lane: checks what megatron-core's release does not change (the main job's process "
        "handling, the docs, end-to-end scripts, an algorithm's variants on a checkpoint path that other "
        "tests cover in every lane): CI runs it in its default lane only")
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA GPU (the GPU lane: `bash scripts/gpu_check.sh`; skipped elsewhere)"
    )


#: Test folders that import no megatron-core (pure math; collectives on fake groups or torchft; the
#: status page's records):
#: every test in them is ``one_lane``.
WITHOUT_MEGATRON_CORE = ("algorithm", "exchange", "status")


@pytest.hookimpl(tryfirst=True)  # before -m selects by marker
def pytest_collection_modifyitems(config, items):
    """The tests of :data:`WITHOUT_MEGATRON_CORE` are ``one_lane``. The GPU lane runs where
    there is a GPU; elsewhere each of its tests says how to run it."""
    import torch

    for item in items:
        folder = Path(str(item.fspath)).parent
        if folder.parent == Path(_TESTS) and folder.name in WITHOUT_MEGATRON_CORE:
            item.add_marker(pytest.mark.one_lane)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `bash scripts/gpu_check.sh` on a machine with one")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


# Every process the tests start (multi-rank jobs, torchrun jobs of the main job and of
# Megatron-LM) runs with the CPU adapter's check of asynchronous collectives (issue 62:
# megatron_edit.cpu.collective_guard): a buffer freed or written while a collective uses it
# trips at once. MEGATRON_EDIT_COLLECTIVE_GUARD=0 in the environment runs them without it.
os.environ.setdefault("MEGATRON_EDIT_COLLECTIVE_GUARD", "1")

SESSION_MARK = "MEGATRON_EDIT_TEST_SESSION"
if not os.environ.get(SESSION_MARK, "").startswith(f"{os.getpid()}-"):  # once per pytest process
    os.environ[SESSION_MARK] = f"{os.getpid()}-{uuid.uuid4().hex}"  # every child inherits it
#: Seconds a test's processes get to end after it (a killed rank is reaped, a child exits). The
#: helper processes Megatron's torch_dist writer spawns from a rank end after it; on a loaded CI
#: machine three of them took more than 15 s (2026-11-28, test_fragments_megatron's checkpoint test).
LEFT_BEHIND_GRACE_S = 40.0
#: torch.compile's subprocess pool (torch 2.8+ starts it in the first compiling process and keeps
#: it for that process's life): not a process a test started, and ending it breaks later compiles.
INDUCTOR_WORKERS = "torch/_inductor/compile_worker"


def _session_processes():
    """{pid: command line} of the live processes started by this session (other than pytest's
    own multiprocessing helpers, which live for the session: the forkserver tests/dist.py
    starts ranks from, and the resource tracker)."""
    import multiprocessing.forkserver as forkserver
    import multiprocessing.resource_tracker as resource_tracker

    needle = f"{SESSION_MARK}={os.environ[SESSION_MARK]}".encode()
    # private attributes: multiprocessing names its helper processes nowhere else
    helpers = {os.getpid(), getattr(forkserver._forkserver, "_forkserver_pid", None),
               getattr(resource_tracker._resource_tracker, "_pid", None)}
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if int(pid) in helpers:
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if needle not in f.read().split(b"\0"):
                    continue  # (a zombie's environment is empty: it has ended)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            if INDUCTOR_WORKERS in cmd:
                continue  # torch.compile's worker pool: torch's own, it lives as long as its parent
            found[int(pid)] = cmd[:200]
        except OSError:  # gone meanwhile, or another user's
            continue
    return found


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Fails the test after which a process it started is still alive (then ends it, so the
    next test starts clean). Linux only (/proc); elsewhere nothing is checked."""
    yield
    if not os.path.isdir("/proc"):
        return
    deadline = time.monotonic() + LEFT_BEHIND_GRACE_S
    left = _session_processes()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = _session_processes()
    if not left:
        return
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    pytest.fail(f"the test left {len(left)} process(es) running (ended now): "
                + "; ".join(f"{pid}: {cmd}" for pid, cmd in sorted(left.items())), pytrace=False)
