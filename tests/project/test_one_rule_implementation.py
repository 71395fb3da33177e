"""One implementation per task-vector rule (issue 39, item 4): numba is a required dependency, so the product keeps no
switch between the kernels and a torch copy of the same rule. The syntax tree of every module of the package is read:
an attribute or name ``AVAILABLE`` read from ``kernels`` (``kernels.AVAILABLE``, ``from .kernels import AVAILABLE``)
or the string ``SYMMERGE_NO_NUMBA`` anywhere fails. The torch definitions live in the tests
(``tests/merge/reference_rules.py``), as the kernels' oracle."""

from __future__ import annotations

import ast
import textwrap

from guards import PACKAGE


def switches(source: str) -> list[int]:
    """Lines where ``source`` reads the kernels' availability or names the environment switch."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr == "AVAILABLE":
            base = node.value
            name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else None
            if name is not None and "kernels" in name:
                found.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and "kernels" in (node.module or ""):
            if any(alias.name == "AVAILABLE" for alias in node.names):
                found.append(node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "SYMMERGE_NO_NUMBA" in node.value:
            found.append(node.lineno)
    return found


def offenders(package=PACKAGE) -> list[str]:
    out = []
    for path in sorted(package.rglob("*.py")):
        out += [f"{path.relative_to(package)}:{line}" for line in switches(path.read_text())]
    return out


def test_the_product_has_no_switch_to_a_second_implementation():
    assert not (found := offenders()), (
        f"the product reads kernels.AVAILABLE / SYMMERGE_NO_NUMBA again at {found}: numba is required; a slower "
        "definition belongs in tests/merge/reference_rules.py")


def test_a_planted_switch_fails(tmp_path):
    planted = {
        "attr.py": "from . import kernels\nif kernels.AVAILABLE:\n    pass\n",
        "deep.py": "import symmerge.merge.kernels\nok = symmerge.merge.kernels.AVAILABLE\n",
        "imported.py": "from .kernels import AVAILABLE\n",
        "env.py": "import os\noff = os.environ.get('SYMMERGE_NO_NUMBA')\n",
    }
    (tmp_path / "pkg").mkdir()
    for name, text in planted.items():
        (tmp_path / "pkg" / name).write_text(textwrap.dedent(text))
    (tmp_path / "pkg" / "fine.py").write_text("AVAILABLE = True\nclass X:\n    AVAILABLE = 1\nx = X().AVAILABLE\n")
    assert offenders(tmp_path / "pkg") == ["attr.py:2", "deep.py:2", "env.py:2", "imported.py:1"]
