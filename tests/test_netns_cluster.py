"""scripts/bench/netns_cluster.sh without network namespaces (no root): its wait for the workers,
sourced (which defines the functions and stops), on plain background shells."""

import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "bench" / "netns_cluster.sh"


def _wait_all(*codes_and_delays) -> int:
    """wait_all over background shells that exit with the given codes after the given delays;
    the status it returns."""
    starts = " ".join(f"(sleep {delay}; exit {code}) & pids+=($!);" for code, delay in codes_and_delays)
    code = f'source "{SCRIPT}"; pids=(); {starts} status=0; wait_all "${{pids[@]}}" || status=$?; echo "$status"'
    out = subprocess.run(["bash", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_a_failing_worker_fails_the_run_with_its_status():
    # Before: `if ! wait "$pid"; then rc=$?` read the negation's status: 0, a crash reported success.
    assert _wait_all((0, 0), (3, 0.3), (0, 0)) == 3
    assert _wait_all((0, 0), (1, 0.5), (5, 0)) == 1  # the first failing worker's, in worker order
    assert _wait_all((0, 0), (0, 0.2)) == 0
