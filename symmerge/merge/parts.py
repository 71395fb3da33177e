"""Task-vector merging from composable parts: a sparsifier and a sign consensus.

With task vectors τ_i = θ_i − θ_base scaled by the weights w_i (multipliers, not normalised):

    θ = θ_base + λ · consensus(sparsify(w_1 τ_1), …, sparsify(w_n τ_n))        (λ = ``scale``)

Sparsifiers (:data:`SPARSIFIERS`; symmerge's own variants below, mergekit's forms further down), applied to
each weighted task vector on its own:

* ``none``: unchanged;
* ``magnitude``: keep the ``density`` fraction of entries of largest magnitude, zero the rest; the
  threshold is taken over every floating tensor of the model's task vector (``scope="model"``) or
  over each tensor alone (``scope="tensor"``); ties at the threshold are kept;
* ``dare``: drop each entry with probability ``drop``, rescale the survivors by 1/(1 − ``drop``)
  (the expectation is unchanged).

Consensus (:data:`CONSENSUS`):

* ``sum``: Σ_i τ̂_i;
* ``ties``: elect γ = sign(Σ_i τ̂_i) per entry, then the disjoint mean: the mean of the non-zero
  τ̂_i whose sign equals γ (0 where none does).

The registered methods are ``task_arithmetic`` = (none, sum), ``ties`` = (magnitude, ties),
``dare`` = (dare, sum) and ``dare_ties`` = (dare, ties); see :func:`task_vector_method`.

DARE masks: the mask of model ``i`` (its index in the list of models) for tensor ``key`` comes from
its own stream of uniforms, seeded with a hash of (``seed``, ``i``, ``key``) (:func:`dare_keep_mask`).
It depends on nothing else: not on the order of the keys in the state dict or of the loop over them,
nor on which other tensors or models are merged. The uniform of entry ``j`` (of the flattened tensor)
is the ``j``-th output of the SplitMix64 generator (a counter-based hash: any entry is drawn without
the ones before it, so threads and the kernel draw the same values) as a float64 in
[0, 1) (:func:`dare_uniforms`); a survivor where U ≥ ``drop``. The same seed gives the same masks on
every device and machine (integer arithmetic only).
"""

from __future__ import annotations

import hashlib
import math
from functools import partial

import torch

from ..errors import SymmergeError
from . import kernels
from .base import CHUNK, Method, boolean, choice, integer, per_model_values, real, weighted_sum
from .in_dtype import HALF, combine_in_dtype, mergekit_election
from .sort_order import window_mask


# ------------------------------------------------------------------ sparsifiers

_HALF = 1 << 16


def magnitude_threshold(tensors, density: float) -> float:
    """The smallest magnitude kept when keeping the top ``density`` fraction of all entries of ``tensors``
    (magnitudes in float32, compared in float32). ``tensors``: a list, or a function returning a fresh
    iterable of them; see :func:`task_vector_thresholds`."""
    visit = tensors if callable(tensors) else (lambda: tensors)
    return task_vector_thresholds(lambda: (([t], torch.zeros((), dtype=t.dtype).expand(t.shape)) for t in visit()),
                                  [1.0], density)[0]


def _high_bins(high: torch.Tensor, density: float) -> tuple[list[int], list[int]]:
    """Per row of ``high`` (counts by the high 16 bits): the bin holding the k-th largest entry and its
    rank inside that bin (k = round(density × entries), at least 1)."""
    bins, ranks = [], []
    for i in range(high.shape[0]):
        total = int(high[i].sum())
        if total == 0:
            raise SymmergeError("magnitude threshold of no entries")
        k = max(1, int(round(density * total)))  # the k-th largest is the threshold
        above = high[i].flip(0).cumsum(0)  # entries in bins >= (HALF - 1 - j)
        j = int(torch.searchsorted(above, torch.tensor(k)))
        bins.append(_HALF - 1 - j)
        ranks.append(k - (int(above[j - 1]) if j > 0 else 0))  # rank inside the chosen bin
    return bins, ranks


def _radix_values(low: torch.Tensor, bins, ranks) -> list[float]:
    """The float32 values whose high 16 bits are ``bins`` and whose low 16 bits hold rank ``ranks``
    (from the largest) in the rows of ``low``."""
    out = []
    for i in range(low.shape[0]):
        j = int(torch.searchsorted(low[i].flip(0).cumsum(0), torch.tensor(ranks[i])))
        value = torch.tensor([(bins[i] << 16) | (_HALF - 1 - j)], dtype=torch.int32).view(torch.float32)
        out.append(value.item())
    return out


