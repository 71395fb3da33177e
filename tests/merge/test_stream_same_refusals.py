"""Memory and disk refuse the same bad input with the same line.

A merge of two Llamas whose FFNs differ (48 units against 40) was refused in memory naming the first tensor of the
model's order (``gate_proj``) and streamed the first of the files' order (``down_proj``); an aligned streamed merge
refused it from inside the alignment ("... in model, ... in anchor") instead of naming the two folders. The layouts
are now compared in one order (the tensors' names sorted), and a streamed aligned merge checks its inputs'
layouts before it aligns anything, as the in-memory merge does."""

from __future__ import annotations

import pytest
import torch

from factories import make_model
from symmerge.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


def _line(capsys, argv) -> tuple:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    return rc, err[-1] if err else ""


@pytest.mark.parametrize("align", ["none", "heads,attn,ffn,rescale"])
def test_a_shape_mismatch_is_the_same_line_in_memory_and_streamed(tmp_path, capsys, align):
    make_model("llama", head=True, dtype=torch.float32, seed=0).save_pretrained(tmp_path / "a")
    make_model("llama", head=True, dtype=torch.float32, seed=1, intermediate_size=48).save_pretrained(tmp_path / "b")
    got = {mode: _line(capsys, ["merge", tmp_path / "b", tmp_path / "a", "--method", "average", "--align", align,
                                "--mode", mode, "--progress", "none", "-o", tmp_path / mode])
           for mode in ("memory", "stream")}
    assert got["memory"] == got["stream"]
    rc, line = got["stream"]
    assert rc == 2 and line.startswith("symmerge: error: shapes differ for model.layers.0.mlp.down_proj.weight: "
                                       f"(32, 48) in {tmp_path / 'b'}, (32, 40) in {tmp_path / 'a'}"), line
    assert not (tmp_path / "memory").exists() and not (tmp_path / "stream").exists()
