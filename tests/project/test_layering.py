"""The package's import graph has no cycles: not between modules, and not between subpackages (``core`` never
imports ``groups`` or ``io``, ``io`` never imports ``merge``, ``evaluate`` never imports ``merge``...).
Imports inside functions count: a lazy import hides a cycle, it does not remove it."""

from __future__ import annotations

import ast
from pathlib import Path

import symmerge

ROOT = Path(symmerge.__file__).parent


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = ("symmerge",) + path.relative_to(ROOT).with_suffix("").parts
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, (path, package) in modules.items():
        base = name.split(".") if package else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    target = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))
                elif (node.module or "").startswith("symmerge"):
                    target = node.module
                else:
                    continue
                # ``from . import kernels`` needs the submodule; ``from . import get_method`` the package itself
                targets = [f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("symmerge")]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "symmerge"


def test_no_import_cycle_between_modules():
    assert _cycles(_graph()) == []


def test_no_import_cycle_between_subpackages():
    graph: dict[str, set[str]] = {}
    for a, targets in _graph().items():
        if a == "symmerge":  # the package's __init__ exports the API: it imports everything, nothing imports it
            continue
        graph.setdefault(_package(a), set()).update(_package(b) for b in targets if _package(b) != _package(a))
    assert "symmerge" not in set().union(*graph.values()), "a module imports the top-level package"
    assert _cycles(graph) == []


def test_the_scan_sees_lazy_imports_and_cycles():
    """Negative control: the scan must find a cycle made of imports inside functions."""
    graph = _graph()
    assert "symmerge.merge.repair" in graph["symmerge.merge.barrier"]  # a lazy import, inside a function
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph["symmerge.core.kinds"].add("symmerge.groups")  # what the registry replaced
    assert _cycles(graph)


def test_core_never_imports_groups_io_or_pipeline():
    for name, targets in _graph().items():
        if _package(name) == "core":
            assert not {_package(t) for t in targets} & {"groups", "io", "pipeline", "merge", "evaluate"}, name
