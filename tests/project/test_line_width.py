"""The width of the package's source: no line of ``symmerge/*.py`` is over 120 columns (the width the code is wrapped
at; before this guard, 91 lines were over it: 114 counted in bytes, as awk counts). A failure names each file and line."""

from __future__ import annotations

from pathlib import Path

WIDTH = 120
PACKAGE = Path(__file__).resolve().parents[2] / "symmerge"


def too_wide(root: Path, width: int = WIDTH) -> list[str]:
    """``file:line: N columns`` for every line of the ``*.py`` files under ``root`` over ``width`` columns."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if len(line) > width:
                found.append(f"{path.relative_to(root.parent)}:{n}: {len(line)} columns")
    return found


def test_no_line_of_the_package_is_over_120_columns():
    wide = too_wide(PACKAGE)
    assert not wide, f"{len(wide)} line(s) over {WIDTH} columns:\n" + "\n".join(wide)


def test_the_check_finds_a_wide_line_and_passes_the_limit(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n" + "y = '" + "a" * (WIDTH - 6) + "'\n")  # 120 columns: fine
    assert too_wide(tmp_path / "pkg") == []
    (tmp_path / "pkg" / "b.py").write_text("z = 2\n" * 3 + "w = '" + "b" * (WIDTH - 5) + "'\n")  # 121 columns
    assert too_wide(tmp_path / "pkg") == [f"pkg/b.py:4: {WIDTH + 1} columns"]
