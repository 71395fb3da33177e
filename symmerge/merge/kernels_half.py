"""mergekit's DARE and DELLA rules in float16/bfloat16 (numba): :func:`dare_della_into`.

mergekit computes a task-vector merge in the config's half dtype D, and torch's CPU kernels compute each
elementwise op of D in float32 and round the result to D (round to nearest, ties to even): the rounding after
every op is the result (:mod:`symmerge.merge.in_dtype`). The kernels here do the same ops in the same order in
float32, rounding to D after each one as torch does, on blocks of entries split over the merge pool — the bits of
:func:`symmerge.merge.in_dtype.combine_in_dtype` (the torch form, the tests' oracle) without its dozen full-size
temporaries per model:

1. per model, its mask: DARE's drawn entry by entry from its SplitMix64 stream (no array), DELLA's by ranking each
   row's magnitudes (:func:`della_row`: a sort of packed keys, the stable order's ranks) into a boolean array;
2. for mergekit's L1 ``rescale``, |δ_i| and |δ_i · keep_i| (δ_i = θ_i − θ_b in D) as D tensors, summed by torch
   itself with mergekit's thread count (a sum over more than 32 768 entries is split among torch's threads and
   its rounding shows the split: it stays torch's), the factor Σ|δ| / Σ|kept δ| as mergekit forms it;
3. one pass over the entries: the weighted deltas, the sign election or the sum, the normalisation, λ, θ_b + ·,
   each op rounded to D.

A sum over the models (torch's ``sum(0)`` of the stacked deltas: float32 accumulation from +0 in model order,
rounded once) is reproduced here; those are not split among threads (three or so entries per sum).
"""

from __future__ import annotations

import numpy as np

from .kernels import _bits53_jit, _jit, _merge_pool, workers

_U53 = 1.0 / 9007199254740992.0  # 2^-53: a uniform from its 53 bits (exact)
_BLOCK = 2048  # entries per block of the combining pass
_ROWS_SPLIT = 1 << 16  # entries from which a mask's rows are split over the pool


# ------------------------------------------------------------------ rounding float32 values to the half dtypes

