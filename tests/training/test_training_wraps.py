"""The start-up patch of Megatron-LM's training integration (megatron_edit.training.training_wraps):
``lm-compile-helpers`` skips ``make`` when the compiled dataset helpers are importable, on every
device, and is applied by the launcher without the CPU adapter.

Needs megatron-core only (``compile_helpers`` is in ``megatron.core.datasets.utils``), no
Megatron-LM checkout.
"""

import importlib.util
import json
import sys

import megatron.core.datasets.utils as dataset_utils
import pytest

from megatron_edit import launch
from megatron_edit.cpu import training_adapter as cpu_training_adapter
from megatron_edit.mcore.compat import TRAINING_SUPPORTED, megatron_core_version
from megatron_edit.mcore.wrap_registry import PatchRegistry
from megatron_edit.training import training_wraps
from megatron_edit.training.training_wraps import (
    HELPERS_MODULE,
    add_startup_patches,
    apply_startup_patches,
)

pytestmark = pytest.mark.skipif(
    not TRAINING_SUPPORTED.contains(megatron_core_version()),
    reason=f"the training patches are written for megatron-core {TRAINING_SUPPORTED}",
)


@pytest.fixture
def make_calls(monkeypatch):
    """Megatron's compile_helpers replaced by a recorder (restored after the test), so the
    patch wraps it and no `make` runs."""
    calls = []
    monkeypatch.setattr(dataset_utils, "compile_helpers", lambda: calls.append("make"))
    return calls


def _find_spec(helpers_found):
    real = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        if name == HELPERS_MODULE:
            return real("json") if helpers_found else None
        return real(name, *args, **kwargs)

    return find_spec


@pytest.mark.parametrize("helpers_found", [True, False], ids=["helpers-built", "helpers-missing"])
def test_compile_helpers_skips_make_only_when_the_helpers_import(
    monkeypatch, make_calls, helpers_found
):
    registry = apply_startup_patches()
    try:
        assert registry.is_applied("lm-compile-helpers")
        assert dataset_utils.compile_helpers._megatron_edit_patch == "lm-compile-helpers"
        monkeypatch.setattr(importlib.util, "find_spec", _find_spec(helpers_found))
        assert dataset_utils.compile_helpers() is None
        assert make_calls == ([] if helpers_found else ["make"])  # else Megatron's own `make`
    finally:
        assert registry.revert() == ["lm-compile-helpers"]
    assert not hasattr(dataset_utils.compile_helpers, "_megatron_edit_patch")


def test_the_installed_wheel_ships_the_helpers():
    # What makes the skip matter: the wheel has helpers_cpp and no Makefile for `make`.
    assert importlib.util.find_spec(HELPERS_MODULE) is not None


def test_the_training_registry_declares_it_unless_the_launcher_applied_it(make_calls):
    # add_training_patches needs megatron.training; the decision it makes is this one.
    assert not training_wraps._startup_patches_applied()
    registry = apply_startup_patches()
    try:
        assert training_wraps._startup_patches_applied()
        again = apply_startup_patches()  # idempotent: no second wrap
        assert not again.is_applied() and again.revert() == []
    finally:
        registry.revert()
    assert add_startup_patches(PatchRegistry()) == ["lm-compile-helpers"]


def test_the_cpu_adapter_no_longer_patches_compile_helpers():
    assert "compile_helpers" not in {
        p.target.rpartition(":")[2] for p in cpu_training_adapter._build_registry().patches
    }


def test_the_launcher_applies_it_on_a_gpu_without_the_cpu_adapter(
    tmp_path, monkeypatch, make_calls, capsys
):
    script, seen = tmp_path / "pretrain_gpt.py", tmp_path / "seen.json"
    script.write_text(
        "import json\n"
        "import megatron.core.datasets.utils as u\n"
        "from megatron_edit.cpu import training_adapter\n"
        "seen = dict(patch=getattr(u.compile_helpers, '_megatron_edit_patch', None),\n"
        "            cpu_adapter=training_adapter.is_active(), result=u.compile_helpers())\n"
        f"open({str(seen)!r}, 'w').write(json.dumps(seen))\n"
    )
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(launch, "_use_cpu", lambda opts: False)  # the GPU path
    monkeypatch.setattr(launch, "_set_up_path", lambda script: None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    launch.main(["--no-runtime-patches", str(script)])
    assert json.loads(seen.read_text()) == {
        "patch": "lm-compile-helpers", "cpu_adapter": False, "result": None
    }
    assert make_calls == []  # the installed wheel ships helpers_cpp
    assert "on GPU, lm-compile-helpers" in capsys.readouterr().out
