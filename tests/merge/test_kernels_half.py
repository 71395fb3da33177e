"""DARE and DELLA in float16/bfloat16 by their kernels (``symmerge.merge.kernels_half``) give the bits of the torch
form — mergekit's arithmetic op for op in the half dtype (``in_dtype.combine_in_dtype`` on the masks
``parts._sparsify_whole`` draws, ``parts._whole_task_vector_tensor``) — on random and adversarial inputs: exponents
far apart (float32 sums and differences that round), magnitudes tied across a row (DELLA's ranks), near-cancelling
sums (the election), signed zeros, zero and negative weights, float16's subnormals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from symmerge.merge import kernels_half, parts
from symmerge.merge.della import LINEAR as DELLA_LINEAR, METHOD as DELLA
from symmerge.merge.dare import LINEAR as DARE_LINEAR
from symmerge.merge.dare_ties import METHOD as DARE_TIES

HALF = [torch.bfloat16, torch.float16]


def _bits(t):
    return t.contiguous().view(torch.int16)


def _adversarial(shape, dtype, seed):
    """A base and three fine-tunes: most entries small changes of a base of mixed magnitude, some far-apart exponents,
    repeated values (ties), exact copies of the base (τ = 0), signed zeros, float16 subnormals."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape))
    base = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 2, (n,), generator=g)
    out = []
    for i in range(3):
        t = base + torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-6, 1, (n,), generator=g)
        pick = torch.rand(n, generator=g)
        t = torch.where(pick < 0.05, base, t)  # unchanged entries
        t = torch.where((pick > 0.05) & (pick < 0.1), base + 0.0625 * (i + 1), t)  # tied magnitudes
        far = 1e6 if dtype == torch.bfloat16 else 1e2
        t = torch.where((pick > 0.1) & (pick < 0.12), base * far, t)  # far-apart exponents
        out.append(t)
    if dtype == torch.float16:  # float16's range: the L1 sums of |τ| (in float16) must stay finite
        base, out = base * 1e-3, [t * 1e-3 for t in out]
        base[:7] = torch.tensor([1e-7, -3e-8, 6e-5, -6.1e-5, 2e-6, 0.0, 1e-4], dtype=torch.float64)  # subnormals
        for i, t in enumerate(out):
            t[:7] = base[:7] * (i - 1) + 1e-7 * i
    base, out = base.to(dtype), [t.to(dtype) for t in out]
    base[7], out[0][7] = 0.0, -0.0  # τ = −0
    base[8], out[1][8] = -0.0, 0.0
    out[2][9] = -out[0][9] - out[1][9] + 3 * base[9]  # a near-cancelling sum
    return base.reshape(shape), [t.reshape(shape) for t in out]


CASES = [
    ("dare", "ties", DARE_TIES, dict(drop=0.5)),
    ("dare", "sum", DARE_LINEAR, dict(drop=0.3)),
    ("dare", "ties", DARE_TIES, dict(drop=(0.2, 0.6, 0.0), normalize=True, rescale=False)),
    ("dare", "sum", DARE_LINEAR, dict(drop=0.5, normalize=True, scale=0.7)),
    ("della", "ties", DELLA, dict(density=0.5, epsilon=0.1)),
    ("della", "sum", DELLA_LINEAR, dict(density=(0.4, 0.6, 1.0), epsilon=0.2)),
    ("della", "ties", DELLA, dict(density=0.5, epsilon=0.1, rescale=False, normalize=False, scale=1.3)),
    ("della", "sum", DELLA_LINEAR, dict(density=0.7, epsilon=0.15, normalize=True)),
]
WEIGHTS = [[1 / 3] * 3, [0.5, -0.25, 1.0], [0.7, 0.0, 0.4]]


def _params(method, extra):
    params = dict(method.params)
    params.update(extra)
    return params


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("weights", range(len(WEIGHTS)))
@pytest.mark.parametrize("shape", [(96, 130), (257,)])
def test_kernel_is_the_torch_form_bit_for_bit(dtype, case, weights, shape):
    sparsifier, consensus, method, extra = CASES[case]
    params, w = _params(method, extra), WEIGHTS[weights]
    base, ts = _adversarial(shape, dtype, seed=case * 7 + weights)
    out = torch.empty(shape, dtype=dtype)
    assert parts._half_into(sparsifier, consensus, "k", ts, w, base, params, None, out)
    ref = parts._whole_task_vector_tensor(sparsifier, consensus, "k", ts, w, base, params, None)
    assert ref.dtype == dtype and torch.equal(_bits(out), _bits(ref)), int((_bits(out) != _bits(ref)).sum())
    assert not torch.equal(out, base)  # the merge moved something


@pytest.mark.parametrize("dtype", HALF)
def test_a_large_tensor_split_over_the_pool_is_the_torch_form(dtype):
    """Over 2¹⁶ entries the passes are split over the merge pool; the L1 sums (over 32 768 entries: torch's thread
    split shows in their rounding) stay torch's."""
    base, ts = _adversarial((300, 700), dtype, seed=5)
    for sparsifier, consensus, method, extra in (CASES[0], CASES[4]):
        params = _params(method, extra)
        out = torch.empty(base.shape, dtype=dtype)
        assert parts._half_into(sparsifier, consensus, "big", ts, [0.4, 0.3, 0.3], base, params, None, out)
        ref = parts._whole_task_vector_tensor(sparsifier, consensus, "big", ts, [0.4, 0.3, 0.3], base, params, None)
        assert torch.equal(_bits(out), _bits(ref)), sparsifier


