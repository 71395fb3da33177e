"""mergekit's methods in symmerge, checked against their definitions on small hand-made tensors (no mergekit
needed: tests/merge/test_mergekit_methods.py compares with mergekit itself), the streamed path against the
in-memory one, and the parameter checks."""

from __future__ import annotations

import math

import pytest
import torch

from symmerge.errors import SymmergeError
from symmerge.merge import MERGEKIT_METHODS, METHODS, get_method
from symmerge.merge.base import CHUNK, merge_tensor
from symmerge.merge.parts import breadcrumbs_band, della_keep_probabilities
from symmerge.merge.spherical import karcher_mean
from symmerge.merge.steps import step_arguments, uniform_steps

D = torch.float64


def merge(name, tensors, base=None, weights=None, **params):
    m = get_method(name)
    out = m.merge([{"w": t} for t in tensors], weights=weights, base=None if base is None else {"w": base}, **params)
    return out["w"]


def test_every_mergekit_method_is_registered_and_symmerge_names_are_aliases():
    assert set(MERGEKIT_METHODS) <= set(METHODS) and len(MERGEKIT_METHODS) == 20
    g = torch.Generator().manual_seed(0)
    a, b, base = (torch.randn(50, generator=g) for _ in range(3))
    assert torch.equal(merge("average", [a, b], weights=[1.0, 3.0]), merge("linear", [a, b], weights=[1.0, 3.0]))
    unnormalised = (a.double() + 3.0 * b.double()).float()
    assert torch.equal(merge("linear", [a, b], weights=[1.0, 3.0], normalize=False), unnormalised)
    assert torch.equal(merge("dare", [a, b], base=base, drop=0.3), merge("dare_linear", [a, b], base=base, density=0.7))
    assert torch.equal(merge("ties", [a, b], base=base, scale=0.5), merge("ties", [a, b], base=base, **{"lambda": 0.5}))


# ------------------------------------------------------------------ spherical


def test_slerp_ends_and_orthogonal_vectors():
    e0, e1 = torch.tensor([1.0, 0.0, 0.0], dtype=D), torch.tensor([0.0, 3.0, 0.0], dtype=D)
    assert torch.equal(merge("slerp", [e1], base=e0, t=0.0), e0)
    assert torch.allclose(merge("slerp", [e1], base=e0, t=1.0), e1, atol=1e-15)
    for t in (0.3, 0.5, 0.8):  # orthogonal: cos/sin weights on the unnormalised vectors
        expect = math.cos(t * math.pi / 2) * e0 + math.sin(t * math.pi / 2) * e1
        assert torch.allclose(merge("slerp", [e1], base=e0, t=t), expect, atol=1e-14)
    # (nearly) parallel: the linear mix
    assert torch.allclose(merge("slerp", [2 * e0], base=e0, t=0.5), 1.5 * e0)
    # a matrix is slerped as one flattened vector: I and the swap are orthogonal
    eye, swap = torch.eye(2, dtype=D), torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=D)
    assert torch.allclose(merge("slerp", [swap], base=eye, t=0.5), torch.full((2, 2), 0.5 ** 0.5, dtype=D))


def test_nuslerp_takes_t_from_the_weights_rows_or_columns_and_task_vectors():
    e0, e1 = torch.tensor([1.0, 0.0, 0.0], dtype=D), torch.tensor([0.0, 3.0, 0.0], dtype=D)
    out = merge("nuslerp", [e0, e1], weights=[1.0, 3.0])  # t = 3/4
    assert torch.allclose(out, math.cos(0.75 * math.pi / 2) * e0 + math.sin(0.75 * math.pi / 2) * e1)
    base = torch.tensor([1.0, 1.0, 1.0], dtype=D)
    assert torch.allclose(merge("nuslerp", [base + e0, base + e1], base=base, weights=[1.0, 3.0]), base + out)
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]], dtype=D)
    b = torch.tensor([[0.0, 1.0], [2.0, 0.0]], dtype=D)
    rows = merge("nuslerp", [a, b], nuslerp_flatten=False)  # each row with its row: orthogonal pairs
    assert torch.allclose(rows, (a + b) * 0.5 ** 0.5)
    cols = merge("nuslerp", [a, b.T.contiguous()], nuslerp_flatten=False, nuslerp_row_wise=True)
    assert torch.allclose(cols, (a + b.T) * 0.5 ** 0.5)
    with pytest.raises(SymmergeError, match="exactly 2"):
        merge("nuslerp", [a])


