"""mergekit's specialised rules as symmerge methods: ``model_stock``, ``nearswap``, ``arcee_fusion``,
``passthrough``, ``sce``, ``ram`` and ``ramplus_tl``. Each is a per-tensor rule in float64 (cast back by the
loop; ``model_stock``, ``arcee_fusion``, ``sce``, ``ram`` and ``ramplus_tl`` on float16/bfloat16 inputs compute in
that dtype, as mergekit does — ``ramplus_tl``'s factors and mix in float32, as mergekit's —: :func:`working_dtype`;
``nearswap`` in the inputs' dtype always); the base model, where one is used, is the ``base`` argument and the
other models the merged ones.

* ``model_stock`` (Jang et al., 2024; base + at least 2 models): with task vectors τ_i = θ_i − θ_b of the
  flattened tensor (``filter_wise``: of each vector along the last axis; a 1-D tensor is one), cos θ the
  mean over the pairs of the clamped cosines τ_i·τ_j / max(‖τ_i‖‖τ_j‖, 1e-6), t = N cos θ / (1 + (N − 1) cos θ)
  (0 where the denominator is below 1e-6 in magnitude), θ = t · mean_i θ_i + (1 − t) θ_b.
* ``nearswap`` (base + exactly 1 model): w = clamp(t / max(|θ_b − θ_1|, 1e-6), 0, 1) per entry,
  θ = w θ_1 + (1 − w) θ_b: the other model's value where the two are within ``t``, the base where far.
* ``arcee_fusion`` (base + exactly 1 model): importance = |θ_1 − θ_b| · KL(p‖q) with p, q the softmaxes of
  θ_1 and θ_b along the last axis (+1e-8 each; one KL per row; computed in float32 as mergekit does: the KL
  of nearly equal rows is ill-conditioned), threshold = median + 1.5 · (q3 − q1) of
  the importances (quantile q: the sorted value at index ⌊q (n − 1)⌋, over all entries — mergekit samples
  10⁶ entries of larger tensors at random), θ = θ_b + (θ_1 − θ_b) [importance ≥ threshold].
* ``passthrough`` (exactly 1 model, no base): the tensor, times ``scale`` when given (per model).
* ``sce`` (Wan et al., 2024, FuseChat; base + models): task vectors τ_i; ``select_topk`` < 1 keeps, in
  every τ_i, only the ⌊select_topk · m⌋ positions of largest variance across the models (m: positions of
  non-zero variance; mergekit's selection, ties in torch.topk's order: :func:`sce_keep`; in float16/bfloat16
  mergekit's arithmetic in that dtype); matrix-level weights ω_i = mean(τ_i²) / Σ_j mean(τ_j²) (uniform
  when that sum is below 1e-6); mergekit's sign election on the τ_i; θ = θ_b + Σ ω_i τ_i [agree] /
  max(Σ ω_i [agree], 1e-6). Weights are not used.
* ``ram`` (Reinforced Agent Merging; base + models): an entry of τ_i is active where |τ_i| > ``epsilon``;
  where one model is active its entry is taken, where several are, their mean; elsewhere the base.
  ``ramplus_tl``: the unique entries of model i are scaled by λ_i = 1 + ``r`` · clamp(ρ_i, 0, ``alpha``),
  ρ_i = (its active entries shared with others) / max(its unique active entries, ``epsilon``), per tensor.
"""

from __future__ import annotations

import torch

from .base import REQUIRED, Method, boolean, real
from .combination import gram, linear_into, linear_tensor
from .in_dtype import HALF
from .parts import elect_mask
from .sort_order import topk_mask

# ------------------------------------------------------------------ model_stock


