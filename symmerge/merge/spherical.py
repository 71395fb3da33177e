"""Spherical interpolation rules (mergekit's ``slerp``, ``nuslerp``, ``multislerp``, ``karcher``) on the flattened
tensor (or, for nuslerp, its rows or columns), computed in float64 and cast back by the loop. On the flattened
tensor each is a linear combination of its inputs whose coefficients depend on the inputs' Gram matrix only:
they run chunk by chunk (:mod:`symmerge.merge.combination`). float16/bfloat16 inputs (stored so, or a config's
``dtype``): nuslerp, multislerp and karcher compute op for op in that dtype as mergekit does (each rounding there
is part of mergekit's result, whose change from the inputs is a few roundings: :func:`in_dtype_rule`); slerp
computes in float32 as mergekit does for them, its norms and cosine by mergekit's spans (:func:`slerp_in_float32`),
and rounds once.

The one interpolation part, :func:`slerp_pair`, moves along the great circle between two vectors' directions
and interpolates their norms' linear mix: with cos Ω the cosine of the angle between a and b,
``slerp(a, b, t) = sin((1 − t)Ω)/sin Ω · a + sin(tΩ)/sin Ω · b``, and the linear mix (1 − t) a + t b where the
two are (anti)parallel (the method's ``colinear`` rule). The methods compose it:

* ``slerp`` (base + exactly one other model): slerp(θ_base, θ_1, ``t``) on the flattened tensor;
  |cos Ω| > 0.9995 → linear; a norm ≤ 1e-8 counts as 1. ``t`` is required (any finite value: t = 0 is the
  base, 1 the other model, outside [0, 1] extrapolates along the circle, as mergekit does).
* ``nuslerp`` (exactly two models, optional base): t = w₂ / (w₁ + w₂) from the raw weights (0.5 when
  |w₁ + w₂| < 1e-6; uniform weights: 0.5); with a base, the task vectors are interpolated and added back;
  ``nuslerp_flatten`` (true): the flattened tensor, else vectors along the last axis or, with
  ``nuslerp_row_wise``, along axis 0; colinear where 1 − cos²Ω ≤ 1e-16; norms clamped at 1e-7.
* ``multislerp`` (one or more models, optional base): each (task) vector's direction u_i = v_i/(‖v_i‖ + eps),
  their weighted mean m (weights normalised when ``normalize_weights``) normalised, the tangent vectors
  u_i − (u_i·m) m averaged with the weights into τ, mapped back by the exponential map
  m cos‖τ‖ + τ sin‖τ‖/‖τ‖ (‖τ‖ + eps), scaled by the weighted mean of the norms; two models whose
  weighted directions cancel (‖Σ wᵢuᵢ‖ < eps) fall back to Σ wᵢ vᵢ, more → SymmergeError. τ is 0 identically
  (the weighted mean of the tangent vectors at the weighted mean direction): the result is m cos(eps) scaled,
  computed so (:func:`multislerp_coefficients`), without the rounding noise a computed τ carries.
* ``karcher`` (one or more models, no base, no weights): the Karcher (Fréchet) mean on the unit sphere of
  the models' directions (uniform weights α = 1/n over the models with norm > ``tol``): start at their
  normalised mean, then at most ``max_iter`` steps of the exponential map along
  Σ α θ_i/sin θ_i (u_i − cos θ_i · m) (θ_i < tol or θ_i = 0 skipped), stopping when that step's norm
  < ``tol`` or 0 (``tol: 0`` converges on a zero step instead of dividing 0 by 0);
  scaled by the mean of all the models' norms.

Per-model weights go in ``weights`` (raw: these methods normalise them themselves where they do).
"""

from __future__ import annotations

import math

import torch

from ..errors import SymmergeError
from .base import REQUIRED, Method, boolean, integer, real
from .combination import gram, linear_into, linear_tensor, with_base
from .in_dtype import HALF


