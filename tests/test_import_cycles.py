"""No import cycle between two files of shipped code, imports inside functions included.

import-linter's contracts order packages; they do not see a cycle inside one
layer, and Python hides a cycle whose back edge is an import inside a
function (or under ``TYPE_CHECKING``) until the day it is moved. So this
reads every ``import`` statement of ``blockd/``, ``client/`` and ``worker/``
from the AST, wherever it sits, and fails on any strongly connected set of
two or more modules. ``bench/`` is checked too: it is not shipped, but its
scripts import each other.

A package's ``__init__`` is not an edge of the modules under it (Python runs
it first, which is not an import the module chose); an import of the package
itself is.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import ROOT

CHECKED = ("blockd", "client", "worker", "bench")


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph(root: Path, packages: tuple[str, ...] = CHECKED) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports (anywhere in its body)."""
    files = {module_name(root, p): p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))
             if "_pb2" not in p.name}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's own package
                    anchor = name.split(".") if is_package else name.split(".")[:-1]
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                # ``from pkg import mod`` imports the module ``pkg.mod`` when there is one
                subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in files]
                targets = subs if len(subs) == len(node.names) else [base, *subs]
            for imported in targets:
                target = imported
                while target and target not in files:  # ``import a.b.c`` of a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.add(target)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of two or more modules (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            advanced = False
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    advanced = True
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            if advanced:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_cycle_between_files() -> None:
    found = cycles(import_graph(Path(ROOT)))
    assert not found, "import cycles between files (imports inside functions count): " + "; ".join(
        " <-> ".join(c) for c in found)


def test_the_check_finds_a_cycle_hidden_in_a_function(tmp_path: Path) -> None:
    """The check can fail: a back edge inside a function, through ``from pkg import mod``."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.b import thing\n")
    (pkg / "b.py").write_text("def thing():\n    from pkg import c\n    return c\n")
    (pkg / "c.py").write_text("import typing\nif typing.TYPE_CHECKING:\n    from .a import x\n")
    (pkg / "d.py").write_text("from pkg import a\n")  # imports into the cycle, not part of it
    assert cycles(import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b", "pkg.c"]]
