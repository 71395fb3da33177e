"""The one kernel of the task-vector rules under mergekit's forms (symmerge/merge/kernels_whole.py), SCE's and RAM's,
against the torch definitions (reference_rules.py: the product's float64 torch code, the implementation for the half
dtypes) and against brute force: the radix select against a sort, the masks against
the stable sorts of their definitions (ties at the cuts included), the merged tensors against the torch code
(bit for bit without an L1 rescale; within the rounding of the rescale factor with one)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reference_rules import torch_rules

from symmerge.merge import get_method
from symmerge.merge.parts import _keep_topk, breadcrumbs_band, della_keep_mask


def tied(n: int, shape, dtype, seed: int) -> list[torch.Tensor]:
    """A base and ``n`` models whose task vectors take few distinct magnitudes (many ties at any cut), with exact
    zeros, opposite signs and a wide range of exponents."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g, dtype=torch.float64)
    out = [base]
    for _ in range(n):
        levels = torch.tensor([0.0, 0.125, 0.25, 0.5, 1e-3, 3.0, 1e-20], dtype=torch.float64)
        tau = levels[torch.randint(0, len(levels), shape, generator=g)] * torch.where(
            torch.rand(shape, generator=g) < 0.5, -1.0, 1.0).double()
        spread = torch.rand(shape, generator=g) < 0.3
        tau[spread] = torch.randn(int(spread.sum()), generator=g, dtype=torch.float64)
        out.append(base + tau)
    return [t.to(dtype) for t in out]


def run(method: str, models, base, weights, kernel: bool, **params):
    """The merge by the kernels (``kernel``) or by the torch definitions (reference_rules.py)."""
    import dataclasses

    from symmerge.merge import specialized

    m = get_method(method)
    sds = [{"w": t} for t in models]
    if kernel:
        return m.merge(sds, base={"w": base}, weights=weights, **params)["w"]
    with pytest.MonkeyPatch.context() as mp:
        torch_rules(mp)
        if m in (specialized.SCE, specialized.RAM, specialized.RAMPLUS_TL):  # their torch code; RAM+'s factors by torch
            m = dataclasses.replace(m, fused_into=None, tensor_context=m.tensor_context and specialized._ramplus_lambdas)
        return m.merge(sds, base={"w": base}, weights=weights, **params)["w"]


@pytest.mark.parametrize("seed", range(3))
def test_window_masks_are_the_positions_of_torchs_sort(seed):
    """The selection (libstdc++'s introsort run only where it straddles a cut) keeps the entries torch's own
    unstable sort puts at the window's positions, ties included: many tied values, both directions, windows at
    either end and inside, sizes across the insertion-sort threshold and large ones."""
    from symmerge.merge.sort_order import window_mask, window_mask_by_sort

    g = torch.Generator().manual_seed(seed)
    for trial in range(60):
        n = int(torch.randint(1, 40, (1,), generator=g)) if trial < 20 else int(torch.randint(40, 200_000, (1,),
                                                                                              generator=g))
        keys = torch.randint(0, int(torch.randint(1, 30, (1,), generator=g)), (n,), generator=g).float()
        if trial % 3 == 0:  # a bfloat16 task vector's magnitudes
            keys = (torch.randn(n, generator=g) * 0.004).bfloat16().abs().float()
        lo = 0 if trial % 4 == 0 else int(torch.randint(0, n, (1,), generator=g))
        hi = int(torch.randint(lo, n + 1, (1,), generator=g))
        for descending in (True, False):
            assert torch.equal(window_mask(keys, lo, hi, descending), window_mask_by_sort(keys, lo, hi, descending))
    # the order is torch's, not the flat order of a stable sort: the test can fail
    keys = torch.randint(0, 3, (5000,), generator=g).float()
    stable = torch.zeros(5000, dtype=torch.bool)
    stable[torch.sort(keys, descending=True, stable=True).indices[:1000]] = True
    assert not torch.equal(window_mask(keys, 0, 1000, True), stable)


def _mask_of(rule, tau: torch.Tensor) -> torch.Tensor:
    """The kernel's mask of ``rule`` on ``tau`` (one model, base 0, no rescale, weight 1): the merged τ's support,
    read through a τ with no zero entry."""
    from symmerge.merge.kernels_whole import task_vector_into

    out = torch.empty_like(tau)
    assert task_vector_into([tau], torch.zeros_like(tau), [1.0], [rule], [None], "sum", False, 1.0, out)
    assert torch.equal(out[out != 0], tau[out != 0])
    return out != 0


