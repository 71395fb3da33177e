"""The Python API blocks of the docs name modules and functions that exist: every ``from symmerge... import``
line of a ```python block in README.md and docs/*.md is executed; and every call in them of a symmerge function or
class passes arguments it takes (the keywords, as many positional arguments; an entry's ``**keywords`` those of the
options object it forwards them to)."""

from __future__ import annotations

import importlib.util
import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _imports(path: Path) -> list[str]:
    lines = []
    for block in re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S):
        for line in block.splitlines():
            m = re.match(r"\s*(from symmerge[\w.]* import [\w, ]+|import symmerge[\w.]*)", line)
            if m:
                lines.append(m.group(1).strip().rstrip(","))
    return lines


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_import(path):
    import importlib.util

    flower = importlib.util.find_spec("flwr") is not None
    for line in _imports(path):
        if "symmerge.federated" in line and not flower:  # the 'flower' extra (tested in its own venv in CI)
            continue
        exec(line, {})  # noqa: S102 - the docs' own import lines


def test_the_scan_finds_the_api_block_and_bad_names():
    lines = _imports(ROOT / "docs" / "merge.md")
    assert "from symmerge.merge.fuse import merge_models" in lines
    with pytest.raises(ImportError):
        exec("from symmerge.fuse import merge_models", {})  # what the block used to say


def _blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def _bound_names(tree) -> dict:
    """name in the block -> its dotted path (``from symmerge.x import f`` -> ``symmerge.x.f``; ``import symmerge``)."""
    import ast

    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("symmerge"):
            names.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
        elif isinstance(node, ast.Import):
            names.update({a.asname or a.name: a.name for a in node.names if a.name.startswith("symmerge")})
    return names


def _dotted(func, names: dict) -> str | None:
    import ast

    parts = []
    while isinstance(func, ast.Attribute):
        parts.append(func.attr)
        func = func.value
    if isinstance(func, ast.Name) and func.id in names:
        return ".".join([names[func.id], *reversed(parts)])
    return None


def _resolve(dotted: str):
    import importlib

    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for p in parts[i:]:
            obj = getattr(obj, p)
        return obj
    raise ImportError(dotted)


def _forwarded(obj) -> set | None:
    """The keywords a public entry with ``**keywords`` forwards (to an options object), or None: anything."""
    import dataclasses

    import symmerge

    forwards = {symmerge.align: symmerge.AlignOptions, symmerge.merge_models: symmerge.MergeOptions,
                symmerge.barrier_study: symmerge.BarrierOptions, symmerge.barrier_many: symmerge.BarrierOptions}
    target = forwards.get(obj)
    if target is None:
        return None
    extra = set(inspect.signature(symmerge.MergeOptions.from_keywords).parameters) if target is symmerge.MergeOptions \
        else set()
    return {f.name for f in dataclasses.fields(target)} | extra


def _bad_calls(path: Path) -> list[str]:
    """Each call in a ```python block of a symmerge function or class whose keywords or argument count it does not
    take: ``name(...): why``."""
    import ast

    bad = []
    for block in _blocks(path):
        tree = ast.parse(block)
        names = _bound_names(tree)
        for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call)):
            dotted = _dotted(call.func, names)
            if dotted is None or ("federated" in dotted and importlib.util.find_spec("flwr") is None):
                continue
            obj = _resolve(dotted)
            sig = inspect.signature(obj)
            keywords = [k.arg for k in call.keywords if k.arg is not None]
            try:
                sig.bind(*[None] * len(call.args), **{k: None for k in keywords})
            except TypeError as e:
                bad.append(f"{dotted}(...) line {call.lineno}: {e}")
                continue
            forwarded = _forwarded(obj)
            named = set(sig.parameters)
            if forwarded is not None:
                bad += [f"{dotted}(...) line {call.lineno}: no keyword {k!r}" for k in keywords
                        if k not in named and k not in forwarded]
    return bad


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_python_blocks_call_with_arguments_the_api_takes(path):
    assert _bad_calls(path) == []


def test_the_call_check_finds_a_misspelt_keyword_and_an_extra_argument(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("```python\nimport symmerge\nfrom symmerge.pipeline.options import AlignOptions\n"
                   "symmerge.align('a', 'b', rescal='joint')\nAlignOptions(symetries='attn')\n"
                   "symmerge.align_to_folder('a', 'b', 'out', None, True)\n```\n")
    bad = _bad_calls(doc)
    assert len(bad) == 3 and "'rescal'" in bad[0] and "symetries" in bad[1] and "too many positional" in bad[2]
