"""One mixture of experts stored in two layouts: a tensor per expert (``save_pretrained``'s) and the experts fused
(transformers 5's in-memory tensors saved as they are). The streamed merge reads tensors as stored, so it cannot
pair them; it said "architectures differ", which they do not. One line now names both layouts and the ways out,
and the way out it names (``--mode memory``) merges them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from conftest import run_cli, save_folder
from factories import make_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    import shutil

    root = tmp_path_factory.mktemp("experts")
    per, other = (save_folder(make_model("olmoe", head=True, seed=s), root / name) for s, name in ((0, "per"),
                                                                                                  (1, "other")))
    fused = root / "fused"
    shutil.copytree(other, fused)
    (fused / "model.safetensors").unlink()
    model = make_model("olmoe", head=True, seed=1).to(torch.float32)
    sd = model.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in sd)  # transformers' fused in-memory tensors
    save_file({k: v.clone() for k, v in sd.items()}, str(fused / "model.safetensors"), metadata={"format": "pt"})
    return per, fused


@pytest.mark.parametrize("order", ["per-first", "fused-first"])
def test_a_streamed_merge_names_the_two_layouts(pair, tmp_path, capsys, order):
    per, fused = pair
    models = (per, fused) if order == "per-first" else (fused, per)
    capsys.readouterr()
    assert run_cli("merge", *models, "--method", "average", "--align", "none", "--mode", "stream",
                   "--progress", "none", "-o", tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "architectures differ" not in err, err
    assert (f"{per} stores its experts one tensor per expert" in err and f"{fused} fused over the experts" in err
            and "--mode memory" in err), err
    assert not (tmp_path / "out").exists()


def test_the_way_out_merges_them(pair, tmp_path):
    per, fused = pair
    assert run_cli("merge", per, fused, "--method", "average", "--align", "none", "--mode", "memory",
                   "--progress", "none", "-o", tmp_path / "out") == 0


def test_other_differences_still_say_architectures_differ():
    from symmerge.core.layout import Layout, check_layouts
    from symmerge.errors import SymmergeError

    a = Layout("a", "olmoe", 4, {"model.layers.0.mlp.experts.0.up_proj.weight": (4, 4), "x": (1,)})
    b = Layout("b", "olmoe", 4, {"model.layers.0.mlp.experts.gate_up_proj": (2, 8, 4), "y": (1,)})
    with pytest.raises(SymmergeError, match="architectures differ"):
        check_layouts([a, b])


def test_a_config_names_the_fused_layout_too(pair, tmp_path, capsys):
    """``symmerge run`` said only "model 'fused' has no tensor '...experts.0.down_proj.weight'"."""
    per, fused = pair
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: linear\nmodels:\n  - model: {per}\n    parameters: {{weight: 1}}\n"
                      f"  - model: {fused}\n    parameters: {{weight: 1}}\n")
    capsys.readouterr()
    assert run_cli("run", config, tmp_path / "o", "--progress", "none") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no tensor" in err and "stores its experts fused" in err, err
    assert not (tmp_path / "o").exists()
