"""The float32 fast path of mergekit's task-vector rules (issue 41: nothing slower): the sign election computed in
the combining pass (kernels_whole._elect32) against its torch definition (in_dtype.mergekit_election), the block
partition against the library's scalar partition, and the window selection on the kernels' arrays against torch's
own sort."""

from __future__ import annotations

import numpy as np
import pytest
import torch




def few_values(n_models: int, m: int, seed: int):
    """float32 base (multiples of 2⁻¹⁰: task vectors exact) and models whose task vectors take few values, some
    summing to nearly nothing (0.1 + 0.2 − 0.3): their float32 rounding decides the elected sign."""
    g = torch.Generator().manual_seed(seed)
    base = torch.round(torch.randn(m, generator=g) * 1024) / 1024
    levels = torch.tensor([0.1, 0.2, -0.3, 0.7, -0.4, 1e-3])
    return base, [base + levels[torch.randint(0, len(levels), (m,), generator=g)] for _ in range(n_models)]


@pytest.mark.parametrize("rescale", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_the_election_in_the_kernel_is_mergekits_float32_election(seed, rescale):
    from symmerge.merge.in_dtype import l1_factor, mergekit_election
    from symmerge.merge.kernels_whole import _elect32_jit

    n, m = 3 + seed, 20000
    base, models = few_values(n, m, seed)
    g = torch.Generator().manual_seed(100 + seed)
    keeps = [torch.rand(m, generator=g) < 0.7 for _ in range(n)]
    keeps[0] = None  # a model kept whole: neither masked nor rescaled
    weights = [1 / 3] * n if seed != 2 else [0.3] * n
    want = mergekit_election(models, base, keeps, weights, rescale)
    ef = np.array([0.0 if k is None or not rescale else float(l1_factor(t, base, k)) for t, k in zip(models, keeps)],
                  dtype=np.float32)
    masks = np.stack([np.ones(m, dtype=np.bool_) if k is None else k.numpy() for k in keeps])
    allk = np.array([k is None for k in keeps])
    tot = np.empty(m, dtype=np.float32)
    arrays = tuple(t.numpy() for t in models) + (base.numpy(),)
    _elect32_jit(arrays, masks, allk, 0, m, ef, np.array(weights, dtype=np.float32), tot)
    got = torch.from_numpy(tot >= 0)
    assert torch.equal(got, want)
    # the test has teeth: the float32 election differs from the sign of the exact (float64) sums somewhere
    exact = sum((t.double() - base.double()) * (1.0 if k is None else k.double()) * w
                for t, k, w in zip(models, keeps, weights))
    if not rescale:
        assert int((want != (exact >= 0)).sum()) > 0


def test_the_block_partition_makes_the_librarys_swaps():
    from symmerge.merge import sort_order as so

    rng = np.random.default_rng(0)
    offl, offr = np.empty(so._BLOCK, np.int64), np.empty(so._BLOCK, np.int64)
    for trial in range(400):
        n = int(rng.integers(17, 5000))
        distinct = int(rng.integers(1, 6)) if trial % 2 else 10 ** 6
        v = rng.integers(0, distinct, n).astype(np.float32)
        first = int(rng.integers(0, n - 16))
        last = int(rng.integers(first + 17, n + 1))
        a, ia, b, ib = v.copy(), np.arange(n), v.copy(), np.arange(n)
        cut_a = so._partition_jit(a, ia, first, last, False)
        cut_b = so._partition_ascending_jit(b, ib, first, last, offl, offr)
        assert cut_a == cut_b and np.array_equal(ia, ib) and np.array_equal(a, b), trial


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_window_of_the_kernels_arrays_is_torchs_sort(dtype):
    from symmerge.merge.sort_order import magnitudes, window_mask_by_sort, window_mask_into

    rng = np.random.default_rng(1)
    for trial in range(60):
        m = int(rng.integers(1, 30000))
        base = torch.from_numpy(rng.standard_normal(m)).to(dtype)
        t = base + torch.from_numpy(rng.integers(-3, 4, m) * 0.25).to(dtype)
        lo = int(rng.integers(0, m))
        hi = int(rng.integers(lo, m + 1))
        desc = bool(trial % 2)
        mask = np.empty(m, dtype=np.bool_)
        scratch = np.empty(m, dtype=np.float32) if trial % 3 == 0 else None
        window_mask_into(t.numpy(), base.numpy(), lo, hi, desc, mask, scratch)
        assert torch.equal(torch.from_numpy(mask), window_mask_by_sort(magnitudes(t, base), lo, hi, desc)), trial
