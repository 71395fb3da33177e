"""Fused kernels for the merge methods' hot loops (numba, a required dependency).

* :func:`magnitude_histogram` / :func:`magnitude_histograms`: the radix select's histograms of
  float32(|(θ_i − θ_base) · w_i|), the task vector formed in float64; :func:`magnitude_sample` and
  :func:`magnitude_windows` the one-visit variant of the model-wide threshold
  (:func:`symmerge.merge.parts.task_vector_thresholds`);
* :func:`_bits53`: the uniforms of :func:`symmerge.merge.parts.dare_uniforms` computed in a loop;
* :func:`average_into`: the weighted average cast into its dtype in one pass;
* :func:`sq_distances`: the report's distances.

Every task-vector rule (TIES, DARE, DELLA, breadcrumbs, task arithmetic, symmerge's model-wide variants) is
one kernel, :func:`symmerge.merge.kernels_whole.task_vector_into`. The slower torch definitions they are
checked against live in the tests (``tests/merge/reference_rules.py``). Kernels are compiled on first use and
cached on disk by numba (``cache=True``); they release the GIL, so the streamed merge's reader and writer
threads run beside them. numba itself is imported at the first call of a kernel (:func:`_jit`), not with the
package: a command whose merge calls none (passthrough, a plan printed, ``--help``) does not pay for it.
"""

from __future__ import annotations

import os
import sys
import threading

import numpy as np

_BLOCK = 4096  # entries converted to float32 at once before their bits are counted
_NUMBA: list = []  # numba, once a kernel was first called
_DECLARED: list = []  # the kernels declared before that (_Kernel)
_LOADING = threading.Lock()


class _Kernel:
    """A kernel declared before numba is imported. Its first call (of any declared kernel) imports numba, makes
    every declared kernel a numba dispatcher and puts the dispatchers in place of these stand-ins wherever a
    ``symmerge`` module names one — so a kernel calling another finds a dispatcher when numba compiles it —
    then calls its dispatcher."""

    __slots__ = ("function", "options", "dispatcher")

    def __init__(self, function, options: dict):
        self.function, self.options, self.dispatcher = function, options, None

    def __call__(self, *args, **kwargs):
        if self.dispatcher is None:
            _load_numba()
        return self.dispatcher(*args, **kwargs)


def _load_numba():
    """Import numba and compile-on-call every declared kernel (see :class:`_Kernel`); once per process. As the
    command, numba is imported as the package's own imports are, without the cyclic garbage collector, its objects
    frozen after (:func:`symmerge._entry.collector_paused`)."""
    import contextlib

    from .._entry import collector_paused, running_as_command

    with _LOADING:
        if _NUMBA:
            return _NUMBA[0]
        with collector_paused() if running_as_command() else contextlib.nullcontext():
            import numba

            for k in _DECLARED:
                k.dispatcher = _compiled(numba, k.function, k.options)
        for name, module in list(sys.modules.items()):
            if name.startswith("symmerge.") and module is not None:
                names = vars(module)
                for key, value in list(names.items()):
                    if isinstance(value, _Kernel):
                        names[key] = value.dispatcher
        _DECLARED.clear()
        _NUMBA.append(numba)
        return numba


def _jit(f, **options):
    """``f`` as a kernel (``numba.njit(cache=True, nogil=True, **options)``): the dispatcher once numba is imported,
    until then a :class:`_Kernel` that imports it at its first call."""
    options = {"cache": True, "nogil": True, **options}
    if _NUMBA:
        return _compiled(_NUMBA[0], f, options)
    kernel = _Kernel(f, options)
    with _LOADING:
        if not _NUMBA:
            _DECLARED.append(kernel)
            return kernel
    return _compiled(_NUMBA[0], f, options)


_UNCACHED: list = []  # said once: the kernels cannot be cached on disk here


def _compiled(numba, f, options: dict):
    """``numba.njit(**options)(f)``, its on-disk cache guarded: a damaged cache file (numba's index or data, e.g. a
    half-written or junk ``.nbi``/``.nbc``) is read as no entry, so the kernel is compiled and its entry written anew
    (numba itself stops with an UnpicklingError); where numba finds no folder to cache in (the package folder and
    ``~/.cache`` read-only, ``NUMBA_CACHE_DIR`` unset) the kernels are compiled in each run, with one note."""
    try:
        dispatcher = numba.njit(**options)(f)
    except RuntimeError as e:
        if "no locator available" not in str(e):
            raise
        if not _UNCACHED:
            _UNCACHED.append(True)
            print("note: numba cannot cache symmerge's kernels here (their package folder and ~/.cache are read-only): "
                  "they are compiled in each run; set NUMBA_CACHE_DIR to a writable folder to keep them",
                  file=sys.stderr)
        return numba.njit(**{**options, "cache": False})(f)
    _guard_cache(dispatcher)
    return dispatcher


