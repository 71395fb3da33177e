"""The one kernel of every task-vector rule (numba): :func:`task_vector_into`; SCE (:func:`sce_into`) and RAM /
RAM+ (:func:`ram_into`) beside it.

:func:`task_vector_into` computes, without float64 copies of whole tensors and without sorting:

1. per model, a boolean mask of the kept entries (:func:`_mask_interval`, :func:`_mask_dare`,
   :func:`symmerge.merge.kernels_half.della_row` — DELLA's one mask, shared with the half-precision kernel —,
   :func:`_mask_above` for a threshold value) and, for the L1 rescale, the two norms Σ|τ|,
   Σ|kept τ| (:func:`_l1_sums`), the models at once on the merge pool; a magnitude rule's cut values are found by
   a radix select on the float32 bit patterns of |τ| (:func:`kth_largest`: two counting passes, no sort); where a
   run of equal magnitudes crosses a cut, the entries torch's sort keeps there, as mergekit takes them
   (:func:`symmerge.merge.sort_order.window_mask_into`, a selection by block partitions on the arrays here: about
   twice the radix select's cost, one model at a time). symmerge's own variants (a model-wide or per-tensor
   threshold of the weighted task vector, DARE's drop of the weighted task vector) need no mask array: they are
   applied entry by entry in the combining pass;
2. then the entries, split over the pool: the masked task vectors rescaled and weighted, their sum or mergekit's
   sign election (for float32 inputs computed in float32 in the same pass, :func:`_elect32`) or symmerge's
   disjoint mean, ``θ_b + λ · combined``, cast into the output (:func:`_combine`).

Every tensor is computed on the CPU (:func:`_via_cpu`: tensors on another device are copied over and the result
back; a float16 output is rounded once from the float64 result). In float16 and bfloat16, mergekit's forms of the
rules and SCE run mergekit's arithmetic in that dtype by the torch code instead
(:func:`symmerge.merge.in_dtype.combine_in_dtype`): there its rounding is the result. The torch definitions the
kernel is checked against (bit for bit, or at a tolerance the tests justify) live in
``tests/merge/reference_rules.py``; ``tests/merge/test_merge_kernels_whole.py`` and ``test_merge_kernels.py``
compare them.
"""

from __future__ import annotations

import threading

import numpy as np

from . import kernels
from .kernels import (_BLOCK, _OUT_KIND, _bits53_jit, _flat_bits, _histogram_jit, _jit, _merge_pool, _store_jit,
                      _widen_jit)
from .kernels_half import _della_rows_jit
from .sort_order import window_mask_into

_HALF = 1 << 16
_SELECTING = threading.Lock()


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


def _mask_above(t, b, w, thr, mask):  # pragma: no cover - compiled
    """mask[j] = float32(|(t_j − b_j) · w|) (float64 product) is not below ``thr`` (NaN magnitudes kept)."""
    for j in range(t.shape[0]):
        mask[j] = not (np.float32(abs((np.float64(t[j]) - np.float64(b[j])) * w)) < thr)


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


def _trim_row(xi, size, wi, th):  # pragma: no cover - compiled
    """xi = v = τ · wi where float32(|v|) ≥ ``th``, else 0 (NaN kept); a function of its own, so that it vectorizes."""
    for j in range(size):
        v = xi[j] * wi
        xi[j] = 0.0 if np.float32(abs(v)) < th else v


def _dare_row(xi, size, wi, di, seed, cut, index):  # pragma: no cover - compiled
    """xi = (τ · wi) / ``di`` where the uniform of entry ``index`` + j of the stream ``seed`` keeps it (its 53 bits ≥
    ``cut``), else 0; a function of its own, so that it vectorizes."""
    for j in range(size):
        v = xi[j] * wi
        xi[j] = v / di if _bits53_jit(seed, index + j) >= cut else 0.0


_trim_row_jit = _jit(_trim_row)
_dare_row_jit = _jit(_dare_row)