@pytest.mark.parametrize("seed", range(4))
def test_magnitude_masks_equal_torchs_sorts(seed):
    from symmerge.merge.sort_order import window_mask_by_sort

    g = torch.Generator().manual_seed(seed)
    size = 997
    levels = torch.tensor([0.5, 1.0, 2.0, 3.0, 1e-3], dtype=torch.float64)
    tau = levels[torch.randint(0, 5, (size,), generator=g)] * torch.where(torch.rand(size, generator=g) < 0.5,
                                                                         -1.0, 1.0).double()
    tau[torch.rand(size, generator=g) < 0.2] += torch.randn(size, generator=g, dtype=torch.float64)[:1]
    for density in (0.001, 0.005, 0.01, 0.1, 0.33, 0.5, 0.9, 0.999):  # narrow bands inside one tied value too
        k = max(1, int(density * size))
        assert torch.equal(_mask_of(("topk", k), tau), window_mask_by_sort(tau.abs().float(), 0, k, True)), density
        assert torch.equal(_keep_topk(tau, density), window_mask_by_sort(tau.abs().float(), 0, k, True)), density
        half = tau.bfloat16()  # a half-precision task vector: torch's order, as mergekit
        assert torch.equal(_keep_topk(half, density), window_mask_by_sort(half.abs().float(), 0, k, True)), density
        for gamma in (0.0, 0.01, 0.2, 0.6):
            target, top = int(density * size), int(gamma * size)
            want = breadcrumbs_band(tau, density, gamma)
            bottom = max(0, size - target - top)
            assert torch.equal(want, window_mask_by_sort(tau.abs().float(), bottom, bottom + target, False))
            half = tau.bfloat16()
            assert torch.equal(breadcrumbs_band(half, density, gamma),
                               window_mask_by_sort(half.abs().float(), bottom, bottom + target, False))
            if target == 0:
                assert not want.any()
                continue
            got = _mask_of(("band", max(0, size - target - top), target), tau)
            assert torch.equal(got, want), (density, gamma)


def test_della_mask_equals_its_definition():
    from symmerge.merge.parts import dare_seed

    g = torch.Generator().manual_seed(5)
    tau = torch.randn(40, 33, generator=g, dtype=torch.float64)
    tau[:, :5] = 0.25  # ties within rows
    for density, eps in ((0.5, 0.1), (0.2, 0.15), (0.8, 0.19)):
        seed = dare_seed(7, 1, "w")
        got = _mask_of(("della", seed, density, eps), tau)
        assert torch.equal(got, della_keep_mask(tau, density, eps, 7, 1, "w"))
        flat = tau.reshape(-1)
        got = _mask_of(("della", seed, density, eps), flat)  # a 1-D tensor: one row
        assert torch.equal(got, della_keep_mask(flat, density, eps, 7, 1, "w"))


CASES = [
    ("ties", dict(density=0.5)), ("ties", dict(density=(0.3, 0.9, 0.05))),
    ("ties", dict(density=0.4, normalize=False)), ("ties", dict(density=0.4, normalize="count")),
    ("ties", {"density": 0.6, "rescale": True, "lambda": 0.7}),
    ("dare_ties", dict(density=0.4)), ("dare_ties", dict(density=0.4, normalize=True, rescale="inverse")),
    ("dare_linear", dict(density=(0.3, 0.6, 1.0))), ("dare_linear", dict(density=0.5, rescale=False,
                                                                          normalize=True)),
    ("breadcrumbs", dict(density=0.9, gamma=0.01)), ("breadcrumbs", dict(density=0.5, gamma=0.3, rescale=True)),
    ("breadcrumbs_ties", dict(density=0.7, gamma=0.05, normalize=True)), ("breadcrumbs", dict(density=0.001)),
    ("della", dict(density=0.5, epsilon=0.1)), ("della_linear", dict(density=(0.4, 0.6, 0.5), epsilon=0.2)),
    ("della", dict(density=0.5, epsilon=0.1, rescale=False)),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(37, 61), (2001,)])
@pytest.mark.parametrize("method, params", CASES)
def test_kernel_equals_the_torch_code(method, params, shape, dtype):
    tensors = tied(3, shape, dtype, seed=len(shape))
    base, models = tensors[0], tensors[1:]
    weights = [0.6, -0.4, 1.3]
    fused = run(method, models, base, weights, True, **params)
    plain = run(method, models, base, weights, False, **params)
    assert fused.dtype == dtype and not torch.equal(fused, base)
    l1 = params.get("rescale", get_method(method).params.get("rescale"))
    if l1 is True:  # the rescale factor's sums in another order: within a rounding of the result
        gap = (fused.double() - plain.double()).abs()
        size = sum((t.double() - base.double()).abs() for t in models)
        ulp = torch.finfo(dtype).eps * plain.double().abs()  # the result rounded the other way
        assert bool((gap <= ulp + 1e-12 * size).all())
        assert dtype == torch.float64 or (fused != plain).double().mean() < 0.01
    else:
        assert torch.equal(fused.view(torch.uint8), plain.view(torch.uint8)), (method, params)


