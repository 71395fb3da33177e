"""The Python API blocks of the docs name modules and functions that exist: every ``from symmerge... import``
line of a ```python block in README.md and docs/*.md is executed."""

from __future__ import annotations

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