def _weigh(x, masks, allk, factors, own, first, start, size):  # pragma: no cover - compiled
    """x_i of a block in place (τ_i on entry): ((τ_i masked) · mul_i / div_i) · w_i (every model kept whole where
    ``allk[i]``), or a weight-first rule of ``own`` = (kinds, thresholds, seeds, cuts) — kind 1 keeps v = τ_i · w_i
    where float32(|v|) ≥ its threshold (else 0), kind 2 keeps v / div_i where the uniform of entry ``first`` +
    ``start`` + j of its stream is ≥ the drop probability (its 53 bits ≥ its cut); ``factors`` = (mul, div, w)."""
    mul, div, w = factors
    kinds, thr, seeds, cuts = own
    for i in range(w.shape[0]):
        xi = x[i]
        mi = mul[i]
        di = div[i]
        wi = w[i]
        if kinds[i] == 1:
            _trim_row_jit(xi, size, wi, thr[i])
        elif kinds[i] == 2:
            _dare_row_jit(xi, size, wi, di, seeds[i], cuts[i], first + start)
        elif allk[i]:
            for j in range(size):
                xi[j] = ((xi[j] * mi) / di) * wi
        else:
            mk = masks[i, start:start + size]
            for j in range(size):
                v = xi[j] if mk[j] else 0.0
                xi[j] = ((v * mi) / di) * wi


_weigh_jit = _jit(_weigh)


def _own_combine(x, bb, size, consensus, normalize, wsum, scale, acc, kept, cnt):  # pragma: no cover - compiled
    """acc[:size] = b + scale · combined, the model-outer loops that vectorize (each entry's sums in model order):
    Σ x_i (``consensus`` 0; ``normalize`` 1: / ``wsum``, 2: / n) or, ``consensus`` 1, symmerge's disjoint mean
    (γ = sign(Σ x_i), the non-zero x_i of sign γ averaged, 0 where none); ``kept``, ``cnt``: scratch."""
    n = x.shape[0]
    for j in range(size):
        acc[j] = x[0, j]
    for i in range(1, n):
        xi = x[i]
        for j in range(size):
            acc[j] = acc[j] + xi[j]
    if consensus == 0:
        if normalize == 1:
            for j in range(size):
                acc[j] = np.float64(bb[j]) + scale * (acc[j] / wsum)
        elif normalize == 2:
            for j in range(size):
                acc[j] = np.float64(bb[j]) + scale * (acc[j] / n)
        else:
            for j in range(size):
                acc[j] = np.float64(bb[j]) + scale * acc[j]
        return
    for i in range(n):
        xi = x[i]
        for j in range(size):
            v = xi[j]
            s = acc[j]
            a = ((v > 0.0) & (s > 0.0)) | ((v < 0.0) & (s < 0.0))
            c = 1 if a else 0
            term = v if a else 0.0
            if i == 0:
                cnt[j] = c
                kept[j] = term
            else:
                cnt[j] = cnt[j] + c
                kept[j] = kept[j] + term
    for j in range(size):
        acc[j] = np.float64(bb[j]) + scale * (kept[j] / cnt[j] if cnt[j] > 0 else 0.0)


_own_combine_jit = _jit(_own_combine)


def _combine(arrays, masks, allk, factors, consensus, normalize, wsum, scale, out_kind, out, acc, x, wide, e32,
             kept, cnt, elected, given, ef, ew, own, first):  # pragma: no cover - compiled
    """out = cast(b + scale · combined) block by block: x_i weighted as :func:`_weigh` does (``factors``, ``own``,
    ``first``: see there), combined = Σ x_i (``consensus`` 0; ``normalize`` 1: / ``wsum``, 2: / n) or
    mergekit's election (1: γ = + where Σ x_i ≥ 0, the agreeing x_i summed; ``normalize`` 1: divided by the
    agreeing weights, 1 where none agree; 2: symmerge's disjoint mean, γ = sign(Σ x_i), / their count); with
    ``given`` 1, γ = + where ``elected`` (mergekit's election in its dtype: ``in_dtype.mergekit_election``); with
    ``given`` 2 (float32 inputs), that election computed here block by block (:func:`_elect32`, ``ef``/``ew``,
    ``e32`` its scratch), no array of it."""
    w = factors[2]
    n = w.shape[0]
    m = arrays[0].shape[0]
    for start in range(0, m, acc.shape[0]):
        size, bb = _block_taus_jit(arrays, start, x)
        if given == 2:
            _elect32_jit(arrays, masks, allk, start, size, ef, ew, e32)
        _weigh_jit(x, masks, allk, factors, own, first, start, size)
        if consensus == 0 or normalize == 2:
            _own_combine_jit(x[:n], bb, size, consensus, normalize, wsum, scale, acc, kept, cnt)
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
                for i in range(n):
                    v = x[i, j]
                    a = (v > 0.0 and tot >= 0.0) or (v < 0.0 and tot < 0.0)
                    term = v if a else 0.0
                    ks = term if i == 0 else ks + term
                    wt = w[i] * (1.0 if a else 0.0)
                    dv = wt if i == 0 else dv + wt
                s = ks / (1.0 if dv == 0.0 else dv) if normalize == 1 else ks
                acc[j] = np.float64(bb[j]) + scale * s
        _store_jit(acc, size, out_kind, out[start:start + size], wide)


