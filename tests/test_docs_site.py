"""The documentation site (docs/, mkdocs.yml) stays true to the code.

* the generated pages (configuration reference, refusal messages) equal what
  ``scripts/dev/gen_docs.py`` generates now;
* every refusal message the AST scan finds is on the generated page, and every message quoted
  in the hand-written troubleshooting page is still in the code;
* the docs' short commands hold: fenced ``python`` / ``bash`` blocks whose first line is
  ``# runnable`` run (python blocks in a subprocess, bash blocks line by line with ``python``
  meaning this interpreter) and exit 0; every ``--help`` / ``--list`` example of the package's
  entry points runs; every EDiT flag named in backticks exists in the parser;
* ``mkdocs build --strict`` passes (skipped when mkdocs is not installed; CI installs it).
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_lane  # (what megatron-core's release does not change)

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TIMEOUT = 120


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "dev" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _pages():
    return sorted(DOCS.rglob("*.md"))


def _blocks(lang: str):
    """(page, code) of every fenced block of ``lang`` whose first line is ``# runnable``."""
    out = []
    # The indent is spaces or tabs only: with \s* a blank line before a fence was taken as its
    # indent, the block then never closed, and the runnable bash blocks were never collected.
    fence = re.compile(r"^([ \t]*)```" + lang + r"[ \t]*\n(.*?)^\1```", re.S | re.M)
    for page in _pages():
        for m in fence.finditer(page.read_text()):
            code = "\n".join(line[len(m.group(1)):] for line in m.group(2).splitlines())
            if code.lstrip().startswith("# runnable"):
                out.append((page.relative_to(ROOT), code))
    return out


def test_generated_pages_are_current():
    result = subprocess.run([sys.executable, "scripts/dev/gen_docs.py", "--check"], cwd=ROOT,
                            capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_refusal_message_is_on_the_page():
    gen = _gen_docs()
    messages = gen.scan_messages()
    page = gen.MESSAGES_PAGE.read_text()
    assert len(messages) > 100, "the scan finds far fewer messages than the code has"
    missing = [m for m in messages if m.text not in page]
    assert not missing, f"{len(missing)} messages not on {gen.MESSAGES_PAGE.name}: {missing[:3]}"
    # Independent of the scanner's rendering: each raise of a package exception class with a
    # literal message is found (the scanner does not lose sites).
    classes = set(gen.package_exception_classes(gen.source_files()))
    literal = 0
    for path in gen.source_files():
        text = path.read_text()
        for cls in classes:
            literal += len(re.findall(r"raise " + cls + r"\(\s*f?[\"']", text))
    found = sum(1 for m in messages if m.kind in classes)
    assert found >= literal, (found, literal)


def _placeholder_pattern(fragment: str) -> re.Pattern:
    parts = re.split(r"\{[^{}]*\}", fragment)
    return re.compile(r"\{[^{}]*\}".join(re.escape(p) for p in parts)
                      if len(parts) > 1 else re.escape(fragment))


def test_troubleshooting_quotes_real_messages():
    page = (DOCS / "troubleshooting" / "index.md").read_text()
    quoted = re.findall(r"^\*\*Message:\*\* `(.+)`$", page, re.M)
    assert len(quoted) >= 10
    generated = (DOCS / "troubleshooting" / "messages.md").read_text()
    stale = [q for q in quoted if q not in generated and not _placeholder_pattern(q).search(generated)]
    assert not stale, f"quoted in troubleshooting/index.md but no longer in the code: {stale}"


@pytest.mark.parametrize("page,code", _blocks("python"), ids=lambda v: str(v)[:40])
def test_runnable_python_blocks(page, code):
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=TIMEOUT)
    assert result.returncode == 0, f"{page}:\n{code}\n{result.stdout}{result.stderr}"


def _commands():
    """The commands of ``# runnable`` bash blocks, and every ``python -m megatron_edit.*
    --help/--list`` or ``scripts/train_gpt_edit.py --help`` example anywhere in the docs."""
    cmds = set()
    for _, code in _blocks("bash"):
        cmds.update(line.strip() for line in code.splitlines()
                    if line.strip() and not line.strip().startswith("#"))
    example = re.compile(r"`((?:\.venv/bin/)?python (?:-m megatron_edit\.\w+|scripts/train_gpt_edit\.py)"
                         r" (?:--help|--list))`")
    for page in _pages():
        cmds.update(example.findall(page.read_text()))
    return sorted(cmds)


@pytest.mark.parametrize("command", _commands())
def test_documented_commands_run(command):
    argv = shlex.split(command)
    if argv[0] in ("python", ".venv/bin/python"):
        argv[0] = sys.executable
    result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, f"{command}\n{result.stdout[-2000:]}{result.stderr[-2000:]}"


def test_flags_named_in_the_docs_exist():
    from megatron_edit.arguments import local_sgd_args_provider

    parser = local_sgd_args_provider(argparse.ArgumentParser())
    known = {s for a in parser._actions for s in a.option_strings}
    flag = re.compile(r"--(?:\[no-\])?(?:local-sgd|outer-optimizer|gta|use-local-sgd)[a-z0-9-]*")
    unknown = {}
    for page in _pages():
        for span in re.findall(r"`([^`\n]+)`", page.read_text()):
            for name in flag.findall(span):
                names = [name.replace("[no-]", ""), name.replace("[no-]", "no-")] if "[no-]" in name else [name]
                if name.endswith("-") or name == "--local-sgd":  # "--local-sgd-{...}" in a message
                    continue
                for n in names:
                    if n not in known:
                        unknown.setdefault(n, str(page.relative_to(ROOT)))
    assert not unknown, f"flags in the docs that the parser does not have: {unknown}"


def test_gpu_launch_command_two_clicks_from_home():
    home = (DOCS / "index.md").read_text()
    assert "(megatron-lm/gpu.md)" in home
    gpu = (DOCS / "megatron-lm" / "gpu.md").read_text()
    assert "-m megatron_edit.launch" in gpu and "--transformer-impl local" in gpu


def test_mkdocs_build_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(Path(sys.executable).parent)) or shutil.which("mkdocs")
    if mkdocs is None or importlib.util.find_spec("mkdocstrings") is None:
        pytest.skip("mkdocs / mkdocstrings not installed (pip install -r docs/requirements.txt)")
    result = subprocess.run([mkdocs, "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                            cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT,
                            env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
