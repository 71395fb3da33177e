"""mergekit's methods through ``symmerge merge``: one model with a base (slerp, task arithmetic), one model alone, an
optional base (nuslerp), negative task weights; in memory and streamed, the same bits, equal to the method's rule on
the tensors."""

from __future__ import annotations

import pytest
import torch

from mergekit_oracle import family, tensors
from symmerge.cli import main
from symmerge.merge import get_method


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return family(tmp_path_factory.mktemp("fam"), "llama", "float32", n=2, layers=2)


def _merge(tmp_path, name, *argv) -> dict:
    out = tmp_path / name
    assert main(["merge", *map(str, argv), "--align", "none", "--progress", "none", "-o", str(out)]) == 0
    return tensors(out)


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_slerp_of_one_model_and_its_base(fam, tmp_path, mode):
    base, (ft1, _) = fam
    got = _merge(tmp_path, mode, ft1, "--base", base, "--method", "slerp", "--param", "t=0.3", "--mode", mode)
    b, a = tensors(base), tensors(ft1)
    want = get_method("slerp").merge([a], base=b, t=0.3)
    for k, v in want.items():
        assert torch.equal(got[k], v.to(got[k].dtype)), k
    k = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(got[k], b[k]) and not torch.equal(got[k], a[k])  # it moved between the two


def test_slerp_memory_equals_stream(fam, tmp_path):
    base, (ft1, _) = fam
    runs = [_merge(tmp_path, mode, ft1, "--base", base, "--method", "slerp", "--param", "t=0.7", "--mode", mode)
            for mode in ("memory", "stream")]
    assert runs[0].keys() == runs[1].keys()
    assert all(torch.equal(runs[0][k], runs[1][k]) for k in runs[0])


def test_nuslerp_takes_an_optional_base(fam, tmp_path):
    base, fts = fam
    got = _merge(tmp_path, "nu", *fts, "--base", base, "--method", "nuslerp")
    want = get_method("nuslerp").merge([tensors(f) for f in fts], base=tensors(base))
    for k, v in want.items():
        assert torch.equal(got[k], v.to(got[k].dtype)), k


def test_negative_task_weight_subtracts_a_task(fam, tmp_path):
    base, fts = fam
    got = _merge(tmp_path, "neg", *fts, "--base", base, "--method", "task_arithmetic", "--weights", "1,-1")
    b, x, y = tensors(base), tensors(fts[0]), tensors(fts[1])
    k = "model.layers.1.self_attn.q_proj.weight"
    assert torch.allclose(got[k].double(), (b[k].double() + (x[k].double() - b[k]) - (y[k].double() - b[k])),
                          atol=1e-6)


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_one_model_merges_as_a_config_of_one_model(fam, tmp_path, mode):
    """``--method X`` takes the models ``merge_method: X`` takes (and mergekit): one model too. Before, the command
    refused one model ("merge needs at least two models") that the same method in a config merged."""
    base, (ft1, _) = fam
    (tmp_path / "ta.yml").write_text(f"models:\n  - model: {ft1}\n    parameters: {{weight: 0.5}}\n"
                                     f"base_model: {base}\nmerge_method: task_arithmetic\ndtype: float32\n")
    (tmp_path / "lin.yml").write_text(f"models:\n  - model: {ft1}\nmerge_method: linear\n"
                                      "parameters: {weight: 1.0}\ndtype: float32\n")
    for name, argv in (("ta", ["--base", base, "--method", "task_arithmetic", "--weights", "0.5"]),
                       ("lin", ["--method", "linear"])):
        got = _merge(tmp_path, f"{name}-{mode}", ft1, *argv, "--mode", mode)
        assert main(["run", str(tmp_path / f"{name}.yml"), str(tmp_path / f"{name}-run"), "--progress", "none"]) == 0
        want = tensors(tmp_path / f"{name}-run")
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got), name
    b, a, k = tensors(base), tensors(ft1), "model.layers.1.self_attn.q_proj.weight"
    assert torch.allclose(tensors(tmp_path / f"ta-{mode}")[k], b[k] + 0.5 * (a[k] - b[k]), atol=1e-6)
    assert all(torch.equal(got[k], a[k]) for k in a)  # one model averaged: the model itself


def test_negative_weights_of_an_average_are_refused(fam, tmp_path, capsys):
    base, fts = fam
    out = tmp_path / "negavg"
    assert main(["merge", *map(str, fts), "--method", "average", "--align", "none", "--weights", "1,-1",
                 "-o", str(out)]) == 2
    assert "non-negative" in capsys.readouterr().err and not out.exists()


def test_a_base_for_linear_says_how_a_config_reads_it(fam, tmp_path, capsys):
    """``--base`` with linear (mergekit's method without a base) is refused, saying what a config's base_model is for
    it: one more merged model, which the command takes among the models."""
    base, (ft1, _) = fam
    out = tmp_path / "lin"
    assert main(["merge", str(ft1), "--base", str(base), "--method", "linear", "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "does not use a base model (a config's base_model is merged as one more model: list it among the models)" \
        in err and not out.exists()