def task_vector_thresholds(visit, weights, density: float, total: int | None = None, sampler=None) -> list[float]:
    """Per model, the smallest float32 magnitude kept when keeping the top ``density`` fraction of the entries of
    its weighted task vector (θ_i − θ_base)·w_i (formed in float64), from ``visit()``: a fresh iterable of (tensors
    of the models, base tensor) pairs, visited twice (a model-wide threshold never holds the model's magnitudes at
    once). Exact: a radix select on the float32 bit patterns (monotonic for magnitudes), the high 16 bits counted
    on the first visit, the low 16 bits of the entries in each model's chosen high bin on the second, each pair
    counted in one pass by the kernels (:mod:`symmerge.merge.kernels`); given ``total`` (the entries of one model's
    visit), the first visit is a sample only (:func:`_window_thresholds`; ``sampler``: how to read it), the same
    values either way."""
    n = len(weights)
    if density <= 0.0:  # nothing kept (mergekit's sparsifiers drop the whole task vector)
        return [math.inf] * n
    if total is not None and total >= _WINDOW_MIN:
        found = _window_thresholds(visit, weights, density, total, sampler)
        if found is not None:
            return found
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    split = kernels.workers()
    with ThreadPoolExecutor(max_workers=split) as pool:  # the two visits: each tensor counted by every core
        hists = np.zeros((split, n, _HALF), dtype=np.int64)
        for ts, base in visit():
            kernels.magnitude_histograms(ts, base, weights, hists, pool=pool)
        bins, ranks = _high_bins(torch.from_numpy(hists.sum(0)), density)
        hists[:] = 0
        for ts, base in visit():
            kernels.magnitude_histograms(ts, base, weights, hists, high_bins=bins, pool=pool)
    return _radix_values(torch.from_numpy(hists.sum(0)), bins, ranks)


_SAMPLE = 1 << 21  # entries per model sampled to place the window
_SAMPLE_WIDTH = 1024  # contiguous entries per sampled block
_WINDOW_MIN = 1 << 18  # below this many entries the two counting visits cost less than the sample's set-up


_GROUPS = 32  # interleaved subsamples whose spread measures the sample's own rank error