_block_taus_jit = _jit(_block_taus)
_mask_dare_jit = _jit(_mask_dare)
_mask_above_jit = _jit(_mask_above)
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
    to ``out``'s dtype (computed on the CPU: see :func:`_via_cpu`); False (nothing written) for DELLA on more than
    two dimensions.

    ``rules[i]``: ``("all",)``, ``("none",)``, ``("topk", k)``, ``("band", bottom, count)``, ``("dare", seed,
    drop)``, ``("della", seed, density, epsilon)`` or ``("above", threshold, w)`` (the entries whose float32
    |τ · w| is not below ``threshold``: a model-wide or per-tensor threshold value) — sparsify, then weight
    (mergekit's order); or symmerge's own variants, weight first (τ · w is sparsified, no mask array):
    ``("weighted", threshold)`` (float32 |τ · w| not below ``threshold``) and ``("weighted_dare", seed, drop)``
    (DARE's drop of τ · w, the survivors ÷ (1 − drop)). ``rescales[i]``: ``None``, ``"l1"`` (× Σ|τ| / Σ|kept τ|,
    unscaled where either is below 1e-7) or ``("inverse", drop)`` (÷ (1 − drop)); ``consensus`` ``"sum"`` or
    ``"ties"``; ``normalize`` True, False or ``"count"``."""
    if any(r[0] == "della" for r in rules) and base.dim() > 2:
        return False
    return _via_cpu(lambda ts, b, o: _task_vector_run(ts, b, weights, rules, rescales, consensus, normalize, scale, o),
                    tensors, base, out)


def _via_cpu(run, tensors, base, out) -> bool:
    """``run(tensors, base, out)`` with every tensor on the CPU (the kernels run there: tensors on another device
    are copied over and the result copied back) and ``out`` a contiguous float32, bfloat16 or float64 CPU tensor;
    any other ``out`` (float16, another device, not contiguous) is filled from a CPU result (float16 rounded once,
    from the float64 result, as the torch code casts it)."""
    import torch

    tensors, base = [t.cpu() for t in tensors], base.cpu()
    kind = str(out.dtype).split(".")[1]
    if out.device.type == "cpu" and out.is_contiguous() and kind in _OUT_KIND:
        return run(tensors, base, out)
    tmp = torch.empty(out.shape, dtype=out.dtype if kind in _OUT_KIND else torch.float64)
    if not run(tensors, base, tmp):
        return False
    out.copy_(tmp)
    return True


_WEIGHT_FIRST = {"weighted": 1, "weighted_dare": 2}  # the rules of symmerge's own variants: kinds of :func:`_combine`
_HALVES = ("torch.bfloat16", "torch.float16")
_WIDEN = 1 << 16  # entries of half-precision inputs widened to float32 at once


def _task_vector_run(tensors, base, weights, rules, rescales, consensus: str, normalize, scale: float, out) -> bool:
    """:func:`task_vector_into` on CPU tensors into a contiguous ``out`` the kernels write."""
    n = len(tensors)
    m = base.numel()
    # half-precision inputs under weight-first rules only (no mask to compute): widened a chunk at a time, no
    # whole-tensor float32 copies
    chunked = str(base.dtype) in _HALVES and all(t.dtype == base.dtype for t in tensors) and all(
        r[0] in ("all", *_WEIGHT_FIRST) for r in rules)
    flat = [t.reshape(-1) for t in (*tensors, base)]
    *arrays, b = [None] * (n + 1) if chunked else _arrays([*tensors, base])
    kind = _OUT_KIND[str(out.dtype).split(".")[1]]
    target = _target(out)
    masks, allk, sums, own = _masks(arrays, b, base, rules, rescales, target if kind == 1 else None)
    mul, div = _factors(rules, rescales, allk, sums)
    wsum = float(sum(weights))
    wsum = wsum if abs(wsum) >= 1e-8 else 1.0
    w = np.array(weights, dtype=np.float64)
    cons = 0 if consensus == "sum" else 1
    norm = 1 if normalize is True else 2 if normalize == "count" else 0
    # mergekit's election, in its dtype (a sign flipped by its rounding flips the whole entry): float32 inputs in the
    # combining pass (given 2), others as an array computed first (given 1)
    given = 0 if cons == 0 or norm == 2 else 2 if b.dtype == np.float32 else 1
    elected, ef, ew = _election(tensors, base, weights, rescales, masks, allk, given)

    bits = [_flat_bits(f) for f in flat] if chunked and str(base.dtype) == "torch.bfloat16" else None

    def run(lo, hi):
        buffers = _combine_buffers(n)
        wide = np.empty((n + 1, _WIDEN), dtype=np.float32) if chunked else None
        for c in range(lo, hi, _WIDEN if chunked else max(1, hi - lo)):
            d = min(hi, c + (_WIDEN if chunked else hi - lo))
            if bits is not None:  # bfloat16: its bit patterns widened exactly into one reused float32 buffer
                for i, a in enumerate(bits):
                    _widen_jit(a[c:d], wide[i, :d - c].view(np.uint32))
                parts = tuple(wide[i, :d - c] for i in range(n + 1))
            else:
                parts = (tuple(f[c:d].float().numpy() for f in flat) if chunked
                         else tuple(a[c:d] for a in arrays) + (b[c:d],))
            _combine_jit(parts, masks[:, c:d], allk, (mul, div, w), cons, norm, wsum, float(scale), kind, target[c:d],
                         *buffers, elected[c:d] if given == 1 else elected, given, ef, ew, own, c)

    _split(run, m)
    return True


def _masks(arrays, b, base, rules, rescales, scratch):
    """Each model's mask of kept entries (rows of the models kept whole never touched), which models are kept
    whole, the L1 norms (Σ|τ|, Σ|kept τ|) of the rescaled ones, and the weight-first rules' arrays (kinds,
    thresholds, seeds, cuts: :func:`_combine`); the costly masks computed on the merge pool. ``scratch``: float32
    memory of the entries' size for a selection (the output's, written only after every mask), or None."""
    n, m = len(arrays), base.numel()
    cols = m if base.dim() < 2 else int(base.shape[1]) if base.dim() == 2 else m
    masks = np.empty((n, m), dtype=np.bool_)
    sums, allk = np.zeros((n, 2), dtype=np.float64), np.zeros(n, dtype=np.bool_)
    kinds, thr = np.zeros(n, dtype=np.int8), np.full(n, -1.0, dtype=np.float32)
    seeds, cuts = np.zeros(n, dtype=np.uint64), np.zeros(n, dtype=np.uint64)

    def mask(i):
        rule, t = rules[i], arrays[i]
        if rule[0] in _WEIGHT_FIRST:
            kinds[i] = _WEIGHT_FIRST[rule[0]]
            if rule[0] == "weighted":
                thr[i] = rule[1]
            else:
                seeds[i], cuts[i] = np.uint64(rule[1]), _cut_bits(rule[2])
        elif rule[0] == "all":
            allk[i] = True
        elif rule[0] == "none":
            masks[i] = False
        elif rule[0] == "above":
            _mask_above_jit(t, b, float(rule[2]), np.float32(rule[1]), masks[i])
        elif rule[0] == "dare":
            _mask_dare_jit(m, np.uint64(rule[1]), _cut_bits(rule[2]), masks[i])
        elif rule[0] == "della":
            density, epsilon = float(rule[2]), float(rule[3])
            _della_rows_jit(t, b, -1, cols, 0, m // cols, (np.uint64(rule[1]), density - epsilon, epsilon), masks[i])
        else:  # a radix select of the cut values; where a run of ties crosses a cut, torch's order (mergekit's)
            lo, lo_start, lo_stop, hi, hi_start, hi_stop, clear = _interval(t, b, rule, m)
            if clear:
                _mask_interval_jit(t, b, np.float32(lo), lo_start, lo_stop, np.float32(hi), hi_start, hi_stop,
                                   masks[i])
            else:
                first, last, desc = (0, rule[1], True) if rule[0] == "topk" else (rule[1], rule[1] + rule[2], False)
                with _SELECTING:  # one selection at a time: its 8 bytes per entry held once, not once per model
                    window_mask_into(t, b, first, last, desc, masks[i], scratch)
        if rescales[i] == "l1" and rule[0] != "all":
            _l1_sums_jit(t, b, masks[i], sums[i])

    if m:
        cheap = ("all", "none", *_WEIGHT_FIRST)
        todo = [i for i in range(n) if rules[i][0] not in cheap]
        list(_merge_pool().map(mask, todo)) if len(todo) > 1 else [mask(i) for i in todo]
        for i in range(n):
            if rules[i][0] in cheap:
                mask(i)
    return masks, allk, sums, (kinds, thr, seeds, cuts)


def _cut_bits(drop) -> np.uint64:
    """DARE's test U ≥ drop on a uniform's 53 bits k: k ≥ ⌈drop · 2⁵³⌉."""
    return np.uint64(np.ceil(float(drop) * 9007199254740992.0))


def _factors(rules, rescales, allk, sums):
    """Each model's rescale as (multiplier, divisor): the L1 rescale's Σ|τ| / Σ|kept τ| (none where either is below
    1e-7), DARE's 1 − p."""
    n = len(rules)
    mul, div = np.ones(n, dtype=np.float64), np.ones(n, dtype=np.float64)
    for i, r in enumerate(rescales):
        if r == "l1" and not allk[i]:
            before, after = float(sums[i, 0]), float(sums[i, 1])
            if before >= 1e-7 and after >= 1e-7:
                mul[i] = before / after
        elif isinstance(r, tuple) and r[0] == "inverse":
            div[i] = 1.0 - float(r[1])
        if rules[i][0] == "weighted_dare":
            div[i] = 1.0 - float(rules[i][2])
    return mul, div


