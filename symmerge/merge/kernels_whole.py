"""Fused kernels for mergekit's per-tensor rules (numba; optional as :mod:`symmerge.merge.kernels`).

The torch code of :mod:`symmerge.merge.parts` (``_whole_task_vector_tensor``: sparsify each task vector
τ_i = θ_i − θ_base of one tensor on its own, rescale, weight, combine) is the definition. It forms float64
copies of whole tensors and sorts every task vector; these loops compute the same per-entry float64
arithmetic without them:

1. per model, a boolean mask of the kept entries (:func:`_mask_interval`, :func:`_mask_dare`,
   :func:`_mask_della`) and, for the L1 rescale, the two norms Σ|τ|, Σ|kept τ| (:func:`_l1_sums`), the
   models at once on the merge pool; a magnitude rule's cut values are found by a radix select on the
   float32 bit patterns of |τ| (:func:`kth_largest`: two counting passes, no sort); where a run of equal
   magnitudes crosses a cut, the entries torch's sort keeps there, as mergekit takes them
   (:func:`symmerge.merge.sort_order.window_mask_into`, a selection by block partitions on the arrays here: about
   twice the radix select's cost, one model at a time);
2. then the entries, split over the pool: the masked task vectors rescaled and weighted as the torch code
   does it, their sum or mergekit's sign election (for float32 inputs computed in float32 in the same pass,
   :func:`_elect32`), ``θ_b + λ · combined``, cast into the output (:func:`_combine`).

The per-entry values and their order of operations are the torch code's; the L1 norms are summed in
another order than torch's (a relative difference of ~1e-16 in the rescale factor). SCE
(:func:`sce_into`, :mod:`symmerge.merge.specialized`'s ``_sce_tensor``) and RAM / RAM+ (:func:`ram_into`)
follow the same plan: SCE's positions given (mergekit's ``torch.topk`` of the variances, its order at a tie:
:func:`symmerge.merge.specialized.sce_keep`; its weights' sums in another order), RAM bit for bit. In float16 and
bfloat16 the task-vector rules and SCE run mergekit's arithmetic in that dtype by the torch code instead
(:func:`symmerge.merge.in_dtype.combine_in_dtype`): there its rounding is the result.
``tests/merge/test_merge_kernels_whole.py`` compares every kernel with the torch code and with brute force.
"""

from __future__ import annotations

import threading

import numpy as np

from . import kernels
from .kernels import _BLOCK, _OUT_KIND, _bits53_jit, _histogram_jit, _jit, _merge_pool, _store_jit
from .sort_order import window_mask_into

_HALF = 1 << 16
_SELECTING = threading.Lock()
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


def _block_taus(arrays, start, x):  # pragma: no cover - compiled
    """x[i, :size] = τ_i = t_i − b (float64) of the block of ``x.shape[1]`` entries from ``start`` (the models'
    arrays, then the base's); returns size and the base's block."""
    n = len(arrays) - 1
    size = min(arrays[0].shape[0], start + x.shape[1]) - start
    bb = arrays[n][start:start + size]
    for i in range(n):
        t = arrays[i][start:start + size]
        xi = x[i]
        for j in range(size):
            xi[j] = np.float64(t[j]) - np.float64(bb[j])
    return size, bb


def _elect32(arrays, masks, allk, start, size, ef, ew, tot):  # pragma: no cover - compiled
    """tot[:size] = the sums whose signs are mergekit's election for the block of float32 inputs from ``start``, in
    float32 as mergekit forms them (:func:`symmerge.merge.in_dtype.mergekit_election`): δ_i = ((t_i − b) · keep_i)
    · ef_i · ew_i, each product rounded to float32 (``ef_i`` the L1 rescale's float32 factor, 0 where none
    applies), summed in model order in float32 (γ = + where ≥ 0)."""
    n = ew.shape[0]
    bb = arrays[n][start:start + size]
    for i in range(n):
        t = arrays[i][start:start + size]
        mk = masks[i, start:start + size]
        keep, f, wi = not allk[i], ef[i], ew[i]
        for j in range(size):
            d = t[j] - bb[j]
            if keep:
                d = d * np.float32(1.0 if mk[j] else 0.0)
                if f != 0.0:
                    d = d * f
            d = d * wi
            tot[j] = d if i == 0 else tot[j] + d


