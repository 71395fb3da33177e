"""Alignment options that nothing would read are one error, before any model is loaded, with no output; each was
accepted and dropped in silence:

* the data-free search's options (``--restarts``, ``--solver-budget``, ``--solver-seed``, ``--ends-weight``,
  ``--depth-decay``) where no search runs: no residual stream aligned (``--symmetries attn,ffn``, ``--stream``),
  or a matcher that does not search (``--match activations``, ``--match learned`` from activations);
* ``--verify-tol`` where no outputs are compared (``--no-verify``; ``--stream`` without ``--verify-forward``);
* ``--learn-dirichlet`` where a pair is learned (the α range is read), ``--learn-alpha-low/high`` where more than
  two models are learned jointly (Dirichlet weights are read);
* ``--learn-augment``/``--learn-augment-style`` (views of images) on text.

Each is checked against the same command that reads the option (it runs, or prints its plan)."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli, write_tokenizer
from factories import make_model
from learned_pair import LINES

LEARN = ["--match", "learned", "--learn-steps", "1", "--learn-batch", "4"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("unread")
    for name, seed in (("a", 0), ("b", 1), ("c", 2)):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(root / name)
        write_tokenizer(root / name)
    (root / "lines.txt").write_text("\n".join(LINES) + "\n")
    return root


def _refused(root, tmp_path, capsys, argv, start):
    argv = [str(a).replace("LINES", str(root / "lines.txt")) for a in argv]
    rc = run_cli(*argv, "-o", tmp_path / "out", "--progress", "none")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and err.startswith(f"symmerge: error: {start}"), err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*"))


SEARCH = [
    (["align", "A", "B", "--symmetries", "attn,ffn", "--restarts", "3"], "--restarts: ", "(attn,ffn)"),
    (["align", "A", "B", "--stream", "--restarts", "3"], "--restarts: ", "not aligned here"),
    (["align", "A", "B", "--symmetries", "attn,ffn", "--solver-budget", "2", "--depth-decay", "2"],
     "--solver-budget, --depth-decay: ", "nothing to search"),
    (["align", "A", "B", "--match", "activations", "--align-data", "LINES", "--ends-weight", "3"],
     "--ends-weight: ", "--match activations does not"),
    (["align", "A", "B", *LEARN, "--align-data", "LINES", "--solver-seed", "3"], "--solver-seed: ",
     "--match learned from --learn-start activations does not"),
    (["merge", "A", "B", "--method", "average", "--align", "attn,ffn", "--restarts", "2"], "--restarts: ",
     "(attn,ffn)"),
    (["merge", "A", "B", "--method", "average", "--mode", "stream", "--restarts", "2"], "--restarts: ",
     "not aligned here"),
]


@pytest.mark.parametrize("argv,start,words", SEARCH)
def test_search_options_where_no_search_runs_are_one_error(root, tmp_path, capsys, argv, start, words):
    argv = [root / x.lower() if x in ("A", "B", "C") else str(x).replace("LINES", str(root / "lines.txt"))
            for x in argv]
    _refused(root, tmp_path, capsys, argv, start)
    _refused(root, tmp_path, capsys, argv, start)  # the same line again (nothing left behind changes it)
    rc = run_cli(*argv, "-o", tmp_path / "out", "--progress", "none")
    assert rc == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["align", "A", "B", "--restarts", "2", "--depth-decay", "2"],  # the residual stream aligned in memory: searched
    ["align", "A", "B", *LEARN, "--align-data", "LINES", "--learn-start", "weights", "--solver-seed", "3"],
    ["merge", "A", "B", "--method", "average", "--restarts", "2"],
])
def test_search_options_where_the_search_runs_are_read(root, tmp_path, capsys, argv):
    argv = [str(root / x.lower()) if x in ("A", "B", "C") else str(x).replace("LINES", str(root / "lines.txt")) for x in argv]
    assert run_cli(*argv, "-o", tmp_path / "out", "--print-plan") == 0
    assert "residual" in capsys.readouterr().out


def test_an_aligned_search_records_its_restarts(root, tmp_path):
    assert run_cli("align", root / "a", root / "b", "-o", tmp_path / "out", "--restarts", "1", "-q") == 0
    solver = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())["solver"]
    assert solver["restarts"] == 1 and len(solver["starts"]) >= 2


@pytest.mark.parametrize("argv,words", [
    (["--no-verify"], "(--no-verify)"),
    (["--stream"], "add --verify-forward"),
])
def test_verify_tol_where_no_outputs_are_compared_is_one_error(root, tmp_path, capsys, argv, words):
    _refused(root, tmp_path, capsys, ["align", root / "a", root / "b", *argv, "--verify-tol", "1e-3"],
             "--verify-tol: ")
    assert run_cli("align", root / "a", root / "b", *argv, "--verify-tol", "1e-3", "-o", tmp_path / "out") == 2
    assert words in capsys.readouterr().err
    # read where the outputs are compared
    assert run_cli("align", root / "a", root / "b", "--stream", "--verify-forward", "--verify-tol", "1e-3", "-o",
                   tmp_path / "out", "--print-plan") == 0
    assert json.loads(capsys.readouterr().out)["plan"]["verify"]["tolerance"] == 1e-3


@pytest.mark.parametrize("argv,start", [
    (["align", "A", "B", "--learn-dirichlet", "2"], "--learn-dirichlet: "),
    (["merge", "A", "B", "--method", "average", "--learn-dirichlet", "2"], "--learn-dirichlet: "),
    (["merge", "A", "B", "C", "--method", "average", "--star", "--learn-dirichlet", "2"], "--learn-dirichlet: "),
    (["merge", "A", "B", "C", "--method", "average", "--learn-alpha-low", "0.2"], "--learn-alpha-low: "),
    (["barrier", "A", "B", "C", "--data", "LINES", "--learn-alpha-high", "0.8"], "--learn-alpha-high: "),
    (["barrier", "A", "B", "--data", "LINES", "--learn-dirichlet", "uniform"], "--learn-dirichlet: "),
])
def test_mixing_options_of_the_other_frame_are_one_error(root, tmp_path, capsys, argv, start):
    argv = [root / x.lower() if x in ("A", "B", "C") else x for x in argv]
    _refused(root, tmp_path, capsys, [*argv, *LEARN, "--align-data", "LINES"], start)


def test_mixing_options_of_the_frame_are_read(root, tmp_path, capsys):
    three = [root / "a", root / "b", root / "c"]
    assert run_cli("merge", *three, "--method", "average", *LEARN, "--align-data", root / "lines.txt",
                   "--learn-dirichlet", "2", "-o", tmp_path / "out", "--print-plan") == 0
    assert run_cli("merge", *three[:2], "--method", "average", *LEARN, "--align-data", root / "lines.txt",
                   "--learn-alpha-low", "0.3", "-o", tmp_path / "out", "--print-plan") == 0


@pytest.mark.parametrize("flags", [["--learn-augment", "2"], ["--learn-augment-style", "strong"]])
def test_augmented_views_on_text_are_one_error(root, tmp_path, capsys, flags):
    _refused(root, tmp_path, capsys, ["align", root / "a", root / "b", *LEARN, "--align-data", "LINES", *flags],
             f"{flags[0]}: ")


def test_no_views_on_text_runs(root, tmp_path):
    assert run_cli("align", root / "a", root / "b", *LEARN, "--align-data", root / "lines.txt", "--learn-augment",
                   "0", "-o", tmp_path / "out", "-q") == 0
