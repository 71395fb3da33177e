"""Every refusal of the command line's parsing (argparse's) is ONE stderr line, exit 2, nothing written:
``symmerge COMMAND: error: MESSAGE (see symmerge COMMAND --help)`` — an unknown flag, a bad choice, a bad number,
a missing argument, an unknown command (argparse printed the command's whole usage block first). A misspelt flag
is named with its did-you-mean even where a required argument is missing too (``merge --metod x``: argparse
reported the missing ``--method``)."""

from __future__ import annotations

import pytest

from symmerge.cli import COMMANDS, main

# per command: arguments that parse (nothing read yet), then the bad ones appended
GOOD = {"align": ["a", "b", "-o", "OUT"], "barrier": ["a", "b", "--data", "d.npz", "-o", "OUT"], "demo": ["-o", "OUT"],
        "extract-lora": ["ft", "base", "-o", "OUT"], "merge": ["a", "b", "-o", "OUT", "--method", "average"],
        "moe": ["cfg.yml", "OUT"], "run": ["cfg.yml", "OUT"], "specs": []}
BAD_CHOICE = {"align": ["--match", "nope"], "barrier": ["--rescale", "nope"], "demo": ["--progress", "nope"],
              "extract-lora": ["--svd", "nope"], "merge": ["--match", "nope"], "moe": ["--residual", "nope"],
              "run": ["--progress", "nope"]}
BAD_INT = {"align": ["--max-sweeps", "x"], "barrier": ["--points", "x"], "demo": ["--seed", "x"],
           "extract-lora": ["--rank", "x"], "merge": ["--batch-size", "x"], "moe": ["--random-seed", "x"],
           "run": ["--random-seed", "x"]}
MISSING = {"align": ["a", "-o", "OUT"], "barrier": ["--data", "d.npz", "-o", "OUT"], "merge": ["-o", "OUT"],
           "moe": [], "run": []}  # a required positional left out (demo, extract-lora, specs have none)


def cases():
    for command in COMMANDS:
        yield command, "unknown flag", [*GOOD[command], "--no-such-flag"]
        if command in BAD_CHOICE:
            yield command, "bad choice", [*GOOD[command], *BAD_CHOICE[command]]
        if command in BAD_INT:
            yield command, "bad int", [*GOOD[command], *BAD_INT[command]]
        if command in MISSING:
            yield command, "missing positional", MISSING[command]
    yield "merge", "bad choice", ["a", "b", "-o", "OUT", "--method", "average", "--heads", "nope"]
    yield "merge", "missing --method", ["a", "b", "-o", "OUT"]
    yield "merge", "bad float", ["a", "b", "-o", "OUT", "--method", "average", "--ends-weight", "heavy"]


def refuse(argv, capsys, tmp_path) -> str:
    """The one stderr line of ``symmerge ARGV`` (exit 2, nothing on stdout, no output folder)."""
    out = tmp_path / "OUT"
    argv = [str(out) if a == "OUT" else a for a in argv]
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(argv)
    captured = capsys.readouterr()
    assert e.value.code == 2
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize("command, what, argv", list(cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_each_parse_error_is_one_line(command, what, argv, capsys, tmp_path):
    line = refuse([command, *argv], capsys, tmp_path)
    assert line.startswith(f"symmerge {command}: error: ") and line.endswith(f" (see symmerge {command} --help)"), line
    assert "usage:" not in line


def test_an_unknown_command_is_one_line(capsys, tmp_path):
    line = refuse(["mrege", "a", "b"], capsys, tmp_path)
    assert line.startswith("symmerge: error: argument COMMAND: invalid choice: 'mrege'"), line
    assert "(did you mean 'merge'?)" in line and line.endswith(" (see symmerge --help)"), line


def test_a_bad_choice_close_to_one_says_which(capsys, tmp_path):
    line = refuse(["merge", "a", "b", "-o", "OUT", "--method", "average", "--match", "activatons"], capsys, tmp_path)
    assert line.endswith("(did you mean 'activations'?) (see symmerge merge --help)"), line


def test_no_command_is_one_line(capsys, tmp_path):
    assert refuse([], capsys, tmp_path) == ("symmerge: error: the following arguments are required: COMMAND "
                                            "(see symmerge --help)")


def test_an_unknown_flag_keeps_its_did_you_mean(capsys, tmp_path):
    line = refuse(["align", "a", "b", "-o", "OUT", "--symetries", "attn"], capsys, tmp_path)
    assert line == ("symmerge align: error: unrecognized arguments: --symetries attn (did you mean --symmetries?) "
                    "(see symmerge align --help)"), line


@pytest.mark.parametrize("flag", [["--metod", "average"], ["--metod=average"]])
def test_a_misspelt_required_flag_is_named_not_the_missing_one(flag, capsys, tmp_path):
    """``merge --metod x`` said 'the following arguments are required: --method' and no did-you-mean."""
    line = refuse(["merge", "a", "b", "-o", "OUT", *flag], capsys, tmp_path)
    assert line == (f"symmerge merge: error: unrecognized arguments: {flag[0]} (did you mean --method?) "
                    "(see symmerge merge --help)"), line


def test_an_abbreviated_flag_is_not_taken_for_an_unknown_one(capsys, tmp_path):
    """argparse takes a unique prefix (``--meth`` for ``--method``): the error is then the real one."""
    line = refuse(["merge", "-o", "OUT", "--meth", "average"], capsys, tmp_path)
    assert line == ("symmerge merge: error: the following arguments are required: models "
                    "(see symmerge merge --help)"), line


@pytest.mark.parametrize("argv", [["--help"], ["merge", "--help"], ["run", "-h"]])
def test_help_is_unchanged(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 0
    assert capsys.readouterr().out.startswith("usage: symmerge")


def test_the_flags_named_unknown_are_exactly_those_no_parser_takes():
    """The unknown-flag check reads the declarations (symmerge.options.declared), not argparse's internals: each
    command's parser takes exactly the flags it knows (a hand-written flag outside them would be named unknown)."""
    from symmerge.cli import _flags, build_parser

    sub = build_parser()._subparsers._group_actions[0].choices
    for command, parser in sub.items():
        taken = {s for action in parser._actions for s in action.option_strings}
        assert taken == set(_flags(command)), command


def test_a_misspelt_method_says_which(capsys, tmp_path):
    """``--method averag`` is refused by the methods' registry (not argparse: the methods are plug-ins), one line
    with the close name (a mergekit config's ``merge_method``: tests/config/test_run_config.py)."""
    from symmerge.errors import SymmergeError
    from symmerge.merge.registry import get_method

    with pytest.raises(SymmergeError, match=r"unknown merge method 'averag' \(did you mean 'average'\?\)"):
        get_method("averag")
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # read by the flag: argparse's line, naming the command and the flag
        main(["merge", str(a), str(b), "-o", str(tmp_path / "OUT"), "--method", "dare_tie", "--align", "none"])
    err = capsys.readouterr().err.splitlines()
    assert refused.value.code == 2 and len(err) == 1, err
    assert err[0].startswith("symmerge merge: error: argument --method: unknown merge method 'dare_tie' (did you "
                             "mean 'dare_ties'?)") and err[0].endswith("(see symmerge merge --help)"), err
    assert not (tmp_path / "OUT").exists()
