"""A side file the output copies (``tokenizer.json`` and the rest of :data:`symmerge.io.model.SIDE_FILES`) that is
no regular file — a FIFO, a broken link — is refused when the input's config is read, before any work, in every
command; it used to be refused only when the output was written ("cannot write the output: ... is a named pipe"),
after the whole alignment or merge."""

from __future__ import annotations

import os

import pytest
import torch

from conftest import save_folder
from factories import make_model
from symmerge.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


def _cli(capsys, *argv):
    capsys.readouterr()
    try:
        rc = main([str(a) for a in argv] + ["--progress", "none"])
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err


@pytest.fixture
def pair(tmp_path):
    """Two tiny float32 Llamas A and B, A's tokenizer.json a FIFO (no writer: opening it to read would block)."""
    for name, seed in (("A", 0), ("B", 1)):
        save_folder(make_model("llama", head=True, dtype=torch.float32, seed=seed), tmp_path / name)
    os.mkfifo(tmp_path / "A" / "tokenizer.json")
    (tmp_path / "c.yml").write_text(f"models:\n  - model: {tmp_path / 'A'}\n  - model: {tmp_path / 'B'}\n"
                                    "merge_method: linear\nparameters:\n  weight: 0.5\n")
    return tmp_path


@pytest.mark.parametrize("argv", [
    ("align", "{A}", "{B}", "-o", "{out}"),
    ("align", "{A}", "{B}", "-o", "{out}", "--stream"),
    ("merge", "{A}", "{B}", "-o", "{out}", "--method", "average"),
    ("merge", "{A}", "{B}", "-o", "{out}", "--method", "average", "--mode", "stream"),
    ("merge", "{B}", "{A}", "-o", "{out}", "--method", "ties", "--base", "{A}"),
    ("run", "{c}", "{out}"),
    ("extract-lora", "{A}", "{B}", "-o", "{out}", "--rank", "2"),
], ids=["align", "align-stream", "merge", "merge-stream", "merge-base", "run", "extract-lora"])
def test_a_fifo_side_file_is_refused_before_any_work(pair, capsys, argv):
    out = pair / "out"
    rc, err = _cli(capsys, *(a.format(A=pair / "A", B=pair / "B", c=pair / "c.yml", out=out) for a in argv))
    lines = [line for line in err.splitlines() if " error: " in line]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert "tokenizer.json: not a regular file" in lines[0] and "side file" in lines[0], lines[0]
    assert not out.exists() and not [p for p in pair.iterdir() if p.name.startswith(".")]


def test_a_broken_link_side_file_names_its_target(tmp_path, capsys):
    for name, seed in (("A", 0), ("B", 1)):
        save_folder(make_model("llama", head=True, dtype=torch.float32, seed=seed), tmp_path / name)
    os.symlink(tmp_path / "gone.json", tmp_path / "B" / "tokenizer_config.json")
    rc, err = _cli(capsys, "merge", tmp_path / "A", tmp_path / "B", "-o", tmp_path / "out", "--method", "average")
    assert rc == 2 and "broken or looping symbolic link" in err and "gone.json" in err, err
    assert not (tmp_path / "out").exists()
