"""``.ci/run``'s slow step collects only the test files whose text says ``mark.slow`` (a ``grep``): collecting the
whole suite to select its dozen slow tests cost 16 s of CPU in a step of a few minutes. This holds only while every
slow mark is spelt so; here every test module's syntax tree is read for a slow mark spelt otherwise (an alias of
``pytest.mark``, ``add_marker("slow")``, ``getattr(pytest.mark, "slow")``), which the grep would miss and the slow
step would then silently leave out."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
CI_RUN = TESTS.parent / ".ci" / "run"
GREP = "grep -rlE --include='test_*.py' 'mark\\.slow' tests"


def grep_finds(text: str) -> bool:
    """What the ``.ci/run`` grep finds in a file's text."""
    return re.search(r"mark\.slow", text) is not None


def marks_slow(text: str) -> bool:
    """Whether the module's syntax tree names the ``slow`` mark in any spelling: an attribute ``.slow`` (of
    ``pytest.mark`` or of an alias of it), or the string ``"slow"`` given to ``add_marker``, ``getattr`` or a call
    on ``pytest.mark``."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr == "slow":
            return True
        if isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "slow" for a in node.args):
            name = ast.unparse(node.func)
            if name.endswith("add_marker") or name == "getattr" or ".mark" in name:
                return True
    return False


def test_the_ci_slow_step_selects_the_files_by_the_grep():
    text = CI_RUN.read_text()
    assert GREP in text, "the slow step's file selection changed: change this test with it"
    assert "-m slow $slow_files" in text


def test_every_slow_mark_is_spelt_so_the_grep_finds_it():
    missed = [str(p.relative_to(TESTS)) for p in sorted(TESTS.rglob("*.py"))
              if marks_slow(p.read_text()) and not (p.name.startswith("test_") and grep_finds(p.read_text()))]
    assert not missed, f"slow marks the .ci/run grep does not find (spell them pytest.mark.slow in a test_*.py): {missed}"
    assert sum(grep_finds(p.read_text()) for p in TESTS.rglob("test_*.py")) >= 10  # the slow files are found


def test_the_check_finds_slow_marks_spelt_otherwise():
    assert marks_slow("import pytest\n@pytest.mark.slow\ndef test_a(): pass\n")
    assert marks_slow("import pytest\nm = pytest.mark\n@m.slow\ndef test_a(): pass\n")
    assert marks_slow("def pytest_collection_modifyitems(items):\n    items[0].add_marker('slow')\n")
    assert marks_slow("import pytest\nslow = getattr(pytest.mark, 'slow')\n")
    assert not grep_finds("import pytest\nm = pytest.mark\n@m.slow\ndef test_a(): pass\n")
    # a tokenizer's "slow" kind is no mark
    assert not marks_slow("tok = load(kind='slow')\nassert 'slow' in names\nuse('slow')\n")
