"""The guards' one checker, on the syntax tree: where the package compares something with a name of one of its
vocabularies written out (a symmetry's, a group kind's, a matcher's) outside the vocabulary's home.

What counts: a comparison (``==``, ``!=``, ``in``, ``not in``) one of whose sides is a string literal, or a
tuple/list/set of them, that is a name of the vocabulary; and a ``match`` statement's ``case "name":``. What does
not: *declaring* — a name as a call's argument, a default, a dict key, a registry entry —, and a comparison whose
other side reads another vocabulary that shares a spelling, named by the guard in ``others`` (the variable or
attribute it is read from: ``needs`` for the statistics a merge method needs, which has an "activations" too).
A name compared through a constant declared for it is reading that declaration."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "symmerge"
COMPARING = (ast.Eq, ast.NotEq, ast.In, ast.NotIn)


def literals(node) -> set:
    """The strings ``node`` writes out: a string literal, or a tuple/list/set of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return set().union(set(), *map(literals, node.elts))
    return set()


def read_from(node) -> str | None:
    """The name an expression is read from: ``x`` → x, ``a.b.c`` → c; None for anything else."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def name_comparisons(source: str, names, others=()) -> list[int]:
    """The lines of ``source`` that compare something with one of ``names`` written out (see the module), a
    comparison with an expression read from one of ``others`` excepted."""
    names, others, lines = set(names), set(others), []

    def counts(sides) -> bool:
        return bool(names & set().union(set(), *map(literals, sides))) and not any(read_from(s) in others for s in sides)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(isinstance(o, COMPARING) for o in node.ops):
            if counts([node.left, *node.comparators]):
                lines.append(node.lineno)
        elif isinstance(node, ast.Match):
            lines += [case.pattern.lineno for case in node.cases
                      if counts([node.subject, *(p.value for p in ast.walk(case.pattern) if isinstance(p, ast.MatchValue))])]
    return sorted(lines)


def leaks(names, home, others=(), check=name_comparisons) -> list[str]:
    """``path:line`` (relative to the package) of every comparison ``check`` finds outside ``home`` (a predicate
    on the path relative to the package)."""
    return [f"{rel.as_posix()}:{n}" for path in sorted(PACKAGE.rglob("*.py"))
            if not home(rel := path.relative_to(PACKAGE)) for n in check(path.read_text(), names, others)]


# ---- the code's shape: long functions, functions with many parameters, attribute bags ----

MAX_LINES = 80  # a function longer than this (its ``def`` line to its last line, docstring included) is long
MAX_PARAMETERS = 10  # a function with more named parameters than this (``self``/``cls`` not counted) is wide


def parameters(fn) -> int:
    """The named parameters of a ``def`` (positional, keyword-only, ``*args``, ``**kwargs``; not self/cls)."""
    a = fn.args
    named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")]
    return len(named) + (a.vararg is not None) + (a.kwarg is not None)


def functions(source):
    """(qualified name, ``def`` node) of every function of ``source`` (text or a parsed tree): ``Class.method``,
    ``outer.inner``."""
    def visit(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                yield prefix + child.name, child
                yield from visit(child, prefix + child.name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from visit(child, prefix + child.name + ".")
            else:
                yield from visit(child, prefix)

    yield from visit(ast.parse(source) if isinstance(source, str) else source, "")


def shape(package: Path = PACKAGE) -> tuple[dict, dict]:
    """({``path::name``: lines} of the long functions, {``path::name``: parameters} of the wide ones) in
    ``package`` (paths relative to it)."""
    long, wide = {}, {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        for name, fn in functions(path.read_text()):
            if (n := fn.end_lineno - fn.lineno + 1) > MAX_LINES:
                long[f"{rel}::{name}"] = n
            if (k := parameters(fn)) > MAX_PARAMETERS:
                wide[f"{rel}::{name}"] = k
    return long, wide


def _is_bag(node) -> bool:
    """Whether a call is an attribute-bag pattern (see :func:`attribute_bags`)."""
    f = node.func
    if isinstance(f, ast.Attribute) and f.attr == "update":
        return ((isinstance(f.value, ast.Attribute) and f.value.attr == "__dict__")
                or (isinstance(f.value, ast.Call) and isinstance(f.value.func, ast.Name) and f.value.func.id == "vars"))
    return (isinstance(f, ast.Name) and f.id == "setattr" and len(node.args) >= 2
            and not (isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)))


def attribute_bags(source: str) -> list[str]:
    """The functions of ``source`` (qualified names, ``<module>`` outside any) that use an attribute-bag pattern:
    ``x.__dict__.update(...)``, ``vars(x).update(...)``, or ``setattr`` with an attribute name that is not written
    out (computed, or taken from a loop: attributes made from data rather than declared)."""
    owner, tree = {}, ast.parse(source)
    for name, fn in functions(tree):  # outer functions first: a nested function's calls end up its own
        for node in ast.walk(fn):
            owner[id(node)] = name
    return sorted({owner.get(id(node), "<module>") for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and _is_bag(node)})


def bags(package: Path = PACKAGE) -> list[str]:
    """``path::function`` of every function in ``package`` with an attribute-bag pattern (:func:`attribute_bags`)."""
    return [f"{path.relative_to(package).as_posix()}::{b}" for path in sorted(package.rglob("*.py"))
            for b in attribute_bags(path.read_text())]
