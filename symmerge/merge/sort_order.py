"""Which entries land at given positions of torch's (unstable) CPU sort, without sorting everything.

mergekit selects entries by ``torch.argsort`` / ``torch.sort`` of float32 magnitudes (TIES' top-k, Model
Breadcrumbs' band). Where magnitudes tie at a cut — the common case in float16/bfloat16, whose task vectors
take few distinct values — *which* of the tied entries are kept is the order that sort leaves them in. On the
CPU, torch's unstable sort of one row is the C++ standard library's ``std::sort`` over (value, index) pairs
with the comparator ``a > b`` (descending) or ``a < b`` (ascending): libstdc++'s introsort — median-of-three
pivot moved to the front, Hoare partition, ranges of at most 16 entries left to one final insertion sort,
heapsort below a depth of 2·⌊log₂ n⌋ — which is deterministic: the same values give the same order.

:func:`window_mask` runs that algorithm only where it decides the answer: a range is partitioned further only
while it straddles one of the cuts (a range wholly inside or outside the window needs no order), so the work
is that of a selection, O(n), not of a sort. Written from the algorithm's published description (the C++
library's sort, introsort: Musser 1997); :func:`window_mask_by_sort` is torch's own sort, the definition the
tests compare it with.
"""

from __future__ import annotations

import numpy as np
import torch

from . import kernels

_THRESHOLD = 16  # introsort leaves ranges of at most this many entries to the final insertion sort
_BLOCK = 512  # positions collected ahead by a block partition


def _less(a, b, desc):  # pragma: no cover - compiled
    return a > b if desc else a < b


def _swap(v, ix, i, j):  # pragma: no cover - compiled
    t = v[i]
    v[i] = v[j]
    v[j] = t
    u = ix[i]
    ix[i] = ix[j]
    ix[j] = u


def _median_to_first(v, ix, result, a, b, c, desc):  # pragma: no cover - compiled
    if _less_jit(v[a], v[b], desc):
        if _less_jit(v[b], v[c], desc):
            _swap_jit(v, ix, result, b)
        elif _less_jit(v[a], v[c], desc):
            _swap_jit(v, ix, result, c)
        else:
            _swap_jit(v, ix, result, a)
    elif _less_jit(v[a], v[c], desc):
        _swap_jit(v, ix, result, a)
    elif _less_jit(v[b], v[c], desc):
        _swap_jit(v, ix, result, c)
    else:
        _swap_jit(v, ix, result, b)


def _partition(v, ix, first, last, desc):  # pragma: no cover - compiled
    """The pivot (median of the second, middle and last entries) moved to ``first``, then Hoare's partition of
    [first + 1, last) around it; returns the cut."""
    mid = first + (last - first) // 2
    _median_to_first_jit(v, ix, first, first + 1, mid, last - 1, desc)
    pivot = v[first]
    lo, hi = first + 1, last
    while True:
        while _less_jit(v[lo], pivot, desc):
            lo += 1
        hi -= 1
        while _less_jit(pivot, v[hi], desc):
            hi -= 1
        if not lo < hi:
            return lo
        _swap_jit(v, ix, lo, hi)
        lo += 1


def _partition_ascending(v, ix, first, last, offl, offr):  # pragma: no cover - compiled
    """:func:`_partition` with ``desc`` False, the same swaps by blocks: Hoare's scans swap the k-th entry from the
    left that is not below the pivot with the k-th from the right that is not above it, while the first lies before
    the second, and return where the left scan stopped (the next such entry from the left, or the last swapped
    right position, whichever comes first). The entries between the last swapped pair are never moved, so their
    positions are collected ahead in blocks (``offl``, ``offr``: scratch of one block each) without a branch per
    entry; a position read after its swap lies beyond the stop and decides nothing."""
    mid = first + (last - first) // 2
    _median_to_first_jit(v, ix, first, first + 1, mid, last - 1, False)
    pivot = v[first]
    size = offl.shape[0]
    lo, hi = first + 1, last - 1  # the next positions to read from each side
    nl = il = nr = ir = 0
    before = last  # the right position of the last swap
    while True:
        while il == nl and lo < last:
            stop = min(lo + size, last)
            nl = 0
            il = 0
            for j in range(lo, stop):
                offl[nl] = j
                nl += 0 if v[j] < pivot else 1
            lo = stop
        left = offl[il] if il < nl else last
        while ir == nr and hi >= first:
            stop = max(hi - size, first - 1)
            nr = 0
            ir = 0
            for j in range(hi, stop, -1):
                offr[nr] = j
                nr += 0 if pivot < v[j] else 1
            hi = stop
        right = offr[ir] if ir < nr else first
        if not left < right:
            return min(left, before)
        _swap_jit(v, ix, left, right)
        il += 1
        ir += 1
        before = right


