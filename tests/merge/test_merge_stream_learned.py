"""``symmerge merge A B -o OUT --mode stream --match learned`` (issue 42, item 6): each model aligned to the anchor
by the learned alignment from the files (symmerge.pipeline.learn_layerwise_write, one layer at a time), then the
aligned folders merged tensor by tensor; the merged model equals the in-memory learned layer-wise merge's bit for
bit (Llama, Qwen3, GPT-2), and what the streamed learned alignment cannot do is refused in one line with no
output (before, ``--mode stream --match learned`` was refused whatever the inputs)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import run_cli
from learned_pair import digest as _digest
from learned_pair import save_pair
from learned_pair import tensors as _tensors

pytestmark = pytest.mark.usefixtures("single_thread")

LEARN = ["--method", "average", "--match", "learned", "--learn-steps", "3", "--learn-batch", "4"]


def _pair(tmp_path: Path, family: str, tied: bool = False) -> Path:
    return save_pair(tmp_path, family, tied)[1]


@pytest.mark.parametrize("family,tied,start", [("llama", True, "activations"), ("qwen3", False, "weights"),
                                              ("gpt2", True, "activations")])
def test_stream_learned_merge_is_the_in_memory_layerwise_learned_merge_bit_for_bit(tmp_path, family, tied, start):
    lines = _pair(tmp_path, family, tied)
    inputs_before = _digest(tmp_path / "a"), _digest(tmp_path / "b")
    learn = [*LEARN, "--learn-start", start, "--align-data", lines]
    streamed, memory = tmp_path / "streamed", tmp_path / "memory"
    assert run_cli("merge", tmp_path / "a", tmp_path / "b", "-o", streamed, "--mode", "stream", *learn) == 0
    report = json.loads((streamed / "symmerge_report.json").read_text())
    alignment = report["alignment"]
    assert report["mode"] == "stream" and alignment["streamed"] and report["plan"]["match"] == "learned"
    row = next(r for r in alignment["models"] if not r["anchor"])
    assert row["match"] == "learned" and row["learned"]["steps"] == 3 and row["learned"]["start"] == start
    assert row["verify_max_rel_diff"] <= 1e-4  # the written aligned folder checked against A, from the files
    # the in-memory learned merge, layer-wise, with the symmetries the streamed alignment resolved (no residual)
    assert run_cli("merge", tmp_path / "a", tmp_path / "b", "-o", memory, "--mode", "memory", "--learn-layerwise",
                   "--align", ",".join(alignment["symmetries"]), *learn) == 0
    mem = json.loads((memory / "symmerge_report.json").read_text())
    assert mem["mode"] == "memory"
    mem_row = next(r for r in mem["alignment"]["models"] if not r["anchor"])
    assert row["learned"]["history"] == mem_row["learned"]["history"]
    got, expected = _tensors(streamed), _tensors(memory)
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in got)  # bit for bit
    plain = tmp_path / "plain"
    assert run_cli("merge", tmp_path / "a", tmp_path / "b", "-o", plain, "--mode", "stream", "--method", "average",
                   "--align", "none") == 0
    assert any(not torch.equal(got[k], v) for k, v in _tensors(plain).items())  # the alignment changed the merge
    assert (_digest(tmp_path / "a"), _digest(tmp_path / "b")) == inputs_before  # inputs never modified
    assert not [p for p in tmp_path.iterdir() if "aligned" in p.name]  # the temporary aligned folders removed


@pytest.mark.parametrize("extra,needle", [
    (["--learn-frame", "dual"], "dual"),
    (["--no-verify"], "--no-verify"),
    (["--residual", "permutation"], "residual"),
    (["--align-data", "generate:4:8"], "generate"),
])
def test_stream_learned_merge_refuses_in_one_line_with_no_output(tmp_path, capsys, extra, needle):
    lines = _pair(tmp_path, "llama", True)
    data = [] if "--align-data" in extra else ["--align-data", lines]
    out = tmp_path / "out"
    capsys.readouterr()
    rc = run_cli("merge", tmp_path / "a", tmp_path / "b", "-o", out, "--mode", "stream", *LEARN, *data, *extra)
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(err) == 1 and err[0].startswith("symmerge: error: ") and needle in err[0], err
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "lines.txt"]


def test_stream_learned_merge_print_plan_names_the_learned_stream(tmp_path, capsys):
    lines = _pair(tmp_path, "llama", True)
    capsys.readouterr()
    assert run_cli("merge", tmp_path / "a", tmp_path / "b", "-o", tmp_path / "out", "--mode", "stream",
                   "--align-data", lines, *LEARN, "--print-plan") == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["plan"]["mode"] == "stream" and plan["plan"]["match"] == "learned"
    assert not (tmp_path / "out").exists()