_elect32_jit = _jit(_elect32)


def _combine(arrays, masks, allk, mul, div, w, consensus, normalize, wsum, scale, out_kind, out, acc, x, wide, e32,
             elected, given, ef, ew):  # pragma: no cover - compiled
    """out = cast(b + scale · combined) block by block: x_i = ((τ_i masked) · mul_i / div_i) · w_i (every model
    kept whole where ``allk[i]``), combined = Σ x_i (``consensus`` 0; ``normalize`` 1: / ``wsum``, 2: / n) or
    mergekit's election (1: γ = + where Σ x_i ≥ 0, the agreeing x_i summed; ``normalize`` 1: divided by the
    agreeing weights, 1 where none agree; 2: symmerge's disjoint mean, γ = sign(Σ x_i), / their count); with
    ``given`` 1, γ = + where ``elected`` (mergekit's election in its dtype: ``in_dtype.mergekit_election``); with
    ``given`` 2 (float32 inputs), that election computed here block by block (:func:`_elect32`, ``ef``/``ew``,
    ``e32`` its scratch), no array of it."""
    n = w.shape[0]
    m = arrays[0].shape[0]
    for start in range(0, m, acc.shape[0]):
        size, bb = _block_taus_jit(arrays, start, x)
        if given == 2:
            _elect32_jit(arrays, masks, allk, start, size, ef, ew, e32)
        for i in range(n):
            xi = x[i]
            mi = mul[i]
            di = div[i]
            wi = w[i]
            if allk[i]:
                for j in range(size):
                    xi[j] = ((xi[j] * mi) / di) * wi
            else:
                mk = masks[i, start:start + size]
                for j in range(size):
                    v = xi[j] if mk[j] else 0.0
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
                if given == 2:
                    tot = 1.0 if e32[j] >= 0.0 else -1.0
                elif given == 1:
                    tot = 1.0 if elected[start + j] else -1.0
                else:
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


_block_taus_jit = _jit(_block_taus)
_mask_dare_jit = _jit(_mask_dare)
_mask_della_jit = _jit(_mask_della)
_l1_sums_jit = _jit(_l1_sums)
_combine_jit = _jit(_combine)
_mask_interval_jit = _jit(_mask_interval)
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
    """(lo, lo_start, lo_stop, hi, hi_start, hi_stop, clear) of a magnitude rule over ``n`` entries: ``("topk", k)``
    keeps the k largest (ties at the k-th: the first in flat order); ``("band", bottom, count)`` the entries of
    ascending ranks [bottom, bottom + count) (ties ranked in flat order); ``clear``: no run of equal magnitudes
    crosses a cut (the interval is then the set torch's order gives too)."""
    if rule[0] == "topk":
        k = rule[1]
        value, above, equal = kth_largest(t, b, k)
        return value, 0, k - above, _INF, 0, 0, k - above == equal
    bottom, count = rule[1], rule[2]
    first, last = bottom, bottom + count - 1  # ascending ranks, 0-based: the k-th largest is rank n - k
    vl, above_l, equal_l = kth_largest(t, b, n - first)
    vh, above_h, equal_h = kth_largest(t, b, n - last)
    less_l, less_h = n - above_l - equal_l, n - above_h - equal_h
    if vl == vh:  # one value: nothing above it
        return vl, first - less_l, last + 1 - less_l, vl, 0, 0, first == less_l and last + 1 - less_l == equal_l
    return vl, first - less_l, equal_l, vh, 0, last + 1 - less_h, first == less_l and last + 1 - less_h == equal_h