def model_stock_ratio(taus, filter_wise: bool = False) -> torch.Tensor:
    """t = N cos / (1 + (N − 1) cos) of the task vectors ``taus`` (float64, same shape): a scalar tensor, or one
    per vector along the last axis (``filter_wise``: shape (..., 1); a 1-D tensor is one vector)."""
    if filter_wise:  # the vectors along the last axis
        vs = [t.unsqueeze(0) if t.dim() == 1 else t for t in taus]
    else:
        vs = [t.reshape(1, -1) for t in taus]
    cosines = []
    for i in range(len(vs)):
        for j in range(i + 1, len(vs)):
            norm = (vs[i].norm(dim=-1) * vs[j].norm(dim=-1)).clamp(min=1e-6)
            cosines.append(((vs[i] * vs[j]).sum(-1) / norm).clamp(-1.0, 1.0))
    cos = torch.stack(cosines).mean(0).unsqueeze(-1)
    n = len(vs)
    den = 1.0 + (n - 1) * cos
    singular = den.abs() < 1e-6
    return torch.where(singular, torch.zeros_like(cos), n * cos / torch.where(singular, torch.ones_like(den), den))


def working_dtype(t: torch.Tensor) -> torch.dtype:
    """float64, or the inputs' own dtype when it is float16/bfloat16: mergekit computes model_stock and
    arcee_fusion in the dtype the tensors reach the method in (the stored one, or the config's ``dtype``), and
    half-precision arithmetic there moves the result by more than one rounding (its cosines, its importances)."""
    return t.dtype if t.dtype in HALF else torch.float64


def model_stock_t(g: torch.Tensor) -> float:
    """t = N cos / (1 + (N − 1) cos) from the task vectors' Gram matrix ``g`` (the flattened tensor):
    :func:`model_stock_ratio`'s cosines τ_i·τ_j / max(‖τ_i‖‖τ_j‖, 1e-6), clamped, averaged over the pairs."""
    n = g.shape[0]
    norms = g.diagonal().clamp(min=0.0).sqrt()
    cosines = [float((g[i, j] / (norms[i] * norms[j]).clamp(min=1e-6)).clamp(-1.0, 1.0))
               for i in range(n) for j in range(i + 1, n)]
    cos = sum(cosines) / len(cosines)
    den = 1.0 + (n - 1) * cos
    return 0.0 if abs(den) < 1e-6 else n * cos / den


def _model_stock_coefficients(key, tensors, base, weights, params, context):
    """θ = t · mean_i θ_i + (1 − t) θ_b as coefficients of ``[*models, base]``; for half-precision inputs
    ``{"half_t": t}``, the ratio computed on the whole tensor in their dtype (mergekit's arithmetic), the rest
    of the rule elementwise (:func:`_model_stock_tensor`)."""
    if base.dtype in HALF:
        return {"half_t": model_stock_ratio([t - base for t in tensors], False)}
    t = model_stock_t(gram(tensors, base))
    return [t / len(tensors)] * len(tensors) + [1.0 - t]


def _model_stock_whole(tensors, base, filter_wise: bool) -> torch.Tensor:
    """The rule on whole tensors in :func:`working_dtype` (float64, or the half dtype as mergekit computes it)."""
    work = working_dtype(base)
    b = base.to(work)
    models = [t.to(work) for t in tensors]
    t = model_stock_ratio([m - b for m in models], filter_wise)
    mean = sum(models) / len(models)
    rows = b.unsqueeze(0) if b.dim() == 1 else b
    if filter_wise:
        return (t * mean.reshape(rows.shape) + (1.0 - t) * rows).reshape(b.shape)
    return (t * mean.reshape(1, -1) + (1.0 - t) * b.reshape(1, -1)).reshape(b.shape)


def _model_stock_tensor(key, tensors, weights, stats, base, params, context):
    if params["filter_wise"] or (base.dtype in HALF and context is None):
        return _model_stock_whole(tensors, base, bool(params["filter_wise"]))
    if base.dtype in HALF:  # a chunk: the whole tensor's ratio, the interpolation elementwise in the half dtype
        t = context["half_t"]
        mean = sum(tensors) / len(tensors)
        return (t * mean.reshape(1, -1) + (1.0 - t) * base.reshape(1, -1)).reshape(base.shape)
    return linear_tensor(_model_stock_coefficients)(key, tensors, weights, stats, base, params, context)


