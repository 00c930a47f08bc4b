"""The package's import graph in numbers (compare before and after a restructuring).

    python scripts/dev/import_graph.py [--root DIR]     # DIR: a checkout (default: this one)

Prints a Markdown table: modules, sub-packages, lines (total, largest module, modules over 400),
imports between megatron_edit modules, how many cross a sub-package boundary, how many of those
import an underscore name, and the import cycles (strongly connected components of size > 1).
Static (ast), so it runs on any commit's files without importing them.
"""

import argparse
import ast
from pathlib import Path


def modules(package: Path):
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_package)
    return out


def edges(mods):
    """(importer, imported, names) for every import of one megatron_edit module by another."""
    out = []
    for name, (path, is_package) in mods.items():
        package = name if is_package else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [(a.name, None) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")
                    module = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [(module, a.name) for a in node.names]
            else:
                continue
            for module, attr in targets:
                if module.split(".")[0] != "megatron_edit":
                    continue
                full = f"{module}.{attr}" if attr and f"{module}.{attr}" in mods else module
                if full in mods and full != name:
                    out.append((name, full, attr if full == module else None))
    return out


def sub_package(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def cycles(graph):
    """The import cycles of ``graph`` ({module: modules it imports}): Tarjan's strongly connected
    components of more than one module (also what tests/test_layout.py asserts empty)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default=str(Path(__file__).resolve().parents[2]))
    args = parser.parse_args()
    mods = modules(Path(args.root) / "megatron_edit")
    es = edges(mods)
    graph = {m: {b for a, b, _ in es if a == m} for m in mods}
    lines = {m: p.read_text().count("\n") for m, (p, _) in mods.items()}
    largest = max(lines, key=lines.get)
    subs = sorted({".".join(m.split(".")[:3]) for m, (_, pkg) in mods.items() if pkg and m != "megatron_edit"})
    crossing = [(a, b, n) for a, b, n in es if sub_package(a) != sub_package(b)]
    private = [(a, b, n) for a, b, n in crossing if n and n.startswith("_") and not n.startswith("__")]
    private_any = [(a, b, n) for a, b, n in es if n and n.startswith("_") and not n.startswith("__")]
    rows = [
        ("modules", len(mods)),
        ("sub-packages", f"{len(subs)} ({', '.join(s.replace('megatron_edit.', '') for s in subs)})"),
        ("lines (total)", sum(lines.values())),
        ("largest module", f"{largest.replace('megatron_edit.', '')} ({lines[largest]} lines)"),
        ("modules over 400 lines", sum(v > 400 for v in lines.values())),
        ("imports between modules", len(es)),
        ("... across sub-packages", len(crossing)),
        ("... of an underscore name across sub-packages", len(private)),
        ("underscore names imported from another module", len(private_any)),
        ("import cycles", len(cycles(graph))),
    ]
    print("| measure | value |\n|---|---|")
    for key, value in rows:
        print(f"| {key} | {value} |")


if __name__ == "__main__":
    main()