def _guard_cache(dispatcher) -> None:
    """Read a damaged on-disk cache entry of ``dispatcher`` as none (numba's ``FunctionCache``: its index and its
    overloads); nothing where numba's cache does not have that shape."""
    cache = getattr(dispatcher, "_cache", None)
    index = getattr(cache, "_cache_file", None)
    if not callable(getattr(index, "_load_index", None)) or not callable(getattr(cache, "load_overload", None)):
        return
    load_index, load_overload = index._load_index, cache.load_overload

    def read_index():
        try:
            return load_index()
        except Exception:  # noqa: BLE001 - any failure to read numba's pickled index: a damaged one
            return {}

    def read_overload(*args, **kwargs):
        try:
            return load_overload(*args, **kwargs)
        except Exception:  # noqa: BLE001 - any failure to read a cached overload: compiled again
            return None

    index._load_index, cache.load_overload = read_index, read_overload


def _histogram(t, b, w, high_bin, hist, scratch):  # pragma: no cover - compiled
    """Count the float32 bit patterns of |(t − b)·w|: by their high 16 bits (``high_bin`` < 0), else
    the low 16 bits of those whose high 16 bits equal ``high_bin``."""
    n = t.shape[0]
    bits = scratch.view(np.uint32)
    for start in range(0, n, scratch.shape[0]):
        stop = min(n, start + scratch.shape[0])
        tb, bb = t[start:stop], b[start:stop]  # block slices indexed from 0: the loop vectorizes (4x)
        for j in range(stop - start):
            scratch[j] = np.float32(abs((np.float64(tb[j]) - np.float64(bb[j])) * w))
        if high_bin < 0:
            for j in range(stop - start):
                hist[bits[j] >> 16] += 1
        else:
            for j in range(stop - start):
                v = bits[j]
                if (v >> 16) == high_bin:
                    hist[v & 0xFFFF] += 1


def _sample(t, b, w, first, stride, width, out):  # pragma: no cover - compiled
    """float32 |(t − b)·w| of the entries [p, p + width) for p = first, first + stride, … < len(t), into
    ``out`` in order; returns how many were written."""
    n = t.shape[0]
    fill = 0
    p = first
    while p < n:
        q = min(n, p + width)
        tb, bb = t[p:q], b[p:q]
        for j in range(q - p):
            out[fill + j] = np.float32(abs((np.float64(tb[j]) - np.float64(bb[j])) * w))
        fill += q - p
        p += stride
    return fill


def _windows(ts, b, w, lo, hi, scratch, wide, bufs, fill, above):  # pragma: no cover - compiled
    """Over the float32 bit patterns v of |(t_i − b)·w_i| of every model i (as int32: magnitudes have no
    sign bit): ``above[i]`` += the count of v > ``hi[i]``, and the v with ``lo[i]`` ≤ v ≤ ``hi[i]``
    appended to ``bufs[i]`` from ``fill[i]`` while it has room (a fill beyond ``len(bufs[i])`` means the
    window held more: the candidates are then incomplete). Block by block, the base's block widened
    once for every model; each block counted first (vectorized), scanned for candidates only where it
    holds some."""
    n = b.shape[0]
    bits = scratch.view(np.int32)
    size_b = scratch.shape[0]
    for start in range(0, n, size_b):
        stop = min(n, start + size_b)
        m = stop - start
        bb = b[start:stop]
        for j in range(m):
            wide[j] = np.float64(bb[j])
        for i in range(len(ts)):
            tb = ts[i][start:stop]
            wi = w[i]
            low, high = lo[i], hi[i]
            for j in range(m):
                scratch[j] = np.float32(abs((np.float64(tb[j]) - wide[j]) * wi))
            count = np.int32(0)
            inside = np.int32(0)
            for j in range(m):
                v = bits[j]
                count += np.int32(v > high)
                inside += np.int32(v >= low) & np.int32(v <= high)
            above[i] += count
            if inside > 0:
                buf = bufs[i]
                if fill[i] + inside <= buf.shape[0]:
                    at = fill[i]
                    for j in range(m):
                        v = bits[j]
                        if v >= low and v <= high:
                            buf[at] = v
                            at += 1
                fill[i] += inside


