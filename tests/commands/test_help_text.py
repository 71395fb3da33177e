"""``symmerge --help`` and every command's ``--help`` show the commands' texts as words: the reStructuredText
markup of the modules' docstrings (double backquotes, ``:mod:`` / ``:func:`` roles) is not printed."""

from __future__ import annotations

import re

import pytest
from symmerge.cli import COMMANDS, main

MARKUP = re.compile(r"`|:(mod|func|class|meth|attr):")


@pytest.mark.parametrize("argv", [["--help"]] + [[name, "--help"] for name in COMMANDS])
def test_help_shows_no_rst_markup(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: symmerge") and not MARKUP.search(out), MARKUP.search(out)


def test_the_words_inside_the_markup_are_kept(capsys):
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    assert "symmerge run CONFIG.yml OUT (as mergekit-yaml CONFIG OUT)" in out and "symmerge.config.aligned" in out