def _round_half(x, size, kind):  # pragma: no cover - compiled
    """x[:size] (float32) rounded in place to bfloat16 (``kind`` 0) or float16 (1), round to nearest even, as torch
    converts a float32 result (overflow to ±inf; a NaN, which the writer refuses, to one quiet NaN)."""
    u = x.view(np.uint32)
    if kind == 0:
        for j in range(size):
            v = u[j]
            r = (v + ((v >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)) & np.uint32(0xFFFF0000)
            u[j] = np.uint32(0x7FC00000) if (v & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000) else r
        return
    half = np.float32(0.5)
    for j in range(size):
        v = u[j]
        a = v & np.uint32(0x7FFFFFFF)
        if a > np.uint32(0x7F800000):  # NaN (a result the writer refuses): one quiet NaN
            u[j] = np.uint32(0x7FC00000)
        elif a < np.uint32(0x38800000):  # below float16's smallest normal: a multiple of 2^-24 (0.5's float32 ulp)
            m = (abs(x[j]) + half) - half
            x[j] = -m if v >> np.uint32(31) else m
        else:
            r = (a + ((a >> np.uint32(13)) & np.uint32(1)) + np.uint32(0xFFF)) & np.uint32(0xFFFFE000)
            if r > np.uint32(0x477FE000):  # above float16's largest finite value (65504)
                r = np.uint32(0x7F800000)
            u[j] = r | (v & np.uint32(0x80000000))


def _widen(src, kind, dst, size):  # pragma: no cover - compiled
    """dst[:size] = the half-precision bit patterns ``src[:size]`` (uint16) as float32 values, exactly."""
    u = dst.view(np.uint32)
    if kind == 0:
        for j in range(size):
            u[j] = np.uint32(src[j]) << np.uint32(16)
        return
    for j in range(size):
        h = np.uint32(src[j])
        s = (h & np.uint32(0x8000)) << np.uint32(16)
        e = (h >> np.uint32(10)) & np.uint32(0x1F)
        m = h & np.uint32(0x3FF)
        if e == 0:  # zero or subnormal: m · 2^-24, exact in float32
            f = np.float32(m) * np.float32(5.9604644775390625e-08)
            dst[j] = -f if s else f
        elif e == 31:
            u[j] = s | np.uint32(0x7F800000) | (m << np.uint32(13))
        else:
            u[j] = s | ((e + np.uint32(112)) << np.uint32(23)) | (m << np.uint32(13))


def _narrow(x, kind, dst, size):  # pragma: no cover - compiled
    """dst[:size] = the half-precision bit patterns of the float32 values ``x[:size]``, which it holds exactly."""
    u = x.view(np.uint32)
    if kind == 0:
        for j in range(size):
            dst[j] = np.uint16(u[j] >> np.uint32(16))
        return
    for j in range(size):
        v = u[j]
        s = np.uint16((v >> np.uint32(16)) & np.uint32(0x8000))
        a = v & np.uint32(0x7FFFFFFF)
        if a > np.uint32(0x7F800000):
            dst[j] = np.uint16(0x7E00)
        elif a == np.uint32(0x7F800000):
            dst[j] = s | np.uint16(0x7C00)
        elif a >= np.uint32(0x38800000):
            dst[j] = s | np.uint16((((a >> np.uint32(23)) - np.uint32(112)) << np.uint32(10)) |
                                   ((a >> np.uint32(13)) & np.uint32(0x3FF)))
        else:
            dst[j] = s | np.uint16(abs(x[j]) * np.float32(16777216.0))


_round_half_jit = _jit(_round_half)
_widen_jit = _jit(_widen)
_narrow_jit = _jit(_narrow)


# ------------------------------------------------------------------ DELLA's mask

def _sort_keys(keys, n, low_bits, tmp, counts):  # pragma: no cover - compiled
    """keys[:n] sorted ascending (distinct uint64 keys, the column in ``low_bits``): scattered in column order into
    buckets — the zero magnitudes, then about n/2 equal ranges of the others' keys — and each bucket sorted
    (insertion sort; np.sort where it holds many out of order)."""
    kmin = np.uint64(0xFFFFFFFFFFFFFFFF)
    kmax = np.uint64(0)
    for c in range(n):
        k = keys[c]
        if k > low_bits:
            if k < kmin:
                kmin = k
            if k > kmax:
                kmax = k
    nb_bits = 1
    while (1 << nb_bits) < (n >> 1):
        nb_bits += 1
    width = 0
    span = kmax - kmin if kmax > low_bits else np.uint64(0)
    while width < 64 and (span >> np.uint64(width)) >= np.uint64(1 << nb_bits):
        width += 1
    nb = (1 << nb_bits) + 1
    for q in range(nb + 1):
        counts[q] = 0
    for c in range(n):
        k = keys[c]
        bk = 0 if k <= low_bits else 1 + np.int64((k - kmin) >> np.uint64(width))
        counts[bk + 1] += 1
    for q in range(1, nb + 1):
        counts[q] += counts[q - 1]
    for c in range(n):
        k = keys[c]
        bk = 0 if k <= low_bits else 1 + np.int64((k - kmin) >> np.uint64(width))
        tmp[counts[bk]] = k
        counts[bk] += 1
    start = 0
    for q in range(nb):
        stop = counts[q]
        if stop - start > 48:
            ordered = True
            for a in range(start + 1, stop):
                if tmp[a] < tmp[a - 1]:
                    ordered = False
                    break
            if not ordered:
                tmp[start:stop].sort()
        else:
            for a in range(start + 1, stop):
                v = tmp[a]
                z = a - 1
                while z >= start and tmp[z] > v:
                    tmp[z + 1] = tmp[z]
                    z -= 1
                tmp[z + 1] = v
        start = stop
    for c in range(n):
        keys[c] = tmp[c]


_sort_keys_jit = _jit(_sort_keys)


def della_row(mag, seed, first, low, epsilon, keys, counts, mask):  # pragma: no cover - compiled
    """DELLA's mask of one row: the entry of ascending rank q (the stable order of the float64 magnitudes ``mag``)
    kept where the uniform of stream entry ``first`` + its column is below ``low`` + (min(max(q / max(cols − 1, 1),
    0), 1) · 2) · ``epsilon``, the torch code's float64 operations (:func:`symmerge.merge.parts.della_keep_mask`).
    The ranks: where every magnitude's bit pattern has its low bits free for the column, one sort of the patterns
    with the column in those bits (distinct keys: the stable order, :func:`_sort_keys`); else a stable argsort.
    ``keys``: uint64 scratch of twice the row's length and more; ``counts``: int64 scratch of the row's length + 4."""
    cols = mag.shape[0]
    span = np.float64(max(cols - 1, 1))
    width = 1
    while (1 << width) < cols:
        width += 1
    low_bits = np.uint64((1 << width) - 1)
    bits = mag.view(np.uint64)
    spare = np.uint64(0)
    for c in range(cols):
        spare |= bits[c] & low_bits
    if spare == 0:
        for c in range(cols):
            keys[c] = bits[c] | np.uint64(c)
        _sort_keys_jit(keys, cols, low_bits, keys[cols:], counts)
        for q in range(cols):
            c = np.int64(keys[q] & low_bits)
            p = low + (min(max(np.float64(q) / span, 0.0), 1.0) * 2.0) * epsilon
            mask[c] = np.float64(_bits53_jit(seed, first + c)) * _U53 < p
        return
    order = np.argsort(mag, kind="mergesort")
    for q in range(cols):
        c = order[q]
        p = low + (min(max(np.float64(q) / span, 0.0), 1.0) * 2.0) * epsilon
        mask[c] = np.float64(_bits53_jit(seed, first + c)) * _U53 < p


_della_row_jit = _jit(della_row)


def _della_rows(t, b, kind, cols, r0, r1, params, mask):  # pragma: no cover - compiled
    """DELLA's mask (:func:`della_row`) of rows [r0, r1) of τ = t − b (flat arrays: float32/float64, or half bit
    patterns of ``kind`` 0 bfloat16 / 1 float16 widened exactly; ``kind`` −1: as they are); ``params`` = (seed,
    low, epsilon)."""
    seed, low, epsilon = params
    mag = np.empty(cols, dtype=np.float64)
    keys = np.empty(2 * cols, dtype=np.uint64)
    counts = np.empty(cols + 4, dtype=np.int64)
    wt = np.empty(cols, dtype=np.float32)
    wb = np.empty(cols, dtype=np.float32)
    for r in range(r0, r1):
        s = r * cols
        if kind >= 0:
            _widen_jit(t[s:s + cols], kind, wt, cols)
            _widen_jit(b[s:s + cols], kind, wb, cols)
            for c in range(cols):
                mag[c] = abs(np.float64(wt[c]) - np.float64(wb[c]))
        else:
            for c in range(cols):
                mag[c] = abs(np.float64(t[s + c]) - np.float64(b[s + c]))
        _della_row_jit(mag, seed, s, low, epsilon, keys, counts, mask[s:s + cols])


_della_rows_jit = _jit(_della_rows)


def della_mask_into(t, b, kind: int, cols: int, seed: int, low: float, epsilon: float, mask) -> None:
    """DELLA's mask of τ = t − b (flat numpy arrays; ``kind`` see :func:`_della_rows`) in rows of ``cols`` entries
    into ``mask`` (bool), the rows split over the merge pool for a large tensor."""
    rows = t.shape[0] // cols if cols else 0
    params = (np.uint64(seed), float(low), float(epsilon))
    parts = workers() if t.shape[0] >= _ROWS_SPLIT and rows > 1 else 1
    step = -(-rows // parts) if rows else 0

    def run(p):
        _della_rows_jit(t, b, kind, cols, min(rows, p * step), min(rows, (p + 1) * step), params, mask)

    if parts == 1:
        run(0)
    else:
        list(_merge_pool().map(run, range(parts)))


# ------------------------------------------------------------------ the rule in the half dtype

def _dare_keep(seed, cut, start, size, kb):  # pragma: no cover - compiled
    """kb[j] = 1 where DARE keeps entry ``start`` + j (its uniform's 53 bits ≥ ``cut``), else 0; its own loop, so
    that it vectorizes."""
    for j in range(size):
        kb[j] = np.float32(1.0) if _bits53_jit(seed, start + j) >= cut else np.float32(0.0)


_dare_keep_jit = _jit(_dare_keep)


def _keep_block(keep, masks, i, start, size, kb):  # pragma: no cover - compiled
    """kb[:size] = 1.0 where model i keeps the entries from ``start``, else 0.0; ``keep`` = (how, seeds, cuts):
    ``how`` 1 its mask array, 2 DARE's uniform, 3 none (0, all kept, never asked)."""
    how = keep[0][i]
    if how == 1:
        mk = masks[i, start:start + size]
        for j in range(size):
            kb[j] = np.float32(1.0) if mk[j] else np.float32(0.0)
    elif how == 2:
        _dare_keep_jit(keep[1][i], keep[2][i], start, size, kb)
    else:
        for j in range(size):
            kb[j] = np.float32(0.0)


_keep_block_jit = _jit(_keep_block)


def _deltas(arrays, kind, masks, model, start, size, x, scratch):  # pragma: no cover - compiled
    """x[i, :size] = mergekit's weighted delta of model i in the half dtype for the block from ``start``:
    round(round(round(round(t_i − b) · keep_i) · f_i) · w_i) (the factor's product only where ``f_i`` ≠ 0);
    ``model`` = (how, seeds, cuts, factors, weights) per model (see :func:`_keep_block`)."""
    how, factors, weights = model[0], model[3], model[4]
    n = how.shape[0]
    bb, kb = scratch[0], scratch[1]
    _widen_jit(arrays[n][start:start + size], kind, bb, size)
    for i in range(n):
        xi = x[i]
        _widen_jit(arrays[i][start:start + size], kind, xi, size)
        for j in range(size):
            xi[j] = xi[j] - bb[j]
        _round_half_jit(xi, size, kind)
        if how[i] != 0:
            _keep_block_jit(model, masks, i, start, size, kb)
            for j in range(size):
                xi[j] = xi[j] * kb[j]
            if factors[i] != 0.0:
                f = factors[i]
                for j in range(size):
                    xi[j] = xi[j] * f
                _round_half_jit(xi, size, kind)
        w = weights[i]
        for j in range(size):
            xi[j] = xi[j] * w
        _round_half_jit(xi, size, kind)


_deltas_jit = _jit(_deltas)


def _consensus(x, n, size, weights, ties, kind, acc, div):  # pragma: no cover - compiled
    """acc[:size] = Σ_i x_i, or with ``ties`` the sum of the x_i agreeing with the elected sign (γ = + where the
    rounded Σ_i x_i ≥ 0) and div[:size] = the agreeing weights' sum rounded to the half dtype ``kind`` (1 where it
    is 0); each sum float32 from +0 in model order (acc rounded by the caller)."""
    zero = np.float32(0.0)
    for j in range(size):
        acc[j] = zero
    for i in range(n):
        xi = x[i]
        for j in range(size):
            acc[j] = acc[j] + xi[j]
    if not ties:
        return
    _round_half_jit(acc, size, kind)
    for j in range(size):
        div[j] = zero
    for i in range(n):  # the election's sign kept in acc's sign bit until the agreeing sum replaces it
        xi = x[i]
        wi = weights[i]
        wz = wi * zero
        for j in range(size):
            v = xi[j]
            pos = acc[j] >= zero
            agree = (v > zero and pos) or (v < zero and not pos)
            div[j] = div[j] + (wi if agree else wz)
    for j in range(size):
        pos = acc[j] >= zero
        s = zero
        for i in range(n):
            v = x[i, j]
            agree = (v > zero and pos) or (v < zero and not pos)
            s = s + (v if agree else v * zero)
        acc[j] = s
    _round_half_jit(div, size, kind)
    for j in range(size):
        if div[j] == zero:
            div[j] = np.float32(1.0)


_consensus_jit = _jit(_consensus)


def _rule(arrays, kind, masks, model, rule, out, lo, hi):  # pragma: no cover - compiled
    """out[lo:hi] (half bit patterns) = mergekit's rule: the weighted deltas (:func:`_deltas`), their consensus
    (:func:`_consensus`), ÷ the divisor where ``normalize``, × λ where ≠ 1, + θ_b, each rounded; ``rule`` = (ties,
    normalize, divisor of the sum (float32), λ (float32), λ ≠ 1)."""
    ties, normalize, sum_div, scale, scaled = rule
    n = model[0].shape[0]
    x = np.empty((n, _BLOCK), dtype=np.float32)
    scratch = np.empty((4, _BLOCK), dtype=np.float32)
    acc, div = scratch[2], scratch[3]
    for start in range(lo, hi, _BLOCK):
        size = min(hi, start + _BLOCK) - start
        _deltas_jit(arrays, kind, masks, model, start, size, x, scratch)
        _consensus_jit(x, n, size, model[4], ties, kind, acc, div)
        _round_half_jit(acc, size, kind)
        if normalize:
            if ties:
                for j in range(size):
                    acc[j] = acc[j] / div[j]
            else:
                for j in range(size):
                    acc[j] = acc[j] / sum_div
            _round_half_jit(acc, size, kind)
        if scaled:
            for j in range(size):
                acc[j] = acc[j] * scale
            _round_half_jit(acc, size, kind)
        bb = scratch[0]
        _widen_jit(arrays[n][start:start + size], kind, bb, size)
        for j in range(size):
            acc[j] = bb[j] + acc[j]
        _round_half_jit(acc, size, kind)
        _narrow_jit(acc, kind, out[start:start + size], size)


_rule_jit = _jit(_rule)


def _abs_parts(arrays, kind, masks, keep, i, lo, hi, before, after):  # pragma: no cover - compiled
    """before[lo:hi] = |δ_i| and after[lo:hi] = |δ_i · keep_i| (half bit patterns), δ_i = round(t_i − b): the
    tensors whose sums make mergekit's L1 factor."""
    n = keep[0].shape[0]
    wt = np.empty(_BLOCK, dtype=np.float32)
    wb = np.empty(_BLOCK, dtype=np.float32)
    kb = np.empty(_BLOCK, dtype=np.float32)
    for start in range(lo, hi, _BLOCK):
        size = min(hi, start + _BLOCK) - start
        _widen_jit(arrays[i][start:start + size], kind, wt, size)
        _widen_jit(arrays[n][start:start + size], kind, wb, size)
        for j in range(size):
            wt[j] = abs(wt[j] - wb[j])
        _round_half_jit(wt, size, kind)
        _narrow_jit(wt, kind, before[start:start + size], size)
        _keep_block_jit(keep, masks, i, start, size, kb)
        for j in range(size):
            wt[j] = wt[j] * kb[j]
        _narrow_jit(wt, kind, after[start:start + size], size)


_abs_parts_jit = _jit(_abs_parts)


# ------------------------------------------------------------------ the driver

_KIND = {"torch.bfloat16": 0, "torch.float16": 1}


def _half_bits(t):
    """A CPU half-precision tensor's entries as a flat uint16 numpy array (no copy for a contiguous tensor)."""
    import torch

    return t.reshape(-1).contiguous().view(torch.int16).numpy().view(np.uint16)


def _split(run, m: int) -> None:
    """``run(lo, hi)`` over [0, m), split into :func:`workers` ranges on the merge pool for a large tensor."""
    parts = workers() if m >= _ROWS_SPLIT else 1
    step = -(-m // parts)
    if parts == 1:
        run(0, m)
    else:
        list(_merge_pool().map(lambda p: run(min(m, p * step), min(m, (p + 1) * step)), range(parts)))


def _models(rules, weights, arrays, kind, shape):
    """Per model (how, seeds, cuts) of :func:`_keep` (3: nothing kept, a weight of 0, as the torch code's mask of
    the non-zero weighted deltas) and the DELLA masks (bool, (models, entries); (models, 1) where none)."""
    n, m = len(rules), arrays[0].shape[0]
    how, seeds, cuts = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)
    della = [i for i, r in enumerate(rules) if r[0] == "della" and float(weights[i]) != 0.0]
    masks = np.zeros((n, m if della else 1), dtype=np.bool_)
    cols = m if len(shape) < 2 else int(shape[1])
    for i, rule in enumerate(rules):
        if (float(weights[i]) == 0.0 and rule[0] != "all") or rule[0] == "none":  # density 0: nothing kept
            how[i] = 3
        elif rule[0] == "dare":
            how[i], seeds[i] = 2, np.uint64(rule[1])
            cuts[i] = np.uint64(np.ceil(float(rule[2]) * 9007199254740992.0))  # U ≥ p on the 53 bits
        elif rule[0] == "della":
            how[i] = 1
            density, epsilon = float(rule[2]), float(rule[3])
            della_mask_into(arrays[i], arrays[-1], kind, cols, int(rule[1]), density - epsilon, epsilon, masks[i])
    return (how, seeds, cuts), masks


def _l1_factors(arrays, kind, masks, keep, dtype, shape):
    """mergekit's L1 factor per model whose entries are masked (``keep`` = (how, seeds, cuts)): Σ|δ| / Σ|kept δ| in
    the half dtype, the sums torch's with mergekit's thread count (the executor's one wrapper,
    :func:`symmerge.merge.in_dtype.mergekit_threads`: the task-vector family declares ``half_reductions``), 0 where
    either is below 1e-7 (no rescale)."""
    import torch

    def factor(before, after):
        b, a = before.sum(), after.sum()
        return 0.0 if (b < 1e-7 or a < 1e-7) else float(b / a)

    n, m = len(arrays) - 1, arrays[0].shape[0]
    factors = np.zeros(n, dtype=np.float32)
    before, after = np.empty(m, dtype=np.uint16), np.empty(m, dtype=np.uint16)
    view = (lambda a: torch.from_numpy(a).view(torch.int16).view(dtype).reshape(shape))
    for i in range(n):
        if keep[0][i] != 0:
            _split(lambda lo, hi: _abs_parts_jit(arrays, kind, masks, keep, i, lo, hi, before, after), m)
            factors[i] = factor(view(before), view(after))
    return factors


def dare_della_into(tensors, base, rules, weights, consensus: str, normalize, scale: float, rescale, out) -> bool:
    """``out`` ← mergekit's DARE/DELLA rule in the half dtype (the bits of
    :func:`symmerge.merge.in_dtype.combine_in_dtype` on the masks of :mod:`symmerge.merge.parts`): ``rules[i]``
    ``("all",)``, ``("none",)``, ``("dare", seed, drop)`` or ``("della", seed, density, epsilon)``; ``rescale``
    True (mergekit's L1), else none; ``consensus`` ``"sum"``/``"ties"``; ``normalize`` True/False. False (nothing
    written) where it does not apply: not float16/bfloat16 CPU tensors of one dtype and shape, or DELLA on a tensor
    of other than one or two dimensions."""
    import torch

    dtype = base.dtype
    if str(dtype) not in _KIND or out.dtype != dtype or not out.is_contiguous() or any(
            t.dtype != dtype or t.shape != base.shape or t.device.type != "cpu" for t in (*tensors, out, base)):
        return False
    if base.dim() not in (1, 2) and any(r[0] == "della" for r in rules):  # the torch code's rows along dim 1
        return False
    kind, shape = _KIND[str(dtype)], tuple(base.shape)
    arrays = tuple(_half_bits(t) for t in (*tensors, base))
    m = arrays[0].shape[0]
    if m == 0:
        return True
    keep, masks = _models(rules, weights, arrays, kind, shape)
    factors = (_l1_factors(arrays, kind, masks, keep, dtype, shape) if rescale is True
               else np.zeros(len(tensors), dtype=np.float32))
    w = torch.tensor([float(x) for x in weights], dtype=dtype)
    divisor = w.sum(0)
    divisor = float(torch.where(divisor.abs() < 1e-8, torch.ones_like(divisor), divisor))
    model = (*keep, factors, w.float().numpy())
    rule = (consensus == "ties", normalize is True, np.float32(divisor), np.float32(float(scale)), float(scale) != 1.0)
    target = out.reshape(-1).view(torch.int16).numpy().view(np.uint16)
    _split(lambda lo, hi: _rule_jit(arrays, kind, masks, model, rule, target, lo, hi), m)
    return True