_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's constants


def _bits53(seed, index):  # pragma: no cover - compiled
    """The top 53 bits of the ``index``-th output of the SplitMix64 stream seeded with ``seed``: the
    uniform of :func:`symmerge.merge.parts.dare_uniforms` (the definition) times 2⁵³."""
    z = seed + (np.uint64(index) + np.uint64(1)) * np.uint64(_GOLDEN)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
    z = z ^ (z >> np.uint64(31))
    return z >> np.uint64(11)


def _sq_diff(a, b):  # pragma: no cover - compiled
    acc = 0.0
    for j in range(a.shape[0]):
        d = np.float64(a[j]) - np.float64(b[j])
        acc += d * d
    return acc


def _widen(a, out):  # pragma: no cover - compiled
    for j in range(a.shape[0]):
        out[j] = np.uint32(a[j]) << np.uint32(16)


def _sq_three(a, b, r):  # pragma: no cover - compiled
    """(Σ (a − b)², Σ (a − r)², Σ (b − r)²) in one pass (two inputs and their result)."""
    ab = ar = br = 0.0
    for j in range(a.shape[0]):
        x, y, z = np.float64(a[j]), np.float64(b[j]), np.float64(r[j])
        ab += (x - y) * (x - y)
        ar += (x - z) * (x - z)
        br += (y - z) * (y - z)
    return ab, ar, br


def _sq_sums(arrays, half, sums):  # pragma: no cover - compiled
    """Σ (a_i − a_k)² for every pair i < k of ``arrays`` (t of them: into ``sums[i·t + k]``), in float64, block by
    block (``1 << 14`` entries of every array, from the cache for every pair), the blocks' sums added in order;
    three arrays (two inputs and their result): the three sums in one pass. ``half``: the arrays hold bfloat16 bit
    patterns (uint16), widened exactly to float32."""
    t = len(arrays)
    m = arrays[0].shape[0]
    block = 1 << 14
    bits = np.empty(t * block, dtype=np.uint32)
    widened = bits.view(np.float32)
    for start in range(0, m, block):
        size = min(m, start + block) - start
        if half:
            for i in range(t):
                _widen_jit(arrays[i][start:start + size], bits[i * block:i * block + size])
        if t == 3:
            if half:
                ab, ar, br = _sq_three_jit(widened[:size], widened[block:block + size],
                                           widened[2 * block:2 * block + size])
            else:
                ab, ar, br = _sq_three_jit(arrays[0][start:start + size], arrays[1][start:start + size],
                                           arrays[2][start:start + size])
            sums[1] += ab
            sums[2] += ar
            sums[5] += br
            continue
        for i in range(t):
            for k in range(i + 1, t):
                if half:
                    sums[i * t + k] += _sq_diff_jit(widened[i * block:i * block + size],
                                                    widened[k * block:k * block + size])
                else:
                    sums[i * t + k] += _sq_diff_jit(arrays[i][start:start + size], arrays[k][start:start + size])


def _scale_add(src, w, first, acc):  # pragma: no cover - compiled
    """acc[:n] = src·w (``first``), else src·w + acc[:n] (contracted to one fused multiply-add)."""
    if first:
        for j in range(src.shape[0]):
            acc[j] = np.float64(src[j]) * w
    else:
        for j in range(src.shape[0]):
            acc[j] = np.float64(src[j]) * w + acc[j]


def _store(acc, size, out_kind, dst, wide):  # pragma: no cover - compiled
    """dst[:size] = acc[:size] (float64) rounded to float32 (``out_kind`` 1), to bfloat16 through float32
    with round-to-nearest-even on the bits (2: ``dst`` holds uint16 bit patterns; NaN: 0x7FC0, as c10
    does; ``wide``: uint32 scratch of at least ``size``), or kept (0): torch's casts."""
    if out_kind == 0:
        for j in range(size):
            dst[j] = acc[j]
    elif out_kind == 1:
        for j in range(size):
            dst[j] = np.float32(acc[j])
    else:
        wide_f = wide.view(np.float32)
        for j in range(size):
            wide_f[j] = np.float32(acc[j])
        for j in range(size):
            u = wide[j]
            if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
                dst[j] = np.uint16(0x7FC0)
            else:
                dst[j] = np.uint16((u + ((u >> np.uint32(16)) & np.uint32(1)) + np.uint32(0x7FFF)) >> np.uint32(16))


