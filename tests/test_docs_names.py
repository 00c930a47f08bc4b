"""Every file path and ``megatron_edit`` name that README.md and the ``--help`` texts mention
exists (the README once named tests at their old paths, ``launch --help`` modules
that had moved)."""

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
OURS = ("tests/", "scripts/", "megatron_edit/", "patches/", "scripts/bench/results/", ".ci/", "docs/")
PATH = re.compile(r"(?<![\w./-])((?:tests|scripts|megatron_edit|patches|scripts/bench/results|\.ci|docs)/[\w./-]*[\w])")
DOTTED = re.compile(r"\bmegatron_edit(?:\.\w+)+")


def _resolves(dotted: str) -> bool:
    """A module, or an attribute of one (``megatron_edit.mcore.checkpoint.CheckpointStateError``)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def _missing(text: str):
    paths = {p.rstrip(".") for p in PATH.findall(text)}
    missing = [p for p in sorted(paths) if "*" not in p and not (ROOT / p).exists()]
    names = sorted({n for n in DOTTED.findall(text)})
    missing += [n for n in names if not _resolves(n) and not (ROOT / n.replace(".", "/")).exists()]
    return missing


def test_readme_names_only_what_exists():
    assert _missing((ROOT / "README.md").read_text()) == []


def test_the_docs_site_names_only_what_exists():
    """docs/*.md too (the generated messages page names files by their paths)."""
    stale = {}
    for page in sorted((ROOT / "docs").rglob("*.md")):
        bad = _missing(page.read_text())
        if bad:
            stale[str(page.relative_to(ROOT))] = bad
    assert stale == {}


@pytest.mark.one_lane  # the docs
@pytest.mark.parametrize("command", [
    [sys.executable, "-m", "megatron_edit.launch", "--help"],
    [sys.executable, str(ROOT / "scripts" / "train_gpt_edit.py"), "--help"],
], ids=["launch", "main-job"])
def test_help_texts_name_only_what_exists(command):
    out = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _missing(out.stdout) == []


def test_the_check_catches_a_stale_name():
    assert _missing("see `tests/test_async.py` and megatron_edit.cpu_adapter") == [
        "tests/test_async.py", "megatron_edit.cpu_adapter"]


def test_the_package_names_only_modules_that_exist():
    """Docstrings, comments and messages of the package name modules and objects that exist
    (comments true to the code). ``megatron_edit.local_sgd/2`` is a checkpoint
    format's name, not a module."""
    stale = {}
    for path in sorted((ROOT / "megatron_edit").rglob("*.py")):
        names = {n for n in DOTTED.findall(path.read_text()) if n != "megatron_edit.local_sgd"}
        bad = [n for n in sorted(names) if not _resolves(n)]
        if bad:
            stale[str(path.relative_to(ROOT))] = bad
    assert stale == {}
