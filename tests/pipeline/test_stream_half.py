"""Half-precision files through ``align --stream``: rounded once and verified as in memory.

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

from factories import make_model
from learned_pair import tensors
from symmerge.cli import main


def _pair(family, dtype, tmp_path):
    for name, seed in (("a", 0), ("b", 5)):
        make_model(family, dtype=torch.float32, seed=seed).to(dtype).save_pretrained(tmp_path / name)
    return str(tmp_path / "a"), str(tmp_path / "b")


def test_a_half_tensor_is_rounded_once_after_all_its_maps():
    """The plan's steps over bfloat16 tensors give their float32 result rounded once: every map applied in float32
    (before, each map's result was rounded: a q_proj moved by the head rotation and the attention's map, a stream
    writer by several groups, were rounded twice or more; streamed, they then differed from the in-memory
    alignment's folder, which rounds once)."""
    from symmerge.core.apply import random_elements
    from symmerge.pipeline.align import instances_for
    from symmerge.pipeline.align_steps import execute_steps, plan_steps

    model = make_model("llama", dtype=torch.float32, seed=0)
    _, instances = instances_for(model)
    local = [i for i in instances if i.kind.per_layer]
    assert {i.group.symmetry for i in local} >= {"heads", "attn", "ffn"}
    elements = random_elements(local, torch.Generator().manual_seed(3))
    half = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    steps = plan_steps(list(half), local)
    twice = [st.tensor for st in steps if len({m.instance for m in st.maps}) > 1]
    assert twice  # tensors more than one group moves: where rounding after each map made a difference
    got = execute_steps(steps, half, local, elements)
    exact = execute_steps(steps, {k: v.float() for k, v in half.items()}, local, elements)
    assert all(got[k].dtype == torch.bfloat16 for k in half)
    assert [k for k in half if not torch.equal(got[k], exact[k].to(torch.bfloat16))] == []
    unrounded = execute_steps(steps, half, local, elements, rounded=False)
    assert all(torch.equal(unrounded[k], exact[k]) for k in twice)


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
    assert all(t.dtype == torch.bfloat16 for t in tensors(out).values())


def test_streamed_verify_forward_of_float32_files_is_unchanged(tmp_path):
    a, b = _pair("llama", torch.float32, tmp_path)
    out = tmp_path / "out"
    assert main(["align", a, b, "-o", str(out), "--stream", "--verify-forward", "--progress", "none"]) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["verify_max_rel_diff"] < 1e-4 and "working_copies" not in report