def _election(tensors, base, weights, rescales, masks, allk, given):
    """What :func:`_combine` needs of mergekit's election: with ``given`` 1 the elected signs (true: +) computed in
    the inputs' dtype (:func:`symmerge.merge.in_dtype.mergekit_election`); with ``given`` 2 the float32 L1 factors
    and weights of :func:`_elect32`."""
    n = len(tensors)
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
    return elected, ef, ew


def _target(out):
    """The output's flat numpy view (bfloat16 as its uint16 bit patterns)."""
    import torch

    flat = out.reshape(-1)
    return flat.view(torch.int16).numpy().view(np.uint16) if out.dtype == torch.bfloat16 else flat.numpy()


def _combine_buffers(n: int):
    """Fresh per-call buffers of a combining pass: the block's float64 results, the models' block values, the
    store's uint32 scratch, the election's float32 sums, the disjoint mean's float64 sums and int64 counts."""
    return (np.empty(_COMBINE_BLOCK, dtype=np.float64), np.empty((n, _COMBINE_BLOCK), dtype=np.float64),
            np.empty(_COMBINE_BLOCK, dtype=np.uint32), np.empty(_COMBINE_BLOCK, dtype=np.float32),
            np.empty(_COMBINE_BLOCK, dtype=np.float64), np.empty(_COMBINE_BLOCK, dtype=np.int64))


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
    return _via_cpu(lambda ts, b, o: _sce_run(ts, b, topk, o, select), tensors, base, out)