def task_vector_into(tensors, base, weights, rules, rescales, consensus: str, normalize, scale: float,
                     out) -> bool:
    """``out`` ← base + ``scale`` · combine(w_i · rescale_i(sparsify_i(t_i − base))) (see the module doc), cast
    to ``out``'s dtype; False (nothing written) where it does not apply: numba missing, ``out`` not float32,
    bfloat16 or float64 or not contiguous, a tensor not on the CPU, DELLA on more than two dimensions.

    ``rules[i]``: ``("all",)``, ``("none",)``, ``("topk", k)``, ``("band", bottom, count)``, ``("dare", seed,
    drop)`` or ``("della", seed, density, epsilon)``; ``rescales[i]``: ``None``, ``"l1"`` (× Σ|τ| / Σ|kept τ|,
    unscaled where either is below 1e-7) or ``("inverse", drop)`` (÷ (1 − drop)); ``consensus`` ``"sum"`` or
    ``"ties"``; ``normalize`` True, False or ``"count"``."""
    if not _applies(tensors, base, out):
        return False
    if any(r[0] == "della" for r in rules) and base.dim() > 2:
        return False
    n = len(tensors)
    *arrays, b = _arrays([*tensors, base])
    m = b.shape[0]
    cols = m if base.dim() < 2 else int(base.shape[1]) if base.dim() == 2 else m
    masks = np.empty((n, m), dtype=np.bool_)  # rows of the models kept whole are never touched
    kind = _OUT_KIND[str(out.dtype).split(".")[1]]
    target = _target(out)
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
        else:  # a radix select of the cut values; where a run of ties crosses a cut, torch's order (mergekit's)
            lo, lo_start, lo_stop, hi, hi_start, hi_stop, clear = _interval(t, b, rule, m)
            if clear:
                _mask_interval_jit(t, b, np.float32(lo), lo_start, lo_stop, np.float32(hi), hi_start, hi_stop,
                                   masks[i])
            else:
                first, last, desc = (0, rule[1], True) if rule[0] == "topk" else (rule[1], rule[1] + rule[2], False)
                with _SELECTING:  # one selection at a time: its 8 bytes per entry held once, not once per model,
                    # the magnitudes in the output's memory where it is float32 (written only after every mask)
                    window_mask_into(t, b, first, last, desc, masks[i], target if kind == 1 else None)
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
    cons = 0 if consensus == "sum" else 1
    norm = 1 if normalize is True else 2 if normalize == "count" else 0

    # mergekit's election, in its dtype (a sign flipped by its rounding flips the whole entry): float32 inputs in the
    # combining pass (given 2), others as an array computed first (given 1)
    given = 0 if cons == 0 or norm == 2 else 2 if b.dtype == np.float32 else 1
    elected = np.zeros(1, dtype=np.bool_)
    ef, ew = np.zeros(n, dtype=np.float32), np.array(weights, dtype=np.float32)
    rescaled = any(r == "l1" for r in rescales)
    if given:
        import torch

        keeps = [None if allk[i] else torch.from_numpy(masks[i]).reshape(base.shape) for i in range(n)]
        if given == 1:
            from .in_dtype import mergekit_election

            elected = mergekit_election(tensors, base, keeps, weights, rescaled).reshape(-1).numpy()
        elif rescaled:
            from .in_dtype import l1_factor

            for i, keep in enumerate(keeps):
                ef[i] = 0.0 if keep is None else l1_factor(tensors[i], base, keep)

    def run(lo, hi):
        _combine_jit(tuple(a[lo:hi] for a in arrays) + (b[lo:hi],), masks[:, lo:hi], allk, mul, div, w, cons, norm,
                     wsum, float(scale), kind, target[lo:hi], *_combine_buffers(n), elected[lo:hi] if given == 1
                     else elected, given, ef, ew)

    _split(run, m)
    return True


def _applies(tensors, base, out) -> bool:
    """numba is there, ``out`` is a contiguous float32, bfloat16 or float64 tensor, every input is on the CPU."""
    return (kernels.AVAILABLE and str(out.dtype).split(".")[1] in _OUT_KIND and out.is_contiguous()
            and all(t.device.type == "cpu" for t in (*tensors, base)))


def _target(out):
    """The output's flat numpy view (bfloat16 as its uint16 bit patterns)."""
    import torch

    flat = out.reshape(-1)
    return flat.view(torch.int16).numpy().view(np.uint16) if out.dtype == torch.bfloat16 else flat.numpy()