def _model_stock_into(key, tensors, weights, base, params, context, out) -> bool:
    """Half-precision inputs: the whole-tensor rule in their dtype (mergekit's arithmetic); else the linear
    combination of the coefficients in one fused pass."""
    if base.dtype in HALF:
        out.copy_(_model_stock_whole(tensors, base, bool(params["filter_wise"])))
        return True
    return linear_into(key, tensors, weights, base, params, context, out)


MODEL_STOCK = Method("model_stock", _model_stock_tensor, half_reductions=True, needs_base=True,
                     params={"filter_wise": False},
                     doc="Model Stock: interpolate the base and the models' mean by t = N cos / (1 + (N-1) cos) "
                         "of the task vectors' mean pairwise cosine.",
                     normalize_weights=False, checks={"filter_wise": boolean()}, models=(2, None),
                     elementwise=True, tensor_context=_model_stock_coefficients, fused_into=_model_stock_into,
                     whole_tensor=lambda p: bool(p["filter_wise"]))

# ------------------------------------------------------------------ nearswap


def _nearswap_tensor(key, tensors, weights, stats, base, params, context):
    """w = clamp(t / max(|a − b|, 1e-6), 0, 1), w·b + (1 − w)·a, op for op in the inputs' dtype as mergekit computes
    it (float16/bfloat16/float32: each step rounded there; its rounding is the result)."""
    dtype = base.dtype if base.dtype in (*HALF, torch.float32, torch.float64) else torch.float64
    a, b = base.to(dtype), tensors[0].to(dtype)
    w = (float(params["t"]) / (a - b).abs().clamp(min=1e-6)).clamp(0.0, 1.0)
    return w * b + (1.0 - w) * a


NEARSWAP = Method("nearswap", _nearswap_tensor, needs_base=True, params={"t": REQUIRED},
                  doc="NearSwap: take the other model's value where it is within t of the base's, "
                      "interpolate with weight t / |difference| elsewhere.",
                  normalize_weights=False, elementwise=True, checks={"t": real()}, models=(1, 1))

# ------------------------------------------------------------------ arcee_fusion


def quantiles(values: torch.Tensor, qs) -> list[float]:
    """The sorted value at index ⌊q (n − 1)⌋ for each q of ``qs`` (exact, over all entries: a partial sort)."""
    import numpy as np

    flat = values.reshape(-1).numpy()
    at = [int(q * (flat.shape[0] - 1)) for q in qs]
    part = np.partition(flat, sorted(set(at)))
    return [float(part[i]) for i in at]