def _window_bounds(sample, k: int, total: int) -> tuple[int, int, int]:
    """From a sample (float32 bit patterns of magnitudes, int32, in blocks of :data:`_SAMPLE_WIDTH`) of
    ``total`` entries: bit patterns (lo, hi) that hold the k-th largest entry with a wide margin, and how
    many entries the window should hold (the sample's share inside it, ties included). The margin is
    6 standard errors of the sample's rank of the estimate (the larger of the binomial one and the one
    measured from the spread of :data:`_GROUPS` interleaved subsamples of whole blocks, which sees the
    correlation of neighbouring entries), plus 0.05 % of the sample."""
    import math

    import numpy as np

    size = sample.shape[0]
    if size == 0:
        return 0, _TOP, total
    p = k / total
    at = k * size / total
    rank = min(size, max(1, round(at)))
    guess = int(np.partition(sample, size - rank)[size - rank])
    blocks = -(-size // _SAMPLE_WIDTH)
    pad = np.zeros(blocks * _SAMPLE_WIDTH, dtype=bool)
    pad[:size] = sample > guess
    per_block = pad.reshape(blocks, _SAMPLE_WIDTH).sum(1)  # entries above the guess in each block
    groups = min(_GROUPS, blocks)
    share = np.bincount(np.arange(blocks) % groups, weights=per_block, minlength=groups) / \
        np.bincount(np.arange(blocks) % groups,
                    weights=np.minimum(_SAMPLE_WIDTH, size - np.arange(blocks) * _SAMPLE_WIDTH), minlength=groups)
    spread = float(share.std(ddof=1)) * size / math.sqrt(groups) if groups > 1 else 0.0
    margin = 6.0 * max(spread, math.sqrt(size * p * (1.0 - p))) + 0.0005 * size + 2.0
    top, bottom = math.floor(at - margin), math.ceil(at + margin)  # ranks from the largest, 1-based
    if top >= 1 and bottom <= size:
        both = np.partition(sample, [size - bottom, size - top])
        lo, hi = int(both[size - bottom]), int(both[size - top])
    else:
        hi = _TOP if top < 1 else int(np.partition(sample, size - top)[size - top])
        lo = 0 if bottom > size else int(np.partition(sample, size - bottom)[size - bottom])
    inside = int(np.count_nonzero((sample >= lo) & (sample <= hi)))  # ties at the ends included
    return lo, hi, int(inside / size * total)


_TOP = 0x7FFFFFFF  # above every magnitude's bit pattern (NaN's included): an open upper end


def _window_thresholds(visit, weights, density: float, total: int, sampler=None) -> list[float] | None:
    """The radix select's thresholds in one counting visit: a systematic sample of each task vector's
    magnitudes (one block of 1 024 entries in every ``total`` / 2²¹ · 1 024: about 2²¹ entries read)
    places a narrow window of bit patterns around each model's k-th largest; the visit then counts the
    entries above the window and keeps those inside it, and the k-th largest is selected among those
    kept. ``sampler(stride, width)``, when given, yields the sampled blocks of each visit's pair (the
    entries at positions p of the visit with p mod ``stride`` < ``width``, as (models, base) tensors)
    without reading the rest; else the sample is taken from ``visit()``. Exact whatever the sample:
    ``None`` (the caller then counts twice) when a window missed the k-th largest or held more entries
    than its buffer."""
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    n = len(weights)
    k = max(1, int(round(density * total)))
    stride = _SAMPLE_WIDTH * max(1, -(-total // _SAMPLE))
    samples: list[list] = [[] for _ in range(n)]
    if sampler is None:
        offset = 0
        for ts, base in visit():
            for i, got in enumerate(kernels.magnitude_sample(ts, base, weights, offset, stride, _SAMPLE_WIDTH)):
                samples[i].append(got)
            offset += base.numel()
        if offset != total:
            return None
    else:
        for ts, base in sampler(stride, _SAMPLE_WIDTH):
            whole = max(1, base.numel())  # the blocks as read: every entry
            for i, got in enumerate(kernels.magnitude_sample(ts, base, weights, 0, whole, whole)):
                samples[i].append(got)
    bounds = [_window_bounds(np.concatenate(s).view(np.int32) if s else np.empty(0, np.int32), k, total)
              for s in samples]
    lows, highs = [b[0] for b in bounds], [b[1] for b in bounds]
    rooms = [min(total, 2 * b[2] + (1 << 16)) for b in bounds]  # untouched room costs no memory
    split = kernels.workers()
    above, fill = np.zeros((split, n), dtype=np.int64), np.zeros((split, n), dtype=np.int64)
    bufs = [[np.empty(r, dtype=np.int32) for r in rooms] for _ in range(split)]
    with ThreadPoolExecutor(max_workers=split) as pool:
        for ts, base in visit():
            kernels.magnitude_windows(ts, base, weights, lows, highs, above, fill, bufs, pool=pool)
    out = []
    for i in range(n):
        count = int(above[:, i].sum())
        held = int(fill[:, i].sum())
        if any(int(fill[p, i]) > rooms[i] for p in range(split)) or not count < k <= count + held:
            return None
        inside = np.concatenate([bufs[p][i][:int(fill[p, i])] for p in range(split)])
        bits = np.partition(inside, held - (k - count))[held - (k - count)]
        out.append(float(np.array([bits], dtype=np.int32).view(np.float32)[0]))
    return out


def _read_ahead(keys, fetch):
    """``fetch(k)`` for every key in order, the next one fetched by a thread while the caller works on
    the current one (reads from files overlap the counting)."""
    from concurrent.futures import ThreadPoolExecutor

    keys = list(keys)
    if not keys:
        return
    with ThreadPoolExecutor(max_workers=1) as pool:
        ahead = pool.submit(fetch, keys[0])
        for i in range(len(keys)):
            current = ahead.result()
            if i + 1 < len(keys):
                ahead = pool.submit(fetch, keys[i + 1])
            yield current
            del current


def _scalar(value):
    """One value of a parameter that may be per model (the first: symmerge's own variants run only where all agree)."""
    return value[0] if isinstance(value, (list, tuple)) else value


def _agree(value) -> bool:
    return not isinstance(value, (list, tuple)) or all(v == value[0] for v in value)


def _magnitude_check(params):
    densities = params["density"] if isinstance(params["density"], (list, tuple)) else [params["density"]]
    for d in densities:
        try:
            ok = 0.0 <= float(d) <= 1.0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise SymmergeError(f"density must be in [0, 1], got {d!r}")
    scope = params["scope"]
    if scope not in SCOPES:
        raise SymmergeError(f"scope must be {', '.join(repr(x) for x in SCOPES)}, got {scope!r}")
    return float(densities[0]), scope


SCOPES = ("model", "tensor", "topk")


def _magnitude_prepare(state_dicts, base, weights, params):
    """Per model, the threshold over its whole weighted task vector (``scope="model"``), else ``None``."""
    _magnitude_check(params)
    densities = [float(d) for d in (params["density"] if isinstance(params["density"], (list, tuple))
                                    else [params["density"]] * len(state_dicts))]
    if params["scope"] != "model" or all(d >= 1.0 for d in densities):
        return None
    keys = [k for k in state_dicts[0] if _dtype(base, k).is_floating_point]
    if not keys:
        return None

    def visit():  # every model's tensor and the base's, one key at a time, the next key read ahead
        return _read_ahead(keys, lambda k: ([sd[k] for sd in state_dicts], base[k]))

    def sampler(stride, width):  # the sampled blocks only, read where they lie
        offset = 0
        for k in keys:
            first = (-offset) % stride
            yield [_blocks(sd, k, first, stride, width) for sd in state_dicts], _blocks(base, k, first, stride, width)
            offset += _numel(base, k)

    total = sum(_numel(base, k) for k in keys)
    found = {}
    for d in dict.fromkeys(densities):  # one select per distinct density (mergekit's per-model density)
        found[d] = task_vector_thresholds(visit, weights, d, total=total, sampler=sampler)
    return [found[d][i] for i, d in enumerate(densities)]


def _numel(mapping, key: str) -> int:  # a mapping that reads from files answers without reading the tensor
    return mapping.numel(key) if hasattr(mapping, "read_blocks") else mapping[key].numel()


def _dtype(mapping, key: str) -> torch.dtype:
    return mapping.dtype(key) if hasattr(mapping, "read_blocks") else mapping[key].dtype


def _blocks(mapping, key: str, first: int, stride: int, width: int) -> torch.Tensor:
    """The flat entries [p, p + width) of ``mapping[key]`` for p = first, first + stride, …, concatenated
    (a mapping with ``read_blocks`` reads just those)."""
    if hasattr(mapping, "read_blocks"):
        return mapping.read_blocks(key, first, stride, width)
    from ..io.checkpoint import blocks_of

    return blocks_of(mapping[key], first, stride, width)


def dare_seed(seed: int, model: int, key: str) -> int:
    """A 63-bit generator seed from (``seed``, model index, tensor name), the same in every process."""
    digest = hashlib.blake2b(f"{int(seed)}\x00{int(model)}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


GOLDEN, MIX1, MIX2 = kernels._GOLDEN, kernels._MIX1, kernels._MIX2  # SplitMix64 (Steele, Lea, Flood 2014)


def dare_uniforms(seed: int, start: int, count: int) -> torch.Tensor:
    """Entries ``start`` … ``start + count − 1`` of the uniform stream of generator seed ``seed``
    (:func:`dare_seed`), float64 in [0, 1): entry j is SplitMix64's j-th output z_j (state
    seed + (j + 1)·0x9E3779B97F4A7C15, then its three xor-shift-multiply steps, modulo 2⁶⁴), as
    (z_j >> 11) · 2⁻⁵³. The definition; :mod:`symmerge.merge.kernels` computes the same values."""
    import numpy as np

    z = np.arange(start + 1, start + count + 1, dtype=np.uint64) * np.uint64(GOLDEN) + np.uint64(seed)
    z ^= z >> np.uint64(30)
    z *= np.uint64(MIX1)
    z ^= z >> np.uint64(27)
    z *= np.uint64(MIX2)
    z ^= z >> np.uint64(31)
    return torch.from_numpy((z >> np.uint64(11)).astype(np.float64) * (1.0 / 2.0 ** 53))


def dare_keep_mask(shape, drop: float, seed: int, model: int, key: str) -> torch.Tensor:
    """Boolean CPU mask of the entries of model ``model``'s tensor ``key`` that DARE keeps."""
    return (dare_uniforms(dare_seed(seed, model, key), 0, math.prod(shape)) >= float(drop)).reshape(tuple(shape))


def _dare_prepare(state_dicts, base, weights, params):
    for p in (params["drop"] if isinstance(params["drop"], (list, tuple)) else [params["drop"]]):
        try:
            ok = 0.0 <= float(p) <= 1.0
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise SymmergeError(f"drop probability must be in [0, 1], got {p!r}")
    return None


_PREPARE = {"none": None, "magnitude": _magnitude_prepare, "dare": _dare_prepare}  # the model-wide checks and context
SPARSIFIERS = ("none", "magnitude", "dare", "breadcrumbs", "della")
CONSENSUS = ("sum", "ties")


# ------------------------------------------------------------------ whole-tensor parts (mergekit's rules)
#
# mergekit's task-vector methods sparsify each task vector τ_i = θ_i − θ_base of one tensor on its own (its
# per-model density), multiply it by its weight, elect signs, and divide by the agreeing weights when
# ``normalize`` is true. The torch parts below are the implementation in float16/bfloat16 (mergekit's arithmetic in
# that dtype) and the tests' oracle in float64; every other case runs in the one kernel (``_whole_into``), symmerge's
# own variants (model-wide threshold, 1/(1 − p) rescale, disjoint mean: weight first) included.


def topk_window(n: int, density: float) -> tuple[int, int]:
    """TIES' top-k as positions of the descending order: [0, max(1, ⌊density·n⌋)); all for density ≥ 1, none
    for density ≤ 0 or no entries."""
    if density >= 1.0:
        return 0, n
    if density <= 0.0 or n == 0:
        return 0, 0
    return 0, max(1, int(density * n))


def band_window(n: int, density: float, gamma: float) -> tuple[int, int]:
    """Model Breadcrumbs' band as positions of the ascending order: ⌊density·n⌋ entries after dropping the
    ⌊gamma·n⌋ largest (fewer largest when the two would overlap: the ⌊density·n⌋ largest below them are kept
    whatever gamma); all for density ≥ 1."""
    if density >= 1.0:
        return 0, n
    target, top = int(density * n), int(gamma * n)
    bottom = max(0, n - target - top)
    return bottom, bottom + target


def _keep_topk(tau: torch.Tensor, density: float) -> torch.Tensor:
    """Mask of the max(1, ⌊density·n⌋) entries of largest float32 magnitude of ``tau`` (the task vector in its
    computing dtype: float16/bfloat16 ones rounded as mergekit's), ties at the k-th as :func:`_ordered_window`."""
    lo, hi = topk_window(tau.numel(), density)
    if hi - lo == tau.numel():
        return torch.ones(tau.shape, dtype=torch.bool)
    return _ordered_window(tau, lo, hi, descending=True)


def breadcrumbs_band(tau: torch.Tensor, density: float, gamma: float) -> torch.Tensor:
    """Model Breadcrumbs' mask (:func:`band_window` of the ascending order of ``tau``'s float32 magnitudes; ties
    as :func:`_ordered_window`)."""
    lo, hi = band_window(tau.numel(), density, gamma)
    if hi - lo == tau.numel():
        return torch.ones(tau.shape, dtype=torch.bool)
    return _ordered_window(tau, lo, hi, descending=False)


def _ordered_window(tau: torch.Tensor, lo: int, hi: int, descending: bool) -> torch.Tensor:
    """The entries at positions [lo, hi) of ``tau``'s float32 magnitudes in the order of torch's sort, as mergekit
    takes them (:func:`symmerge.merge.sort_order.window_mask`)."""
    return window_mask(tau.abs().float(), lo, hi, descending)


def della_keep_probabilities(tau: torch.Tensor, density: float, epsilon: float) -> torch.Tensor:
    """DELLA's keep probability of each entry: along each row (dim 1, for every index of the other dims, as
    mergekit ranks; a 1-D tensor is one row), the entries ranked by magnitude (ties in order) get density − ε for
    the smallest up to density + ε for the largest, linear in the rank; float64."""
    t = tau.reshape(1, -1) if tau.dim() < 2 else tau  # a 0-dim tensor: one row of one entry
    order = torch.sort(t.abs(), dim=1, stable=True).indices
    ranks = torch.empty(order.shape, dtype=torch.float64, device=t.device)  # the inverse permutation, by scatter
    along = torch.arange(t.shape[1], dtype=torch.float64, device=t.device).view(1, -1, *(1,) * (t.dim() - 2))
    ranks.scatter_(1, order, along.expand(order.shape))  # more than two dims (ViT's (1, n, d)): ranked along dim 1
    span = max(t.shape[1] - 1, 1)
    probs = (density - epsilon) + (ranks / span).clamp(0, 1) * 2.0 * epsilon
    return probs.reshape(tau.shape)


def della_keep_mask(tau: torch.Tensor, density: float, epsilon: float, seed: int, model: int, key: str):
    """DELLA's random mask: entry j kept where its uniform (the DARE stream of (``seed``, ``model``, ``key``),
    :func:`dare_uniforms`) is below its keep probability."""
    probs = della_keep_probabilities(tau, density, epsilon)
    u = dare_uniforms(dare_seed(seed, model, key), 0, tau.numel()).reshape(tau.shape)
    return u < probs


def l1_rescaled(tau: torch.Tensor, keep: torch.Tensor, eps: float = 1e-7) -> torch.Tensor:
    """τ masked by ``keep`` and scaled so its L1 norm is τ's (mergekit's ``rescale``); unscaled where either
    norm is below ``eps``."""
    kept = tau.masked_fill(~keep, 0.0)
    before, after = float(tau.abs().sum()), float(kept.abs().sum())
    if before < eps or after < eps:
        return kept
    return kept * (before / after)


def _sparsify_whole(sparsifier: str, key: str, i: int, tau: torch.Tensor, params, context,
                    low: torch.Tensor | None = None) -> torch.Tensor:
    """Model ``i``'s (unweighted) task vector ``tau`` (float64) of tensor ``key`` after the sparsifier, whole
    tensor; ``low``: the same task vector computed in the inputs' dtype (mergekit's), whose magnitudes rank the
    entries of the top-k and the band (``tau`` where not given)."""
    low = tau if low is None else low
    rescale = params.get("rescale", False)

    def value(name):
        return per_model_values(params[name], len(context["n"]))[i]

    if sparsifier == "none":
        return tau
    if _drops_all(sparsifier, value):
        return torch.zeros_like(tau)
    if sparsifier == "magnitude":
        density, scope = float(value("density")), params["scope"]
        if density >= 1.0:
            return tau
        if scope == "topk":
            keep = _keep_topk(low, density)
        elif scope == "model":
            keep = (tau * context["w"][i]).abs().float() >= context["thresholds"][i]  # the weighted τ's threshold
        else:
            keep = tau.abs().float() >= task_vector_thresholds(lambda: [([tau], torch.zeros_like(tau))], [1.0],
                                                               density)[0]
        return l1_rescaled(tau, keep) if rescale is True else tau.masked_fill(~keep, 0.0)
    if sparsifier == "dare":
        p = float(value("drop"))
        if p == 0.0:
            return tau
        keep = dare_keep_mask(tau.shape, p, params["seed"], i, key)
        if rescale == "inverse":
            return tau.masked_fill(~keep, 0.0) / (1.0 - p)
        return l1_rescaled(tau, keep) if rescale is True else tau.masked_fill(~keep, 0.0)
    if sparsifier == "breadcrumbs":
        keep = breadcrumbs_band(low, float(value("density")), float(value("gamma")))
    elif sparsifier == "della":
        density = float(value("density"))
        if density >= 1.0:
            return tau
        keep = della_keep_mask(tau, density, float(value("epsilon")), params["seed"], i, key)
    else:
        raise SymmergeError(f"unknown sparsifier {sparsifier!r}")
    return l1_rescaled(tau, keep) if rescale is True else tau.masked_fill(~keep, 0.0)


def _drops_all(sparsifier: str, value) -> bool:
    """The sparsifier keeps nothing of this model's task vector: density 0 (``magnitude``, ``della``; mergekit's
    branch: the task vector dropped, whatever the scope, epsilon or rescale) or DARE's drop 1 (mergekit's
    density 0). Breadcrumbs' band is empty at density 0 by its own window."""
    if sparsifier in ("magnitude", "della"):
        return float(value("density")) <= 0.0
    return sparsifier == "dare" and float(value("drop")) >= 1.0


def elect_mask(deltas: torch.Tensor) -> torch.Tensor:
    """mergekit's sign election: γ = +1 where Σ_i δ_i ≥ 0 (ties go to +), else −1; the mask of the non-zero
    δ_i whose sign is γ (``deltas`` stacked on dim 0, already weighted)."""
    elected = torch.where(deltas.sum(0) >= 0, 1.0, -1.0).to(deltas.dtype)
    return torch.sign(deltas) == elected


def combine(deltas, weights, consensus: str, normalize, elected=None) -> torch.Tensor:
    """The merged task vector of the weighted, sparsified ``deltas`` (a list): ``consensus`` ``sum`` (Σ δ_i,
    divided by Σ w_i when ``normalize`` is true, unless |Σ w_i| < 1e-8) or ``ties`` (Σ of the δ_i agreeing
    with the elected sign, divided by the agreeing weights Σ w_i [agree] when ``normalize`` is true (1 where
    none agrees), by the number of agreeing ones when ``normalize="count"`` (symmerge's disjoint mean, with
    its election: γ = sign(Σ δ_i), nothing where the sum is 0), as is when false). ``elected`` (true: +), when
    given, is the ``ties`` election (:func:`mergekit_election`) instead of the sign of Σ δ_i."""
    if consensus == "sum":
        total = weighted_sum(deltas, [1.0] * len(deltas))
        if normalize is True:
            div = sum(weights)
            total = total / (div if abs(div) >= 1e-8 else 1.0)
        elif normalize == "count":
            total = total / len(deltas)
        return total
    stacked = torch.stack(deltas)
    if normalize == "count":  # symmerge's disjoint mean: γ = sign(Σ δ_i), the non-zero δ_i of that sign averaged
        agree = (torch.sign(stacked) == torch.sign(stacked.sum(0))) & (stacked != 0)
        count = agree.sum(0)
        return (stacked.masked_fill(~agree, 0.0).sum(0) / count.clamp(min=1)).masked_fill(count == 0, 0.0)
    if elected is None:
        agree = elect_mask(stacked)
    else:
        agree = torch.sign(stacked) == torch.where(elected, 1.0, -1.0).to(stacked.dtype)
    total = stacked.masked_fill(~agree, 0.0).sum(0)
    if normalize is True:
        w = torch.tensor(weights, dtype=stacked.dtype).reshape(-1, *([1] * (stacked.dim() - 1)))
        div = (w * agree).sum(0)
        total = total / div.masked_fill(div == 0, 1.0)
    return total


def _whole_rules(sparsifier: str, key: str, tensors, base, weights, params, context):
    """Each model's rule and rescale for :func:`symmerge.merge.kernels_whole.task_vector_into` under mergekit's
    order (sparsify each task vector, then weight: the rules of :func:`_sparsify_whole`); ``context``: the
    model-wide thresholds of ``scope="model"``."""
    n, numel = len(tensors), base.numel()
    rescale = params.get("rescale", False)
    l1 = "l1" if rescale is True else None
    rules, rescales = [], []
    for i in range(n):
        def value(name):
            return per_model_values(params[name], n)[i]

        rule, how = ("all",), None
        if _drops_all(sparsifier, value):
            rule = ("none",)
        elif sparsifier == "magnitude":
            density = float(value("density"))
            if density < 1.0:
                how = l1
                if params["scope"] == "topk":
                    rule = ("topk", max(1, int(density * numel)))
                elif params["scope"] == "model":  # the weighted task vector's model-wide threshold
                    rule = ("above", float(context[i]), float(weights[i]))
                else:  # the task vector's own threshold over this tensor
                    rule = ("above", task_vector_thresholds(lambda: [([tensors[i]], base)], [1.0], density)[0], 1.0)
        elif sparsifier == "dare":
            p = float(value("drop"))
            if p != 0.0:
                rule = ("dare", dare_seed(params["seed"], i, key), p)
                how = ("inverse", p) if rescale == "inverse" else l1
        elif sparsifier == "breadcrumbs":
            density, gamma = float(value("density")), float(value("gamma"))
            if density < 1.0:
                target, top = int(density * numel), int(gamma * numel)
                rule = ("band", max(0, numel - target - top), target) if target > 0 else ("none",)
                how = l1
        elif sparsifier == "della":
            density = float(value("density"))
            if density < 1.0:
                rule, how = ("della", dare_seed(params["seed"], i, key), density, float(value("epsilon"))), l1
        rules.append(rule)
        rescales.append(how)
    return rules, rescales


def _own_rules(sparsifier: str, key: str, tensors, base, weights, params, context):
    """Each model's rule for :func:`symmerge.merge.kernels_whole.task_vector_into` under symmerge's own variants
    (weight first: the weighted task vector τ_i·w_i is sparsified): its threshold over the model
    (``scope="model"``, ``context``) or over this tensor (``scope="tensor"``), or DARE's drop with the 1/(1 − p)
    rescale; the masks drawn as :func:`dare_keep_mask` draws them."""
    n = len(tensors)
    rules = [("all",)] * n
    if _drops_all(sparsifier, lambda name: _scalar(params[name])):
        rules = [("none",)] * n
    elif sparsifier == "magnitude":
        density = float(_scalar(params["density"]))
        if density < 1.0:
            thresholds = context if params["scope"] == "model" else [
                task_vector_thresholds(lambda: [([t], base)], [w], density)[0] for t, w in zip(tensors, weights)]
            rules = [("weighted", float(x)) for x in thresholds]
    elif sparsifier == "dare":
        p = float(_scalar(params["drop"]))
        if p != 0.0:
            rules = [("weighted_dare", dare_seed(params["seed"], i, key), p) for i in range(n)]
    return rules, [None] * n


def _in_dtype(sparsifier: str, consensus: str, base, params) -> bool:
    """The rule runs in float16/bfloat16 as mergekit computes it there (the torch code of
    :func:`_whole_task_vector_tensor`): mergekit's forms of the rules on half-precision tensors."""
    if base.dtype not in HALF:
        return False
    return _needs_whole(sparsifier, consensus, params) or (sparsifier == "none" and params["normalize"] != "count")


def _whole_into(sparsifier: str, consensus: str, key, tensors, weights, base, params, context, out) -> bool:
    """The rule into ``out`` by the one kernel (:func:`symmerge.merge.kernels_whole.task_vector_into`), or False
    (nothing written: a rule of the half dtypes, or DELLA on more than two dimensions)."""
    if base is None or _in_dtype(sparsifier, consensus, base, params):
        return False
    from . import kernels_whole

    own = not _needs_whole(sparsifier, consensus, params)
    spec = (_own_rules if own else _whole_rules)(sparsifier, key, tensors, base, weights, params, context)
    return kernels_whole.task_vector_into(tensors, base, weights, *spec, consensus, params["normalize"],
                                          float(params["scale"]), out)


def _task_vector_tensor(sparsifier: str, consensus: str, key, tensors, weights, stats, base, params, context):
    """θ_b + λ · combine(sparsify(θ_i − θ_b) · w_i) of one tensor: the kernel's (:func:`_whole_into`), else (the
    half dtypes under mergekit's forms, DELLA on more than two dimensions) the torch code, float64 (mergekit's
    order: sparsify, then weight) or mergekit's arithmetic in the half dtype. Computed on the CPU, returned on the
    base's device."""
    device = base.device
    tensors, base = [t.cpu() for t in tensors], base.cpu()
    out = torch.empty(base.shape, dtype=base.dtype)
    if _whole_into(sparsifier, consensus, key, tensors, weights, base, params, context, out):
        return out.to(device)
    if _half_into(sparsifier, consensus, key, tensors, weights, base, params, context, out):
        return out.to(device)
    if sparsifier == "none" and params["normalize"] != "count":
        # task arithmetic in float16/bfloat16: mergekit's own rounding, elementwise (chunks give the same bits and
        # cache-sized temporaries)
        flat, b = [t.reshape(-1) for t in tensors], base.reshape(-1)
        for i in range(0, b.numel(), CHUNK):
            out.view(-1)[i:i + CHUNK] = combine_in_dtype([t[i:i + CHUNK] for t in flat], b[i:i + CHUNK],
                                                         [None] * len(flat), weights, consensus, params["normalize"],
                                                         float(params["scale"]), False)
        return out.to(device)
    return _whole_task_vector_tensor(sparsifier, consensus, key, tensors, weights, base, params, context).to(device)


def _half_into(sparsifier: str, consensus: str, key, tensors, weights, base, params, context, out) -> bool:
    """DARE and DELLA under mergekit's forms in float16/bfloat16 (mergekit's arithmetic in that dtype) into ``out`` by
    their kernel (:func:`symmerge.merge.kernels_half.dare_della_into`: the bits of :func:`combine_in_dtype` on the
    masks :func:`_sparsify_whole` draws), or False (nothing written: another rule, symmerge's own variants)."""
    if sparsifier not in ("dare", "della") or not _in_dtype(sparsifier, consensus, base, params):
        return False
    if params["normalize"] == "count" or params.get("rescale") == "inverse":
        return False
    from . import kernels_half

    rules, _ = _whole_rules(sparsifier, key, tensors, base, weights, params, context)
    return kernels_half.dare_della_into(tensors, base, rules, weights, consensus, params["normalize"],
                                        float(params["scale"]), params.get("rescale"), out)


def _whole_task_vector_tensor(sparsifier: str, consensus: str, key, tensors, weights, base, params, context):
    """The torch rule (see :func:`_task_vector_tensor`) on CPU tensors."""
    b = base.double()
    ctx = {"n": tensors, "thresholds": context, "w": weights}
    deltas = [_sparsify_whole(sparsifier, key, i, t.double() - b, params, ctx, low=t - base) * w
              for i, (t, w) in enumerate(zip(tensors, weights))]
    if base.dtype in HALF and params["normalize"] != "count" and params.get("rescale") != "inverse":
        return combine_in_dtype(tensors, base, [d != 0 for d in deltas], weights, consensus, params["normalize"],
                                float(params["scale"]), params.get("rescale"))
    elected = None
    if consensus == "ties" and params["normalize"] != "count":
        elected = mergekit_election(tensors, base, [d != 0 for d in deltas], weights, params.get("rescale"))
    return b + float(params["scale"]) * combine(deltas, weights, consensus, params["normalize"], elected)


def _needs_whole(sparsifier: str, consensus: str, params) -> bool:
    """The parameters leave symmerge's own variants (weight first): per-model values that differ, a per-tensor
    top-k, a rescale other than DARE's 1/(1 − p), or a normalisation other than the consensus' own."""
    if any(not _agree(params.get(name)) for name in ("density", "drop")):
        return True
    if sparsifier in ("breadcrumbs", "della"):
        return True
    if sparsifier == "magnitude" and (params.get("scope") == "topk" or params.get("rescale") is True):
        return True
    if sparsifier == "dare" and params.get("rescale") != "inverse":
        return True
    own = "count" if consensus == "ties" else False
    return params.get("normalize", own) != own


def _no_overlap_check(method: str, params) -> None:
    """DELLA: density ± epsilon must lie in (0, 1) for every model whose density is in (0, 1) (density 0 drops the
    task vector, 1 keeps it: mergekit's two branches before its check)."""
    if "epsilon" not in params:
        return
    dens, eps = params["density"], params["epsilon"]
    n = max(len(v) if isinstance(v, (list, tuple)) else 1 for v in (dens, eps))
    for d, e in zip(per_model_values(dens, n), per_model_values(eps, n)):
        if 0.0 < float(d) < 1.0 and not (0.0 < float(d) - float(e) and float(d) + float(e) < 1.0):
            raise SymmergeError(f"method {method!r}: epsilon must leave density ± epsilon inside (0, 1), got "
                                f"density {d}, epsilon {e}")


TV_CHECKS = {
    "scale": real(), "lambda": real(), "density": real(0.0, 1.0), "scope": choice(*SCOPES),
    "drop": real(0.0, 1.0), "seed": integer(), "normalize": choice(True, False, "count"),
    "rescale": choice(True, False, "inverse"), "int8_mask": boolean(), "gamma": real(0.0, 1.0),
    "epsilon": real(0.0, 1.0, hi_open=True),
}


def task_vector_method(name: str, sparsifier: str, consensus: str, params: dict, doc: str = "",
                       other_names: tuple = ()) -> Method:
    """The method θ_base + scale · ``consensus``(``sparsifier``(w_i τ_i)); ``params`` (defaults) must
    name ``scale`` and whatever the sparsifier reads (``density``/``scope``, ``drop``/``seed``,
    ``gamma``, ``epsilon``). Every such method also takes mergekit's ``lambda`` (= ``scale``), ``normalize``,
    ``rescale`` and ``int8_mask`` (no effect: a storage choice of mergekit's masks), DARE's ``density``
    (= 1 − ``drop``); ``density``, ``drop``, ``gamma`` and ``epsilon`` are per model. Every parameter set runs
    in the one kernel (:func:`symmerge.merge.kernels_whole.task_vector_into`): symmerge's own variants (weight
    first: a model-wide or per-tensor threshold, DARE's 1/(1 − p), the disjoint mean) and mergekit's forms
    (sparsify first: per-tensor top-k, L1 rescale, ``normalize`` true/false, per-model values, breadcrumbs,
    DELLA); mergekit's forms in float16/bfloat16 run mergekit's arithmetic in that dtype (the torch code)."""
    if sparsifier not in SPARSIFIERS or consensus not in CONSENSUS:
        raise SymmergeError(f"unknown parts ({sparsifier!r}, {consensus!r}); sparsifiers: "
                            f"{', '.join(SPARSIFIERS)}; consensus: {', '.join(CONSENSUS)}")
    params = {"normalize": "count" if consensus == "ties" else False, "int8_mask": False, **params}
    params.setdefault("rescale", "inverse" if sparsifier == "dare" else (True if sparsifier == "della" else False))
    aliases = {"lambda": ("scale", None)}
    if sparsifier == "dare":
        aliases["density"] = ("drop", lambda d: 1.0 - float(d))
    per_model = tuple(p for p in ("density", "drop", "gamma", "epsilon") if p in params)
    checks = {k: v for k, v in TV_CHECKS.items() if k in params or k in aliases}
    tensor = partial(_task_vector_tensor, sparsifier, consensus)

    def fused_into(key, tensors, weights, base, params, context, out):
        return _whole_into(sparsifier, consensus, key, tensors, weights, base, params, context, out)

    return Method(name, tensor, needs_base=True, params=dict(params), doc=doc, prepare=_PREPARE.get(sparsifier),
                  normalize_weights=False, elementwise=False, per_model=per_model, checks=checks, aliases=aliases,
                  fused_into=fused_into, check_all=_no_overlap_check if sparsifier == "della" else None,
                  weight_required=True, other_names=other_names,
                  half_reductions=sparsifier in ("dare", "della"))  # their L1 factors: whole-tensor sums