def _adjust_heap(v, ix, first, hole, length, value, index, desc):  # pragma: no cover - compiled
    top = hole
    child = hole
    while child < (length - 1) // 2:
        child = 2 * (child + 1)
        if _less_jit(v[first + child], v[first + child - 1], desc):
            child -= 1
        v[first + hole] = v[first + child]
        ix[first + hole] = ix[first + child]
        hole = child
    if (length & 1) == 0 and child == (length - 2) // 2:
        child = 2 * (child + 1)
        v[first + hole] = v[first + child - 1]
        ix[first + hole] = ix[first + child - 1]
        hole = child - 1
    parent = (hole - 1) // 2
    while hole > top and _less_jit(v[first + parent], value, desc):
        v[first + hole] = v[first + parent]
        ix[first + hole] = ix[first + parent]
        hole = parent
        parent = (hole - 1) // 2
    v[first + hole] = value
    ix[first + hole] = index


def _make_heap(v, ix, first, last, desc):  # pragma: no cover - compiled
    length = last - first
    if length >= 2:
        parent = (length - 2) // 2
        while True:
            _adjust_heap_jit(v, ix, first, parent, length, v[first + parent], ix[first + parent], desc)
            if parent == 0:
                break
            parent -= 1


def _heap_sort(v, ix, first, last, desc):  # pragma: no cover - compiled
    """The library's partial sort of the whole range: make a heap, then pop it."""
    _make_heap_jit(v, ix, first, last, desc)
    end = last
    while end - first > 1:
        end -= 1
        value, index = v[end], ix[end]
        v[end] = v[first]
        ix[end] = ix[first]
        _adjust_heap_jit(v, ix, first, 0, end - first, value, index, desc)


def _insertion_sort(v, ix, first, last, desc):  # pragma: no cover - compiled
    """A stable insertion sort of one leaf range (what the final insertion sort does to it)."""
    for i in range(first + 1, last):
        value, index = v[i], ix[i]
        j = i
        while j > first and _less_jit(value, v[j - 1], desc):
            v[j] = v[j - 1]
            ix[j] = ix[j - 1]
            j -= 1
        v[j] = value
        ix[j] = index


def _straddles(first, last, cuts):  # pragma: no cover - compiled
    for c in cuts:
        if first < c < last:
            return True
    return False


def _introselect(v, ix, first0, last0, depth0, cuts, desc):  # pragma: no cover - compiled
    """Introsort on (v, ix) from the range [first0, last0) at depth limit ``depth0``, every range that straddles no
    cut left as it is (its entries stay on one side). Ascending ranges are partitioned by blocks
    (:func:`_partition_ascending`, the same swaps)."""
    offl = np.empty(_BLOCK, dtype=np.int64)
    offr = np.empty(_BLOCK, dtype=np.int64)
    stack = np.empty((128, 3), dtype=np.int64)  # (first, last, depth); a straddled range splits into <= 2 per cut
    stack[0, 0], stack[0, 1], stack[0, 2] = first0, last0, depth0
    top = 1
    while top > 0:
        top -= 1
        first, last, depth = stack[top, 0], stack[top, 1], stack[top, 2]
        leaf = True
        while last - first > _THRESHOLD:
            if not _straddles_jit(first, last, cuts):
                leaf = False
                break
            if depth == 0:
                _heap_sort_jit(v, ix, first, last, desc)
                leaf = False
                break
            depth -= 1
            if desc:
                cut = _partition_jit(v, ix, first, last, desc)
            else:
                cut = _partition_ascending_jit(v, ix, first, last, offl, offr)
            if _straddles_jit(cut, last, cuts):
                if top == stack.shape[0]:
                    bigger = np.empty((2 * stack.shape[0], 3), dtype=np.int64)
                    bigger[:top] = stack[:top]
                    stack = bigger
                stack[top, 0], stack[top, 1], stack[top, 2] = cut, last, depth
                top += 1
            last = cut
        if leaf and last - first > 1 and _straddles_jit(first, last, cuts):
            _insertion_sort_jit(v, ix, first, last, desc)


def _fill(ix, lo, hi, mask):  # pragma: no cover - compiled
    for p in range(lo, hi):
        mask[ix[p]] = True