def arcee_importance(other: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
    """|other − base| times the KL divergence of the rows' softmaxes (+1e-8), in the inputs' dtype."""
    p = torch.softmax(other, dim=-1) + 1e-8
    q = torch.softmax(base, dim=-1) + 1e-8
    return (other - base).abs() * (p * torch.log(p / q)).sum(-1, keepdim=True)


def _arcee_half(tensors, base) -> torch.Tensor:
    """float16/bfloat16 inputs: the importance, the threshold's arithmetic and the change in the half dtype, as
    mergekit computes them (the result in float32, rounded by the caller)."""
    importance = arcee_importance(tensors[0], base)
    # the sorted importances at mergekit's three indices, by a partial sort of their exact float32 values (the
    # values a full sort puts there, so the same half-dtype numbers; ~2× faster than torch.sort of the tensor)
    q1, median, q3 = (torch.tensor(v, dtype=importance.dtype)
                      for v in quantiles(importance.float(), (0.25, 0.5, 0.75)))
    keep = importance >= median + 1.5 * (q3 - q1)
    return base.float() + (tensors[0] - base).float() * keep


_ROWS = 1 << 15  # entries of the rows whose importances are computed at once


def _arcee_into(key, tensors, weights, base, params, context, out) -> bool:
    # the importance in float32 (float64 for float64 inputs), as mergekit computes it: the KL of two nearly
    # equal rows is ill-conditioned, and a float64 KL moves ~12 % of the mask's entries near the threshold
    # (tests/merge/test_mergekit_methods.py); the result itself is formed in float64. Rows at a time (each row's
    # importance is its own), then the result chunk by chunk: no whole-tensor temporaries but the importances.
    from .base import CHUNK

    if base.dtype in HALF:
        out.copy_(_arcee_half(tensors, base))
        return True
    work = torch.promote_types(base.dtype, torch.float32)
    other = tensors[0]
    importance = torch.empty(base.shape, dtype=work)
    if base.dim() < 2:
        importance.copy_(arcee_importance(other.to(work), base.to(work)))
    else:
        rows_o, rows_b, rows_i = (x.reshape(-1, x.shape[-1]) for x in (other, base, importance))
        step = max(1, _ROWS // max(1, base.shape[-1]))
        for r in range(0, rows_b.shape[0], step):
            rows_i[r:r + step] = arcee_importance(rows_o[r:r + step].to(work), rows_b[r:r + step].to(work))
    q1, median, q3 = quantiles(importance, (0.25, 0.5, 0.75))
    keep = (importance >= median + 1.5 * (q3 - q1)).reshape(-1)
    del importance
    flat_o, flat_b, flat_out = other.reshape(-1), base.reshape(-1), out.view(-1)
    for i in range(0, flat_b.numel(), CHUNK):
        b = flat_b[i:i + CHUNK].double()
        flat_out[i:i + CHUNK] = b + (flat_o[i:i + CHUNK].double() - b) * keep[i:i + CHUNK]
    return True


def _arcee_fusion_tensor(key, tensors, weights, stats, base, params, context):
    out = torch.empty(base.shape, dtype=base.dtype)
    _arcee_into(key, tensors, weights, base, params, context, out)
    return out


ARCEE_FUSION = Method("arcee_fusion", _arcee_fusion_tensor, needs_base=True, fused_into=_arcee_into,
                      doc="Arcee Fusion: keep the other model's changes whose importance (|change| x KL of the "
                          "rows' softmaxes) reaches median + 1.5 IQR.", normalize_weights=False, models=(1, 1))

# ------------------------------------------------------------------ passthrough


def _passthrough_tensor(key, tensors, weights, stats, base, params, context):
    scale = params["scale"]
    scale = scale[0] if isinstance(scale, (list, tuple)) else scale
    return tensors[0].double() if scale is None else tensors[0].double() * float(scale)


PASSTHROUGH = Method("passthrough", _passthrough_tensor, params={"scale": None}, ignores_base=True, copy_unless="scale",
                     doc="Passthrough: the one model's tensor, times scale when given.", normalize_weights=False,
                     elementwise=True, checks={"scale": real(optional=True)}, per_model=("scale",), models=(1, 1))

# ------------------------------------------------------------------ sce


def sce_weights(taus: torch.Tensor) -> torch.Tensor:
    """ω_i = mean(τ_i²) / Σ_j mean(τ_j²) (uniform when the sum is below 1e-6)."""
    w = taus.square().reshape(taus.shape[0], -1).mean(1)
    total = float(w.sum())
    return torch.full_like(w, 1.0 / w.numel()) if abs(total) < 1e-6 else w / total


def torch_variance(stacked: torch.Tensor, rows: int = 1 << 20) -> torch.Tensor:
    """``torch.var(stacked, dim=0, unbiased=False)``, the same bits, 5–8× faster on the CPU: torch reduces the
    models' axis by Welford's update in float64 (count, mean, M2; model order) and casts the variance to the
    tensors' dtype through float32 (float64 kept), at ~100 ns per entry on one thread along that strided axis;
    here the same updates run as whole-tensor float64 ops over chunks of ``rows`` entries
    (``tests/merge/test_sce_variance.py`` holds the two equal bit for bit, ties and far-apart scales included)."""
    n, flat = stacked.shape[0], stacked.reshape(stacked.shape[0], -1)
    out = torch.empty(flat.shape[1], dtype=stacked.dtype)
    for lo in range(0, flat.shape[1], rows):
        x = flat[:, lo:lo + rows].double()
        mean, m2 = torch.zeros_like(x[0]), torch.zeros_like(x[0])
        for i in range(n):
            delta = x[i] - mean
            mean = mean + delta / (i + 1)
            m2 = m2 + delta * (x[i] - mean)
        var = m2 / n
        out[lo:lo + rows] = var if stacked.dtype == torch.float64 else var.float().to(stacked.dtype)
    return out.reshape(stacked.shape[1:])


def sce_keep(tensors, base, topk: float) -> torch.Tensor | None:
    """The positions SCE keeps, as mergekit selects them (None: all): the variances across the models of the task
    vectors computed in the tensors' dtype D (``torch.var``, biased), k = ⌊topk · (non-zero variances)⌋, and the k
    that ``torch.topk`` returns — ties at the cut in its order (:func:`symmerge.merge.sort_order.topk_mask`)."""
    if topk >= 1.0:
        return None
    if topk <= 0.0:
        return torch.zeros(base.shape, dtype=torch.bool)
    var = torch_variance(torch.stack([t.to(base.dtype) - base for t in tensors]))
    k = int(int(torch.count_nonzero(var)) * topk)
    keys = var.abs().reshape(-1)
    return topk_mask(keys.float() if base.dtype in HALF else keys, k).reshape(base.shape)


def _sce_in_dtype(tensors, base, keep) -> torch.Tensor:
    """mergekit's SCE in the inputs' half dtype D, op for op (task vectors, selection, sign election, mean squares,
    weighted agreeing sum and its division, each in D)."""
    dtype = base.dtype
    tvs = torch.stack([t.to(dtype) - base for t in tensors])
    if keep is not None:
        tvs = tvs * keep.to(dtype).unsqueeze(0)
    agree = (tvs.sign() == ((tvs.sum(0) >= 0).to(dtype) * 2 - 1)).to(dtype)
    w = tvs.square().reshape(tvs.shape[0], -1).mean(dim=1)
    total = torch.sum(w).item()
    w = torch.ones_like(w) / w.shape[0] if abs(total) < 1e-6 else w / total
    w = w.reshape(-1, *([1] * base.dim())) * agree
    return base + (tvs * w).sum(0) / torch.sum(w, dim=0).clamp(min=1e-6)


def _sce_into(key, tensors, weights, base, params, context, out) -> bool:
    """SCE by the fused kernel (:func:`symmerge.merge.kernels_whole.sce_into`) into ``out``, or False (float16 and
    bfloat16: mergekit's arithmetic in that dtype, by the torch code)."""
    if base.dtype in HALF:
        return False
    from .kernels_whole import sce_into

    topk = float(params["select_topk"])
    return sce_into(tensors, base, topk, out, select=sce_keep(tensors, base, topk))


def _sce_tensor(key, tensors, weights, stats, base, params, context):
    out = torch.empty(base.shape, dtype=base.dtype)
    if _sce_into(key, tensors, weights, base, params, context, out):
        return out
    keep = sce_keep(tensors, base, float(params["select_topk"]))
    if base.dtype in HALF:
        return _sce_in_dtype(tensors, base, keep)
    b = base.double()
    taus = torch.stack([t.double() - b for t in tensors])
    if keep is not None:
        taus = taus * keep
    agree = elect_mask(taus)
    w = sce_weights(taus).reshape(-1, *([1] * (taus.dim() - 1))) * agree
    return b + (taus * w).sum(0) / w.sum(0).clamp(min=1e-6)


SCE = Method("sce", _sce_tensor, needs_base=True, params={"select_topk": 1.0, "int8_mask": False},
             doc="SCE: keep the highest-variance positions, weight each task vector by its mean square, "
                 "TIES sign election, weighted mean of the agreeing entries.",
             normalize_weights=False, checks={"select_topk": real(0.0, 1.0), "int8_mask": boolean()},
             fused_into=_sce_into)

# ------------------------------------------------------------------ ram / ramplus_tl


def _ram_parts(tensors, base, epsilon, dtype=torch.float64):
    b = base.to(dtype)
    taus = torch.stack([t.to(dtype) - b for t in tensors])
    active = taus.abs() > epsilon
    count = active.sum(0, keepdim=True)
    return b, taus.masked_fill(~active, 0.0), active, count


def _ram_tensor(key, tensors, weights, stats, base, params, context):
    """RAM in float64, or op for op in the inputs' float16/bfloat16 as mergekit computes it there (its rounding of
    the task vectors, which of them pass epsilon, the mean and the sum is the result)."""
    b, taus, active, count = _ram_parts(tensors, base, float(params["epsilon"]), working_dtype(base))
    unique, shared = count == 1, count > 1
    merged = taus * unique + taus * shared / count.clamp(min=1)
    return b + merged.sum(0)


def _ramplus_lambdas(key, tensors, base, weights, params, context):
    """RAM+'s per-tensor factors λ_i = 1 + r · clamp(ρ_i, 0, alpha) (shape (n, 1)), the counts of active entries
    shared with other models and unique to model i (exact integers): counted by the kernel in float64, or for
    float16/bfloat16 inputs as mergekit computes them — which task vectors pass epsilon after their rounding to
    that dtype, chunk by chunk, ρ and λ in float32 (the half-precision implementation)."""
    eps = float(params["epsilon"])
    if base.dtype not in HALF:
        from .kernels_whole import ram_counts

        shared_n, unique_n = (torch.from_numpy(c) for c in ram_counts(tensors, base, eps))
    else:
        from .base import CHUNK

        n = len(tensors)
        shared_n, unique_n = torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64)
        flat, b = [t.reshape(-1) for t in tensors], base.reshape(-1)
        for i in range(0, b.numel(), CHUNK):
            _, _, active, count = _ram_parts([t[i:i + CHUNK] for t in flat], b[i:i + CHUNK], eps, working_dtype(base))
            shared_n += (active & (count > 1)).sum(1)
            unique_n += (active & (count == 1)).sum(1)
    real_t = torch.float32 if base.dtype in HALF else torch.float64
    rho = shared_n.to(real_t) / unique_n.to(real_t).clamp(min=eps)
    return (1.0 + float(params["r"]) * rho.clamp(0.0, float(params["alpha"]))).reshape(-1, 1)


def _ramplus_tensor(key, tensors, weights, stats, base, params, context):
    """RAM+ given its per-tensor factors (``context``: :func:`_ramplus_lambdas` of the whole tensor; computed here
    when None), entry by entry: in float64, or for float16/bfloat16 inputs as mergekit computes it (the task vectors
    and the shared entries' mean in that dtype, the unique entries times λ and the sum in float32)."""
    if context is None:
        context = _ramplus_lambdas(key, tensors, base, weights, params, None)
    b, taus, active, count = _ram_parts(tensors, base, float(params["epsilon"]), working_dtype(base))
    unique, shared = count == 1, count > 1
    lam = context.reshape(-1, *([1] * (taus.dim() - 1)))
    merged = taus * unique * lam + taus * shared / count.clamp(min=1)
    return b + merged.sum(0)


def _ram_into(key, tensors, weights, base, params, context, out) -> bool:
    """RAM (``context`` None) or RAM+ (``context``: its factors) by the fused kernel into ``out``, or False."""
    if base.dtype in HALF:  # RAM and RAM+ in the half dtype: the torch code (mergekit's arithmetic)
        return False
    from .kernels_whole import ram_into

    return ram_into(tensors, base, float(params["epsilon"]), None if context is None else context.numpy(), out)


RAM = Method("ram", _ram_tensor, needs_base=True, params={"epsilon": 1e-5}, fused_into=_ram_into,
             doc="RAM: per entry, the one model that changed it, or the mean of the several that did (changes "
                 "above epsilon).", normalize_weights=False, elementwise=True, checks={"epsilon": real(0.0)})
RAMPLUS_TL = Method("ramplus_tl", _ramplus_tensor, needs_base=True, params={"r": 0.1, "alpha": 0.2, "epsilon": 1e-5},
                    doc="RAM+ (tensor-local): RAM with each model's unique changes scaled by 1 + r clamp(shared / "
                        "unique, 0, alpha).", normalize_weights=False, elementwise=True, fused_into=_ram_into,
                    tensor_context=_ramplus_lambdas, checks={"r": real(), "alpha": real(0.0), "epsilon": real(0.0)})

METHODS = [MODEL_STOCK, NEARSWAP, ARCEE_FUSION, PASSTHROUGH, SCE, RAM, RAMPLUS_TL]