def test_multislerp_of_two_orthogonal_unit_vectors_is_their_bisector():
    e0, e1 = torch.tensor([1.0, 0.0], dtype=D), torch.tensor([0.0, 1.0], dtype=D)
    assert torch.allclose(merge("multislerp", [e0, e1]), torch.tensor([1.0, 1.0], dtype=D) * 0.5 ** 0.5, atol=1e-7)
    assert torch.equal(merge("multislerp", [2 * e0]), 2 * e0)


def test_karcher_mean_is_the_point_where_the_log_maps_cancel():
    g = torch.Generator().manual_seed(1)
    vs = [torch.randn(5, generator=g, dtype=D) * s for s in (1.0, 2.0, 0.5)]
    mean = karcher_mean(vs, [1 / 3] * 3, max_iter=200, tol=1e-12)
    m = mean / mean.norm()
    logs = []
    for v in vs:  # log map on the sphere at m
        u = v / v.norm()
        c = float(m @ u)
        theta = math.acos(max(-1.0, min(1.0, c)))
        logs.append(theta / math.sin(theta) * (u - c * m))
    assert float(sum(logs).norm()) < 1e-9
    assert math.isclose(float(mean.norm()), sum(float(v.norm()) for v in vs) / 3, rel_tol=1e-12)
    out = merge("karcher", vs, max_iter=200, tol=1e-12)
    assert torch.allclose(out, mean)


# ------------------------------------------------------------------ task vectors


def test_model_stock_ratio_from_the_angle():
    base = torch.zeros(3, dtype=D)
    t1 = torch.tensor([1.0, 0.0, 0.0], dtype=D)
    t2 = torch.tensor([0.5, 3 ** 0.5 / 2, 0.0], dtype=D)  # 60 degrees: cos = 1/2, t = 2 cos / (1 + cos) = 2/3
    out = merge("model_stock", [1.0 + t1, 1.0 + t2], base=base + 1.0)
    assert torch.allclose(out, 1.0 + (2 / 3) * (t1 + t2) / 2)
    with pytest.raises(SymmergeError, match="at least 2"):
        merge("model_stock", [t1], base=base)


def test_ties_mergekit_normalize_by_the_agreeing_weights():
    base = torch.zeros(4, dtype=D)
    t1 = torch.tensor([5.0, 1.0, -1.0, 0.5], dtype=D)
    t2 = torch.tensor([-1.0, -1.0, 1.0, 0.4], dtype=D)
    m = get_method("ties")
    p = {k: m.params[k] for k in ("scope", "density", "normalize")}
    assert p == {"scope": "topk", "density": 1.0, "normalize": True}  # mergekit's defaults are the method's
    out = merge("ties", [t1, t2], base=base, weights=[0.5, 2.0])
    # weighted: [2.5, .5, -.5, .25] and [-2, -2, 2, .8]; sums .5, -1.5, 1.5, 1.05 -> (+, -, +, +)
    assert torch.allclose(out, torch.tensor([5.0, -1.0, 1.0, (0.25 + 0.8) / 2.5], dtype=D))
    # a sum of exactly 0 elects +; normalize false sums the agreeing entries
    out = merge("ties", [t1[:2], -t1[:2]], base=base[:2], **{**p, "normalize": False})
    assert torch.equal(out, torch.tensor([5.0, 1.0], dtype=D))
    # mergekit's top-k: max(1, floor(density * n)) per tensor
    one = torch.tensor([5.0, -4, 3, -2, 1, 0.5, -0.25, 0.1, -0.05, 0.01], dtype=D)
    out = merge("ties", [one], base=torch.zeros(10, dtype=D), **{**p, "density": 0.35})
    assert torch.equal(out, torch.where(torch.arange(10) < 3, one, 0.0))
    out = merge("ties", [one], base=torch.zeros(10, dtype=D), **{**p, "density": 0.01})
    assert torch.equal(out, torch.where(torch.arange(10) < 1, one, 0.0))
    # symmerge's own variant (explicit parameters): model-wide threshold, disjoint mean of the weighted vectors
    assert torch.allclose(merge("ties", [t1, t2], base=base, weights=[0.5, 2.0], density=1.0, scope="model",
                                normalize="count"),
                          torch.tensor([2.5, -2.0, 2.0, (0.25 + 0.8) / 2], dtype=D))