_less_jit = kernels._jit(_less)
_swap_jit = kernels._jit(_swap)
_median_to_first_jit = kernels._jit(_median_to_first)
_partition_jit = kernels._jit(_partition)
_partition_ascending_jit = kernels._jit(_partition_ascending)
_adjust_heap_jit = kernels._jit(_adjust_heap)
_make_heap_jit = kernels._jit(_make_heap)
_heap_sort_jit = kernels._jit(_heap_sort)
_insertion_sort_jit = kernels._jit(_insertion_sort)
_straddles_jit = kernels._jit(_straddles)
_introselect_jit = kernels._jit(_introselect)
_fill_jit = kernels._jit(_fill)


def window_mask_by_sort(keys: torch.Tensor, lo: int, hi: int, descending: bool) -> torch.Tensor:
    """Boolean mask (``keys``' shape) of the entries at positions [lo, hi) of torch's own unstable sort of the
    flattened ``keys`` (float32): the definition :func:`window_mask` reproduces."""
    flat = keys.reshape(-1)
    order = torch.sort(flat, descending=descending).indices
    keep = torch.zeros(flat.numel(), dtype=torch.bool)
    keep[order[lo:hi]] = True
    return keep.reshape(keys.shape)


def window_mask(keys: torch.Tensor, lo: int, hi: int, descending: bool) -> torch.Tensor:
    """:func:`window_mask_by_sort`'s mask by a selection (numba, on the CPU: keys on another device are copied)."""
    n = keys.numel()
    lo, hi = max(0, min(lo, n)), max(0, min(hi, n))
    if hi <= lo:
        return torch.zeros(keys.shape, dtype=torch.bool)
    clear = _without_ties_at_the_cuts(keys, lo, hi, descending)
    if clear is not None:  # no tie straddles a cut: the window is a range of values, whatever the order of ties
        return clear
    v = keys.reshape(-1).to(torch.float32).cpu().numpy().copy()
    ix = _index_array(n)
    _positions_jit(v, ix, bool(descending))
    mask = np.zeros(n, dtype=np.bool_)
    _select_into(v, ix, lo, hi, mask)
    return torch.from_numpy(mask).reshape(keys.shape)


def _index_array(n: int) -> np.ndarray:
    """Uninitialised positions for ``n`` entries: 32-bit where they fit."""
    return np.empty(n, dtype=np.int32 if n < 2 ** 31 else np.int64)


def _select_into(v: np.ndarray, ix: np.ndarray, lo: int, hi: int, mask: np.ndarray) -> None:
    """mask = the entries at positions [lo, hi) of the library's introsort of ``v`` (float32 keys, consumed, with
    their positions ``ix``; a descending order is the ascending order of −v: the same comparisons, ties
    included)."""
    n = v.shape[0]
    _introselect_jit(v, ix, np.int64(0), np.int64(n), np.int64(2 * (n.bit_length() - 1)),
                     (np.int64(lo), np.int64(hi)), False)
    mask[:] = False
    _fill_jit(ix, lo, hi, mask)


def _magnitudes_into(t, b, v, ix, negate):  # pragma: no cover - compiled
    """v = float32(|t − b|) (−that where ``negate``), the difference in float64: for float32 or float64 inputs the
    bits of :func:`magnitudes` (a difference of two float32 rounded once from float64 is the float32 difference);
    ix = 0, 1, … in the same pass."""
    for j in range(t.shape[0]):
        m = np.float32(abs(np.float64(t[j]) - np.float64(b[j])))
        v[j] = -m if negate else m
        ix[j] = j


def _positions(v, ix, negate):  # pragma: no cover - compiled
    """ix = 0, 1, …; v negated in place where ``negate`` (one pass)."""
    for j in range(v.shape[0]):
        if negate:
            v[j] = -v[j]
        ix[j] = j


_magnitudes_into_jit = kernels._jit(_magnitudes_into)
_positions_jit = kernels._jit(_positions)


def window_mask_into(t: np.ndarray, b: np.ndarray, lo: int, hi: int, descending: bool, mask: np.ndarray,
                     scratch: np.ndarray | None = None) -> None:
    """:func:`window_mask` of :func:`magnitudes` (t, b) written into ``mask`` (flat numpy arrays: float32 or float64
    inputs, a boolean row), by the introselect alone: for a caller that already knows a run of ties crosses a cut
    (no check by values first). The magnitudes computed in one compiled pass (into ``scratch``, a float32 array of
    the entries' count, where given), the positions 32-bit where they fit: 8 bytes per entry at most while it runs.
    Needs numba."""
    n = t.shape[0]
    v = np.empty(n, dtype=np.float32) if scratch is None else scratch
    ix = _index_array(n)
    _magnitudes_into_jit(t, b, v, ix, bool(descending))
    _select_into(v, ix, lo, hi, mask)


