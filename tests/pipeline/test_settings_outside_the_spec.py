"""A model whose settings its family's symmetries do not hold for (Qwen2-MoE / Qwen3-MoE with dense layers among
the sparse ones, Phi with qk_layernorm) was refused by the default ``merge`` ('recommended'), which merges a model
type without a spec plainly, with a note. Now 'recommended' reads those settings from config.json
(``Spec.unsupported_settings``) and merges without alignment, with the note, in both modes, in a config's aligned
merge and in ``barrier`` (its plain curve); an explicit symmetry list stays one error."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from factories import make_model


@pytest.fixture(scope="module", params=["qwen2_moe", "qwen3_moe", "phi"])
def pair(tmp_path_factory, request):
    family = request.param
    setting = {"phi": {"qk_layernorm": True}}.get(family, {"mlp_only_layers": [1]})
    root = tmp_path_factory.mktemp(family)
    for name, seed in (("a", 0), ("b", 1)):
        make_model(family, head=True, dtype=torch.float32, seed=seed, **setting).save_pretrained(root / name)
    return root, family


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_recommended_merges_without_alignment_with_a_note(pair, tmp_path, capsys, mode):
    root, family = pair
    out = tmp_path / "o"
    assert run_cli("merge", root / "a", root / "b", "--method", "average", "--mode", mode, "--progress", "none",
                   "-o", out) == 0
    err = capsys.readouterr().err
    assert f"note: 'recommended' aligns nothing: the {family} family's symmetries do not hold" in err, err
    alignment = json.loads((out / "symmerge_report.json").read_text())["alignment"]
    assert alignment["symmetries"] == [] and "do not hold" in alignment["note"]


def test_an_explicit_list_is_one_error(pair, tmp_path, capsys):
    root, family = pair
    rc = run_cli("merge", root / "a", root / "b", "--method", "average", "--align", "attn", "--progress", "none",
                 "-o", tmp_path / "o")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "are not supported" in err, err
    assert not (tmp_path / "o").exists()


def test_a_config_and_barrier_read_the_same_rule(pair, tmp_path, capsys):
    from conftest import npz_file
    from symmerge.merge.barrier import BarrierOptions, plan_barrier

    root, family = pair
    plan = plan_barrier([str(root / "a"), str(root / "b")], str(npz_file(tmp_path / "d.npz", n=4)), BarrierOptions())
    assert [a.name for a in plan.arms] == ["none"] and "do not hold" in plan.arms[0].note
    # dense layers among sparse ones merge in place (a config refused them: 'layers of one template')
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {root / 'a'}\n    parameters: {{weight: 0.5}}\n"
                      f"  - model: {root / 'b'}\n    parameters: {{weight: 0.5}}\nalign: recommended\n"
                      f"dtype: float32\n")
    assert run_cli("run", config, tmp_path / "o", "--progress", "none") == 0, capsys.readouterr().err
    assert "do not hold" in json.loads((tmp_path / "o" / "symmerge_report.json").read_text())["alignment"]["note"]