class InDtype:
    """A whole tensor's result computed in the inputs' half dtype (mergekit's arithmetic: its roundings are the
    result), handed out in flat order to the chunks of :func:`symmerge.merge.base.merge_tensor`, which runs them in
    order (a config's ``dtype`` that rounds the inputs casts every chunk: the method's fused pass is not used
    there)."""

    def __init__(self, result: torch.Tensor):
        self.flat, self.at = result.reshape(-1), 0

    def take(self, n: int) -> torch.Tensor:
        self.at += n
        return self.flat[self.at - n:self.at]


def in_dtype_rule(rule, coefficients):
    """The three entries of an elementwise spherical method whose half-precision result is ``rule(tensors, base,
    weights, params)`` on whole tensors (float16/bfloat16 inputs) and otherwise the linear combination of
    ``coefficients``: its ``tensor`` (chunks take the whole result in order), ``tensor_context`` and
    ``fused_into``."""
    whole = linear_tensor(coefficients)

    def tensor(key, tensors, weights, stats, base, params, context):
        if isinstance(context, InDtype):
            return context.take(tensors[0].numel()).reshape(tensors[0].shape)
        if tensors[0].dtype in HALF:
            return rule(tensors, base, weights, params)
        return whole(key, tensors, weights, stats, base, params, context)

    def context_of(key, tensors, base, weights, params, context):
        if tensors[0].dtype in HALF:
            return InDtype(rule(tensors, base, weights, params))
        return coefficients(key, tensors, base, weights, params, context)

    def into(key, tensors, weights, base, params, context, out) -> bool:
        if isinstance(context, InDtype):
            out.copy_(context.flat.reshape(out.shape))
            return True
        return linear_into(key, tensors, weights, base, params, context, out)

    return tensor, context_of, into


def slerp_coefficients(na, nb, dot, t: float, colinear, norm_floor: float = 1e-8, clamp: bool = False):
    """(c_a, c_b) with slerp(a, b, t) = c_a a + c_b b, from the norms ``na``, ``nb`` and the dot product ``dot``
    of a and b (float64 tensors of one shape: one pair, or one per vector). ``colinear(cos) -> bool mask``: where
    the linear mix is taken. ``clamp``: norms below ``norm_floor`` are raised to it (nuslerp), else replaced by
    1 (slerp)."""
    def floor(norm):
        return norm.clamp(min=norm_floor) if clamp else torch.where(norm > norm_floor, norm, torch.ones_like(norm))

    cos = (dot / (floor(na) * floor(nb))).clamp(-1.0, 1.0)
    lin = colinear(cos)
    omega = torch.acos(torch.where(lin, torch.zeros_like(cos), cos))
    s = torch.sin(omega)
    s = torch.where(lin, torch.ones_like(s), s)
    ca = torch.where(lin, torch.full_like(cos, 1.0 - t), torch.sin((1.0 - t) * omega) / s)
    cb = torch.where(lin, torch.full_like(cos, t), torch.sin(t * omega) / s)
    return ca, cb


def slerp_pair(a: torch.Tensor, b: torch.Tensor, t: float, dim: int | None = None, colinear=None,
               norm_floor: float = 1e-8, clamp: bool = False) -> torch.Tensor:
    """slerp(a, b, t) of float64 tensors: over all entries (``dim`` None) or of the vectors along ``dim``
    (:func:`slerp_coefficients`)."""
    if dim is None:
        na, nb, dot = a.norm(), b.norm(), (a * b).sum()
    else:
        na, nb, dot = a.norm(dim=dim, keepdim=True), b.norm(dim=dim, keepdim=True), (a * b).sum(dim=dim, keepdim=True)
    ca, cb = slerp_coefficients(na, nb, dot, t, colinear, norm_floor, clamp)
    return ca * a + cb * b


# ------------------------------------------------------------------ slerp