@pytest.mark.parametrize("dtype", HALF)
def test_rounding_is_torchs(dtype):
    """float32 values rounded to the half dtype as torch converts them: halfway cases (ties to even), values just
    either side, subnormals of the half dtype, overflow."""
    g = torch.Generator().manual_seed(0)
    grid = torch.randn(20000, generator=g) * 10.0 ** torch.randint(-9, 6, (20000,), generator=g).float()
    h = grid.to(dtype)
    up = torch.nextafter(h.float(), torch.full_like(grid, float("inf"))).to(dtype).float()
    mid = (h.float().double() + (up.double() - h.float().double()) / 2).float()  # exact halfway points
    edge = torch.tensor([65504.0, 65519.99, 65520.0, 1e6, 3.3e38, 6.0e-8, 2.98e-8, 2.9802322e-08, 1e-40, -1e-45,
                         0.0, -0.0, 5.96e-8, 6.1035156e-05, 6.1e-05])
    x = torch.cat([grid, mid, torch.nextafter(mid, torch.zeros_like(mid)), torch.nextafter(mid, mid * 2), edge])
    x = x[torch.isfinite(x)]  # halfway above float16's largest: no value (the inputs are finite)
    kind = 0 if dtype == torch.bfloat16 else 1
    got = x.numpy().copy()
    kernels_half._round_half_jit(got, got.shape[0], kind)
    assert torch.equal(torch.from_numpy(got).view(torch.int32), x.to(dtype).float().view(torch.int32))
    bits = np.empty(got.shape[0], dtype=np.uint16)
    kernels_half._narrow_jit(got, kind, bits, got.shape[0])
    assert torch.equal(torch.from_numpy(bits.view(np.int16)), x.to(dtype).view(torch.int16))
    wide = np.empty(got.shape[0], dtype=np.float32)
    kernels_half._widen_jit(bits, kind, wide, got.shape[0])
    assert torch.equal(torch.from_numpy(wide).view(torch.int32), x.to(dtype).float().view(torch.int32))


def test_della_row_ranks_are_the_stable_sorts_both_ways():
    """The packed-key sort (magnitudes whose low bits are free) and the argsort (where they are not) give the ranks
    of a stable sort: the mask of ``parts.della_keep_mask``, ties across the row included."""
    g = torch.Generator().manual_seed(3)
    cases = {
        "packed": (torch.randint(0, 40, (30, 577), generator=g).double() * 0.125),  # few values: many ties
        "argsort": torch.randn(30, 577, generator=g, dtype=torch.float64),  # every mantissa bit used
    }
    skewed = torch.randint(1, 5000, (30, 577), generator=g).double()
    skewed[:, 5] = 2.0 ** 100  # one far value: the others crowd into few buckets, out of order (sorted there as a whole)
    cases["skewed"] = skewed
    for name, tau in cases.items():
        mag = tau.abs().reshape(-1).numpy()
        assert (name != "argsort") == bool(np.all((mag.view(np.uint64) & np.uint64(1023)) == 0))
        seed = parts.dare_seed(4, 2, "w")
        mask = np.zeros(tau.numel(), dtype=np.bool_)
        zeros = np.zeros(tau.numel(), dtype=np.float64)
        kernels_half.della_mask_into(tau.reshape(-1).numpy(), zeros, -1, 577, seed, 0.4, 0.1, mask)
        assert torch.equal(torch.from_numpy(mask).reshape(tau.shape), parts.della_keep_mask(tau, 0.5, 0.1, 4, 2, "w"))


@pytest.mark.parametrize("dtype", HALF)
def test_a_scalar_and_a_3d_tensor_under_dare(dtype):
    base, ts = _adversarial((4, 6, 5), dtype, seed=11)
    for shape in ((4, 6, 5), ()):
        b, xs = (base, ts) if shape else (base.reshape(-1)[10], [t.reshape(-1)[10] for t in ts])
        for sparsifier, consensus, method, extra in CASES[:4]:
            params = _params(method, extra)
            out = torch.empty(b.shape, dtype=dtype)
            assert parts._half_into(sparsifier, consensus, "s", xs, [0.4, 0.3, 0.3], b, params, None, out)
            ref = parts._whole_task_vector_tensor(sparsifier, consensus, "s", xs, [0.4, 0.3, 0.3], b, params, None)
            assert torch.equal(_bits(out), _bits(ref)), (shape, params)


def test_declines_what_it_does_not_compute():
    b = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    out = torch.empty_like(b)
    assert not kernels_half.dare_della_into([b + 1], b, [("della", 1, 0.5, 0.1)], [1.0], "sum", False, 1.0, True, out)
    f = torch.zeros(4, 4)
    assert not kernels_half.dare_della_into([f + 1], f, [("dare", 1, 0.5)], [1.0], "sum", False, 1.0, True,
                                            torch.empty_like(f))
