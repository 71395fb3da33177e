"""symmerge's own TIES / DARE-TIES / DARE / task-arithmetic variants (weight first: model-wide or per-tensor
threshold, 1/(1 − p), disjoint mean) by the one kernel (numba, kernels_whole.task_vector_into) against their torch
definitions (reference_rules.py, the oracle kept in the tests), bit for bit, on adversarial values; and TIES
against a from-definition reference written here without the library's parts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from reference_rules import radix_thresholds, torch_rules

from symmerge.merge import get_method, kernels
from symmerge.merge.parts import dare_keep_mask


def adversarial(n: int, size: int, dtype, seed: int) -> list[torch.Tensor]:
    """A base and ``n`` models whose task vectors mix signs, exact zeros, exact cancellations, ties in
    magnitude, huge exponent gaps and subnormal differences."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(size, generator=g, dtype=torch.float64)
    base[: size // 8] = 0.0
    out = [base]
    for i in range(n):
        tau = torch.randn(size, generator=g, dtype=torch.float64) * torch.logspace(-30, 3, size, dtype=torch.float64)[
            torch.randperm(size, generator=g)]
        tau[torch.rand(size, generator=g) < 0.15] = 0.0  # unchanged entries
        tau[torch.rand(size, generator=g) < 0.1] = 0.125 * (-1) ** i  # ties in magnitude, opposite signs
        if i == 1:
            tau[: size // 10] = -(out[1][: size // 10] - base[: size // 10])  # cancels model 0 exactly
        out.append(base + tau)
    return [t.to(dtype) for t in out]


# symmerge's own variants of ties and dare_ties (model-wide threshold, 1/(1 - p), disjoint mean): the chunked
# rules these kernels fuse; explicit parameters since every name means mergekit's method by default
VARIANTS = {"ties": {"scope": "model", "normalize": "count"}, "dare_ties": {"rescale": "inverse", "normalize": "count"},
            "dare_linear": {"rescale": "inverse", "normalize": False}, "task_arithmetic": {}}


def by_definition(method: str, sds, **kwargs):
    """``get_method(method).merge`` with the torch definitions (reference_rules.py) in place of the kernels."""
    with pytest.MonkeyPatch.context() as mp:
        torch_rules(mp)
        return get_method(method).merge(sds, **kwargs)


def both(method: str, models, base, weights, **params):
    """The merge of ``method`` (symmerge's variant, unless the parameters say otherwise) by the kernel and by the
    torch definition."""
    m = get_method(method)
    params = {**VARIANTS.get(method, {}), **params}
    sds = [{"w": t.reshape(-1, 40) if t.numel() % 40 == 0 else t} for t in models]
    b = {"w": base.reshape(-1, 40) if base.numel() % 40 == 0 else base}
    fused = m.merge(sds, base=b, weights=weights, **params)["w"]
    plain = by_definition(method, sds, base=b, weights=weights, **params)["w"]
    return fused, plain


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.float64:
        return torch.equal(a.view(torch.int64), b.view(torch.int64))
    if a.dtype == torch.float32:
        return torch.equal(a.view(torch.int32), b.view(torch.int32))
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_fused_ties_and_dare_ties_equal_the_torch_code_bit_for_bit(dtype, n):
    tensors = adversarial(n, 3 * 32768 + 200, dtype, seed=n)  # several chunks of the elementwise loop
    base, models = tensors[0], tensors[1:]
    cases = [("ties", None, dict(density=0.3)), ("ties", [0.7, 1.3, 2.0, 0.5, 1.0][:n], dict(density=0.05, scale=0.6)),
             ("ties", None, dict(density=0.5, scope="tensor")), ("ties", None, dict(density=1.0)),
             ("dare_ties", None, dict(drop=0.6, seed=3)), ("dare_ties", [0.7, 1.3, 2.0, 0.5, 1.0][:n],
                                                          dict(drop=0.9, seed=1, scale=1.7)),
             ("dare_ties", None, dict(drop=0.0))]
    for method, weights, params in cases:
        fused, plain = both(method, models, base, weights, **params)
        assert fused.dtype == dtype
        assert bits_equal(fused, plain), (method, weights, params)
        assert not torch.equal(fused, base.reshape(fused.shape))  # a real merge


def test_fused_threshold_equals_the_torch_radix_select():
    from symmerge.merge.parts import task_vector_thresholds

    tensors = adversarial(3, 50000, torch.float32, seed=9)
    base, models = tensors[0], tensors[1:]
    halves = [(list(t[:20000] for t in models), base[:20000]), (list(t[20000:] for t in models), base[20000:])]
    for weights in ([1.0, 1.0, 1.0], [0.3, 2.5, 1.0]):
        for density in (1e-4, 0.01, 0.2, 0.77):
            got = task_vector_thresholds(lambda: iter(halves), weights, density)
            assert got == radix_thresholds(lambda: iter(halves), weights, density)
            for i, w in enumerate(weights):  # and the k-th largest float32 magnitude by a sort
                mags = ((models[i].double() - base.double()) * w).abs().float()
                k = max(1, round(density * mags.numel()))
                assert got[i] == mags.sort(descending=True).values[k - 1].item()


def ties_by_definition(models, base, density: float, scale: float) -> torch.Tensor:
    """TIES written from its definition, entry by entry in Python floats (float64): each task vector
    keeps its k = round(density·size) entries of largest float32 magnitude (ties at the k-th value
    kept); the sign of the sum is elected; the kept entries of that sign are averaged."""
    taus = [[float(t) - float(b) for t, b in zip(m.tolist(), base.tolist())] for m in models]
    trimmed = []
    for tau in taus:
        mags = sorted((abs(torch.tensor(v, dtype=torch.float32).item()) for v in tau), reverse=True)
        kth = mags[max(1, round(density * len(tau))) - 1]
        trimmed.append([v if abs(torch.tensor(v, dtype=torch.float32).item()) >= kth else 0.0 for v in tau])
    out = []
    for j, b in enumerate(base.tolist()):
        values = [t[j] for t in trimmed]
        total = 0.0
        for v in values:
            total += v
        agreeing = [v for v in values if v != 0.0 and (v > 0) == (total > 0)] if total != 0.0 else []
        mean = 0.0
        for v in agreeing:
            mean += v
        out.append(b + scale * (mean / len(agreeing) if agreeing else 0.0))
    return torch.tensor(out, dtype=torch.float64).to(base.dtype)


@pytest.mark.parametrize("fused", [True, False])
def test_ties_equals_its_definition_entry_by_entry(fused):
    g = torch.Generator().manual_seed(2)
    base = torch.randn(3000, generator=g)
    models = [base + torch.randn(3000, generator=g) * 0.1 for _ in range(3)]
    models[1][:300] = models[0][:300]  # equal entries, and opposite ones that cancel in the sum
    models[2][:300] = 2 * base[:300] - models[0][:300]
    merge = get_method("ties").merge if fused else (lambda *a, **k: by_definition("ties", *a, **k))
    params = dict(VARIANTS["ties"], scale=0.8)
    got = merge([{"w": m} for m in models], base={"w": base}, density=0.3, **params)["w"]
    wrong = merge([{"w": m} for m in models], base={"w": base}, density=0.31, **params)["w"]
    expected = ties_by_definition(models, base, 0.3, 0.8)
    assert torch.equal(got, expected)
    assert not torch.equal(wrong, expected)  # the reference tells densities apart


def test_fused_dare_ties_uses_the_documented_masks():
    n = 40000
    base = torch.zeros(n)
    models = [torch.full((n,), 1.0), torch.full((n,), -0.5)]
    out = get_method("dare_ties").merge([{"w": m} for m in models], base={"w": base}, drop=0.5, seed=11,
                                        **VARIANTS["dare_ties"])["w"]
    k0, k1 = dare_keep_mask((n,), 0.5, 11, 0, "w"), dare_keep_mask((n,), 0.5, 11, 1, "w")
    expect = torch.where(k0, 2.0, torch.where(k1, -1.0, 0.0))  # model 0 wins where both survive
    assert torch.equal(out, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [2, 3])  # two inputs: the three sums in one pass
def test_fused_report_distances_equal_float64_sums(dtype, n):
    g = torch.Generator().manual_seed(4)
    xs = [(torch.randn(40007, generator=g) * (i + 1)).to(dtype) for i in range(n)]
    y = (sum(x.double() for x in xs) / n).to(dtype)
    pairs, to_result = kernels.sq_distances(xs, y)
    for (i, j), v in pairs.items():
        assert v == pytest.approx(((xs[i].double() - xs[j].double()) ** 2).sum().item(), rel=1e-12)
    for i, v in enumerate(to_result):
        assert v == pytest.approx(((y.double() - xs[i].double()) ** 2).sum().item(), rel=1e-12)
    half = kernels.sq_distances([x.half() for x in xs], y.half())  # float16: widened exactly, the same kernel
    assert half == kernels.sq_distances([x.half().float() for x in xs], y.half().float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_fused_average_equals_the_torch_code_bit_for_bit(dtype, n):
    """The one-pass average (weighted sum with torch's fused multiply-adds, then the cast, bfloat16 by
    round-to-nearest-even through float32) against the chunked torch rule, on adversarial values."""
    models = adversarial(n, 3 * 32768 + 200, dtype, seed=10 + n)[1:]  # several chunks of the torch loop
    m, sds = get_method("average"), [{"w": t.reshape(-1, 8)} for t in models]
    for weights in (None, [0.7, 1.3, 2.0, 0.5, 1.0][:n], [1e-30, 1.0, 3.0, 1e-3, 7.0][:n]):
        fused = m.merge(sds, weights=weights)["w"]
        with pytest.MonkeyPatch.context() as mp:  # the torch chunks (the rule where the kernel declines)
            mp.setattr(kernels, "average_into", lambda *a: False)
            plain = m.merge(sds, weights=weights)["w"]
        assert fused.dtype == dtype and bits_equal(fused, plain), weights
        if n > 1:
            assert not torch.equal(fused, models[0].reshape(fused.shape))  # a real merge
    assert kernels._average_agrees()  # this machine gives torch's bits, so the kernel really ran above


def test_fused_average_declines_what_it_does_not_cover():
    x = torch.randn(100)
    out = torch.empty(100)
    assert kernels.average_into([x, x], [0.5, 0.5], out) and torch.equal(out, x)
    assert not kernels.average_into([x.half(), x.half()], [0.5, 0.5], out.half())  # float16: the torch chunks
    assert not kernels.average_into([x, x.double()], [0.5, 0.5], out)  # mixed dtypes
    assert not kernels.average_into([x[::2], x[::2]], [0.5, 0.5], torch.empty(50))  # not contiguous


def test_dare_uniforms_are_splitmix64_known_answers():
    """SplitMix64's published first outputs for seed 1234567 (Vigna's reference splitmix64.c), as the
    uniforms' top 53 bits; a stream read from any position gives the same entries."""
    from symmerge.merge.parts import dare_uniforms

    known = [6457827717110365317, 3203168211198807973, 9817491932198370423, 4593380528125082431,
             16408922859458223821]
    got = dare_uniforms(1234567, 0, 5)
    assert got.dtype == torch.float64
    assert got.tolist() == [(z >> 11) * 2.0 ** -53 for z in known]
    assert torch.equal(dare_uniforms(1234567, 3, 2), got[3:])
    u = dare_uniforms(99, 0, 200000)  # uniform on [0, 1): a coarse check of the stream
    assert 0.0 <= u.min() and u.max() < 1.0 and abs(u.mean().item() - 0.5) < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_every_own_variant_equals_its_definition(dtype):
    """symmerge's own variants of every task-vector rule (the model-wide and per-tensor thresholds, DARE's
    1/(1 − p) with the sum and the disjoint mean, task arithmetic), float16 included (computed from the float64
    result, rounded once), by the kernel and by the torch definition: the same bits."""
    tensors = adversarial(3, 2 * 32768 + 77, dtype, seed=5)
    base, models = tensors[0], tensors[1:]
    for method, params in (("ties", dict(density=0.2)), ("ties", dict(density=0.4, scope="tensor")),
                           ("dare_ties", dict(drop=0.7, seed=2, scale=1.3)), ("dare_linear", dict(drop=0.3, seed=4)),
                           ("dare_linear", dict(drop=0.3, seed=4, normalize="count")),
                           ("task_arithmetic", dict(scale=0.7, normalize="count"))):
        fused, plain = both(method, models, base, [0.7, -1.3, 2.0], **params)
        assert fused.dtype == dtype and bits_equal(fused, plain), (method, params)


def test_dare_kernel_draws_the_documented_uniforms_far_into_a_stream():
    """Entries beyond 2³² of a tensor's stream: the kernel's integer test k ≥ ⌈drop·2⁵³⌉ on the stream's 53
    bits keeps exactly the entries whose :func:`dare_uniforms` value is ≥ drop."""
    from symmerge.merge.parts import dare_uniforms

    m, start, seed, drop = 5000, (1 << 33) + 11, 123456789, 0.37
    cut = np.uint64(np.ceil(drop * 9007199254740992.0))
    bits = [kernels._bits53_jit(np.uint64(seed), start + j) for j in range(m)]
    keep = dare_uniforms(seed, start, m) >= drop
    assert [bool(b >= cut) for b in bits] == keep.tolist()
    assert [float(b) * 2.0 ** -53 for b in bits[:50]] == dare_uniforms(seed, start, 50).tolist()
    assert 0.55 < keep.double().mean().item() < 0.70


@pytest.mark.parametrize("split", [1, 2, 3])
def test_split_threshold_counts_equal_one_pass(split, monkeypatch):
    """Tensors of at least 2²⁰ entries are counted by several threads, each range into its own
    histograms: the thresholds equal a sort's k-th largest magnitude whatever the split."""
    from symmerge.merge.parts import task_vector_thresholds

    monkeypatch.setattr(kernels, "workers", lambda: split)
    g = torch.Generator().manual_seed(4)
    base = torch.randn((1 << 20) + 333, generator=g)
    models = [base + torch.randn(base.shape, generator=g) * 10.0 ** (-i) for i in range(3)]
    pairs = [(models, base), ([m[:1000] for m in models], base[:1000])]  # a large and a small tensor
    weights = [1.0, 0.5, 2.0]
    got = task_vector_thresholds(lambda: iter(pairs), weights, 0.1)
    for i, w in enumerate(weights):
        mags = torch.cat([((p[0][i].double() - p[1].double()) * w).abs().float() for p in pairs])
        assert got[i] == mags.sort(descending=True).values[round(0.1 * mags.numel()) - 1].item()


def sorted_magnitudes(pairs, weights) -> list[torch.Tensor]:
    """Per model, every float32 |(t − b)·w| over every pair's entries, sorted in descending order."""
    return [torch.cat([((p[0][i].double() - p[1].double()) * w).abs().float().reshape(-1) for p in pairs])
            .sort(descending=True).values for i, w in enumerate(weights)]


def kth_largest_magnitudes(pairs, weights, density, by_sort=None):
    """Per model, the k-th largest float32 |(t − b)·w| over every pair's entries, by a sort (``by_sort``: the
    sorted_magnitudes of these pairs and weights, sorted once for several densities)."""
    by_sort = sorted_magnitudes(pairs, weights) if by_sort is None else by_sort
    return [mags[max(1, round(density * mags.numel())) - 1].item() for mags in by_sort]


@pytest.mark.parametrize("split", [1, 2])
def test_window_thresholds_equal_a_sort(split, monkeypatch):
    """The one-visit select (a sample places a window around the k-th largest; the visit counts above
    it and keeps what is inside) finds a sort's k-th largest magnitude, ties and zeros included, with
    the window path actually taken."""
    from symmerge.merge import parts

    monkeypatch.setattr(kernels, "workers", lambda: split)
    monkeypatch.setattr(parts, "_SAMPLE", 1 << 14)  # a sparse sample: stride > width
    g = torch.Generator().manual_seed(11)
    base = torch.randn((1 << 20) + 777, generator=g)
    models = [base + torch.randn(base.shape, generator=g) * 10.0 ** (-i) for i in range(3)]
    models[0][: 1 << 17] = base[: 1 << 17]  # a block of zero task-vector entries
    models[1][::7] = base[::7] + 0.25  # many ties in magnitude
    pairs = [(models, base), ([m[:3001] for m in models], base[:3001]), ([m[5:9] for m in models], base[5:9])]
    total = sum(p[1].numel() for p in pairs)
    taken = []
    real = parts._window_thresholds
    monkeypatch.setattr(parts, "_window_thresholds", lambda *a: taken.append(real(*a)) or taken[-1])
    for weights in ([1.0, 1.0, 1.0], [0.3, 2.5, 1.0]):
        by_sort = sorted_magnitudes(pairs, weights)  # the reference's sort, once for the seven densities
        for density in (1e-6, 0.01, 0.2, 0.5, 0.93, 0.99, 1.0):
            got = parts.task_vector_thresholds(lambda: iter(pairs), weights, density, total=total)
            assert got == kth_largest_magnitudes(pairs, weights, density, by_sort), (weights, density)
            assert taken[-1] == got, (weights, density)  # found in one visit, no fallback


def test_window_thresholds_fall_back_when_the_window_misses(monkeypatch):
    """A window that misses the k-th largest (or overflows its buffer) is detected: the two-visit radix
    select then gives the exact thresholds."""
    from symmerge.merge import parts

    g = torch.Generator().manual_seed(12)
    base = torch.randn(300_000, generator=g)
    models = [base + torch.randn(base.shape, generator=g) for _ in range(2)]
    pairs = [(models, base)]
    want = kth_largest_magnitudes(pairs, [1.0, 1.0], 0.2)
    half, one = 0x3F000000, 0x3F800000  # 0.5 and 1.0: the k-th largest (20 %) is about 1.28, above 1.0
    for bounds in ((0, 1, 300_000), (half, one, 300_000), (0, 0x7F800000, 10)):  # far below, below, overflow
        monkeypatch.setattr(parts, "_window_bounds", lambda sample, k, total, b=bounds: b)
        assert parts._window_thresholds(lambda: iter(pairs), [1.0, 1.0], 0.2, 300_000) is None
        assert parts.task_vector_thresholds(lambda: iter(pairs), [1.0, 1.0], 0.2, total=300_000) == want


def test_ties_merge_with_the_window_select_equals_the_torch_code(monkeypatch):
    """The whole TIES merge (model-wide thresholds through the method's prepare) is bit-equal to the
    torch code when the thresholds come from the one-visit select."""
    from symmerge.merge import parts

    monkeypatch.setattr(parts, "_WINDOW_MIN", 0)
    monkeypatch.setattr(parts, "_SAMPLE", 1 << 12)
    tensors = adversarial(3, 3 * 32768 + 200, torch.float32, seed=5)
    for density in (0.05, 0.3, 0.9):
        fused, plain = both("ties", tensors[1:], tensors[0], [0.7, 1.3, 2.0], density=density)
        assert bits_equal(fused, plain), density


@pytest.mark.parametrize("split", [2, 3])
def test_split_ties_merge_equals_the_torch_code(split, monkeypatch):
    """A tensor merged by several threads, each over its own range of entries (DARE's uniforms indexed
    from the range's first entry), is bit-equal to the torch code: TIES and DARE-TIES, float32 and
    bfloat16."""
    from symmerge.merge import kernels_whole

    monkeypatch.setattr(kernels, "workers", lambda: split)
    monkeypatch.setattr(kernels_whole, "_SPLIT", 1000)
    def drop_pools():
        for pool in kernels._pools.values():
            pool.shutdown()
        kernels._pools.clear()

    drop_pools()  # a pool of ``split`` threads
    try:
        for dtype in (torch.float32, torch.bfloat16):
            tensors = adversarial(3, 3 * 32768 + 211, dtype, seed=21)
            for method, params in (("ties", dict(density=0.3)), ("dare_ties", dict(drop=0.7, seed=5))):
                fused, plain = both(method, tensors[1:], tensors[0], [0.7, 1.3, 2.0], **params)
                assert bits_equal(fused, plain), (dtype, method)
    finally:
        drop_pools()
