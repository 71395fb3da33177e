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
