"""``merge --print-plan`` printed 'recommended' unresolved: every symmetry of the library's list, ``experts`` for a
dense Llama. It now prints the family's (as the anchor resolves it when bound) and the plan's note when
'recommended' aligns nothing."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from factories import make_model


def _pair(root, family: str, **settings):
    for name, seed in (("a", 0), ("b", 1)):
        make_model(family, head=True, dtype=torch.float32, seed=seed, **settings).save_pretrained(root / name)
    return root


@pytest.mark.parametrize("family,has_experts", [("llama", False), ("mixtral", True)])
def test_print_plan_names_the_familys_symmetries(tmp_path, capsys, family, has_experts):
    _pair(tmp_path, family)
    capsys.readouterr()
    assert run_cli("merge", tmp_path / "a", tmp_path / "b", "--method", "average", "--print-plan",
                   "-o", tmp_path / "o") == 0
    alignment = json.loads(capsys.readouterr().out)["alignment"]
    assert alignment["requested"] == "recommended"
    assert ("experts" in alignment["symmetries"]) is has_experts, alignment
    assert {"attn", "ffn" if family == "llama" else "attn", "residual"} <= set(alignment["symmetries"]), alignment
    assert not (tmp_path / "o").exists()


def test_print_plan_says_why_nothing_is_aligned(tmp_path, capsys):
    _pair(tmp_path, "qwen2_moe", mlp_only_layers=[1])
    capsys.readouterr()
    assert run_cli("merge", tmp_path / "a", tmp_path / "b", "--method", "average", "--print-plan",
                   "-o", tmp_path / "o") == 0
    alignment = json.loads(capsys.readouterr().out)["alignment"]
    assert alignment["symmetries"] == [] and "do not hold" in alignment["note"], alignment


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    return _pair(tmp_path_factory.mktemp("plans"), "llama")


def _printed(capsys, *argv) -> dict:
    capsys.readouterr()
    assert run_cli(*argv, "--print-plan") == 0
    return json.loads(capsys.readouterr().out)


def test_a_streamed_merge_prints_what_it_aligns(llamas, tmp_path, capsys):
    """A streamed merge printed ``residual`` and ran without it (only the per-layer groups stream); the report's
    symmetries are now the printed ones."""
    argv = ("merge", llamas / "a", llamas / "b", "--method", "average", "--mode", "stream", "-o", tmp_path / "o")
    printed = _printed(capsys, *argv)["alignment"]["symmetries"]
    assert "residual" not in printed and {"heads", "attn", "ffn"} <= set(printed), printed
    assert run_cli(*argv, "--progress", "none") == 0
    report = json.loads((tmp_path / "o" / "symmerge_report.json").read_text())
    assert report["alignment"]["symmetries"] == printed


def test_an_explicit_residual_that_cannot_stream_is_refused_by_the_plan(llamas, tmp_path, capsys):
    """``--print-plan`` exited 0 for what the run refuses."""
    capsys.readouterr()
    assert run_cli("merge", llamas / "a", llamas / "b", "--method", "average", "--align", "heads,residual",
                   "--mode", "stream", "-o", tmp_path / "o", "--print-plan") == 2
    assert "cannot be streamed" in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_an_aligned_config_prints_the_resolved_symmetries(llamas, tmp_path, capsys, mode):
    """``run --print-plan`` printed 'recommended' unresolved: ``experts`` on a Llama, ``residual`` when streamed."""
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {llamas / 'a'}\n    parameters: {{weight: 1}}\n"
                      f"  - model: {llamas / 'b'}\n    parameters: {{weight: 1}}\nalign: recommended\nmode: {mode}\n")
    (document,) = _printed(capsys, "run", config, tmp_path / "o")["documents"]
    printed = document["alignment"]["symmetries"]
    assert "experts" not in printed and ("residual" in printed) is (mode == "memory"), printed
