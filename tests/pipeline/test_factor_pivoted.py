"""The activation start's factorisation above ``activations.PIVOTED_FROM`` (issue 42, item 6): a pivoted Cholesky
(LAPACK ``dpstrf``) of rank r instead of ``eigh``. The factor reproduces the Gram to float64 rounding (full rank,
low rank, exactly rank-deficient, indefinite by rounding, zero), the threshold picks the path, and the solvers
read the same statistics from it: an FFN assignment equal to the brute-force optimum, hidden elements recovered
exactly, the same elements as from ``eigh`` on a generic pair, and the activation start function-preserving on a
Llama in float32 and float64 with the threshold forced low (whole pass and by layer)."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import make_inputs, output_rel_diff, with_weights
from factories import disguised, make_model
from symmerge.core.apply import apply
from symmerge.errors import SymmergeError
from symmerge.io.data import Batch, Data
from symmerge.pipeline import activations
from symmerge.pipeline.activations import factor, match_activations
from symmerge.pipeline.align import align_pair, instances_for
from symmerge.pipeline.options import AlignOptions
from test_activations import ALL, canonical_pair, max_error, unlabeled

pytestmark = pytest.mark.usefixtures("single_thread")

LOCAL = ("heads", "attn", "ffn", "rescale")


@pytest.fixture
def pivoted(monkeypatch):
    """Every Gram factored by the pivoted Cholesky; the list of (n, rank) of each call."""
    calls = []
    real = activations.pivoted_cholesky

    def spy(sym, f):
        la, lb = real(sym, f)
        calls.append((sym.shape[0], la.shape[1]))
        return la, lb
    monkeypatch.setattr(activations, "PIVOTED_FROM", 0)
    monkeypatch.setattr(activations, "pivoted_cholesky", spy)
    return calls


def low_rank_gram(n: int, rank: int, seed: int = 0) -> torch.Tensor:
    """Σ_t z_t z_tᵀ over ``rank`` random activations scaled unevenly per feature (as a layer's would be)."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(rank, n, generator=g, dtype=torch.float64) * torch.logspace(-2, 1, n, dtype=torch.float64)
    return z.T @ z


def blocks_error(gram: torch.Tensor, la: torch.Tensor, lb: torch.Tensor) -> float:
    """The largest error of ``L_a L_bᵀ``, ``L_a L_aᵀ``, ``L_b L_bᵀ`` against the Gram's blocks, relative to its
    largest entry."""
    f = la.shape[0]
    got = [la @ lb.T, la @ la.T, lb @ lb.T]
    want = [gram[:f, f:], gram[:f, :f], gram[f:, f:]]
    return max((x - y).abs().max().item() for x, y in zip(got, want)) / gram.abs().max().item()


@pytest.mark.parametrize("n,rank", [(96, 20), (96, 96), (96, 300), (200, 7), (64, 1)])
def test_pivoted_factor_has_the_grams_products_and_its_rank(monkeypatch, n, rank):
    gram = low_rank_gram(n, rank)
    before = gram.clone()
    monkeypatch.setattr(activations, "PIVOTED_FROM", n)  # n ≥ threshold: pivoted
    la, lb = factor(gram)
    assert torch.equal(gram, before)  # the input is not modified
    assert la.shape == lb.shape == (n // 2, min(rank, n))  # n × rank: the rank found
    assert blocks_error(gram, la, lb) < 1e-13
    monkeypatch.setattr(activations, "PIVOTED_FROM", n + 1)  # n below the threshold: eigh, as before
    ea, eb = factor(gram)
    assert ea.shape == (n // 2, n) and blocks_error(gram, ea, eb) < 1e-13
    # the two factors differ by an orthogonal map on the right: the same products
    assert (la @ lb.T - ea @ eb.T).abs().max().item() < 1e-12 * gram.abs().max().item()


def test_exactly_rank_deficient_gram_with_duplicated_zero_and_scaled_columns(pivoted):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(40, 6, generator=g, dtype=torch.float64)
    b = torch.cat([a[:, [2, 0]], 3 * a[:, [1]], torch.zeros(40, 1, dtype=torch.float64), a[:, :2] + a[:, 2:4]], 1)
    joint = activations.Joint.empty(6)
    joint.add(a, b)  # 12 columns of rank 6: B's are copies, multiples and sums of A's, one is zero
    la, lb = factor(joint.gram)
    assert pivoted == [(12, 6)]
    torch.testing.assert_close(la @ lb.T, a.T @ b, atol=1e-12, rtol=0)
    torch.testing.assert_close(la @ la.T, a.T @ a, atol=1e-12, rtol=0)
    torch.testing.assert_close(lb @ lb.T, b.T @ b, atol=1e-12, rtol=0)
    # the correlations too (the FFN units' statistic: rank 6 still, the zero column's correlations are 0)
    corr = joint.correlation()
    ca, cb = factor(corr)
    assert pivoted[-1] == (12, 6)
    assert blocks_error(corr, ca, cb) < 1e-13 and cb[3].abs().max().item() == 0.0


def test_indefinite_by_rounding_and_zero_grams(pivoted):
    gram = low_rank_gram(80, 10, seed=2)
    lam, V = torch.linalg.eigh(gram)
    lam[:70] = -1e-14 * lam.max() * torch.rand(70, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    rounded = (V * lam) @ V.T  # rank 10 with 70 eigenvalues just below 0, as a sum of rounded products can be
    rounded = (rounded + rounded.T) / 2
    la, lb = factor(rounded)
    assert pivoted[-1] == (80, 10) and blocks_error(rounded, la, lb) < 1e-12
    za, zb = factor(torch.zeros(10, 10, dtype=torch.float64))
    assert za.shape == zb.shape == (5, 1) and not za.any() and not zb.any()


def test_non_finite_statistics_are_one_clear_error(pivoted):
    gram = low_rank_gram(16, 4)
    gram[3, 3] = math.nan
    with pytest.raises(SymmergeError, match="not finite"):
        factor(gram)


# ------------------------------------------------------------------ the solvers on the pivoted factor


def _down_inputs(model, data) -> torch.Tensor:
    """The FFN units (the down projection's input) of a one-layer Llama on every token of ``data``."""
    got = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_pre_hook(lambda m, args: got.append(args[0]))
    with torch.no_grad():
        for batch in data.batches:
            model(**batch.inputs)
    hook.remove()
    return torch.cat([x.reshape(-1, x.shape[-1]) for x in got]).double()


def few_tokens(model, batch: int, length: int) -> Data:
    """One unpadded batch of ``batch`` × ``length`` random tokens."""
    ids = torch.randint(3, model.config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(7))
    mask = torch.ones_like(ids, dtype=torch.bool)
    return Data("memory", "text", [Batch({"input_ids": ids, "attention_mask": mask.long()}, None, mask)], batch,
                labeled=False)


@pytest.mark.parametrize("tokens", [(4, 9), (1, 9)], ids=["full-rank", "rank-deficient"])
@pytest.mark.parametrize("path", ["pivoted", "eigh"])
def test_ffn_assignment_equals_the_brute_force_optimum(monkeypatch, tokens, path):
    """7 SwiGLU units, every one of the 5 040 permutations valued on correlations computed with numpy: the
    activation start's assignment is the unique best, from either factor (9 tokens: the joint correlation of
    14 columns has rank ≤ 8; 36: full rank)."""
    monkeypatch.setattr(activations, "PIVOTED_FROM", 0 if path == "pivoted" else 10 ** 9)
    a = make_model("llama", head=True, seed=0, num_hidden_layers=1, intermediate_size=7)
    b = make_model("llama", head=True, seed=4, num_hidden_layers=1, intermediate_size=7)
    data = few_tokens(a, *tokens)
    _, instances = instances_for(a)
    opts = AlignOptions(symmetries=("ffn",)).solver_options()
    assert opts.rescale == "none"  # plain correlations (with unit scales: |correlation|)
    elements = match_activations(instances, a, b, data, opts)
    (ffn,) = [i for i in instances if i.kind.name == "permutation"]
    perm = elements[ffn.name].perm.tolist()
    xa, xb = _down_inputs(a, data).numpy(), _down_inputs(b, data).numpy()
    corr = np.corrcoef(np.concatenate([xa, xb], 1), rowvar=False)[:7, 7:]
    values = sorted((sum(corr[p[j], j] for j in range(7)), p) for p in itertools.permutations(range(7)))
    (second, _), (best, best_perm) = values[-2], values[-1]
    assert best - second > 1e-6  # the optimum is unique: the check can fail
    assert perm == list(best_perm)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2", "vit"])
def test_hidden_elements_recovered_from_the_pivoted_factor(pivoted, family):
    """Head pairing, per-head rotations and scales (RoPE pairs, GQA), FFN permutation with unit scales, the
    residual stream: brought back from activations alone, every per-layer Gram factored by dpstrf."""
    anchor = make_model(family, head=True)
    moved, _, _ = disguised(anchor, ALL, seed=3)
    instances, opts, ca, cb, ma, mb = canonical_pair(moved, anchor, ALL)
    elements = match_activations(instances, ma, mb, unlabeled(anchor, batches=1), opts, weights_for=())
    assert pivoted and max_error(instances, elements, ca, cb) < 1e-6
    assert any(rank < n for n, rank in pivoted)  # 36 tokens: some Grams were rank-deficient


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_pivoted_and_eigh_factors_give_the_same_elements(monkeypatch, family):
    """A generic pair (two seeds; the optima unique): the elements from either factor move A to the same
    tensors, to float64 rounding (the permutations identical)."""
    a = make_model(family, head=True, seed=0)
    b = make_model(family, head=True, seed=5)
    _, instances = instances_for(a)
    opts = AlignOptions(symmetries=LOCAL).solver_options()
    data = unlabeled(a, batches=1)
    out = {}
    for path, threshold in (("eigh", 10 ** 9), ("pivoted", 0)):
        monkeypatch.setattr(activations, "PIVOTED_FROM", threshold)
        out[path] = apply(a.state_dict(), instances, match_activations(instances, a, b, data, opts))
    sd = a.state_dict()
    assert any(not torch.allclose(out["eigh"][k], sd[k]) for k in sd)  # the alignment moved A
    for k in sd:
        torch.testing.assert_close(out["pivoted"][k], out["eigh"][k], atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_activation_start_is_function_preserving_on_llama(pivoted, dtype, tol):
    """``align --match activations`` (the learned path's start) by layer, every Gram through dpstrf."""
    a = make_model("llama", head=True, seed=0, dtype=dtype)
    b = make_model("llama", head=True, seed=6, dtype=dtype)
    res = align_pair(a, b, AlignOptions(symmetries=LOCAL, match="activations", align_data=unlabeled(a, batches=1)))
    assert pivoted and any(rank < n for n, rank in pivoted)  # through dpstrf, rank-deficient Grams among them
    assert res.report["verify_max_rel_diff"] <= tol
    assert output_rel_diff(a, res.model, make_inputs(a, seed=9)) <= tol  # on inputs the start never saw
    moved, start = res.model.state_dict(), a.state_dict()
    assert any(not torch.allclose(moved[k], start[k]) for k in start)  # A was moved


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_whole_pass_start_is_function_preserving_on_llama(pivoted, dtype, tol):
    """The whole pass (every layer's factors at once, padded to one width, solved together across layers)."""
    a = make_model("llama", head=True, seed=0, dtype=dtype)
    b = make_model("llama", head=True, seed=6, dtype=dtype)
    _, instances = instances_for(a)
    elements = match_activations(instances, a, b, unlabeled(a, batches=1), AlignOptions(symmetries=LOCAL).solver_options(),
                                 by_layer=False)
    assert len({rank for _, rank in pivoted}) > 1  # ranks differ between sites: the padding was needed
    moved = apply(a.state_dict(), instances, elements)
    assert output_rel_diff(a, with_weights(a, moved), make_inputs(a, seed=9)) <= tol
    assert output_rel_diff(b, with_weights(a, moved), make_inputs(a, seed=9)) > 1e-2  # A is not B: the check can fail


# ------------------------------------------------------------------ below the threshold: the same bits as before


def _old_correlation(joint) -> torch.Tensor:
    """``Joint.correlation`` as it was (whole-matrix expressions)."""
    n = max(joint.count, 1)
    mean = joint.sums / n
    cov = joint.gram / n - torch.outer(mean, mean)
    std = cov.diagonal().clamp_min(0).sqrt()
    std = torch.where(std > 1e-12 * std.max().clamp_min(1e-300), std, torch.full_like(std, math.inf))
    return cov / std[:, None] / std[None, :]


@pytest.mark.parametrize("f", [3, 700, 1500])
def test_eigh_path_and_correlations_are_bit_for_bit_as_before(f):
    """The in-place correlations (blocks of rows) and the symmetrisation equal the old expressions bit for bit,
    so every result below the threshold is unchanged."""
    g = torch.Generator().manual_seed(f)
    joint = activations.Joint.empty(f)
    for _ in range(2):
        a = torch.randn(40, f, generator=g, dtype=torch.float64) * 3 + 1
        b = torch.randn(40, f, generator=g, dtype=torch.float64)
        b[:, 0] = 2.0  # a constant column
        joint.add(a, b)
    assert torch.equal(joint.correlation(), _old_correlation(joint))
    gram = joint.gram.clone()
    corr = replace(joint, gram=gram).correlation(in_place=True)
    assert corr.data_ptr() == gram.data_ptr() and torch.equal(corr, _old_correlation(joint))
    sym = joint.gram + torch.randn(2 * f, 2 * f, generator=g, dtype=torch.float64) * 1e-12  # not quite symmetric
    assert torch.equal(activations._symmetrised_in_place(sym.clone()), (sym + sym.T) / 2)
    if f <= 700:
        lam, V = torch.linalg.eigh((sym + sym.T) / 2)
        L = V * lam.clamp_min(0).sqrt()
        la, lb = factor(sym)
        assert torch.equal(la, L[:f]) and torch.equal(lb, L[f:])


def test_big_joint_statistics_by_blocks_of_rows(monkeypatch):
    """From the threshold up the Gram of float32 activations is accumulated in float64 a block of rows at a time
    and factored in place (``consume``): the same statistics to float32 rounding, and of the tokens' rank (the
    float32 sums of the path below the threshold leave rounding of full rank: dpstrf finds more columns there)."""
    monkeypatch.setattr(activations, "_ROWS", 7)
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(30, 20, generator=g), torch.randn(30, 20, generator=g)
    small, big = activations.Joint.empty(20), activations.Joint.empty(20)
    small.add(a, b)
    monkeypatch.setattr(activations, "PIVOTED_FROM", 40)
    big.add(a, b)
    z = torch.cat([a, b], 1).double()
    torch.testing.assert_close(big.gram, z.T @ z, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(big.gram, small.gram, rtol=1e-6, atol=1e-5)
    gram = big.gram.clone()
    la, lb = factor(big.gram, consume=True)
    assert la.shape == (20, 30) and blocks_error(gram, la, lb) < 1e-13
    assert factor(small.gram)[0].shape[1] > 30  # float32 sums: rank beyond the tokens (the check can fail)
