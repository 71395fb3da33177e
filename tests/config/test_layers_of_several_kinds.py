"""Layers of several kinds in one checkpoint: Qwen2-MoE with ``mlp_only_layers`` (a dense FFN among mixtures of
experts). Every config over such models was refused, 'layer 1 has different tensors than layer 0 ...: slices and
gradients need layers of one template', a plain ``models:`` list included, which ``merge --method`` merges (mergekit
0.1.5 writes such a merge without the experts: 43 of 67 tensors). Now each layer is merged where it is: a plain
config gives ``merge``'s tensors bit for bit, slices and gradients that keep every layer in its place merge, and a
slice that puts a sparse layer where the config written says dense (or back) is one error naming the layer."""

from __future__ import annotations

import pytest
import torch

from conftest import folder_tensors, run_cli
from factories import make_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    for name, seed in (("base", 0), ("ft1", 1), ("ft2", 2)):
        make_model("qwen2_moe", head=True, dtype=torch.float32, seed=seed,
                   mlp_only_layers=[1]).save_pretrained(root / name)
    return root


def _write(path, text: str):
    path.write_text(text)
    return path


def test_a_plain_config_is_merges_bits(family, tmp_path):
    config = _write(tmp_path / "c.yml", f"merge_method: ties\nbase_model: {family / 'base'}\nmodels:\n"
                    f"  - model: {family / 'ft1'}\n    parameters: {{weight: 1.0, density: 0.5}}\n"
                    f"  - model: {family / 'ft2'}\n    parameters: {{weight: 1.0, density: 0.5}}\n")
    assert run_cli("run", config, tmp_path / "run", "--progress", "none") == 0
    assert run_cli("merge", family / "ft1", family / "ft2", "--base", family / "base", "--method", "ties",
                   "--param", "density=0.5", "--progress", "none", "-o", tmp_path / "merge") == 0
    a, b = folder_tensors(tmp_path / "run"), folder_tensors(tmp_path / "merge")
    assert set(a) == set(b) == set(folder_tensors(family / "ft1"))
    assert any(".layers.1.mlp.gate_proj" in k for k in a) and any(".layers.0.mlp.experts.0." in k for k in a)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []


def test_slices_and_gradients_that_keep_layers_in_place_merge(family, tmp_path):
    sliced = _write(tmp_path / "s.yml", f"merge_method: passthrough\nslices:\n  - sources:\n"
                    f"      - model: {family / 'ft1'}\n        layer_range: [0, 1]\n  - sources:\n"
                    f"      - model: {family / 'ft2'}\n        layer_range: [1, 2]\n")
    assert run_cli("run", sliced, tmp_path / "s", "--progress", "none") == 0
    out, one, two = folder_tensors(tmp_path / "s"), folder_tensors(family / "ft1"), folder_tensors(family / "ft2")
    assert set(out) == set(one)
    # layer 1 and the tensors after the layers (final norm, head) from the last slice, as mergekit's post_weights
    last = [k for k in out if ".layers.1." in k or (".layers." not in k and "embed" not in k)]
    assert all(torch.equal(v, (two if k in last else one)[k]) for k, v in out.items())
    graded = _write(tmp_path / "g.yml", f"merge_method: slerp\nbase_model: {family / 'ft1'}\nparameters:\n"
                    f"  t: [0, 1]\nmodels:\n  - model: {family / 'ft1'}\n  - model: {family / 'ft2'}\n")
    assert run_cli("run", graded, tmp_path / "g", "--progress", "none") == 0
    assert set(folder_tensors(tmp_path / "g")) == set(one)


@pytest.mark.parametrize("layer_range", [[1, 2], [0, 1, 0, 1]])
def test_a_slice_that_moves_a_layer_of_another_kind_is_one_error(family, tmp_path, capsys, layer_range):
    if len(layer_range) == 2:
        sources = f"  - sources:\n      - model: {family / 'ft1'}\n        layer_range: {layer_range}\n"
    else:  # the sparse layer 0 twice: the second where the config written has the dense layer 1
        sources = "".join(f"  - sources:\n      - model: {family / 'ft1'}\n        layer_range: [{a}, {b}]\n"
                          for a, b in zip(layer_range[::2], layer_range[1::2]))
    config = _write(tmp_path / "m.yml", f"merge_method: passthrough\nslices:\n{sources}")
    capsys.readouterr()
    assert run_cli("run", config, tmp_path / "o", "--progress", "none") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds other tensors" in err and "layers of one template" in err, err
    assert not (tmp_path / "o").exists()


def test_a_uniform_stack_has_no_layer_kinds(tmp_path):
    from symmerge.config.layout import layer_kind, read_layout

    make_model("llama", head=True, dtype=torch.float32).save_pretrained(tmp_path / "l")
    lay = read_layout(tmp_path / "l")
    assert lay.layer_sets == () and lay.optional == () and layer_kind(lay, 0) == frozenset(lay.suffixes)
    assert layer_kind(lay, lay.layers) is None
