"""No test module defines a module-level function that an older pytest the project admits (``pytest>=8``) would
run as a setup or teardown hook: pytest 8.0 calls a module's ``setup()`` / ``teardown()`` with the module as the
argument (``tests/pipeline/test_descent.py``'s helper ``setup(family, ...)`` was, on pytest 8.0.0: 5 errors); later
versions ignore them, so the suite on the newest pytest cannot show it."""

from __future__ import annotations

import ast
from pathlib import Path

HOOK_NAMES = {"setup", "teardown"}  # nose-style names pytest 8.0 still treats as module hooks
TESTS = Path(__file__).resolve().parent.parent


def hook_named_functions(source: str) -> list[str]:
    """The module-level functions of ``source`` named like a hook."""
    return [n.name for n in ast.parse(source).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name in HOOK_NAMES]


def test_the_checker_finds_a_planted_helper():
    planted = "def setup(family):\n    pass\n\nclass C:\n    def setup(self):\n        pass\n\ndef teardown():\n    pass\n"
    assert hook_named_functions(planted) == ["setup", "teardown"]  # methods are not module hooks


def test_no_test_module_has_a_module_level_setup_or_teardown():
    found = {str(p.relative_to(TESTS)): names for p in sorted(TESTS.rglob("test_*.py"))
             if (names := hook_named_functions(p.read_text()))}
    assert not found, f"rename these helpers (pytest 8.0 runs them as module hooks): {found}"
