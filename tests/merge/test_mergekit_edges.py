"""Edges of merge parameters against mergekit 0.1.5's own rule functions (in-process, on small tensors; the whole
audit on checkpoints is benchmarks/methodedge_audit.py). Skipped where mergekit is not installed."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("mergekit.merge_methods.karcher")

from mergekit.merge_methods.karcher import karcher_merge_tensors  # noqa: E402

from symmerge.merge import get_method  # noqa: E402


@pytest.mark.parametrize("max_iter, tol", [(1, 0.0), (10, 0.0), (0, 0.0), (0, 1e-5), (1, 1e-5)])
def test_karcher_at_tol_0_and_max_iter_0_1_as_mergekit(max_iter, tol):
    """mergekit merges with ``tol: 0`` (its float32 steps are never exactly 0); symmerge divided 0 by 0 there
    (a ZeroDivisionError out of ``symmerge run``, or a NaN result refused). Float32 inputs, float32 rounding."""
    g = torch.Generator().manual_seed(1)
    a = torch.randn(16, 24, generator=g)
    models = [a + 0.01 * torch.randn(16, 24, generator=g) for _ in range(2)]
    theirs = karcher_merge_tensors(models, [0.5, 0.5], max_iter=max_iter, tol=tol)
    ours = get_method("karcher").merge([{"w": t.double()} for t in models], max_iter=max_iter, tol=tol)["w"]
    assert torch.isfinite(ours).all()
    assert float((ours - theirs.double()).abs().max()) <= 1e-5 * float(theirs.abs().max())
