"""``merge --print-plan`` printed 'recommended' unresolved: every symmetry of the library's list, ``experts`` for a
dense Llama. It now prints the family's (as the anchor resolves it when bound) and the plan's note when
'recommended' aligns nothing."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from factories import make_model


@pytest.mark.parametrize("family,has_experts", [("llama", False), ("mixtral", True)])
def test_print_plan_names_the_familys_symmetries(tmp_path, capsys, family, has_experts):
    for name, seed in (("a", 0), ("b", 1)):
        make_model(family, head=True, dtype=torch.float32, seed=seed).save_pretrained(tmp_path / name)
    capsys.readouterr()
    assert run_cli("merge", tmp_path / "a", tmp_path / "b", "--method", "average", "--print-plan",
                   "-o", tmp_path / "o") == 0
    alignment = json.loads(capsys.readouterr().out)["alignment"]
    assert alignment["requested"] == "recommended"
    assert ("experts" in alignment["symmetries"]) is has_experts, alignment
    assert {"attn", "ffn" if family == "llama" else "attn", "residual"} <= set(alignment["symmetries"]), alignment
    assert not (tmp_path / "o").exists()


def test_print_plan_says_why_nothing_is_aligned(tmp_path, capsys):
    for name, seed in (("a", 0), ("b", 1)):
        make_model("qwen2_moe", head=True, dtype=torch.float32, seed=seed,
                   mlp_only_layers=[1]).save_pretrained(tmp_path / name)
    capsys.readouterr()
    assert run_cli("merge", tmp_path / "a", tmp_path / "b", "--method", "average", "--print-plan",
                   "-o", tmp_path / "o") == 0
    alignment = json.loads(capsys.readouterr().out)["alignment"]
    assert alignment["symmetries"] == [] and "do not hold" in alignment["note"], alignment
