"""``--residual largest|permutation`` in every family: the element the stream gets (a dense orthogonal
matrix, or a permutation — signed for RMSNorm, which commutes with sign flips — of the hidden dims),
every stream member moved exactly by it, the function kept, and the report naming the group used."""

from __future__ import annotations

import pytest
import torch

from conftest import make_inputs, output_rel_diff, sq_dist, with_weights
from factories import FAMILIES, INPUT_NORMS, PRE_LAYERNORM, RMSNORM, TIED_FINAL_NORM, WRITER_NORMS, make_model
from symmerge.core.apply import apply, random_elements
from symmerge.core.slots import unit_matrix
from symmerge.groups.residual import StreamElement
from symmerge.pipeline.align import align_pair, instances_for
from symmerge.pipeline.options import AlignOptions

pytestmark = pytest.mark.usefixtures("single_thread")  # no thread count checked here; 2-3x faster on 2 loaded cores


def expected_variant(family: str, residual: str) -> str:
    if family in WRITER_NORMS:  # random (non-uniform) output norms allow no rotation of the stream
        return "signed_permutation"
    if family in INPUT_NORMS:  # so does a random norm on the embeddings' sum
        return "permutation"
    if family in TIED_FINAL_NORM:  # and a random final norm before a tied LM head
        return "signed_permutation"
    if family in RMSNORM:
        return "orthogonal" if residual == "largest" else "signed_permutation"
    if family in PRE_LAYERNORM and residual == "largest":
        return "centered"
    return "permutation"  # post-LN LayerNorm (largest group), or any LayerNorm with --residual permutation


def stream_matrix(element, d: int) -> torch.Tensor:
    """The element as a d × d matrix M with new unit j = Σ_i M[j, i] old unit i."""
    if element.Q is not None:
        return element.Q.double().T
    M = torch.zeros(d, d, dtype=torch.float64)
    M[torch.arange(d), element.perm] = 1.0 if element.signs is None else element.signs.double()
    return M


def is_signed_permutation_matrix(M: torch.Tensor, signed: bool) -> bool:
    entries = M[M != 0]
    one_per_row = bool(((M != 0).sum(0) == 1).all() and ((M != 0).sum(1) == 1).all())
    values = bool((entries.abs() == 1).all()) and (signed or bool((entries == 1).all()))
    return one_per_row and values


@pytest.mark.parametrize("residual", ["largest", "permutation"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gets_the_stream_group_it_asks_for(family, residual, fp64_rmsnorm):
    model, anchor = make_model(family, head=True, seed=0), make_model(family, head=True, seed=1)
    res = align_pair(model, anchor, AlignOptions(symmetries=("residual",), residual=residual))
    variant = expected_variant(family, residual)
    rep = res.report
    assert rep["residual_variant"] == variant
    inst = next(i for i in res.instances if i.group.symmetry == "residual")
    M = stream_matrix(res.elements[inst.name], inst.size)
    assert torch.allclose(M @ M.T, torch.eye(inst.size, dtype=torch.float64), atol=1e-9)
    if variant in ("orthogonal", "centered"):  # dense: far from any signed permutation
        assert not is_signed_permutation_matrix(M, signed=True)
        assert int((M.abs() > 1e-6).sum()) > 2 * inst.size
        assert rep["norms_folded"] and rep["residual_group"].startswith("O(d")
    else:
        assert is_signed_permutation_matrix(M, signed=variant == "signed_permutation")
        assert not rep["norms_folded"] and "permutations" in rep["residual_group"]
        if variant == "signed_permutation":
            assert rep["residual_group"].startswith("signed permutations")
        else:
            assert rep["residual_group"].startswith("S_d")
        # every member of the stream (embeddings first) is moved exactly: rows re-indexed, signs only
        sd_a, sd_out = model.state_dict(), res.model.state_dict()
        shared = {s.key for i in res.instances if not i.kind.per_layer and i is not inst for s in i.slots}
        members = [s for s in inst.slots if not s.diag and s.key not in shared]  # CLIP's projections: two groups
        assert members
        for s in members:
            before, after = unit_matrix(sd_a[s.key], s).double(), unit_matrix(sd_out[s.key], s).double()
            assert torch.equal(after, M @ before), s.key
        for s in inst.slots:  # norm weights: permuted, never sign-flipped
            if s.diag:
                before, after = unit_matrix(sd_a[s.key], s).double(), unit_matrix(sd_out[s.key], s).double()
                assert torch.equal(after, M.abs() @ before), s.key
    assert rep["verify_max_rel_diff"] < 1e-9
    assert output_rel_diff(model, res.model, make_inputs(model)) < 1e-9


@pytest.mark.parametrize("family", sorted(RMSNORM))
def test_rmsnorm_permutation_is_signed_and_the_signs_are_used(family, fp64_rmsnorm):
    """RMSNorm families: a hidden signed permutation of the anchor is undone exactly (signs included);
    the solved permutation without its signs leaves the model far from the anchor."""
    anchor = make_model(family, head=True, seed=0)
    _, instances = instances_for(anchor, residual="permutation")
    wide = [i for i in instances if i.group.symmetry == "residual"]
    el = random_elements(wide, torch.Generator().manual_seed(4), scale=False)
    (name, hidden), = el.items()
    assert hidden.signs is not None and bool((hidden.signs < 0).any())
    model = with_weights(anchor, apply(anchor.state_dict(), wide, el))
    assert output_rel_diff(anchor, model, make_inputs(anchor)) < 1e-9
    res = align_pair(model, anchor, AlignOptions(symmetries=("residual",), residual="permutation"))
    assert res.report["distance_after"] < 1e-9 * res.report["distance_before"]
    solved = res.elements[name]
    assert bool((solved.signs < 0).any())
    unsigned = apply(model.state_dict(), wide, {name: StreamElement(perm=solved.perm)})
    keys = [k for k, v in anchor.state_dict().items() if v.is_floating_point()]
    assert sq_dist(unsigned, anchor.state_dict(), keys) > 0.01 * res.report["distance_before"] ** 2


@pytest.mark.parametrize("family", sorted(PRE_LAYERNORM))
def test_layernorm_permutation_takes_no_signs(family):
    """The control: sign flips of a LayerNorm stream change the function (mean-centring does not commute
    with them), so --residual permutation gives LayerNorm families plain permutations."""
    anchor = make_model(family, head=True, seed=0)
    _, instances = instances_for(anchor, residual="permutation")
    wide = [i for i in instances if i.group.symmetry == "residual"]
    d = wide[0].size
    perm = torch.randperm(d, generator=torch.Generator().manual_seed(2))
    signs = torch.ones(d, dtype=torch.float64)
    signs[::3] = -1
    inputs = make_inputs(anchor)
    plain = with_weights(anchor, apply(anchor.state_dict(), wide, {wide[0].name: StreamElement(perm=perm)}))
    assert output_rel_diff(anchor, plain, inputs) < 1e-9
    signed = with_weights(anchor, apply(anchor.state_dict(), wide,
                                        {wide[0].name: StreamElement(perm=perm, signs=signs)}))
    assert output_rel_diff(anchor, signed, inputs) > 1e-3