def _sce_run(tensors, base, topk: float, out, select) -> bool:
    """:func:`sce_into` on CPU tensors into a contiguous ``out`` the kernels write."""
    import torch

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
            select = given.reshape(-1).cpu().numpy()
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
    tensors, base = [t.cpu() for t in tensors], base.cpu()
    n = len(tensors)
    shared_n, unique_n = np.zeros(n, dtype=np.int64), np.zeros(n, dtype=np.int64)
    _ram_counts_jit(_arrays([*tensors, base]), float(eps), shared_n, unique_n)
    return shared_n, unique_n


def ram_into(tensors, base, eps: float, lam, out) -> bool:
    """``out`` ← RAM (``lam`` None) or RAM+ with the per-model factors ``lam`` of ``tensors`` over ``base``, cast to
    ``out``'s dtype; False (nothing written) where it does not apply (see :func:`task_vector_into`)."""
    return _via_cpu(lambda ts, b, o: _ram_run(ts, b, eps, lam, o), tensors, base, out)


def _ram_run(tensors, base, eps: float, lam, out) -> bool:
    """:func:`ram_into` on CPU tensors into a contiguous ``out`` the kernels write."""
    n = len(tensors)
    arrays = _arrays([*tensors, base])
    lam = np.ones(n) if lam is None else np.asarray(lam, dtype=np.float64).reshape(-1)
    kind = _OUT_KIND[str(out.dtype).split(".")[1]]
    target = _target(out)

    def run(lo, hi):
        _ram_combine_jit(tuple(a[lo:hi] for a in arrays), float(eps), lam, kind, target[lo:hi],
                         *_combine_buffers(n)[:3])

    _split(run, arrays[0].shape[0])
    return True