def test_breadcrumbs_keeps_exactly_the_mid_band():
    tau = torch.tensor([5.0, -4, 3, -2, 1, 0.5, -0.25, 0.1, -0.05, 0.01], dtype=D)  # sorted by magnitude
    for density, gamma, kept in ((0.5, 0.1, range(1, 6)), (0.5, 0.2, range(2, 7)), (0.7, 0.25, range(2, 9)),
                                 (0.3, 0.8, range(7, 10)), (1.0, 0.3, range(10))):
        mask = breadcrumbs_band(tau, density, gamma)
        assert mask.tolist() == [i in kept for i in range(10)], (density, gamma)
        out = merge("breadcrumbs", [tau], base=torch.zeros(10, dtype=D), density=density, gamma=gamma)
        assert torch.equal(out, tau * mask)


def test_della_keep_probabilities_by_rank_and_rates():
    row = torch.tensor([[1.0, -3.0, 2.0, 4.0]], dtype=D)
    p = della_keep_probabilities(row, 0.5, 0.1)
    assert torch.allclose(p, torch.tensor([[0.4, 0.5 + 0.1 / 3, 0.5 - 0.1 / 3, 0.6]], dtype=D))
    g = torch.Generator().manual_seed(0)
    tau = torch.randn(200, 500, generator=g, dtype=D)
    out = merge("della_linear", [tau], base=torch.zeros_like(tau), density=0.3, epsilon=0.2)
    kept = out != 0
    assert abs(kept.double().mean().item() - 0.3) < 0.01
    ranks = tau.abs().argsort(1).argsort(1)  # larger magnitudes are kept more often
    assert kept[ranks >= 400].double().mean() > 0.45 and kept[ranks < 100].double().mean() < 0.15
    assert math.isclose(float(out.abs().sum()), float(tau.abs().sum()), rel_tol=1e-12)  # L1 rescale
    with pytest.raises(SymmergeError, match="epsilon"):
        merge("della", [tau], base=tau, density=0.1, epsilon=0.15)


def test_dare_linear_mergekit_rescale_restores_the_l1_norm():
    g = torch.Generator().manual_seed(0)
    tau = torch.randn(4000, generator=g, dtype=D)
    m = get_method("dare_linear")
    p = {"density": 0.3}
    assert m.params["rescale"] is True  # mergekit's default
    out = merge("dare_linear", [tau], base=torch.zeros_like(tau), **p)
    assert abs((out != 0).double().mean().item() - 0.3) < 0.03
    assert math.isclose(float(out.abs().sum()), float(tau.abs().sum()), rel_tol=1e-12)
    plain = merge("dare_linear", [tau], base=torch.zeros_like(tau), density=0.3, rescale=False)
    assert torch.equal(plain, torch.where(out != 0, tau, 0.0))
    # symmerge's dare: the same mask, survivors / (1 - p)
    assert torch.allclose(merge("dare", [tau], base=torch.zeros_like(tau), drop=0.7, rescale="inverse"), plain / 0.3)


def test_sce_weights_select_and_erase():
    base = torch.zeros(4, dtype=D)
    t1 = torch.tensor([2.0, 0.0, 1.0, -1.0], dtype=D)
    t2 = torch.tensor([1.0, 0.0, -2.0, -1.0], dtype=D)
    w1, w2 = 6 / 4, 6 / 4  # mean squares 1.5 and 1.5: equal weights
    out = merge("sce", [t1, t2], base=base)
    # elected: +, + (sum 0), -, -; agreeing means
    assert torch.allclose(out, torch.tensor([1.5, 0.0, -2.0, -1.0], dtype=D))
    assert w1 == w2
    # select_topk 0.5 of the 3 positions of non-zero variance: 1 (position 2, variance 2.25)
    out = merge("sce", [t1, t2], base=base, select_topk=0.5)
    assert torch.allclose(out, torch.tensor([0.0, 0.0, -2.0, 0.0], dtype=D))


