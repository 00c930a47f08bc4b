"""Shared pytest setup: the repository root on sys.path (spawned ranks inherit it), a `slow` marker.

Multi-rank tests use tests/dist.py's run_ranks and carry a pytest-timeout mark.
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")