def _slerp_coefficients(key, tensors, base, weights, params, context):
    g = gram([base, tensors[0]])
    ca, cb = slerp_coefficients(g[0, 0].sqrt(), g[1, 1].sqrt(), g[0, 1], float(params["t"]),
                                colinear=lambda c: c.abs() > 0.9995, norm_floor=1e-8)
    return [float(cb), float(ca)]  # of [model, base]


SLERP_SPAN = 1 << 20  # entries of the flattened tensor per partial norm and partial dot product (mergekit's)


def slerp_in_float32(a: torch.Tensor, b: torch.Tensor, t: float) -> torch.Tensor:
    """slerp(a, b, t) of two float16/bfloat16 tensors as mergekit computes it: float32 arithmetic on the flattened
    tensor taken in spans of :data:`SLERP_SPAN` entries — each norm the norm of the spans' float32 norms (1 where
    ≤ 1e-8), the cosine the float32 sum of the spans' sums of the products of the unit vectors' entries (clamped),
    Ω, sin Ω and the two coefficients in float32 (the linear mix's 1 − t and t where |cos| > 0.9995), each entry
    c_a a + c_b b in float32, rounded once to the inputs' dtype. Its float32 reductions are the result's: a
    coefficient computed in float64 moves a 50 M-parameter bfloat16 model 1.7–2.4e-3 from mergekit's."""
    x, y = a.reshape(1, -1), b.reshape(1, -1)
    spans = [slice(i, i + SLERP_SPAN) for i in range(0, x.shape[1], SLERP_SPAN)]
    if not spans:
        return a.clone()

    def norm(v):
        parts = torch.stack([torch.linalg.vector_norm(v[:, s].float(), dim=1, keepdim=True) for s in spans])
        whole = torch.linalg.vector_norm(parts, dim=0)
        return torch.where(whole > 1e-8, whole, 1)

    na, nb = norm(x), norm(y)
    cos = torch.stack([((x[:, s].float() / na) * (y[:, s].float() / nb)).sum(dim=1, keepdim=True)
                       for s in spans]).sum(dim=0).clamp(-1, 1)
    t32 = torch.full((1, 1), float(t), dtype=torch.float32)
    lin = cos.abs() > 0.9995
    omega = torch.acos(torch.where(lin, 0, cos))
    sin = torch.sin(omega)
    ca = torch.where(lin, 1 - t32, torch.sin((1 - t32) * omega) / sin)
    cb = torch.where(lin, t32, torch.sin(t32 * omega) / sin)
    out = torch.empty_like(x)
    for s in spans:
        out[:, s] = ca * x[:, s].float() + cb * y[:, s].float()
    return out.reshape(a.shape)


def _slerp_half(tensors, base, weights, params) -> torch.Tensor:
    return slerp_in_float32(base, tensors[0].to(base.dtype), float(params["t"]))


_slerp_tensor, _slerp_context, _slerp_into = in_dtype_rule(_slerp_half, _slerp_coefficients)

SLERP = Method("slerp", _slerp_tensor, half_reductions=True, needs_base=True, params={"t": REQUIRED},
               doc="Spherical linear interpolation from the base model (t = 0) to one other model (t = 1), on the "
                   "flattened tensor.", normalize_weights=False, checks={"t": real()}, models=(1, 1),
               elementwise=True, tensor_context=_slerp_context, fused_into=_slerp_into)


# ------------------------------------------------------------------ nuslerp


def _nuslerp_t(weights) -> float:
    w1, w2 = weights
    total = w1 + w2
    return 0.5 if abs(total) < 1e-6 else w2 / total


def _nuslerp_colinear(c):
    return (1.0 - c * c) <= 1e-16


def _nuslerp_coefficients(key, tensors, base, weights, params, context):
    g = gram(tensors, base)
    ca, cb = slerp_coefficients(g[0, 0].sqrt(), g[1, 1].sqrt(), g[0, 1], _nuslerp_t(weights),
                                colinear=_nuslerp_colinear, norm_floor=1e-7, clamp=True)
    return with_base([ca, cb], base)


