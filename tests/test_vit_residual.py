"""ViT's residual stream (LayerNorm): one permutation of the hidden dims across the whole model —
embeddings, every reader's columns, every writer's rows and biases, every LayerNorm's γ and β and the
classifier. Exact function preservation on the real transformers class, recovery of a hidden one by
alignment, the solver against brute force, and a negative control (a rotation is not a symmetry)."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import add_noise, make_inputs, make_model, output_rel_diff, sq_dist, with_weights
from symmerge.align import align, instances_for
from symmerge.apply import HeadElement, apply, haar, random_elements
from symmerge.errors import SymmergeError
from symmerge.solvers.residual import permutation_residual

pytestmark = pytest.mark.usefixtures("single_thread")
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def residual_of(model):
    _, instances = instances_for(model)
    return [i for i in instances if i.group.kind == "residual"], instances


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_random_residual_permutation_preserves_outputs(dtype):
    model = make_model("vit", head=True, dtype=dtype)
    (res,), instances = residual_of(model)
    assert res.variant == "permutation" and res.size == model.config.hidden_size
    keys = {s.key for s in res.slots}
    assert {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings", "vit.layernorm.bias",
            "vit.layers.1.layernorm_after.weight", "vit.layers.0.mlp.fc2.bias", "classifier.weight"} <= keys
    x = make_inputs(model)
    for seed in (0, 1):
        el = random_elements(instances, torch.Generator().manual_seed(seed))
        new = apply(model.state_dict(), instances, el)  # every group at once, the residual included
        assert all(not torch.equal(new[k], model.state_dict()[k]) for k in keys if model.state_dict()[k].numel() > 1)
        assert output_rel_diff(model, with_weights(model, new), x) <= TOL[dtype]


def test_rotation_of_the_stream_breaks_layernorm():
    """Negative control: an orthogonal Q on every stream tensor (LayerNorm parameters left alone, as
    for RMSNorm after folding) changes a LayerNorm model's function (mean-centring does not commute)."""
    import dataclasses

    model = make_model("vit", head=True)
    (res,), _ = residual_of(model)
    dense = dataclasses.replace(res, slots=tuple(s for s in res.slots if not s.diag), variant="orthogonal")
    Q = haar(1, res.size, torch.Generator().manual_seed(0))
    new = apply(model.state_dict(), [dense], {res.name: HeadElement(Q, torch.ones(1, dtype=torch.float64))})
    assert output_rel_diff(model, with_weights(model, new), make_inputs(model)) > 1e-2


def test_base_model_has_no_residual_group():
    model = make_model("vit", head=False)
    assert residual_of(model)[0] == []
    with pytest.raises(SymmergeError, match="residual"):
        align(model, make_model("vit", head=False, seed=1), ("attn", "residual"))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_alignment_recovers_a_hidden_residual_permutation(dtype):
    b = make_model("vit", head=True, dtype=dtype, seed=0)
    _, instances = instances_for(b)
    el = random_elements(instances, torch.Generator().manual_seed(7))
    noisy, noise = add_noise(apply(b.state_dict(), instances, el), 0.01, seed=8)
    a = with_weights(b, noisy)
    aligned, rep = align(a, b, ("attn", "ffn", "rescale", "residual"))
    assert rep["residual_variant"] == "permutation"
    assert rep["distance_after"] == pytest.approx(noise, rel=0.2)  # the hidden element is undone
    without, rep0 = align(a, b, ("attn", "ffn", "rescale"))
    assert rep0["distance_after"] > 5 * rep["distance_after"]
    assert output_rel_diff(a, aligned, make_inputs(a)) <= 1e-4


def test_permutation_residual_equals_brute_force():
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        C, D = torch.randn(5, 5, generator=g, dtype=torch.float64), torch.randn(5, 5, generator=g, dtype=torch.float64)
        Q = permutation_residual(C, D)
        best = max(sum(C[p[j], j] + D[p[j], j] for j in range(5)).item() for p in itertools.permutations(range(5)))
        assert torch.trace(Q.T @ (C + D)).item() == pytest.approx(best, rel=1e-12)
        assert torch.equal(Q.sum(0), torch.ones(5)) and torch.equal(Q.sum(1), torch.ones(5))