def _without_ties_at_the_cuts(keys: torch.Tensor, lo: int, hi: int, descending: bool) -> torch.Tensor | None:
    """The window's mask by its values alone — ascending positions [a, b) are the entries ≥ the value at position
    a and < the value at position b — when no run of equal values crosses a cut (the value at each inner cut
    position p has exactly p entries below it); else None (the order of the tied entries decides)."""
    flat = keys.reshape(-1).cpu()
    n = flat.numel()
    a, b = (n - hi, n - lo) if descending else (lo, hi)
    inner = [p for p in (a, b) if 0 < p < n]
    if not inner:
        return torch.ones(keys.shape, dtype=torch.bool, device=keys.device)
    values = np.partition(flat.numpy(), inner)[inner]  # a selection (numpy's introselect), no sort
    keep = torch.ones(n, dtype=torch.bool)
    for p, value in zip(inner, values):
        side = "low" if p == a else "high"
        below = flat < float(value)
        if int(below.sum()) != p:
            return None
        keep &= ~below if side == "low" else below
    return keep.reshape(keys.shape).to(keys.device)


def magnitudes(t: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The keys mergekit sorts: |t − b| computed in the tensors' own dtype (a float16/bfloat16 task vector rounded
    as mergekit's is), as float32."""
    return (t - b).abs().float()


# ------------------------------------------------------------------ torch.topk's set (SCE)
#
# torch's CPU top-k of one row copies (value, index) pairs and, with the comparator ``a > b``, runs the C++
# library's std::partial_sort of the first k where k·64 ≤ n, else std::nth_element at k − 1 (introselect:
# median-of-three partitions down to ranges of at most 3, then an insertion sort; a heap select below depth
# 2·⌊log₂ n⌋); the k pairs in front are the top k (their order inside does not change the set).


def _heap_select(v, ix, first, middle, last, desc):  # pragma: no cover - compiled
    """The library's heap select: a heap of [first, middle), then each later entry that beats its top replaces it."""
    length = middle - first
    _make_heap_jit(v, ix, first, middle, desc)
    for i in range(middle, last):
        if _less_jit(v[i], v[first], desc):
            value, index = v[i], ix[i]
            v[i] = v[first]
            ix[i] = ix[first]
            _adjust_heap_jit(v, ix, first, 0, length, value, index, desc)


def _nth_element(v, ix, nth, desc):  # pragma: no cover - compiled
    first = 0
    last = v.shape[0]
    depth = 0
    m = last
    while m > 1:
        depth += 1
        m >>= 1
    depth *= 2
    while last - first > 3:
        if depth == 0:
            _heap_select_jit(v, ix, first, nth + 1, last, desc)
            _swap_jit(v, ix, first, nth)
            return
        depth -= 1
        cut = _partition_jit(v, ix, first, last, desc)
        if cut <= nth:
            first = cut
        else:
            last = cut
    _insertion_sort_jit(v, ix, first, last, desc)


_heap_select_jit = kernels._jit(_heap_select)
_nth_element_jit = kernels._jit(_nth_element)


def topk_mask_by_torch(keys: torch.Tensor, k: int) -> torch.Tensor:
    """Boolean mask of the entries ``torch.topk(keys.reshape(-1), k)`` returns (the definition of :func:`topk_mask`)."""
    flat = keys.reshape(-1)
    keep = torch.zeros(flat.numel(), dtype=torch.bool)
    if k > 0:
        keep[torch.topk(flat, k, largest=True).indices] = True
    return keep.reshape(keys.shape)


def topk_mask(keys: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`topk_mask_by_torch`'s mask by the same selection (numba, on the CPU; torch's top-k where the keys are
    not float32: mergekit's order in its half dtype)."""
    n = keys.numel()
    k = max(0, min(k, n))
    if k == 0 or k == n:
        return torch.full(keys.shape, k == n, dtype=torch.bool)
    if keys.dtype != torch.float32:
        return topk_mask_by_torch(keys, k)
    v = keys.reshape(-1).cpu().numpy().copy()
    ix = np.arange(n, dtype=np.int64)
    if k * 64 <= n:
        _heap_select_jit(v, ix, 0, k, n, True)
    else:
        _nth_element_jit(v, ix, k - 1, True)
    mask = np.zeros(n, dtype=np.bool_)
    _fill_jit(ix, 0, k, mask)
    return torch.from_numpy(mask).reshape(keys.shape)
