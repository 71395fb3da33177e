"""Density 0 (DARE's drop 1) drops that model's task vector, as mergekit's sparsifiers do (their branch before any
ranking, Bernoulli draw or DELLA's epsilon check): every task-vector method takes it, every model at 0 gives the base,
and a model at 0 among others adds nothing (its zero task vector joins the sign election and, where the divisor is
the agreeing weights, leaves it) — on every path of the rule: the float32 kernel, symmerge's own weight-first
variants, the half-precision kernels and the torch code. symmerge refused density 0 before (`(0.0, 1.0]`)."""

from __future__ import annotations

import pytest
import torch

from symmerge.errors import SymmergeError
from symmerge.merge import get_method

# method -> its parameters at density 0 (mergekit's names; DARE's density is 1 − drop)
METHODS = {"ties": {}, "dare_ties": {}, "dare_linear": {}, "della": {"epsilon": 0.1},
           "della_linear": {"epsilon": 0.1}, "breadcrumbs_ties": {"gamma": 0.05}}
SHAPES = {"w": (12, 20), "b": (20,), "e": (3, 4, 5)}  # DELLA on 3 dimensions takes the torch code


def _family(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = {k: torch.randn(s, generator=g) for k, s in SHAPES.items()}
    models = [{k: (v + 0.01 * torch.randn(v.shape, generator=g)) for k, v in base.items()} for _ in range(2)]
    cast = (lambda sd: {k: v.to(dtype) for k, v in sd.items()})
    return [cast(m) for m in models], cast(base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_density_zero_everywhere_gives_the_base(name, dtype):
    models, base = _family(dtype)
    merged = get_method(name).merge(models, weights=[0.6, 0.9], base=base, density=0.0, **METHODS[name])
    for k in base:
        assert merged[k].dtype == dtype
        assert torch.equal(merged[k], base[k]), (name, dtype, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_a_model_at_density_zero_adds_nothing(name, dtype):
    """(A, B) with B's density 0 is A alone at A's weight, bit for bit (the default ``normalize``: TIES divides
    by the agreeing weights, B's zero task vector agrees nowhere; the DARE/DELLA sums are not divided)."""
    models, base = _family(dtype, seed=1)
    method = get_method(name)
    params = METHODS[name]
    pair = method.merge(models, weights=[0.6, 0.9], base=base, density=[0.5, 0.0], **params)
    alone = method.merge(models[:1], weights=[0.6], base=base, density=[0.5], **params)
    changed = 0
    for k in base:
        assert torch.equal(pair[k], alone[k]), (name, dtype, k)
        changed += int((pair[k] != base[k]).sum())
    assert changed > 0  # A's task vector is there: not the base


@pytest.mark.parametrize("variant", [{"scope": "model"}, {"scope": "tensor"}, {"normalize": "count"},
                                     {"rescale": True}])
def test_ties_variants_at_density_zero_give_the_base(variant):
    """symmerge's own TIES variants (a model-wide or per-tensor threshold, the disjoint mean, the L1 rescale)."""
    models, base = _family(torch.float32, seed=2)
    merged = get_method("ties").merge(models, weights=[0.6, 0.9], base=base, density=0.0, **variant)
    assert all(torch.equal(merged[k], base[k]) for k in base)


@pytest.mark.parametrize("rescale", ["inverse", True, False])
def test_dare_drop_one_gives_the_base(rescale):
    """symmerge's ``dare`` (``drop``, its 1/(1 − drop) rescale by default): drop 1 leaves nothing to rescale."""
    models, base = _family(torch.float32, seed=3)
    merged = get_method("dare").merge(models, weights=[0.6, 0.9], base=base, drop=1.0, rescale=rescale)
    assert all(torch.equal(merged[k], base[k]) for k in base)


@pytest.mark.parametrize("name, params", [("ties", {"density": -0.1}), ("ties", {"density": 1.5}),
                                          ("dare_ties", {"density": -0.1}), ("dare", {"drop": 1.01}),
                                          ("della", {"density": 0.05, "epsilon": 0.1})])
def test_outside_the_range_still_refused(name, params):
    models, base = _family(torch.float32)
    with pytest.raises(SymmergeError):
        get_method(name).merge(models, weights=[0.6, 0.9], base=base, **params)


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_the_command_line_takes_density_zero(mode, tmp_path):
    """``symmerge merge --method dare_ties --param density=0`` in memory and streamed: the base's tensors."""
    from conftest import run_cli, save_folder
    from factories import make_model
    from safetensors.torch import load_file

    folders = []
    for i in range(3):
        m = make_model("llama", dtype=torch.float32, seed=0)
        if i:
            with torch.no_grad():
                for p in m.parameters():
                    p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
        folders.append(save_folder(m, tmp_path / f"m{i}"))
    out = tmp_path / "out"
    assert run_cli("merge", str(folders[1]), str(folders[2]), "--base", str(folders[0]), "--method", "dare_ties",
                   "--param", "density=0", "--align", "none", "--mode", mode, "-o", str(out), "-q") == 0
    merged, base = load_file(out / "model.safetensors"), load_file(folders[0] / "model.safetensors")
    assert merged.keys() == base.keys() and all(torch.equal(merged[k], base[k]) for k in base)