def test_nearswap_arcee_fusion_passthrough_ram():
    base = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=D)
    other = torch.tensor([1.0, 2.1, 3.5, 8.0], dtype=D)
    assert torch.allclose(merge("nearswap", [other], base=base, t=0.2), torch.tensor([1.0, 2.1, 3.2, 4.2], dtype=D))
    assert torch.equal(merge("passthrough", [other], scale=2.0), 2 * other)
    assert torch.equal(merge("passthrough", [other]), other)
    with pytest.raises(SymmergeError, match="exactly 1"):
        merge("passthrough", [other, other])
    # arcee fusion: importance |o − b| · KL(softmax(o) ‖ softmax(b)) per row, kept from median + 1.5 IQR
    g = torch.Generator().manual_seed(0)
    b = torch.randn(16, 8, generator=g, dtype=D)
    o = b + 0.01 * torch.randn(16, 8, generator=g, dtype=D)
    o[2, 5] += 1.0
    p, q = torch.softmax(o, -1) + 1e-8, torch.softmax(b, -1) + 1e-8
    imp = (o - b).abs() * (p * (p / q).log()).sum(-1, keepdim=True)
    srt = imp.reshape(-1).sort().values
    q1, med, q3 = (srt[int(x * 127)] for x in (0.25, 0.5, 0.75))
    keep = imp >= med + 1.5 * (q3 - q1)
    assert keep[2, 5] and 0 < int(keep.sum()) < 40
    assert torch.equal(merge("arcee_fusion", [o], base=b), b + (o - b) * keep)
    # ram: unique changes taken, shared ones averaged, below epsilon ignored
    t1 = base + torch.tensor([0.5, 0.0, 1.0, 1e-7], dtype=D)
    t2 = base + torch.tensor([0.0, 0.0, 3.0, 0.0], dtype=D)
    assert torch.allclose(merge("ram", [t1, t2], base=base), base + torch.tensor([0.5, 0.0, 2.0, 0.0], dtype=D))
    # ramplus_tl: model 1 has 1 unique and 1 shared entry: rho 1 -> clamp 0.2 -> lambda 1 + 0.1 * 0.2
    out = merge("ramplus_tl", [t1, t2], base=base)
    assert torch.allclose(out, base + torch.tensor([0.5 * 1.02, 0.0, 2.0, 0.0], dtype=D))


# ------------------------------------------------------------------ streamed = in memory


CONFIGS = {
    "linear": ({}, False, 2), "slerp": ({"t": 0.4}, True, 1), "nuslerp": ({}, True, 2),
    "multislerp": ({}, True, 3), "karcher": ({}, False, 3), "task_arithmetic": ({"lambda": 0.7}, True, 3),
    "ties": ({"density": (0.5, 0.3, 0.7)}, True, 3), "dare_ties": ({"density": 0.4}, True, 3),
    "dare_linear": ({"density": 0.4}, True, 3), "breadcrumbs": ({"density": 0.6, "gamma": 0.1}, True, 3),
    "breadcrumbs_ties": ({"density": 0.6}, True, 3), "della": ({"density": 0.5}, True, 3),
    "della_linear": ({"density": 0.5}, True, 3), "sce": ({"select_topk": 0.5}, True, 3),
    "model_stock": ({}, True, 3), "nearswap": ({"t": 0.05}, True, 1), "arcee_fusion": ({}, True, 1),
    "passthrough": ({"scale": 0.5}, False, 1), "ram": ({"epsilon": 0.05}, True, 3),
    "ramplus_tl": ({"epsilon": 0.05}, True, 3),
}


# symmerge's own variants, as explicit parameters (the defaults are mergekit's)
VARIANTS = {"ties": {"scope": "model", "normalize": "count", "density": 0.2}, "dare_linear": {"rescale": "inverse"},
            "dare_ties": {"rescale": "inverse", "normalize": "count"}}


