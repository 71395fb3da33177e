"""The rules run as linear combinations of their inputs (coefficients from the chunked Gram matrix) against
their definitions on whole vectors, written here as the rules read: slerp, nuslerp, multislerp (with its
tangent-space mean computed), karcher (the iteration on the vectors), Model Stock; and Arcee Fusion's
importances taken rows at a time and its quantiles by a partial sort against the whole-tensor torch code."""

from __future__ import annotations

import math

import pytest
import torch

from symmerge.merge import get_method
from symmerge.merge.base import CHUNK
from symmerge.merge.spherical import gram, karcher_coefficients, karcher_mean, multislerp_coefficients

D = torch.float64


def vectors(n: int, size: int, spread: float, seed: int) -> list[torch.Tensor]:
    """``n`` vectors around a common one (``spread``: their relative distance to it)."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(size, generator=g, dtype=D)
    return [(common + spread * torch.randn(size, generator=g, dtype=D)) * (0.5 + i) for i in range(n)]


def test_gram_is_the_plain_product_over_chunks():
    vs = vectors(3, 2 * CHUNK + 17, 1.0, 0)
    base = torch.randn(2 * CHUNK + 17, dtype=D)
    x = torch.stack(vs)
    assert torch.allclose(gram(vs), x @ x.T, rtol=1e-13)
    assert torch.allclose(gram(vs, base), (x - base) @ (x - base).T, rtol=1e-13)
    assert torch.allclose(gram([v.float() for v in vs]), x.float().double() @ x.float().double().T, rtol=1e-13)


def multislerp_by_definition(vs, weights, eps=1e-8):
    """The torch rule as written before: directions, their weighted mean, the tangent vectors' mean τ, the
    exponential map, the weighted mean of the norms."""
    v = torch.stack(vs)
    w = torch.tensor(weights, dtype=D)
    w = w / w.sum()
    norms = v.norm(dim=1, keepdim=True)
    units = v / (norms + eps)
    mean = (units * w[:, None]).sum(0)
    mean = mean / mean.norm()
    tau = ((units - (units @ mean)[:, None] * mean) * w[:, None]).sum(0)
    tn = float(tau.norm()) + eps
    return (mean * math.cos(tn) + tau * (math.sin(tn) / tn)) * float((norms[:, 0] * w).sum())


@pytest.mark.parametrize("spread", [1e-4, 0.1, 1.0, 10.0])
def test_multislerp_coefficients_equal_the_tangent_space_rule(spread):
    vs = vectors(3, 500, spread, 1)
    weights = [0.2, 0.5, 0.3]
    c = multislerp_coefficients(gram(vs), weights, True, 1e-8)
    got = sum(ci * v for ci, v in zip(c, vs))
    want = multislerp_by_definition(vs, weights)
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12 * float(want.abs().max()))


@pytest.mark.parametrize("spread", [1e-6, 1e-3, 0.3, 3.0])
def test_karcher_coefficients_follow_the_iteration_on_the_vectors(spread):
    vs = vectors(4, 300, spread, 2)
    for max_iter, tol in ((10, 1e-5), (0, 1e-5), (50, 1e-9)):
        c = karcher_coefficients(gram(vs), [0.25] * 4, max_iter, tol)
        got = sum(ci * v for ci, v in zip(c, vs))
        want = karcher_mean(vs, [0.25] * 4, max_iter, tol)
        assert torch.allclose(got, want, rtol=1e-9, atol=1e-9 * float(want.abs().max())), (spread, max_iter)
    zero = [torch.zeros(300, dtype=D), *vs[:2]]  # a model below tol is left out of the directions
    c = karcher_coefficients(gram(zero), [1 / 3] * 3, 10, 1e-5)
    assert c[0] == 0.0
    assert torch.allclose(sum(ci * v for ci, v in zip(c, zero)), karcher_mean(zero, [1 / 3] * 3, 10, 1e-5))


@pytest.mark.parametrize("name, params, n, base", [
    ("slerp", {"t": 0.3}, 1, True), ("slerp", {"t": 1.7}, 1, True), ("nuslerp", {}, 2, False),
    ("nuslerp", {}, 2, True), ("multislerp", {}, 3, True), ("multislerp", {}, 1, True), ("karcher", {}, 3, False)])
def test_the_chunked_rules_equal_their_whole_vector_forms(name, params, n, base):
    g = torch.Generator().manual_seed(4)
    shape = (CHUNK // 50 + 3, 50)
    b = torch.randn(shape, generator=g, dtype=D)
    models = [b + torch.randn(shape, generator=g, dtype=D) * s for s in (0.5, 1.0, 2.0)[:n]]
    weights = [1.0, 3.0, 2.0][:n]
    m = get_method(name)
    got = m.merge([{"w": t} for t in models], base={"w": b} if base else None,
                  weights=None if name == "karcher" else weights, **params)["w"]
    flat = [t.reshape(-1) for t in models]
    if name == "slerp":
        a, c = b.reshape(-1), flat[0]
        t = params["t"]
        omega = math.acos(float((a / a.norm()) @ (c / c.norm())))
        want = math.sin((1 - t) * omega) / math.sin(omega) * a + math.sin(t * omega) / math.sin(omega) * c
    elif name == "nuslerp":
        a, c = (flat[0] - b.reshape(-1), flat[1] - b.reshape(-1)) if base else (flat[0], flat[1])
        omega = math.acos(float((a / a.norm()) @ (c / c.norm())))
        t = 0.75
        want = math.sin((1 - t) * omega) / math.sin(omega) * a + math.sin(t * omega) / math.sin(omega) * c
        want = want + (b.reshape(-1) if base else 0.0)
    elif name == "multislerp":
        want = flat[0] if n == 1 else b.reshape(-1) + multislerp_by_definition([f - b.reshape(-1) for f in flat],
                                                                               weights)
    else:
        want = karcher_mean(flat, [1 / n] * n, 10, 1e-5)
    assert torch.allclose(got.reshape(-1), want, rtol=1e-11, atol=1e-11)


def test_model_stock_from_the_gram_matrix_equals_the_vector_rule():
    from symmerge.merge.specialized import model_stock_ratio, model_stock_t

    for spread in (1e-3, 1.0, 100.0):
        vs = vectors(3, 400, spread, 6)
        base = torch.randn(400, dtype=D)
        want = float(model_stock_ratio([v - base for v in vs]).reshape(()))
        assert math.isclose(model_stock_t(gram(vs, base)), want, rel_tol=1e-12, abs_tol=1e-14)
        got = get_method("model_stock").merge([{"w": v} for v in vs], base={"w": base})["w"]
        assert torch.allclose(got, want * sum(vs) / 3 + (1 - want) * base, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("shape", [(700, 90), (5000,), (3, 4, 50)])
def test_arcee_fusion_rows_at_a_time_equals_the_whole_tensor_code(shape, dtype, monkeypatch):
    from symmerge.merge import specialized
    from symmerge.merge.specialized import arcee_importance

    g = torch.Generator().manual_seed(7)
    base = torch.randn(shape, generator=g).to(dtype)
    other = (base.double() + 0.05 * torch.randn(shape, generator=g, dtype=D)).to(dtype)
    monkeypatch.setattr(specialized, "_ROWS", 1000)  # several row blocks
    got = get_method("arcee_fusion").merge([{"w": other}], base={"w": base})["w"]
    half = dtype in (torch.float16, torch.bfloat16)  # mergekit's arithmetic in the half dtype itself
    work = dtype if half else torch.promote_types(dtype, torch.float32)
    importance = arcee_importance(other.to(work), base.to(work))
    s = importance.reshape(-1).sort().values  # the quantiles by a full sort
    q1, median, q3 = (s[int(q * (s.numel() - 1))] for q in (0.25, 0.5, 0.75))
    keep = importance >= (median + 1.5 * (q3 - q1) if half else float(median) + 1.5 * (float(q3) - float(q1)))
    if half:
        want = (base.float() + (other - base).float() * keep).to(dtype)
    else:
        want = (base.double() + (other.double() - base.double()) * keep).to(dtype)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert 0 < int((got != base).sum()) < got.numel()
