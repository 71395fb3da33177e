"""A value a flag's own reader refuses is argparse's one line naming the command and the flag, exit 2, as every
other refusal of a command-line value: ``symmerge merge: error: argument --distill-lr: must be a positive number,
got 'fast' (see symmerge merge --help)``, not a ``symmerge: error:`` line that names no command. Parametrised over
the declarations (:mod:`symmerge.options.declared`), so that a flag added later is covered: every option read by a
function of its own (``parse=``) given text it cannot read, and every option with a range given a value below it."""

from __future__ import annotations

import re

import pytest

from symmerge.cli import COMMANDS, main
from symmerge.options.declared import TABLE

BAD_TEXT = "bogus"  # read by no parse function: not a number, a method, 'auto'...


def cases():
    for command in COMMANDS:
        for option in TABLE.of(command):
            if option.form not in ("value", "append") or not option.flags:
                continue
            if option.parse is not None:
                yield pytest.param(command, option, BAD_TEXT, id=f"{command}{option.flag}={BAD_TEXT}")
            if option.minimum is not None:
                low = f"{option.minimum - 1:g}"
                yield pytest.param(command, option, low, id=f"{command}{option.flag}={low}")


CASES = list(cases())


def test_the_cases_cover_the_value_readers_of_the_commands():
    ids = {c.id for c in CASES}
    assert {"merge--distill-lr=bogus", "merge--distill=bogus", "merge--method=bogus", "merge--joint-rounds=-1",
            "merge--head-from=bogus", "extract-lora--rank=bogus", "run--random-seed=bogus", "extract-lora--device=bogus",
            "merge--weights=bogus", "merge--param=bogus", "align--layers=bogus", "merge--align=bogus",
            "moe--out-shard-size=bogus", "merge--lora-merge-dtype=bogus", "barrier--points=1", "merge--restarts=-1",
            "align--ends-weight=bogus", "extract-lora--sv-epsilon=-1"} <= ids


@pytest.mark.parametrize("command, option, text", CASES)
def test_a_refused_value_is_argparses_line_naming_the_command_and_the_flag(tmp_path, monkeypatch, capsys, command,
                                                                         option, text):
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([command, f"{option.flag}={text}"])
    captured = capsys.readouterr()
    assert e.value.code == 2 and captured.out == ""
    named = "/".join(option.flags)
    line = re.fullmatch(rf"symmerge {command}: error: argument {re.escape(named)}: (.+) "
                        rf"\(see symmerge {command} --help\)\n", captured.err)
    assert line, captured.err
    assert not line.group(1).startswith(option.flag), captured.err  # the flag named once, by argparse
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, flag", [
    (["merge", "m0", "m1", "--method", "average", "--data", "D"], "--data"),
    (["merge", "m0", "m1", "--method", "average", "--eval-data", "D"], "--eval-data"),
    (["merge", "m0", "m1", "--method", "average", "--match", "activations", "--align-data", "D"], "--align-data"),
    (["align", "m0", "m1", "--match", "activations", "--align-data", "D"], "--align-data"),
    (["barrier", "m0", "m1", "--data", "D"], "--data"),
])
@pytest.mark.parametrize("data", ["missing.npz", "no-format"])
def test_a_data_file_refused_names_its_flag(tmp_path, monkeypatch, capsys, argv, flag, data):
    """A data file that is not there, or of no known format, is refused before any model is read, in one line
    naming the flag that gave it (it named only the path: ``symmerge: error: bogus: unknown data format ''``)."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main([*[data if a == "D" else a for a in argv], "-o", "out"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"symmerge: error: {flag} {data}: ") and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def test_an_anchor_folder_that_is_not_there_is_refused_before_any_model_is_read(tmp_path, monkeypatch, capsys):
    """``--anchor bogus`` loaded every model first (a progress line, then the error): now one line before."""
    from conftest import save_folder
    from factories import make_model

    monkeypatch.chdir(tmp_path)
    for s in (0, 1):
        save_folder(make_model("llama", seed=s), tmp_path / f"m{s}")
    capsys.readouterr()
    assert main(["merge", "m0", "m1", "--method", "average", "--anchor", "bogus", "-o", "out"]) == 2
    err = capsys.readouterr().err
    assert err == ("symmerge: error: --anchor bogus: no such folder (an index into the models, 0..1, or a Hugging Face "
                   "model folder)\n"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m0", "m1"]