def nuslerp_in_dtype(a: torch.Tensor, b: torch.Tensor, t: float, dim: int | None) -> torch.Tensor:
    """nuslerp of two float16/bfloat16 tensors as mergekit computes it, every op in their dtype D: each vector (the
    flattened tensor, ``dim`` None, or those along ``dim``) divided by its norm (rounded to D, clamped at 1e-7), the
    cosine a sum of the rounded products, Ω, its sine and the two coefficients in D, the combination
    (sin((1 − t)Ω) a + sin(tΩ) b) / sin Ω rounded op by op; (1 − t) a + t b where 1 − cos² ≤ 1e-16 in D."""
    shape = a.shape
    if dim is None:
        a, b = a.reshape(-1), b.reshape(-1)
    else:
        a, b = a.transpose(dim, -1), b.transpose(dim, -1)

    def unit(x):
        return x / torch.norm(x, dim=-1, keepdim=True).clamp(min=1e-7)

    cos = (unit(a) * unit(b)).sum(dim=-1, keepdim=True).clamp(-1, 1)
    lin = (1 - cos.square()) <= 1e-16
    omega = torch.acos(torch.where(lin, 0, cos))
    out = (torch.sin((1 - t) * omega) * a + torch.sin(t * omega) * b) / torch.sin(omega)
    out = torch.where(lin, (1 - t) * a + t * b, out)
    return (out if dim is None else out.transpose(dim, -1)).reshape(shape)


def _nuslerp_half(tensors, base, weights, params) -> torch.Tensor:
    """nuslerp in the inputs' half dtype (:func:`nuslerp_in_dtype`), on the task vectors (rounded to it) given a
    base, added back to the base in it."""
    a, b = tensors
    if base is not None:
        a, b = a - base, b - base
    dim = None if params["nuslerp_flatten"] or a.dim() == 0 else (0 if params["nuslerp_row_wise"] else -1)
    out = nuslerp_in_dtype(a, b, _nuslerp_t(weights), dim)
    return out if base is None else base + out


_nuslerp_flat, _nuslerp_context, _nuslerp_into = in_dtype_rule(_nuslerp_half, _nuslerp_coefficients)


def _nuslerp_tensor(key, tensors, weights, stats, base, params, context):
    if isinstance(context, InDtype) or params["nuslerp_flatten"] or tensors[0].dim() == 0:
        return _nuslerp_flat(key, tensors, weights, stats, base, params, context)
    if tensors[0].dtype in HALF:
        return _nuslerp_half(tensors, base, weights, params)
    a, b = tensors[0].double(), tensors[1].double()
    if base is not None:
        a, b = a - base.double(), b - base.double()
    out = slerp_pair(a, b, _nuslerp_t(weights), dim=0 if params["nuslerp_row_wise"] else -1,
                     colinear=_nuslerp_colinear, norm_floor=1e-7, clamp=True)
    return out if base is None else base.double() + out


NUSLERP = Method("nuslerp", _nuslerp_tensor, half_reductions=True, accepts_base=True, weight_required=True,
                 params={"nuslerp_flatten": True, "nuslerp_row_wise": False},
                 doc="SLERP of two models (or of their task vectors, given a base) at t = w2 / (w1 + w2), "
                     "flattened or row/column-wise.", normalize_weights=False,
                 checks={"nuslerp_flatten": boolean(), "nuslerp_row_wise": boolean()}, models=(2, 2),
                 elementwise=True, tensor_context=_nuslerp_context, fused_into=_nuslerp_into,
                 whole_tensor=lambda p: not p["nuslerp_flatten"])


# ------------------------------------------------------------------ multislerp