def _combine_buffers(n: int):
    """Fresh per-call buffers of a combining pass: the block's float64 results, the models' block values, the
    store's uint32 scratch."""
    return (np.empty(_COMBINE_BLOCK, dtype=np.float64), np.empty((n, _COMBINE_BLOCK), dtype=np.float64),
            np.empty(_COMBINE_BLOCK, dtype=np.uint32), np.empty(_COMBINE_BLOCK, dtype=np.float32))


def _split(run, m: int) -> None:
    """``run(lo, hi)`` over [0, m), split into :func:`kernels.workers` ranges on the merge pool from
    :data:`_SPLIT` entries on (each range independent of the others)."""
    if m == 0:
        return
    parts = kernels.workers() if m >= _SPLIT else 1
    step = -(-m // parts)
    if parts == 1:
        run(0, m)
    else:
        list(_merge_pool().map(lambda p: run(p * step, min(m, (p + 1) * step)), range(parts)))


# ------------------------------------------------------------------ SCE (symmerge.merge.specialized._sce_tensor)


def _sce_squares(arrays, squares):  # pragma: no cover - compiled
    """squares[i] = Σ_j τ_ij², in flat order (every entry selected)."""
    n = len(arrays) - 1
    bb = arrays[n]
    for j in range(bb.shape[0]):
        b = np.float64(bb[j])
        for i in range(n):
            x = np.float64(arrays[i][j]) - b
            squares[i] += x * x


def _sce_combine(arrays, select, every, omega, out_kind, out, acc, x, wide):  # pragma: no cover - compiled
    """out = cast(b + Σ x_i ω_i [agree_i] / max(Σ ω_i [agree_i], 1e-6)) with x_i = τ_i × [selected] (``every``:
    all), γ = + where Σ x_i ≥ 0, agree_i: x_i non-zero of sign γ; the torch code's float64 operations."""
    n = omega.shape[0]
    m = arrays[0].shape[0]
    for start in range(0, m, acc.shape[0]):
        size, bb = _block_taus_jit(arrays, start, x)
        if not every:
            for i in range(n):
                xi = x[i]
                for j in range(size):
                    xi[j] = xi[j] * (1.0 if select[start + j] else 0.0)
        for j in range(size):
            tot = x[0, j]
            for i in range(1, n):
                tot = tot + x[i, j]
            num = 0.0
            den = 0.0
            for i in range(n):
                v = x[i, j]
                a = (v > 0.0 and tot >= 0.0) or (v < 0.0 and tot < 0.0)
                wi = omega[i] * (1.0 if a else 0.0)
                num = v * wi if i == 0 else num + v * wi
                den = wi if i == 0 else den + wi
            acc[j] = np.float64(bb[j]) + num / max(den, 1e-6)
        _store_jit(acc, size, out_kind, out[start:start + size], wide)


_sce_squares_jit = _jit(_sce_squares)
_sce_combine_jit = _jit(_sce_combine)


def sce_into(tensors, base, topk: float, out, select=None) -> bool:
    """``out`` ← SCE of ``tensors`` over ``base`` (:func:`symmerge.merge.specialized._sce_tensor`: the
    ⌊topk · m⌋ positions of largest variance across the models, as ``select`` gives them; weights ω_i = mean of the
    selected τ_i² over their sum, uniform when it is below 1e-6; mergekit's election; the agreeing weighted
    mean), cast to ``out``'s dtype; False (nothing written) where it does not apply (see
    :func:`task_vector_into`). ``select`` (a boolean tensor of ``base``'s shape): the positions kept where
    ``topk`` < 1 (mergekit's selection, :func:`symmerge.merge.specialized.sce_keep`)."""
    import torch

    if not _applies(tensors, base, out):
        return False
    n = len(tensors)
    arrays = _arrays([*tensors, base])
    m = arrays[0].shape[0]
    if m == 0:
        return True
    every = topk >= 1.0
    given = select
    select = np.zeros(0 if every else m, dtype=np.bool_)
    squares = np.zeros(n, dtype=np.float64)
    if every:
        _sce_squares_jit(arrays, squares)
    else:  # mergekit's selection, given (none kept where it is not)
        if given is not None:
            select = given.reshape(-1).numpy()
        b64 = base.reshape(-1).double()
        for i, t in enumerate(tensors):
            squares[i] = float(((t.reshape(-1).double() - b64) * torch.from_numpy(select)).square().sum())
    omega = squares / m
    total = float(omega.sum())
    omega = np.full(n, 1.0 / n) if abs(total) < 1e-6 else omega / total
    kind = _OUT_KIND[str(out.dtype).split(".")[1]]
    target = _target(out)

    def run(lo, hi):
        _sce_combine_jit(tuple(a[lo:hi] for a in arrays), select if every else select[lo:hi], every, omega, kind,
                         target[lo:hi], *_combine_buffers(n)[:3])

    _split(run, m)
    return True


# ------------------------------------------------------------------ RAM, RAM+ (symmerge.merge.specialized)


def _ram_counts(arrays, eps, shared_n, unique_n):  # pragma: no cover - compiled
    """Per model, its active entries (|τ_i| > eps) that some other model changes too (``shared_n``) and that
    only it changes (``unique_n``)."""
    n = len(arrays) - 1
    bb = arrays[n]
    for j in range(bb.shape[0]):
        b = np.float64(bb[j])
        count = 0
        for i in range(n):
            count += 1 if abs(np.float64(arrays[i][j]) - b) > eps else 0
        if count > 0:
            for i in range(n):
                if abs(np.float64(arrays[i][j]) - b) > eps:
                    if count == 1:
                        unique_n[i] += 1
                    else:
                        shared_n[i] += 1


def _ram_combine(arrays, eps, lam, out_kind, out, acc, x, wide):  # pragma: no cover - compiled
    """out = cast(b + Σ_i (x_i · [unique] · λ_i + x_i · [shared] / max(count, 1))), x_i = τ_i where |τ_i| > eps
    else 0, count the active models: the torch code's float64 operations, summed in model order."""
    n = lam.shape[0]
    m = arrays[0].shape[0]
    for start in range(0, m, acc.shape[0]):
        size, bb = _block_taus_jit(arrays, start, x)
        for i in range(n):
            xi = x[i]
            for j in range(size):
                xi[j] = xi[j] if abs(xi[j]) > eps else 0.0
        for j in range(size):
            count = 0
            for i in range(n):
                count += 1 if x[i, j] != 0.0 else 0  # active entries are non-zero (eps >= 0)
            total = 0.0
            for i in range(n):
                v = x[i, j]
                term = (v * (1.0 if count == 1 else 0.0)) * lam[i] + (v * (1.0 if count > 1 else 0.0)) / np.float64(
                    max(count, 1))
                total = term if i == 0 else total + term
            acc[j] = np.float64(bb[j]) + total
        _store_jit(acc, size, out_kind, out[start:start + size], wide)


_ram_counts_jit = _jit(_ram_counts)
_ram_combine_jit = _jit(_ram_combine)


def ram_counts(tensors, base, eps: float):
    """(shared, unique) active-entry counts per model (int64 numpy arrays) for RAM+'s factors, or None where the
    kernels do not apply."""
    if not kernels.AVAILABLE or any(t.device.type != "cpu" for t in (*tensors, base)):
        return None
    n = len(tensors)
    shared_n, unique_n = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    _ram_counts_jit(_arrays([*tensors, base]), float(eps), shared_n, unique_n)
    return shared_n, unique_n


def ram_into(tensors, base, eps: float, lam, out) -> bool:
    """``out`` ← RAM (``lam`` None) or RAM+ with the per-model factors ``lam`` of ``tensors`` over ``base``, cast to
    ``out``'s dtype; False (nothing written) where it does not apply (see :func:`task_vector_into`)."""
    if not _applies(tensors, base, out):
        return False
    n = len(tensors)
    arrays = _arrays([*tensors, base])
    lam = np.ones(n) if lam is None else np.asarray(lam, dtype=np.float64).reshape(-1)
    kind = _OUT_KIND[str(out.dtype).split(".")[1]]
    target = _target(out)

    def run(lo, hi):
        _ram_combine_jit(tuple(a[lo:hi] for a in arrays), float(eps), lam, kind, target[lo:hi], *_combine_buffers(n)[:3])

    _split(run, arrays[0].shape[0])
    return True