def _average(arrays, half, w, out_kind, out, wide, acc):  # pragma: no cover - compiled
    """out = cast(Σ_i w_i · float64(a_i)), block by block, as :func:`symmerge.merge.base.weighted_sum`
    and the cast compute it: the first product, then ``a_i · w_i + sum`` fused (torch's ``add_(t, alpha=w)``
    is a fused multiply-add), rounded to float32 (``out_kind`` 1), to bfloat16 through float32 with
    round-to-nearest-even on the bits (2: ``out`` holds uint16 bit patterns; NaN: 0x7FC0, as c10 does), or
    kept (0). ``half``: the inputs are bfloat16 bit patterns (uint16), widened exactly."""
    n = len(arrays)
    m = arrays[0].shape[0]
    block = acc.shape[0]
    wide_f = wide.view(np.float32)
    for start in range(0, m, block):
        size = min(m, start + block) - start
        for i in range(n):
            if half:
                _widen_jit(arrays[i][start:start + size], wide[:size])
                _scale_add_jit(wide_f[:size], w[i], i == 0, acc)
            else:
                _scale_add_jit(arrays[i][start:start + size], w[i], i == 0, acc)
        _store_jit(acc, size, out_kind, out[start:start + size], wide)


_histogram_jit = _jit(_histogram)
_sample_jit = _jit(_sample)
_windows_jit = _jit(_windows)
_bits53_jit = _jit(_bits53)
# the report's distances need no fixed summation order: reassociated (vectorized) sums
_sq_diff_jit = _jit(_sq_diff, fastmath=True)
_sq_three_jit = _jit(_sq_three, fastmath=True)
_widen_jit = _jit(_widen)
_store_jit = _jit(_store)
_sq_sums_jit = _jit(_sq_sums, fastmath=True)
# 'contract' only: a·w + s may become one fused multiply-add, as torch's vectorized add computes it
_scale_add_jit = _jit(_scale_add, fastmath={"contract"})
_average_jit = _jit(_average, fastmath={"contract"})
_AVERAGE_BLOCK = 4096
_average_checked: dict = {}  # dtype -> the kernel gave torch's bits on this machine (checked once per dtype)


_OUT_KIND = {"float64": 0, "float32": 1, "bfloat16": 2}  # the kernels' ``out_kind`` (see :func:`_store`)


def _flat_bits(t):
    """A CPU tensor's entries as a flat numpy array, bfloat16 as its uint16 bit patterns (no copy for a
    contiguous tensor)."""
    import torch

    t = t.reshape(-1)
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


def _fits(tensors, out) -> bool:
    """Whether a whole-tensor kernel applies: ``out`` float32, float64 or bfloat16 and
    contiguous, every input a contiguous CPU tensor of ``out``'s dtype and shape."""
    if str(out.dtype).split(".")[1] not in _OUT_KIND or not out.is_contiguous():
        return False
    return not any(t.dtype != out.dtype or t.device.type != "cpu" or not t.is_contiguous() or t.shape != out.shape
                   for t in tensors)


def _average_run(tensors, weights, out) -> None:
    import torch

    _average_jit(tuple(_flat_bits(t) for t in tensors), tensors[0].dtype == torch.bfloat16,
                 np.array(weights, dtype=np.float64), _OUT_KIND[str(out.dtype).split(".")[1]], _flat_bits(out),
                 np.empty(_AVERAGE_BLOCK, dtype=np.uint32), np.empty(_AVERAGE_BLOCK, dtype=np.float64))


def _average_agrees(dtype=None) -> bool:
    """Whether the kernel gives torch's bits here (fused multiply-add or not, the compiler and the CPU
    decide): checked once per process and dtype (all three when None) on values whose products and sums
    round."""
    import torch

    from .base import weighted_sum

    dtypes = (torch.float32, torch.bfloat16, torch.float64) if dtype is None else (dtype,)
    for dt in dtypes:
        if dt not in _average_checked:
            g = torch.Generator().manual_seed(0)
            xs = [(torch.randn(5003, generator=g, dtype=torch.float64) *
                   10.0 ** torch.randint(-6, 6, (5003,), generator=g)).to(dt) for _ in range(3)]
            w = [0.3, 0.45, 0.25]
            out = torch.empty(5003, dtype=dt)
            _average_run(xs, w, out)
            _average_checked[dt] = torch.equal(out.view(torch.uint8), weighted_sum(xs, w).to(dt).view(torch.uint8))
    return all(_average_checked[dt] for dt in dtypes)


