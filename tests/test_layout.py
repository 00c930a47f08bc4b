"""The package's layers (issue: a layout that shows the architecture), checked on its source.

Every ``megatron_edit`` module's imports (module level and inside functions) are read with
``ast``: there must be no import cycle, and each layer imports only the layers before it:

    algorithm  <  config, arguments  <  exchange  <  mcore  <  cpu  <  training  <  entry points

``algorithm`` (pure math) imports nothing above it and never touches ``torch.distributed`` or
Megatron; the configuration takes its formats and the delay's bound from it
(:mod:`megatron_edit.algorithm.formats`, :func:`megatron_edit.algorithm.schedule.delay_limit`);
``exchange`` never imports Megatron. A module over 400 lines says why in its docstring.
"""

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "megatron_edit"

LAYERS = {"algorithm": 0, "config": 1, "arguments": 1, "flags": 1, "exchange": 2, "mcore": 3, "cpu": 4, "training": 5}
ENTRY = 6  # api, launch, plan, supervise, wraps and status (the CLIs) and __init__


_SPEC = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "dev" / "import_graph.py")
import_graph = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(import_graph)

MODULES = import_graph.modules(PACKAGE)  # name -> (path, is a package), as the script counts them


def _imports(name):
    """(imported megatron_edit module, every external module) of one module."""
    path, is_package = MODULES[name]
    tree = ast.parse(path.read_text())
    package = name if is_package else name.rpartition(".")[0]
    internal, external = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            targets = [(module, alias.name) for alias in node.names]
        else:
            continue
        for module, attr in targets:
            if module.split(".")[0] != "megatron_edit":
                external.add(module)
                continue
            # `from pkg import submodule` imports the submodule
            full = f"{module}.{attr}" if attr and f"{module}.{attr}" in MODULES else module
            if full in MODULES and full != name:
                internal.add(full)
    return internal, external


GRAPH = {name: _imports(name)[0] for name in MODULES}


def _layer(name):
    parts = name.split(".")
    if len(parts) == 1 or parts[1] in ("api", "launch", "plan", "supervise", "wraps", "status"):
        return ENTRY
    return LAYERS[parts[1]]


def test_every_module_belongs_to_a_layer():
    for name in MODULES:
        _layer(name)


def test_no_import_cycles():
    assert import_graph.cycles(GRAPH) == []
    assert import_graph.cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # it finds one


def test_each_layer_imports_only_the_layers_before_it():
    wrong = [
        (name, dep) for name, deps in GRAPH.items() for dep in deps
        if _layer(dep) > _layer(name) and not (name == "megatron_edit" or name.endswith("__init__"))
    ]
    assert wrong == []


@pytest.mark.parametrize("layer,forbidden", [
    ("algorithm", ("torch.distributed", "megatron")),
    ("exchange", ("megatron",)),
    ("config", ("torch.distributed", "megatron")),
])
def test_lower_layers_stay_free_of_distributed_and_megatron(layer, forbidden):
    for name in MODULES:
        if name.split(".")[1:2] == [layer]:
            external = _imports(name)[1]
            assert not [m for m in external if m.split(".")[0] in forbidden or m in forbidden], name


def test_long_modules_say_why():
    for name, (path, _) in MODULES.items():
        text = path.read_text()
        if text.count("\n") > 400:
            doc = ast.get_docstring(ast.parse(text)) or ""
            assert "This module is long because" in doc, f"{name}: {text.count(chr(10))} lines"


def test_no_module_over_450_lines_and_no_function_over_100():
    """One concept per module, read in one sitting; a function fits a screen or two."""
    long_modules, long_functions = [], []
    for name, (path, _) in MODULES.items():
        text = path.read_text()
        if text.count("\n") > 450:
            long_modules.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                long_functions.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert long_modules == [] and long_functions == []


def test_the_status_page_reads_records_without_the_training_side():
    """``megatron_edit.status`` serves a run from its record files alone (a finished run's too, on a
    machine without torch): of the package it imports only the record's schema and the config."""
    status = [name for name in MODULES if name.split(".")[1:2] == ["status"]]
    assert status, "megatron_edit.status moved: update this test"
    reached = {dep for name in status for dep in GRAPH[name] if not dep.startswith("megatron_edit.status")}
    assert reached <= {"megatron_edit.exchange.record", "megatron_edit.config"}, reached
    external = {m.split(".")[0] for name in status for m in _imports(name)[1]}
    assert not external & {"torch", "megatron", "numpy"}, external


def test_the_graph_sees_lazy_imports():
    """A sanity check of the walker: api imports training.training_wraps inside a function."""
    assert "megatron_edit.training.training_wraps" in GRAPH["megatron_edit.api"]


def test_no_private_name_is_imported_across_sub_packages():
    """A module's underscore names are its sub-package's business: another layer
    imports only public names."""
    crossing = []
    for name, (path, is_package) in MODULES.items():
        package = name if is_package else name.rpartition(".")[0]
        mine = name.split(".")[1] if name.count(".") else ""
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = package.split(".")
                target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "megatron_edit":
                continue
            theirs = target.split(".")[1] if target.count(".") else ""
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__") and theirs != mine:
                    crossing.append(f"{name} imports {target}.{alias.name}")
    assert crossing == []


def test_the_checkpoint_sub_package_has_one_public_face():
    """Outside ``megatron_edit.mcore.checkpoint`` only its ``__init__`` is imported
    (its modules are its own business)."""
    face = "megatron_edit.mcore.checkpoint"
    inside = [m for m in MODULES if m.startswith(face + ".")]
    assert inside, "the checkpoint sub-package moved: update this test"
    reaching_in = [f"{name} imports {target}" for name, targets in GRAPH.items()
                   if not name.startswith(face) for target in targets if target in inside]
    assert reaching_in == []