def test_the_split_merge_equals_one_part(monkeypatch):
    from symmerge.merge import kernels_whole

    base, *models = tied(3, (300, 1000), torch.float32, seed=3)
    whole = run("ties", models, base, [0.5, 0.5, 1.0], True, density=0.3)
    monkeypatch.setattr(kernels_whole, "_SPLIT", 1 << 30)
    one = run("ties", models, base, [0.5, 0.5, 1.0], True, density=0.3)
    assert torch.equal(whole, one)
    assert torch.equal(whole, run("ties", models, base, [0.5, 0.5, 1.0], False, density=0.3))


def test_the_kernel_declines_della_on_more_than_two_dimensions_and_writes_any_output():
    """DELLA's rows on more than two dimensions: the torch code (False, nothing written); a float16 or
    non-contiguous output is written from the CPU result (float16 rounded once from float64)."""
    from symmerge.merge.kernels_whole import task_vector_into

    g = torch.Generator().manual_seed(1)
    t, b = torch.randn(4, 3, 5, generator=g), torch.randn(4, 3, 5, generator=g)
    assert not task_vector_into([t], b, [1.0], [("della", 1, 0.5, 0.1)], [None], "sum", False, 1.0,
                                torch.empty_like(t))
    wide = torch.empty(4, 3, 5, dtype=torch.float64)
    assert task_vector_into([t], b, [0.5], [("all",)], [None], "sum", False, 1.0, wide)
    assert torch.equal(wide, b.double() + (t.double() - b.double()) * 0.5)
    half = torch.empty(4, 3, 5, dtype=torch.float16)
    assert task_vector_into([t], b, [0.5], [("all",)], [None], "sum", False, 1.0, half)
    assert torch.equal(half, wide.half())
    strided = torch.empty(5, 3, 4).permute(2, 1, 0)
    assert task_vector_into([t], b, [0.5], [("all",)], [None], "sum", False, 1.0, strided)
    assert torch.equal(strided, wide.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("topk", [0.0, 0.001, 0.3, 0.5, 0.99, 1.0])
def test_sce_keeps_the_positions_torch_topk_of_the_variances_returns(topk, dtype):
    """mergekit's selection: torch.var of the task vectors in the computing dtype, torch.topk of the k largest
    (its order at a tie, reproduced by a selection), k = ⌊topk · non-zero variances⌋."""
    from symmerge.merge.sort_order import topk_mask_by_torch
    from symmerge.merge.specialized import sce_keep

    base, *models = tied(3, (41, 53), dtype, seed=11)
    models[2][:5] = models[1][:5]  # zero and tied variances
    got = sce_keep(models, base, topk)
    if topk >= 1.0:
        assert got is None
        return
    var = torch.var(torch.stack([t - base for t in models]), dim=0, unbiased=False)
    k = int(int(torch.count_nonzero(var)) * topk)
    want = topk_mask_by_torch(var.abs().reshape(-1).float() if dtype in (torch.float16, torch.bfloat16)
                              else var.abs().reshape(-1), k).reshape(base.shape)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("topk", [0.0, 0.2, 0.5, 1.0])
def test_sce_kernel_equals_the_torch_code(topk, dtype):
    base, *models = tied(3, (60, 70), dtype, seed=4)
    fused = run("sce", models, base, None, True, select_topk=topk)
    plain = run("sce", models, base, None, False, select_topk=topk)
    gap = (fused.double() - plain.double()).abs()  # the weights' sums in another order: a rounding at most
    size = sum((t.double() - base.double()).abs() for t in models)
    assert bool((gap <= torch.finfo(dtype).eps * plain.double().abs() + 1e-12 * size).all())
    assert dtype == torch.float64 or (fused != plain).double().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("method, params", [("ram", dict(epsilon=0.1)), ("ram", dict(epsilon=0.0)),
                                            ("ramplus_tl", dict(epsilon=0.1, r=0.5, alpha=0.3)),
                                            ("ramplus_tl", dict(epsilon=1e-3))])
def test_ram_kernels_equal_the_torch_code_bit_for_bit(method, params, dtype):
    base, *models = tied(3, (70, 300), dtype, seed=6)
    models[1][:10] = base[:10]  # entries only one model changes
    fused = run(method, models, base, None, True, **params)
    plain = run(method, models, base, None, False, **params)
    assert torch.equal(fused.view(torch.uint8), plain.view(torch.uint8)) and not torch.equal(fused, base)