def multislerp_coefficients(g: torch.Tensor, weights, normalize: bool, eps: float, key: str = "") -> list[float]:
    """The multislerp of vectors of Gram matrix ``g`` as coefficients of those vectors (see the module doc): with
    the weighted mean m = Σ w_i v_i / (‖v_i‖ + eps), the tangent vectors' weighted mean at m/‖m‖ is
    m − (m · m/‖m‖) m/‖m‖ = 0, so the exponential map returns m/‖m‖ (times cos eps), scaled by Σ w_i ‖v_i‖."""
    n = g.shape[0]
    if n == 1:
        return [1.0]
    w = torch.tensor(weights, dtype=torch.float64)
    if normalize:
        w = w / w.sum()
    norms = g.diagonal().clamp(min=0.0).sqrt()
    a = w / (norms + eps)  # m = Σ a_i v_i
    mean_norm = float((a @ g @ a).clamp(min=0.0).sqrt())
    if mean_norm < eps:
        if n != 2:
            raise SymmergeError(f"multislerp: the weighted directions of tensor {key!r} cancel out (antipodal "
                                "models with balancing weights); change the weights")
        return [float(x) for x in w]
    return [float(x) for x in a / mean_norm * (math.cos(eps) * float((norms * w).sum()))]


def _multislerp_coefficients(key, tensors, base, weights, params, context):
    if len(tensors) == 1:
        return [1.0] + ([0.0] if base is not None else [])  # the model itself
    c = multislerp_coefficients(gram(tensors, base), weights, bool(params["normalize_weights"]),
                                float(params["eps"]), key)
    return with_base(c, base)


def multislerp_in_dtype(tensors, base, weights, normalize: bool, eps: float) -> torch.Tensor:
    """multislerp of float16/bfloat16 tensors as mergekit computes it, every op in their dtype D (the weights too,
    rounded to D): task vectors, norms, unit vectors u_i = v_i / (‖v_i‖ + eps), their weighted sum m and its norm,
    m/‖m‖, the tangent vectors u_i − (u_i·m) m and their weighted sum τ, m cos(‖τ‖ + eps) + τ sin(‖τ‖ + eps) / (‖τ‖
    + eps), times Σ w_i ‖v_i‖, plus the base — each rounded to D (the result of the module doc, with D's rounding
    noise in τ); two models whose weighted directions cancel: Σ w_i v_i in D. Where eps underflows in float16 (1e-8
    rounds to 0) mergekit divides 0 by 0 for a zero (task) vector and for τ = 0 — a tensor that fine-tuning left
    unchanged — and writes NaN: here their limits (direction 0, sin x / x = 1), the same bits everywhere else."""
    if len(tensors) == 1:
        return tensors[0]
    shape = tensors[0].shape
    v = torch.stack([t.reshape(-1) for t in tensors])
    if base is not None:
        v -= base.reshape(-1)
    w = torch.tensor([float(x) for x in weights], dtype=v.dtype)
    if normalize:
        w = w / w.sum()
    w_col = w.reshape(-1, 1)
    norms = torch.norm(v, dim=-1, keepdim=True)
    den = norms + eps  # 0 only for a zero vector where eps underflows (float16): its direction 0, not 0/0
    units = v / torch.where(den == 0, 1, den)
    mean = (units * w_col).sum(0)
    mean_norm = torch.norm(mean)
    if mean_norm < eps or mean_norm == 0:
        if len(tensors) != 2:
            raise SymmergeError("multislerp: the weighted directions of a tensor cancel out (antipodal models with "
                                "balancing weights); change the weights")
        out = (v[0] * w[0] + v[1] * w[1]).reshape(shape)
        return out if base is None else out + base
    mean = mean / mean_norm
    tangent = ((units - (units * mean).sum(-1, keepdim=True) * mean) * w_col).sum(0)
    tangent_norm = torch.norm(tangent) + eps  # 0 only for τ = 0 where eps underflows (float16): sin x / x → 1
    ratio = torch.sin(tangent_norm) / tangent_norm if tangent_norm != 0 else torch.ones_like(tangent_norm)
    out = mean * torch.cos(tangent_norm) + tangent * ratio
    out = (out * (norms.squeeze(-1) * w).sum()).reshape(shape)
    return out if base is None else out + base


