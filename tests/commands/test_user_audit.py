"""A demanding user's bad input, found in an audit of the README's commands: each is one clear
'symmerge: error:' line (or one warning where mergekit goes on), exit 2, before any work, nothing written."""

from __future__ import annotations

import pytest

from conftest import save_folder
from factories import make_model
from symmerge.cli import main
from symmerge.errors import SymmergeError
from symmerge.pipeline.options import AlignOptions

pytestmark = pytest.mark.usefixtures("single_thread")


def run_cli(capsys, *argv):
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr, got: {err!r}"
    assert lines[0].startswith("symmerge: error:"), lines[0]
    return lines[0]


# ------------------------------------------------------------------ --verify-tol


@pytest.mark.parametrize("tol", ["-1", "nan", "inf", "-inf"])
def test_a_verify_tolerance_out_of_range_is_refused_before_any_work(tmp_path, capsys, tol):
    """A negative or NaN tolerance used to run the whole alignment, then claim 'aligned model is not equivalent'
    (an infinite one silently turned the check off); now the flag's own line before any model is read."""
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "align", tmp_path / "no-model", tmp_path / "no-anchor", "-o", out,
                         f"--verify-tol={tol}", "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "--verify-tol" in line and "no-model" not in line, line
    assert not out.exists()


@pytest.mark.parametrize("tol", [-1e-3, float("nan"), float("inf"), "1e-3", True])
def test_align_options_refuse_a_bad_verify_tolerance(tol):
    with pytest.raises(SymmergeError, match="verify-tol"):
        AlignOptions(verify_tol=tol)


@pytest.mark.parametrize("tol", [None, 0, 0.0, 1e-4, 1])
def test_align_options_keep_a_good_verify_tolerance(tol):
    assert AlignOptions(verify_tol=tol).verify_tol == tol


# ------------------------------------------------------------------ one line, whatever the message


def test_a_causal_lm_folder_without_a_tokenizer_is_one_line(tmp_path, capsys):
    """transformers' own message (several lines) used to be quoted as it is: five lines on stderr."""
    models = [save_folder(make_model("llama", seed=s), tmp_path / f"l{s}") for s in (0, 1)]
    text = tmp_path / "t.txt"
    text.write_text("hello world\nanother line\n")
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "barrier", *models, "--data", text, "--align", "none", "--points", "2", "-o", out,
                         "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "tokenizer" in line
    assert not out.exists()


def test_an_error_message_of_several_lines_is_printed_on_one(monkeypatch, capsys):
    import symmerge.commands.specs as specs

    def fail(args):
        raise SymmergeError("first part\n  (1) a detail \n\n(2) another\n")

    monkeypatch.setattr(specs, "run", fail)
    rc, _, err = run_cli(capsys, "specs")
    assert rc == 2
    assert one_error_line(err) == "symmerge: error: first part (1) a detail (2) another"
