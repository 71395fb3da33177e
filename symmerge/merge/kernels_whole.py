"""Fused kernels for mergekit's per-tensor task-vector rules (numba; optional as :mod:`symmerge.merge.kernels`).

The torch code of :mod:`symmerge.merge.parts` (``_whole_task_vector_tensor``: sparsify each task vector
τ_i = θ_i − θ_base of one tensor on its own, rescale, weight, combine) is the definition. It forms float64
copies of whole tensors and sorts every task vector; these loops compute the same per-entry float64
arithmetic without them:

1. per model, a boolean mask of the kept entries and the two L1 norms of the rescale (Σ|τ|, Σ|kept τ|), in
   one pass (:func:`_mask_interval`, :func:`_mask_dare`, :func:`_mask_della`), the models at once on the
   merge pool; a magnitude rule's cut values are found by a radix select on the float32 bit patterns of
   |τ| (:func:`kth_largest`: two counting passes, no sort), its ties at a cut kept in flat order as the
   stable sort keeps them;
2. then the entries, split over the pool: the masked task vectors rescaled and weighted as the torch code
   does it, their sum or mergekit's sign election, ``θ_b + λ · combined``, cast into the output
   (:func:`_combine`).

The per-entry values and their order of operations are the torch code's; the L1 norms are summed in
another order than torch's (a relative difference of ~1e-16 in the rescale factor), and so are the row
sort's ties (none: a stable sort in both). ``tests/test_merge_kernels_whole.py`` compares both.
"""

from __future__ import annotations

import numpy as np

from . import kernels
from .kernels import _BLOCK, _OUT_KIND, _bits53_jit, _histogram_jit, _jit, _merge_pool, _store_jit

_HALF = 1 << 16
_U53 = 1.0 / 9007199254740992.0  # 2^-53: a uniform from its 53 bits (exact)


def _mask_interval(t, b, lo, lo_start, lo_stop, hi, hi_start, hi_stop, mask):  # pragma: no cover - compiled
    """mask[j] = the float32 magnitude v of τ_j = t_j − b_j (float64) lies strictly between ``lo`` and ``hi``,
    or equals ``lo`` and is the c-th such entry (flat order, from 0) with ``lo_start`` ≤ c < ``lo_stop``, or
    equals ``hi`` (≠ ``lo``) with ``hi_start`` ≤ c < ``hi_stop``."""
    clo = 0
    chi = 0
    for j in range(t.shape[0]):
        v = np.float32(abs(np.float64(t[j]) - np.float64(b[j])))
        k = False
        if v == lo:
            k = clo >= lo_start and clo < lo_stop
            clo += 1
        elif v == hi:
            k = chi >= hi_start and chi < hi_stop
            chi += 1
        elif v > lo and v < hi:
            k = True
        mask[j] = k


def _mask_dare(n, seed, cut_bits, mask):  # pragma: no cover - compiled
    """mask[j] = the j-th uniform of the stream ``seed`` is ≥ the drop probability (its 53 bits ≥ ``cut_bits``)."""
    for j in range(n):
        mask[j] = _bits53_jit(seed, j) >= cut_bits


def _l1_sums(t, b, mask, sums):  # pragma: no cover - compiled
    """sums = (Σ|τ|, Σ|τ| over the entries ``mask`` keeps), τ = t − b in float64, in flat order."""
    total = 0.0
    kept = 0.0
    for j in range(t.shape[0]):
        a = abs(np.float64(t[j]) - np.float64(b[j]))
        total += a
        if mask[j]:
            kept += a
    sums[0] = total
    sums[1] = kept


def _mask_della(t, b, cols, seed, low, epsilon, mask):  # pragma: no cover - compiled
    """DELLA's mask, row by row (rows of ``cols`` entries): the entry of ascending rank r (stable sort of the
    float64 magnitudes) is kept where its uniform is below ``low`` + (r / max(cols − 1, 1) · 2) · ``epsilon``
    (``low`` = density − epsilon), the torch code's float64 operations."""
    rows = t.shape[0] // cols
    span = np.float64(max(cols - 1, 1))
    row = np.empty(cols, dtype=np.float64)
    for r in range(rows):
        s = r * cols
        for c in range(cols):
            row[c] = abs(np.float64(t[s + c]) - np.float64(b[s + c]))
        order = np.argsort(row, kind="mergesort")
        for q in range(cols):
            c = order[q]
            p = low + (min(max(np.float64(q) / span, 0.0), 1.0) * 2.0) * epsilon
            mask[s + c] = np.float64(_bits53_jit(seed, s + c)) * _U53 < p


