"""Spherical interpolation rules (mergekit's ``slerp``, ``nuslerp``, ``multislerp``, ``karcher``): whole-tensor
rules on the flattened tensor (or its rows), computed in float64 and cast back by the loop.

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
  weighted directions cancel (‖Σ wᵢuᵢ‖ < eps) fall back to Σ wᵢ vᵢ, more → SymmergeError.
* ``karcher`` (one or more models, no base, no weights): the Karcher (Fréchet) mean on the unit sphere of
  the models' directions (uniform weights α = 1/n over the models with norm > ``tol``): start at their
  normalised mean, then at most ``max_iter`` steps of the exponential map along
  Σ α θ_i/sin θ_i (u_i − cos θ_i · m) (θ_i < tol skipped), stopping when that step's norm < ``tol``;
  scaled by the mean of all the models' norms.

Per-model weights go in ``weights`` (raw: these methods normalise them themselves where they do).
"""

from __future__ import annotations

import math

import torch

from ..errors import SymmergeError
from .base import REQUIRED, Method, boolean, integer, real


def slerp_pair(a: torch.Tensor, b: torch.Tensor, t: float, dim: int | None = None, colinear=None,
               norm_floor: float = 1e-8, clamp: bool = False) -> torch.Tensor:
    """slerp(a, b, t) of float64 tensors: over all entries (``dim`` None) or of the vectors along ``dim``.
    ``colinear(cos) -> bool mask``: where the linear mix is taken. ``clamp``: norms below ``norm_floor`` are
    raised to it (nuslerp), else replaced by 1 (slerp)."""
    def unit(x):
        norm = x.norm() if dim is None else x.norm(dim=dim, keepdim=True)
        if clamp:
            norm = norm.clamp(min=norm_floor)
        else:
            norm = torch.where(norm > norm_floor, norm, torch.ones_like(norm))
        return x / norm

    ua, ub = unit(a), unit(b)
    cos = ((ua * ub).sum() if dim is None else (ua * ub).sum(dim=dim, keepdim=True)).clamp(-1.0, 1.0)
    lin = colinear(cos)
    omega = torch.acos(torch.where(lin, torch.zeros_like(cos), cos))
    s = torch.sin(omega)
    s = torch.where(lin, torch.ones_like(s), s)
    ca = torch.where(lin, torch.full_like(cos, 1.0 - t), torch.sin((1.0 - t) * omega) / s)
    cb = torch.where(lin, torch.full_like(cos, t), torch.sin(t * omega) / s)
    return ca * a + cb * b


# ------------------------------------------------------------------ slerp


def _slerp_tensor(key, tensors, weights, stats, base, params, context):
    return slerp_pair(base.double(), tensors[0].double(), float(params["t"]),
                      colinear=lambda c: c.abs() > 0.9995, norm_floor=1e-8)


SLERP = Method("slerp", _slerp_tensor, needs_base=True, params={"t": REQUIRED}, doc="Spherical linear interpolation "
               "from the base model (t = 0) to one other model (t = 1), on the flattened tensor.",
               normalize_weights=False, checks={"t": real()}, models=(1, 1))


# ------------------------------------------------------------------ nuslerp


def _nuslerp_tensor(key, tensors, weights, stats, base, params, context):
    w1, w2 = weights
    total = w1 + w2
    t = 0.5 if abs(total) < 1e-6 else w2 / total
    a, b = tensors[0].double(), tensors[1].double()
    if base is not None:
        a, b = a - base.double(), b - base.double()

    def colinear(c):
        return (1.0 - c * c) <= 1e-16

    if params["nuslerp_flatten"] or a.dim() == 0:
        out = slerp_pair(a.reshape(-1), b.reshape(-1), t, dim=0, colinear=colinear, norm_floor=1e-7,
                         clamp=True).reshape(a.shape)
    else:
        dim = 0 if params["nuslerp_row_wise"] else -1
        out = slerp_pair(a, b, t, dim=dim, colinear=colinear, norm_floor=1e-7, clamp=True)
    return out if base is None else base.double() + out


NUSLERP = Method("nuslerp", _nuslerp_tensor, accepts_base=True,
                 params={"nuslerp_flatten": True, "nuslerp_row_wise": False},
                 doc="SLERP of two models (or of their task vectors, given a base) at t = w2 / (w1 + w2), "
                     "flattened or row/column-wise.", normalize_weights=False,
                 checks={"nuslerp_flatten": boolean(), "nuslerp_row_wise": boolean()}, models=(2, 2))


# ------------------------------------------------------------------ multislerp


def _multislerp_tensor(key, tensors, weights, stats, base, params, context):
    if len(tensors) == 1:
        return tensors[0].double()
    eps = float(params["eps"])
    vs = torch.stack([t.double().reshape(-1) for t in tensors])
    if base is not None:
        vs = vs - base.double().reshape(-1)
    w = torch.tensor(weights, dtype=torch.float64)
    if params["normalize_weights"]:
        w = w / w.sum()
    norms = vs.norm(dim=1, keepdim=True)
    units = vs / (norms + eps)
    mean = (units * w[:, None]).sum(0)
    mean_norm = float(mean.norm())
    if mean_norm < eps:
        if len(tensors) != 2:
            raise SymmergeError(f"multislerp: the weighted directions of tensor {key!r} cancel out (antipodal "
                                "models with balancing weights); change the weights")
        out = (vs * w[:, None]).sum(0)
    else:
        mean = mean / mean_norm
        tangents = units - (units @ mean)[:, None] * mean
        tau = (tangents * w[:, None]).sum(0)
        tn = float(tau.norm()) + eps
        out = (mean * math.cos(tn) + tau * (math.sin(tn) / tn)) * float((norms[:, 0] * w).sum())
    out = out.reshape(tensors[0].shape)
    return out if base is None else base.double() + out


MULTISLERP = Method("multislerp", _multislerp_tensor, accepts_base=True,
                    params={"normalize_weights": True, "eps": 1e-8},
                    doc="Barycentric interpolation on the hypersphere of any number of models (or task vectors): "
                        "tangent-space mean at the weighted mean direction, mapped back, scaled by the mean norm.",
                    normalize_weights=False, checks={"normalize_weights": boolean(), "eps": real(0.0)})


# ------------------------------------------------------------------ karcher


def karcher_mean(vectors, alphas, max_iter: int, tol: float) -> torch.Tensor:
    """The weighted Karcher mean of float64 1-D ``vectors`` (see the module docstring)."""
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
            if theta < tol:
                continue
            step += ai * (theta / math.sin(theta)) * (u - c * mean)
        sn = float(step.norm())
        if sn < tol:
            break
        mean = math.cos(sn) * mean + math.sin(sn) * (step / sn)
        un = float(mean.norm())
        if un > tol:
            mean = mean / un
    return sum(al * nrm for al, nrm in zip(alphas, norms)) * mean


def _karcher_tensor(key, tensors, weights, stats, base, params, context):
    if len(tensors) == 1:
        return tensors[0].double()
    n = len(tensors)
    out = karcher_mean([t.double().reshape(-1) for t in tensors], [1.0 / n] * n, int(params["max_iter"]),
                       float(params["tol"]))
    return out.reshape(tensors[0].shape)


KARCHER = Method("karcher", _karcher_tensor, params={"max_iter": 10, "tol": 1e-5},
                 doc="Karcher (Riemannian) mean of the models' directions on the unit sphere, scaled by their "
                     "mean norm (uniform; weights are not used).",
                 checks={"max_iter": integer(0), "tol": real(0.0)})

METHODS = [SLERP, NUSLERP, MULTISLERP, KARCHER]
