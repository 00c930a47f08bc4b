"""Shared pytest setup: the repository root and tests/ on sys.path (spawned ranks inherit it),
the `slow` and `cuda` markers.

The test folders mirror the package's layers (algorithm/, exchange/, mcore/, training/, cpu/);
the helpers every layer's tests share (dist.py: multi-rank runs; gpt_utils.py, edit_runs.py:
tiny megatron-core GPT runs) sit in tests/ itself. Multi-rank tests use dist.run_ranks and carry
a pytest-timeout mark.
"""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[1])
_TESTS = str(Path(__file__).resolve().parent)
for _path in (_TESTS, _ROOT):
    if _path not in sys.path:
        sys.path.insert(0, _path)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running test (deselect with -m 'not slow')")
    config.addinivalue_line(
        "markers", "cuda: needs a CUDA GPU (the GPU lane: `bash scripts/gpu_check.sh`; skipped elsewhere)"
    )


def pytest_collection_modifyitems(config, items):
    """The GPU lane runs where there is a GPU; elsewhere each of its tests says how to run it."""
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU: run `bash scripts/gpu_check.sh` on a machine with one")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