def _combine(arrays, masks, allk, mul, div, w, consensus, normalize, wsum, scale, out_kind, out, acc, x, wide):
    # pragma: no cover - compiled
    """out = cast(b + scale · combined) block by block: x_i = ((τ_i masked) · mul_i / div_i) · w_i (every model
    kept whole where ``allk[i]``), combined = Σ x_i (``consensus`` 0; ``normalize`` 1: / ``wsum``, 2: / n) or
    mergekit's election (1: γ = + where Σ x_i ≥ 0, the agreeing x_i summed; ``normalize`` 1: divided by the
    agreeing weights, 1 where none agree; 2: symmerge's disjoint mean, γ = sign(Σ x_i), / their count)."""
    n = w.shape[0]
    m = arrays[0].shape[0]
    size_b = acc.shape[0]
    for start in range(0, m, size_b):
        size = min(m, start + size_b) - start
        bb = arrays[n][start:start + size]
        for i in range(n):
            t = arrays[i][start:start + size]
            xi = x[i]
            mi = mul[i]
            di = div[i]
            wi = w[i]
            if allk[i]:
                for j in range(size):
                    xi[j] = (((np.float64(t[j]) - np.float64(bb[j])) * mi) / di) * wi
            else:
                mk = masks[i, start:start + size]
                for j in range(size):
                    d = np.float64(t[j]) - np.float64(bb[j])
                    v = d if mk[j] else 0.0
                    xi[j] = ((v * mi) / di) * wi
        if consensus == 0:
            for j in range(size):
                s = x[0, j]
                for i in range(1, n):
                    s = s + x[i, j]
                if normalize == 1:
                    s = s / wsum
                elif normalize == 2:
                    s = s / n
                acc[j] = np.float64(bb[j]) + scale * s
        else:
            for j in range(size):
                tot = x[0, j]
                for i in range(1, n):
                    tot = tot + x[i, j]
                ks = 0.0
                dv = 0.0
                cnt = 0
                for i in range(n):
                    v = x[i, j]
                    if normalize == 2:
                        a = (v > 0.0 and tot > 0.0) or (v < 0.0 and tot < 0.0)
                    else:
                        a = (v > 0.0 and tot >= 0.0) or (v < 0.0 and tot < 0.0)
                    term = v if a else 0.0
                    ks = term if i == 0 else ks + term
                    wt = w[i] * (1.0 if a else 0.0)
                    dv = wt if i == 0 else dv + wt
                    cnt += 1 if a else 0
                if normalize == 1:
                    s = ks / (1.0 if dv == 0.0 else dv)
                elif normalize == 2:
                    s = ks / cnt if cnt > 0 else 0.0
                else:
                    s = ks
                acc[j] = np.float64(bb[j]) + scale * s
        _store_jit(acc, size, out_kind, out[start:start + size], wide)


_mask_interval_jit = _jit(_mask_interval)
_mask_dare_jit = _jit(_mask_dare)
_mask_della_jit = _jit(_mask_della)
_l1_sums_jit = _jit(_l1_sums)
_combine_jit = _jit(_combine)
_COMBINE_BLOCK = 4096
_SPLIT = 1 << 18  # entries from which the combining pass is split over the pool


def _arrays(tensors):
    """Flat numpy views of CPU tensors in one dtype: float32 or float64 as they are, half precisions widened to
    float32, a mix with float64 widened to float64 (exact: the torch code forms the same float64 values)."""
    import torch

    dtype = torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32
    return tuple(t.reshape(-1).to(dtype).contiguous().numpy() for t in tensors)


def kth_largest(t, b, k: int) -> tuple[float, int, int]:
    """The k-th largest (1-based) float32 magnitude of τ = t − b (flat numpy arrays, τ in float64), the count of
    entries above it and of those equal to it: a radix select on the float32 bit patterns (high 16 bits
    counted, then the low 16 of the chosen high bin)."""
    scratch = np.empty(_BLOCK, dtype=np.float32)
    high = np.zeros(_HALF, dtype=np.int64)
    _histogram_jit(t, b, 1.0, -1, high, scratch)
    above = np.cumsum(high[::-1])  # entries in bins >= HALF - 1 - j
    j = int(np.searchsorted(above, k))
    hb = _HALF - 1 - j
    before = int(above[j - 1]) if j > 0 else 0
    low = np.zeros(_HALF, dtype=np.int64)
    _histogram_jit(t, b, 1.0, hb, low, scratch)
    inside = np.cumsum(low[::-1])
    i = int(np.searchsorted(inside, k - before))
    lb = _HALF - 1 - i
    value = np.array([(hb << 16) | lb], dtype=np.uint32).view(np.float32)[0]
    return float(value), before + (int(inside[i - 1]) if i > 0 else 0), int(low[lb])


_INF = float(np.float32(np.inf))


def _interval(t, b, rule, n: int):
    """(lo, lo_start, lo_stop, hi, hi_start, hi_stop) of a magnitude rule over ``n`` entries: ``("topk", k)``
    keeps the k largest (ties at the k-th: the first in flat order); ``("band", bottom, count)`` the entries of
    ascending ranks [bottom, bottom + count) (ties ranked in flat order)."""
    if rule[0] == "topk":
        k = rule[1]
        value, above, _ = kth_largest(t, b, k)
        return value, 0, k - above, _INF, 0, 0
    bottom, count = rule[1], rule[2]
    first, last = bottom, bottom + count - 1  # ascending ranks, 0-based: the k-th largest is rank n - k
    vl, above_l, equal_l = kth_largest(t, b, n - first)
    vh, above_h, equal_h = kth_largest(t, b, n - last)
    less_l, less_h = n - above_l - equal_l, n - above_h - equal_h
    if vl == vh:  # one value: nothing above it
        return vl, first - less_l, last + 1 - less_l, vl, 0, 0
    return vl, first - less_l, equal_l, vh, 0, last + 1 - less_h