def average_into(tensors, weights, out) -> bool:
    """``out`` ← Σ w_i t_i cast to ``out``'s dtype, the bits of ``weighted_sum(tensors, weights).to(dtype)``,
    in one pass; False (nothing written) where it does not apply: mixed or other dtypes,
    non-CPU or non-contiguous tensors, or a machine where the kernel's rounding differs from torch's."""
    if not _fits(tensors, out) or not _average_agrees(out.dtype):
        return False
    _average_run(tensors, weights, out)
    return True


def _np(t):
    """A 1-D numpy view of a tensor (float32/float64 as they are; half precisions widened, exactly; a tensor on
    another device copied to the CPU first: the kernels run there)."""
    import torch

    t = t.reshape(-1).cpu()
    if t.dtype not in (torch.float32, torch.float64):
        t = t.float()
    return t.contiguous().numpy()


def magnitude_histogram(t, b, w: float, hist, high_bin: int = -1) -> None:
    """Add to ``hist`` (an int64 numpy array of 65536 counts) the high (``high_bin`` < 0) or low 16-bit
    histogram of float32(|(t − b)·w|), the difference and product in float64."""
    _histogram_jit(_np(t), _np(b), float(w), int(high_bin), hist, np.empty(_BLOCK, dtype=np.float32))


_SPLIT = 1 << 20  # entries from which a tensor's histograms are split over the workers
_SPLIT_WINDOW = 1 << 17  # the same for the window's count (one visit: every tensor of a layer is worth splitting)


