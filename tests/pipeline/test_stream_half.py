"""Half-precision files through ``align --stream``: the same alignment as in memory, verified the same way.

The in-memory alignment of float16/bfloat16 models solves, applies and verifies on float32 copies and rounds the
result once (:func:`symmerge.pipeline.verify.working_copies`). Streamed, every map of a tensor is applied in
float32 and the tensor rounded once (:func:`symmerge.pipeline.align_steps.transformed`), and ``--verify-forward``
compares the float32 values before that rounding with the input's float32 copy: the rounded folder against the
rounded input measured the rounding (a tiny bfloat16 Qwen2-MoE pair was refused, 0.0516 > 0.05: one token's expert
routing flips), not the alignment."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from factories import make_model
from symmerge.cli import main


def _pair(family, dtype, tmp_path):
    for name, seed in (("a", 0), ("b", 5)):
        make_model(family, dtype=torch.float32, seed=seed).to(dtype).save_pretrained(tmp_path / name)
    return str(tmp_path / "a"), str(tmp_path / "b")


def _tensors(folder):
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_streamed_bfloat16_alignment_writes_the_in_memory_alignment(tmp_path):
    """Each tensor rounded once (it was rounded after each map: a q_proj moved by the head rotation and the
    attention's map differed from the in-memory alignment's in one element)."""
    a, b = _pair("llama", torch.bfloat16, tmp_path)
    assert main(["align", a, b, "-o", str(tmp_path / "mem"), "--progress", "none"]) == 0
    assert main(["align", a, b, "-o", str(tmp_path / "str"), "--stream", "--progress", "none"]) == 0
    mem, streamed = _tensors(tmp_path / "mem"), _tensors(tmp_path / "str")
    assert set(mem) == set(streamed)
    assert [k for k in mem if not torch.equal(mem[k], streamed[k])] == []
    assert all(t.dtype == torch.bfloat16 for t in streamed.values())


@pytest.mark.parametrize("mode", [[], ["--pipeline"]])
def test_streamed_verify_forward_of_half_files_checks_the_float32_alignment(tmp_path, capsys, mode):
    a, b = _pair("qwen2_moe", torch.bfloat16, tmp_path)
    out = tmp_path / "out"
    assert main(["align", a, b, "-o", str(out), "--stream", "--verify-forward", "--progress", "none", *mode]) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["verify_max_rel_diff"] < 1e-4 and report["verify_tolerance"] == 1e-4
    assert report["working_copies"]["dtype"] == "float32"
    assert report["working_copies"]["stored"] == ["bfloat16", "bfloat16"]
    assert "on float32 copies, written in bfloat16" in capsys.readouterr().out
    assert not (out / ".verify-float32").exists()  # the float32 values are removed after the check
    assert all(t.dtype == torch.bfloat16 for t in _tensors(out).values())


def test_streamed_verify_forward_of_float32_files_is_unchanged(tmp_path):
    a, b = _pair("llama", torch.float32, tmp_path)
    out = tmp_path / "out"
    assert main(["align", a, b, "-o", str(out), "--stream", "--verify-forward", "--progress", "none"]) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["verify_max_rel_diff"] < 1e-4 and "working_copies" not in report