def task_vector_into(tensors, base, weights, rules, rescales, consensus: str, normalize, scale: float,
                     out) -> bool:
    """``out`` ← base + ``scale`` · combine(w_i · rescale_i(sparsify_i(t_i − base))) (see the module doc), cast
    to ``out``'s dtype; False (nothing written) where it does not apply: numba missing, ``out`` not float32,
    bfloat16 or float64 or not contiguous, a tensor not on the CPU, DELLA on more than two dimensions.

    ``rules[i]``: ``("all",)``, ``("none",)``, ``("topk", k)``, ``("band", bottom, count)``, ``("dare", seed,
    drop)`` or ``("della", seed, density, epsilon)``; ``rescales[i]``: ``None``, ``"l1"`` (× Σ|τ| / Σ|kept τ|,
    unscaled where either is below 1e-7) or ``("inverse", drop)`` (÷ (1 − drop)); ``consensus`` ``"sum"`` or
    ``"ties"``; ``normalize`` True, False or ``"count"``."""
    import torch

    if not kernels.AVAILABLE or str(out.dtype).split(".")[1] not in _OUT_KIND or not out.is_contiguous():
        return False
    if any(t.device.type != "cpu" for t in (*tensors, base)):
        return False
    if any(r[0] == "della" for r in rules) and base.dim() > 2:
        return False
    n = len(tensors)
    *arrays, b = _arrays([*tensors, base])
    m = b.shape[0]
    cols = m if base.dim() < 2 else int(base.shape[1]) if base.dim() == 2 else m
    masks = np.empty((n, m), dtype=np.bool_)  # rows of the models kept whole are never touched
    sums = np.zeros((n, 2), dtype=np.float64)
    allk = np.zeros(n, dtype=np.bool_)

    def mask(i):
        rule, t = rules[i], arrays[i]
        if rule[0] == "all":
            allk[i] = True
        elif rule[0] == "none":
            masks[i] = False
        elif rule[0] == "dare":
            cut = np.uint64(np.ceil(float(rule[2]) * 9007199254740992.0))
            _mask_dare_jit(m, np.uint64(rule[1]), cut, masks[i])
        elif rule[0] == "della":
            density, epsilon = float(rule[2]), float(rule[3])
            _mask_della_jit(t, b, cols, np.uint64(rule[1]), density - epsilon, epsilon, masks[i])
        else:
            lo, lo_start, lo_stop, hi, hi_start, hi_stop = _interval(t, b, rule, m)
            _mask_interval_jit(t, b, np.float32(lo), lo_start, lo_stop, np.float32(hi), hi_start, hi_stop, masks[i])
        if rescales[i] == "l1" and rule[0] != "all":
            _l1_sums_jit(t, b, masks[i], sums[i])

    if m:
        todo = [i for i in range(n) if rules[i][0] not in ("all", "none")]
        list(_merge_pool().map(mask, todo)) if len(todo) > 1 else [mask(i) for i in todo]
        for i in range(n):
            if rules[i][0] in ("all", "none"):
                mask(i)
    mul, div = np.ones(n, dtype=np.float64), np.ones(n, dtype=np.float64)
    for i, r in enumerate(rescales):
        if r == "l1" and not allk[i]:
            before, after = float(sums[i, 0]), float(sums[i, 1])
            if before >= 1e-7 and after >= 1e-7:
                mul[i] = before / after
        elif isinstance(r, tuple) and r[0] == "inverse":
            div[i] = 1.0 - float(r[1])
    wsum = float(sum(weights))
    wsum = wsum if abs(wsum) >= 1e-8 else 1.0
    w = np.array(weights, dtype=np.float64)
    kind = _OUT_KIND[str(out.dtype).split(".")[1]]
    target = out.reshape(-1).view(torch.int16).numpy().view(np.uint16) if out.dtype == torch.bfloat16 else \
        out.reshape(-1).numpy()
    cons = 0 if consensus == "sum" else 1
    norm = 1 if normalize is True else 2 if normalize == "count" else 0
    parts = kernels.workers() if m >= _SPLIT else 1
    step = -(-m // parts) if m else 0

    def run(p):
        lo, hi = p * step, min(m, (p + 1) * step)
        _combine_jit(tuple(a[lo:hi] for a in arrays) + (b[lo:hi],), masks[:, lo:hi], allk, mul, div, w, cons, norm,
                     wsum, float(scale), kind, target[lo:hi], np.empty(_COMBINE_BLOCK, dtype=np.float64),
                     np.empty((n, _COMBINE_BLOCK), dtype=np.float64), np.empty(_COMBINE_BLOCK, dtype=np.uint32))

    if parts == 1:
        if m:
            run(0)
    else:
        list(_merge_pool().map(run, range(parts)))
    return True
