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