def _multislerp_half(tensors, base, weights, params) -> torch.Tensor:
    return multislerp_in_dtype(tensors, base, weights, bool(params["normalize_weights"]), float(params["eps"]))


_multislerp_tensor, _multislerp_context, _multislerp_into = in_dtype_rule(_multislerp_half, _multislerp_coefficients)

MULTISLERP = Method("multislerp", _multislerp_tensor, half_reductions=True, accepts_base=True, weight_required=True,
                    params={"normalize_weights": True, "eps": 1e-8},
                    doc="Barycentric interpolation on the hypersphere of any number of models (or task vectors): "
                        "tangent-space mean at the weighted mean direction, mapped back, scaled by the mean norm.",
                    normalize_weights=False, checks={"normalize_weights": boolean(), "eps": real(0.0)},
                    elementwise=True, tensor_context=_multislerp_context, fused_into=_multislerp_into)


# ------------------------------------------------------------------ karcher


def karcher_mean(vectors, alphas, max_iter: int, tol: float) -> torch.Tensor:
    """The weighted Karcher mean of float64 1-D ``vectors`` (see the module docstring): the definition, on the
    vectors; :func:`karcher_coefficients` runs the same iteration on their Gram matrix."""
    norms = [float(v.norm()) for v in vectors]
    valid = [i for i, nrm in enumerate(norms) if nrm > tol]
    if not valid:
        return torch.zeros_like(vectors[0])
    total = sum(alphas[i] for i in valid)
    a = [alphas[i] / total for i in valid]
    units = [vectors[i] / norms[i] for i in valid]
    mean = sum(ai * u for ai, u in zip(a, units))
    mn = float(mean.norm())
    mean = units[0].clone() if mn < tol else mean / mn
    for _ in range(max_iter):
        step = torch.zeros_like(mean)
        for ai, u in zip(a, units):
            c = max(-1.0, min(1.0, float(mean @ u)))
            theta = math.acos(c)
            if theta < tol or theta == 0.0:  # tol 0: the term's limit is 0 (u = mean)
                continue
            step += ai * (theta / math.sin(theta)) * (u - c * mean)
        sn = float(step.norm())
        if sn < tol or sn == 0.0:  # tol 0: a zero step is converged (not 0 / 0)
            break
        mean = math.cos(sn) * mean + math.sin(sn) * (step / sn)
        un = float(mean.norm())
        if un > tol:
            mean = mean / un
    return sum(al * nrm for al, nrm in zip(alphas, norms)) * mean


def karcher_coefficients(g: torch.Tensor, alphas, max_iter: int, tol: float) -> list[float]:
    """:func:`karcher_mean` of the vectors of Gram matrix ``g`` as coefficients of those vectors: every iterate
    lies in the span of the unit vectors, so it is held as coefficients α (mean = Σ α_k u_k) and every dot
    product and norm of the iteration is a quadratic form in the unit vectors' Gram matrix."""
    n = g.shape[0]
    norms = g.diagonal().clamp(min=0.0).sqrt().tolist()
    valid = [i for i in range(n) if norms[i] > tol]
    if not valid:
        return [0.0] * n
    total = sum(alphas[i] for i in valid)
    a = torch.tensor([alphas[i] / total for i in valid], dtype=torch.float64)
    nv = torch.tensor([norms[i] for i in valid], dtype=torch.float64)
    gu = g[valid][:, valid] / torch.outer(nv, nv)  # the unit vectors' Gram matrix

    def norm(x):
        return math.sqrt(max(0.0, float(x @ gu @ x)))

    mean = a.clone()
    mn = norm(mean)
    mean = torch.eye(len(valid), dtype=torch.float64)[0] if mn < tol else mean / mn
    for _ in range(max_iter):
        step = torch.zeros_like(mean)
        for j in range(len(valid)):
            c = max(-1.0, min(1.0, float(mean @ gu[:, j])))
            theta = math.acos(c)
            if theta < tol or theta == 0.0:
                continue
            step[j] += a[j] * (theta / math.sin(theta))
            step -= a[j] * (theta / math.sin(theta)) * c * mean
        sn = norm(step)
        if sn < tol or sn == 0.0:
            break
        mean = math.cos(sn) * mean + math.sin(sn) * (step / sn)
        un = norm(mean)
        if un > tol:
            mean = mean / un
    scale = sum(al * nrm for al, nrm in zip(alphas, norms))
    out = [0.0] * n
    for j, i in enumerate(valid):
        out[i] = scale * float(mean[j]) / norms[i]
    return out