def magnitude_histograms(tensors, base, weights, hists, high_bins=None, pool=None) -> None:
    """:func:`magnitude_histogram` of every model's ``tensors`` against ``base`` (``high_bins``: one per
    model, or None for the high histograms) into ``hists`` (int64, (parts, models, 65536)): a tensor of
    at least 2²⁰ entries is split into ``parts`` ranges counted at once by ``pool``'s threads (the kernel
    releases the GIL), each range into its own ``hists[p]``; the counts' sum over ``parts`` is the same."""
    b = _np(base)
    ts = [_np(t) for t in tensors]
    parts = hists.shape[0] if pool is not None and b.shape[0] >= _SPLIT else 1
    step = -(-b.shape[0] // parts)

    def run(p):
        lo, hi = p * step, min(b.shape[0], (p + 1) * step)
        scratch = np.empty(_BLOCK, dtype=np.float32)
        for i, (t, w) in enumerate(zip(ts, weights)):
            _histogram_jit(t[lo:hi], b[lo:hi], float(w), -1 if high_bins is None else int(high_bins[i]),
                           hists[p, i], scratch)

    if parts == 1:
        run(0)
    else:
        list(pool.map(run, range(parts)))


def magnitude_sample(tensors, base, weights, offset: int, stride: int, width: int) -> list:
    """Per model, float32 |(t_i − b)·w_i| of the entries of this tensor whose position in the visit (the
    tensor starts at ``offset``) lies in a block [g, g + width) with g a multiple of ``stride``: a
    systematic sample of the visit, one in ``stride / width`` entries."""
    b = _np(base)
    m = b.shape[0]
    first = (-offset) % stride
    count = 0 if first >= m else -(-(m - first) // stride) * width
    out = []
    for t, w in zip(tensors, weights):
        buf = np.empty(count, dtype=np.float32)
        out.append(buf[:_sample_jit(_np(t), b, float(w), first, stride, width, buf)])
    return out


def magnitude_windows(tensors, base, weights, lows, highs, above, fill, bufs, pool=None) -> None:
    """:func:`_windows` of every model's ``tensors`` against ``base`` with model i's window
    [``lows[i]``, ``highs[i]``] (float32 bit patterns, at most 2³¹ − 1): counts into ``above[p, i]``,
    candidates into ``bufs[p][i]`` from ``fill[p, i]`` — ``p`` a range of the tensor counted by one of
    ``pool``'s threads (tensors of at least 2¹⁷ entries are split over ``above.shape[0]`` ranges)."""
    b = _np(base)
    ts = [_np(t) for t in tensors]
    if any(t.dtype != b.dtype for t in ts):  # one dtype for the compiled loop (mixed inputs: rare)
        b, ts = b.astype(np.float64), [t.astype(np.float64) for t in ts]
    parts = above.shape[0] if pool is not None and b.shape[0] >= _SPLIT_WINDOW else 1
    step = -(-b.shape[0] // parts)
    w = np.array(weights, dtype=np.float64)
    lo, hi = np.array(lows, dtype=np.int32), np.array(highs, dtype=np.int32)

    def run(p):
        start, stop = p * step, min(b.shape[0], (p + 1) * step)
        _windows_jit(tuple(t[start:stop] for t in ts), b[start:stop], w, lo, hi, np.empty(_BLOCK, dtype=np.float32),
                     np.empty(_BLOCK, dtype=np.float64), tuple(bufs[p]), fill[p], above[p])

    if parts == 1:
        run(0)
    else:
        list(pool.map(run, range(parts)))


def workers() -> int:
    """Threads for the kernels that split a tensor: the cores this process may use, at most 4 (the
    counting is bound by memory bandwidth beyond)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


_pools: dict = {}


def _merge_pool():
    """A process-wide pool of :func:`workers` threads for the split merges (created once)."""
    with _pool_lock:
        if "merge" not in _pools:
            from concurrent.futures import ThreadPoolExecutor

            _pools["merge"] = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="symmerge-merge")
        return _pools["merge"]


_pool_lock = threading.Lock()


def sq_distances(inputs, result=None) -> tuple[dict, list]:
    """The report's squared L2 distances of one tensor, the one per-tensor rule of a merge's report in memory and
    streamed (:func:`symmerge.merge.steps.report_distances`): (every pair i < k of ``inputs``: ``{(i, k): …}``,
    each input to ``result``: a list, empty without a result). Each is Σ (a − b)² with the differences in float64:
    exact from any floating dtype, so a 16-bit tensor and its float32 copy give the same value. float32, float64
    and bfloat16 tensors of one dtype on the CPU are read in place; any other mix (float16, dtypes mixed, another
    device) is widened exactly, ``_STRETCH`` entries at a time (float64 where one is float64, else float32), and
    gives the values of its float32 (float64) copies. The sums are reassociated (vectorized, per block): a value
    is the same for the same tensors measured together (one input pair or the inputs and their result: three
    tensors are summed in one pass), not necessarily in the last bit for a pair measured with other tensors. One
    input and its result (a one-input merge) are summed by :func:`symmerge.core.distance.sq_distance` (float64
    blocks, torch only), without the compiled kernel."""
    import torch

    tensors = [*inputs, *([result] if result is not None else [])]
    t, n = len(tensors), len(inputs)
    if any(x.numel() != tensors[0].numel() for x in tensors):
        raise ValueError("sq_distances: tensors of different sizes")
    if n == 1 and result is not None:  # a one-input merge (passthrough, a copy): no pair, and no numba imported
        from ..core.distance import sq_distance

        return {}, [sq_distance({0: inputs[0]}, {0: result}, [0])]
    sums = np.zeros(t * t, dtype=np.float64)
    if t >= 2:
        dtype = tensors[0].dtype
        if all(x.dtype == dtype and x.device.type == "cpu" for x in tensors) and dtype in (
                torch.float32, torch.float64, torch.bfloat16):
            _sq_sums_jit(tuple(_flat_bits(x.detach()) for x in tensors), dtype == torch.bfloat16, sums)
        else:
            wide = torch.float64 if any(x.dtype == torch.float64 for x in tensors) else torch.float32
            flat = [x.detach().reshape(-1) for x in tensors]
            for at in range(0, flat[0].numel(), _STRETCH):
                _sq_sums_jit(tuple(x[at:at + _STRETCH].to("cpu", wide).numpy() for x in flat), False, sums)
    total = sums.tolist()
    return ({(i, k): total[i * t + k] for i in range(n) for k in range(i + 1, n)},
            [total[i * t + n] for i in range(n)] if result is not None else [])


_STRETCH = 1 << 18  # entries widened at once: a multiple of _sq_sums' block, so the same blocks and sums
