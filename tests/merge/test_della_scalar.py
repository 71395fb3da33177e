"""DELLA on a 0-dim tensor (a scalar parameter) in every dtype: the half-precision path ranked along dim 1 of the
unsqueezed tensor and raised IndexError on a scalar; now a scalar is one row of one entry, as the float32 kernel
treats it, so the kept entries are the same in every dtype."""
import pytest
import torch

import symmerge.merge  # noqa: F401  (registers the methods)
from symmerge.merge.parts import della_keep_probabilities
from symmerge.merge.registry import METHODS


def test_keep_probabilities_of_a_scalar_are_one_rows():
    p = della_keep_probabilities(torch.tensor(0.3, dtype=torch.float64), 0.5, 0.1)
    assert p.shape == () and float(p) == pytest.approx(0.4)  # the smallest (only) rank: density − ε


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["della", "della_linear"])
def test_della_merges_a_scalar_in_half_precision_as_in_float32(name, dtype):
    g = torch.Generator().manual_seed(0)
    kept = set()
    for seed in range(8):
        base = {"s": torch.tensor(1.0), "w": torch.randn(4, 4, generator=g)}
        fts = [{k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in base.items()} for _ in range(2)]
        out = {}
        for dt in (torch.float32, dtype):
            b = {k: v.to(dt) for k, v in base.items()}
            f = [{k: v.to(dt) for k, v in d.items()} for d in fts]
            out[dt] = METHODS[name].merge(f, base=b, weights=[0.5, 0.5], density=0.5, epsilon=0.1, seed=seed)["s"]
        assert out[dtype].dtype == dtype and out[dtype].shape == ()
        # the same masks in both dtypes: the half result is the float32 one within the half dtype's rounding
        assert float(out[dtype]) == pytest.approx(float(out[torch.float32]), abs=2e-2)
        kept.add(float(out[torch.float32]) != 1.0)
    assert kept == {True, False}  # some seeds keep the scalar's delta, some drop it: the test sees both cases


@pytest.mark.parametrize("shape", [(1, 17, 8), (2, 5, 3, 4)])
def test_keep_probabilities_of_a_tensor_of_more_dims_rank_along_dim_1(shape):
    """ViT's position embeddings (1, n, d): ranked along dim 1 for every index of the other dims, as mergekit's
    della_magprune ranks (argsort along dim 1); it stopped with torch's RuntimeError (the ranks' shape)."""
    g = torch.Generator().manual_seed(0)
    tau = torch.randn(shape, generator=g, dtype=torch.float64)
    p = della_keep_probabilities(tau, 0.5, 0.1)
    n = shape[1]
    moved = tau.movedim(1, -1).reshape(-1, n)  # every row along dim 1
    expected = torch.empty_like(moved)
    for r in range(moved.shape[0]):
        order = sorted(range(n), key=lambda j: abs(float(moved[r, j])))  # brute force: rank by magnitude
        for rank, j in enumerate(order):
            expected[r, j] = 0.4 + rank / (n - 1) * 0.2
    assert p.shape == tau.shape
    assert torch.allclose(p.movedim(1, -1).reshape(-1, n), expected, atol=1e-12)


def test_della_merges_a_tensor_of_three_dims():
    g = torch.Generator().manual_seed(1)
    base = {"pos": torch.randn(1, 17, 8, generator=g)}
    fts = [{"pos": base["pos"] + 0.1 * torch.randn(1, 17, 8, generator=g)} for _ in range(2)]
    out = METHODS["della"].merge(fts, base=base, weights=[0.5, 0.5], density=0.5, epsilon=0.1, seed=0)["pos"]
    assert out.shape == (1, 17, 8) and torch.isfinite(out).all() and not torch.equal(out, base["pos"])