def _karcher_coefficients(key, tensors, base, weights, params, context):
    n = len(tensors)
    if n == 1:
        return [1.0]
    return karcher_coefficients(gram(tensors), [1.0 / n] * n, int(params["max_iter"]), float(params["tol"]))


def karcher_in_dtype(tensors, alphas, max_iter: int, tol: float) -> torch.Tensor:
    """:func:`karcher_mean` of float16/bfloat16 tensors as mergekit computes it: the norms (and the step's norm) in
    float32, every vector op in the tensors' dtype D — the unit vectors, their weighted sum, each iterate's dot
    products, angles, θ/sin θ and step rounded to D; the iteration stops or skips a model by those rounded values."""
    if len(tensors) == 1:
        return tensors[0]
    norms = [torch.linalg.vector_norm(t.float()) for t in tensors]
    units = [torch.zeros_like(t) if float(n) == 0.0 else t / n for t, n in zip(tensors, norms)]
    valid = [i for i, n in enumerate(norms) if float(n) > tol]
    if not valid:
        return torch.zeros_like(tensors[0])
    total = sum(alphas[i] for i in valid)
    a = [alphas[i] / total for i in valid]
    units = [units[i] for i in valid]
    mean = torch.zeros_like(units[0])
    for ai, u in zip(a, units):
        mean += ai * u
    mn = torch.linalg.vector_norm(mean.float())
    mean = units[0].clone() if float(mn) < tol else mean / mn
    for _ in range(max_iter):
        step = torch.zeros_like(mean)
        for ai, u in zip(a, units):
            c = torch.dot(mean.reshape(-1), u.reshape(-1)).clamp(-1.0, 1.0)
            theta = torch.arccos(c)
            if float(theta) < tol:
                continue
            step += ai * (theta / torch.sin(theta)) * (u - c * mean)
        sn = torch.linalg.vector_norm(step.float())
        if float(sn) < tol:
            break
        mean = torch.cos(sn) * mean + torch.sin(sn) * (step / sn)
        un = torch.linalg.vector_norm(mean.float())
        if float(un) > tol:
            mean = mean / un
    return sum(al * n for al, n in zip(alphas, norms)) * mean


def _karcher_half(tensors, base, weights, params) -> torch.Tensor:
    n = len(tensors)
    return karcher_in_dtype(tensors, [1.0 / n] * n, int(params["max_iter"]), float(params["tol"]))


_karcher_tensor, _karcher_context, _karcher_into = in_dtype_rule(_karcher_half, _karcher_coefficients)

KARCHER = Method("karcher", _karcher_tensor, half_reductions=True, params={"max_iter": 10, "tol": 1e-5},
                 ignores_base=True,
                 doc="Karcher (Riemannian) mean of the models' directions on the unit sphere, scaled by their "
                     "mean norm (uniform; weights are not used).",
                 checks={"max_iter": integer(0), "tol": real(0.0)}, elementwise=True,
                 tensor_context=_karcher_context, fused_into=_karcher_into)

METHODS = [SLERP, NUSLERP, MULTISLERP, KARCHER]
