"""Merge methods at the edges of their parameters (found by benchmarks/methodedge_audit.py against mergekit 0.1.5;
tests/merge/test_mergekit_edges.py compares the same edges with mergekit itself where it is installed)."""

from __future__ import annotations

import pytest
import torch

from symmerge.merge import get_method
from symmerge.merge.spherical import gram, karcher_coefficients, karcher_mean

D = torch.float64


def _pair(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, generator=g, dtype=D)
    return [a, a + 0.1 * torch.randn(n, generator=g, dtype=D)]


@pytest.mark.parametrize("max_iter", [1, 10])
def test_karcher_with_tol_0_converges_instead_of_dividing_by_zero(max_iter):
    """``tol: 0`` (mergekit accepts it): two models of equal weight start at their mean exactly, so the first step
    is 0 (before: 0 / 0, a ZeroDivisionError out of ``symmerge run`` or a NaN result), and a model on the mean has
    angle 0 (θ / sin θ → 1, the step's term 0)."""
    vs = _pair()
    want = karcher_mean(vs, [0.5, 0.5], max_iter, 1e-12)
    got = karcher_mean(vs, [0.5, 0.5], max_iter, 0.0)
    assert torch.isfinite(got).all() and torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    c = karcher_coefficients(gram(vs), [0.5, 0.5], max_iter, 0.0)
    assert torch.allclose(sum(ci * v for ci, v in zip(c, vs)), want, rtol=1e-10, atol=1e-12)
    same = [vs[0], vs[0].clone()]  # every angle 0
    assert torch.allclose(karcher_mean(same, [0.5, 0.5], max_iter, 0.0), vs[0], rtol=1e-12, atol=0)
    out = get_method("karcher").merge([{"w": v.reshape(8, 8)} for v in vs], max_iter=max_iter, tol=0.0)["w"]
    assert torch.isfinite(out).all() and torch.allclose(out.reshape(-1), want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("weights", [[-0.5, 1.5], [1.3, -0.3], [-1.0, -3.0]])
def test_linear_takes_weights_of_any_sign_as_mergekit_does(weights):
    """mergekit's ``linear`` with ``normalize: true`` divides by the weights' sum whatever their signs (a weight above
    1 beside a negative one extrapolates, as ExPO-style configs do): Σ w_i θ_i / Σ w_i, equal to mergekit's file bit
    for bit in the audit. It refused them ("weights of an average must be non-negative"). ``average``, symmerge's own
    name, keeps its non-negative weights."""
    from symmerge.errors import SymmergeError

    vs = _pair()
    sds = [{"w": v.reshape(8, 8)} for v in vs]
    want = sum(w * v for w, v in zip(weights, vs)) / sum(weights)
    for fused in (False, True):  # the per-tensor rule and its fused kernel (float32 output)
        got = get_method("linear").merge([{k: t.float() for k, t in sd.items()} for sd in sds] if fused else sds,
                                         weights=weights, normalize=True)["w"].reshape(-1)
        assert torch.allclose(got.double(), want, rtol=1e-6 if fused else 1e-12, atol=1e-6 if fused else 1e-12)
    with pytest.raises(SymmergeError, match="non-negative"):
        get_method("average").merge(sds, weights=weights)


def test_linear_weights_summing_to_zero_are_one_line():
    """mergekit writes NaN for ``[1, -1]`` under ``normalize: true`` (its sum divides); symmerge says why in one
    line, and ``normalize: false`` takes them (θ_1 − θ_2, as mergekit)."""
    from symmerge.errors import SymmergeError

    vs = _pair()
    sds = [{"w": v.reshape(8, 8)} for v in vs]
    with pytest.raises(SymmergeError, match=r"sum to 0: linear with normalize divides by their sum"):
        get_method("linear").merge(sds, weights=[1.0, -1.0], normalize=True)
    diff = get_method("linear").merge(sds, weights=[1.0, -1.0], normalize=False)["w"].reshape(-1)
    assert torch.equal(diff, vs[0] - vs[1])