@pytest.mark.parametrize("name", MERGEKIT_METHODS)
@pytest.mark.parametrize("mergekit", [False, True])
def test_streamed_steps_give_the_in_memory_bits(name, mergekit):
    """The in-memory loop, the per-step path (steps + merge_tensor into a ring's uint8 memory) and, for
    elementwise rules, the whole-tensor rule agree bit for bit on a tensor of more than one chunk."""
    params, use_base, n = CONFIGS[name]
    m = get_method(name)
    if not mergekit:
        params = {**params, **VARIANTS.get(name, {})}
    g = torch.Generator().manual_seed(3)
    shapes = {"big": (CHUNK // 100 + 7, 100), "vec": (300,), "ids": (5,)}
    base = {k: torch.randn(s, generator=g).to(torch.bfloat16 if k == "vec" else torch.float32)
            for k, s in shapes.items()}
    base["ids"] = torch.arange(5)
    models = [{k: (v + 0.1 * torch.randn(v.shape, generator=g).to(v.dtype)) if v.is_floating_point() else v
               for k, v in base.items()} for _ in range(n)]
    weights = [0.6, 1.4, 0.9][:n] if name not in ("karcher", "model_stock", "sce", "passthrough") else None
    b = base if use_base else None
    memory = m.merge(models, weights=weights, base=b, **params)
    steps = uniform_steps(list(base), n, base=n if use_base else None, weights=weights, params=params)
    inputs = [*models, base]
    cache = {}
    for step in steps:
        w, p = step_arguments(m, step, n, cache)
        context = m.prepare(models, b, w, p) if m.prepare is not None else None
        ring = torch.empty(4 * base[step.name].numel() * 8, dtype=torch.uint8)
        sources = [inputs[s.model][s.key] for s in step.sources]
        b_step = None if step.base is None else inputs[step.base.model][step.base.key]
        value = merge_tensor(m, step.name, sources, w, None, b_step, p, context, out=ring)
        assert torch.equal(value, memory[step.name]), step.name
        assert value.dtype == base[step.name].dtype
        if m.elementwise and value.is_floating_point():
            ctx = m.tensor_context(step.name, sources, b_step, w, p, context) if m.tensor_context else context
            whole = m.tensor(step.name, sources, w, None, b_step, p, ctx)
            assert torch.equal(whole.to(value.dtype), value), step.name


# ------------------------------------------------------------------ parameters


@pytest.mark.parametrize("name, params, message", [
    ("ties", {"density": "abc"}, "'density' must be a number in"),
    ("ties", {"density": 1.5}, "'density' must be a number in"),
    ("dare_ties", {"density": -0.5}, "'density'"),  # 0: mergekit's drop of the task vector
    ("dare_linear", {"density": [0.5, 2.0]}, "'density'"),
    ("slerp", {}, "needs the parameter 't'"),
    ("slerp", {"t": "half"}, "'t' must be a finite number"),
    ("nearswap", {"t": float("nan")}, "'t'"),
    ("nuslerp", {"nuslerp_flatten": "maybe"}, "'nuslerp_flatten' must be true or false"),
    ("karcher", {"max_iter": 2.5}, "'max_iter' must be an integer"),
    ("ties", {"normalize": "sometimes"}, "'normalize'"),
    ("breadcrumbs", {"gamma": -0.1}, "'gamma'"),
    ("della", {"density": 0.1, "epsilon": 0.2}, "density ± epsilon"),
    ("sce", {"select_topk": 2}, "'select_topk'"),
    ("ties", {"lambda": 1.0, "scale": 2.0}, "'scale' or its alias 'lambda'"),
    ("linear", {"weight": 1.0}, "no parameter 'weight'"),
])
def test_bad_parameters_are_one_symmerge_error_naming_the_parameter(name, params, message):
    with pytest.raises(SymmergeError, match=message):
        get_method(name).check_params(params, n=2)


def test_string_values_from_the_command_line_are_checked_and_converted():
    m = get_method("ties")
    assert m.check_params({"normalize": "true"}, n=2)["normalize"] is True
    assert m.check_params({"density": [0.2, 0.4]}, n=2)["density"] == (0.2, 0.4)
    with pytest.raises(SymmergeError, match="has 3 values for 2 models"):
        m.check_params({"density": [0.2, 0.4, 0.1]}, n=2)
    assert get_method("dare_linear").check_params({"density": 0.25})["drop"] == 0.75
    checked = get_method("dare_ties").check_params({"density": 0.5})
    assert (checked["drop"], checked["rescale"], checked["normalize"]) == (0.5, True, False)


def test_model_counts_and_bases_are_checked():
    x = torch.zeros(3)
    with pytest.raises(SymmergeError, match="exactly 1"):
        merge("slerp", [x, x], base=x, t=0.5)
    with pytest.raises(SymmergeError, match="needs a base"):
        merge("slerp", [x], t=0.5)
    with pytest.raises(SymmergeError, match="does not use a base"):
        merge("karcher", [x, x], base=x)
    assert torch.equal(merge("multislerp", [x + 1, x + 2], base=x), merge("multislerp", [x + 1, x + 2], base=x))
