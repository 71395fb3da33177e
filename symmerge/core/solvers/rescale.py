"""Rotation + scalar rescale of a head group, batched over heads.

For one head, with the moved model's blocks ``X1`` and the anchor's ``X2`` split by scale power
(``+``: scaled by ``a``, ``-``: by ``1/a``), ``Mp = Σ₊ X1 X2ᵀ``, ``Mm = Σ₋ X1 X2ᵀ``, ``n1p = ‖X1₊‖²``,
``n1m = ‖X1₋‖²``, the squared distance after the element (R, a), minus the anchor's ‖X2‖², is

    f(a, R) = a² n1p + n1m / a² − 2 tr(Rᵀ (a Mp + Mm / a)).

* rotation only: ``a = 1``, ``R`` = Procrustes of ``Mp + Mm`` (paper Algorithm 1);
* sequential (paper eq. 11–12): that ``R``, then the best ``a`` for it, a root of the quartic
  ``n1p a⁴ − cp a³ + cm a − n1m = 0`` with ``cp = tr(RᵀMp)``, ``cm = tr(RᵀMm)``;
* joint: ``min_a F(a)``, ``F(a) = a² n1p + n1m / a² − 2 ‖a Mp + Mm / a‖_*`` (for fixed ``a`` the best
  ``R`` is Procrustes of ``a Mp + Mm / a``). Solved from the sequential solution by safeguarded
  Newton (exact first and second derivatives of the nuclear norm from one SVD per step), then a
  bounded search: F on a log grid over a bracket that provably contains the minimiser; heads with a
  lower grid point are refined there (golden section, then Newton).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .procrustes import finite_cost, procrustes


def head_objective(a, R, Mp, Mm, n1p, n1m) -> torch.Tensor:
    """f(a, R) per head (see module docstring)."""
    cp = torch.einsum("bij,bij->b", R, Mp)
    cm = torch.einsum("bij,bij->b", R, Mm)
    return a * a * n1p + n1m / (a * a) - 2 * (a * cp + cm / a)


def _profile(a, Mp, Mm, n1p, n1m) -> torch.Tensor:
    """F(a) = min_R f(a, R): a batch of scales ``a`` (..., B) in one batched singular-value call."""
    M = a[..., None, None] * Mp + Mm / a[..., None, None]
    return a * a * n1p + n1m / (a * a) - 2 * torch.linalg.svdvals(M).sum(-1)


def scale_for_rotation(R, Mp, Mm, n1p, n1m) -> torch.Tensor:
    """Best ``a > 0`` for fixed rotations: the positive root of eq. 12 with the lowest objective."""
    cp = torch.einsum("bij,bij->b", R, Mp)
    cm = torch.einsum("bij,bij->b", R, Mm)
    return quartic_scale(cp, cm, n1p, n1m)


def quartic_scale(cp, cm, p, m, signed: bool = False) -> torch.Tensor:
    """Per entry, the scale ``a`` minimising ``a² p − 2 a cp + m / a² − 2 cm / a`` (``p, m ≥ 0``): the
    real root of ``p a⁴ − cp a³ + cm a − m = 0`` with the lowest objective; ``a > 0``, or any ``a ≠ 0``
    when ``signed``. Entries with ``p = 0`` or ``m = 0`` get 1."""
    cp, cm, p, m = (torch.as_tensor(x, dtype=torch.float64).numpy() for x in (cp, cm, p, m))
    out = np.ones_like(p)
    ok = (p > 0) & (m > 0)
    if ok.any():
        # monic quartic a⁴ + c3 a³ + 0 a² + c1 a + c0, roots as eigenvalues of its companion matrix
        c3, c1, c0 = -cp[ok] / p[ok], cm[ok] / p[ok], -m[ok] / p[ok]
        comp = np.zeros((ok.sum(), 4, 4))
        comp[:, 1, 0] = comp[:, 2, 1] = comp[:, 3, 2] = 1.0
        comp[:, 0, :] = -np.stack([c3, np.zeros_like(c3), c1, c0], axis=1)
        roots = np.linalg.eigvals(comp)
        real = roots.real
        usable = (np.abs(roots.imag) <= 1e-7 * np.maximum(1.0, np.abs(real))) & ((real != 0) if signed else (real > 0))
        a = np.where(usable, real, np.nan)
        # polish each candidate with Newton steps on the quartic
        for _ in range(3):
            poly = a**4 + c3[:, None] * a**3 + c1[:, None] * a + c0[:, None]
            der = 4 * a**3 + 3 * c3[:, None] * a**2 + c1[:, None]
            a = np.where(der != 0, a - poly / np.where(der != 0, der, 1), a)
        g = a * a * p[ok, None] - 2 * a * cp[ok, None] + m[ok, None] / (a * a) - 2 * cm[ok, None] / a
        g = np.where(np.isfinite(g) & ((a != 0) if signed else (a > 0)), g, np.inf)
        best = np.argmin(g, axis=1)
        chosen = a[np.arange(len(best)), best]
        out[ok] = np.where(np.isfinite(chosen), chosen, 1.0)
    return torch.from_numpy(out)


def sequential_scale(Mp, Mm, n1p, n1m):
    """Paper's rescale: rotate at a = 1, then the best scale for that rotation."""
    finite_cost(Mp, Mm)
    R, _ = procrustes(Mp + Mm)
    return R, scale_for_rotation(R, Mp, Mm, n1p, n1m)


def _bracket(Mp, Mm, n1p, n1m, n2p, n2m):
    """[lo, hi] holding every minimiser of F: F(a) ≥ (a‖X1₊‖ − ‖X2₊‖)² + (‖X1₋‖/a − ‖X2₋‖)² − ‖X2‖²
    and min F ≤ F(1), so both squares are ≤ F(1) + ‖X2‖²."""
    one = torch.ones_like(n1p)
    budget = (_profile(one, Mp, Mm, n1p, n1m) + n2p + n2m).clamp_min(0).sqrt()
    hi = (n2p.sqrt() + budget) / n1p.sqrt()
    lo = n1m.sqrt() / (n2m.sqrt() + budget)
    return lo.clamp_min(1e-8), hi.clamp(max=1e8)


def _derivatives(a, Mp, Mm, n1p, n1m):
    """F(a), F'(a), F''(a) and the optimal R(a) from one batched SVD.

    With M(a) = a Mp + Mm/a = U Σ Vᵀ: d‖M‖_*/da = tr(Rᵀ M'), and the curvature of the nuclear norm
    along D = M' is Σ_{i<j} (D̃ᵢⱼ − D̃ⱼᵢ)² / (σᵢ + σⱼ) with D̃ = Uᵀ D V (plus tr(Rᵀ M'') from M's own curvature).
    """
    s = a[:, None, None]
    U, S, Vh = torch.linalg.svd(s * Mp + Mm / s)
    R = U @ Vh
    D1, D2 = Mp - Mm / s**2, 2 * Mm / s**3
    Dt = U.mT @ D1 @ Vh.mT
    skew = (Dt - Dt.mT).square()
    denom = S[:, :, None] + S[:, None, :]
    curvature = 0.5 * (skew / denom.clamp_min(torch.finfo(S.dtype).tiny)).sum((1, 2))
    F = a * a * n1p + n1m / (a * a) - 2 * S.sum(-1)
    dF = 2 * a * n1p - 2 * n1m / a**3 - 2 * torch.einsum("bij,bij->b", R, D1)
    d2F = 2 * n1p + 6 * n1m / a**4 - 2 * (torch.einsum("bij,bij->b", R, D2) + curvature)
    return F, dF, d2F, R


def _refine(a, ok, Mp, Mm, n1p, n1m, tol: float, max_iter: int):
    """Damped Newton on F from ``a`` (per head). A step that raises F beyond rounding is rejected and
    the damping halved; where F is not convex the exact a-step for the current R is taken instead
    (it never raises F). Stops when the step or the predicted decrease is at rounding level."""
    F, dF, d2F, R = _derivatives(a, Mp, Mm, n1p, n1m)
    damp = torch.ones_like(a)
    eps = torch.finfo(a.dtype).eps
    for _ in range(max_iter):
        convex = d2F > 0
        newton = a - damp * dF / torch.where(convex, d2F, torch.ones_like(d2F))
        step = torch.where(convex, newton.clamp(a / 2, 2 * a), scale_for_rotation(R, Mp, Mm, n1p, n1m))
        negligible = convex & (dF.square() <= 2 * d2F * 64 * eps * F.abs().clamp_min(1.0))
        active = ok & ~negligible & (torch.abs(step - a) > tol * a)
        if not active.any():
            break
        idx = active.nonzero().squeeze(1)  # one SVD per head still moving
        F2, dF2, d2F2, R2 = _derivatives(step[idx], Mp[idx], Mm[idx], n1p[idx], n1m[idx])
        accept = F2 <= F[idx] + 64 * eps * F[idx].abs().clamp_min(1.0)
        took = idx[accept]
        a, F, dF, d2F, R = a.clone(), F.clone(), dF.clone(), d2F.clone(), R.clone()
        a[took], F[took], dF[took], d2F[took], R[took] = step[took], F2[accept], dF2[accept], d2F2[accept], R2[accept]
        damp = damp.clone()
        damp[took] = 1.0
        damp[idx[~accept]] /= 2
    return a, R, F


def joint_scale(Mp, Mm, n1p, n1m, n2p, n2m, grid: int = 8, tol: float = 1e-13, max_iter: int = 50):
    """Jointly optimal (R, a) per head; F(joint) ≤ F(sequential) by construction.

    Newton refinement from the sequential solution, then a bounded search: F on a log grid over a
    bracket that provably holds the minimiser; heads where a grid point is lower are refined again
    by golden section + Newton from there.
    """
    R, a = sequential_scale(Mp, Mm, n1p, n1m)
    ok = (n1p > 0) & (n1m > 0)
    if not ok.any():
        return R, a
    a, R, current = _refine(a, ok, Mp, Mm, n1p, n1m, tol, max_iter)
    lo, hi = _bracket(Mp, Mm, n1p, n1m, n2p, n2m)
    t = torch.linspace(0, 1, grid, dtype=torch.float64)[:, None]
    candidates = torch.exp(torch.log(lo) + t * (torch.log(hi) - torch.log(lo)))  # (grid, B)
    # F(a) ≥ a² n1p + n1m / a² − 2 (a ‖Mp‖_* + ‖Mm‖_* / a) (triangle inequality): grid points where this
    # bound is not below the current F cannot be lower, so only the others need their SVD (3/4 of the
    # grid is skipped on roberta-base-shaped heads)
    nuc_p, nuc_m = torch.linalg.svdvals(torch.cat([Mp, Mm])).sum(-1).split(len(Mp))
    bound = candidates**2 * n1p + n1m / candidates**2 - 2 * (candidates * nuc_p + nuc_m / candidates)
    values = torch.full_like(candidates, math.inf)
    need = ok & (bound <= current + 1e-12 * current.abs().clamp_min(1.0))  # a superset, rounding aside
    if need.any():
        g_idx, h_idx = need.nonzero(as_tuple=True)
        values[g_idx, h_idx] = _profile(candidates[g_idx, h_idx], Mp[h_idx], Mm[h_idx], n1p[h_idx], n1m[h_idx])
    best_val, best_idx = values.min(0)
    worse = ok & (best_val < current - 1e-12 * current.abs().clamp_min(1.0))
    if worse.any():  # another basin is lower: golden section around the best grid point, then Newton
        cols = torch.arange(len(best_idx))
        left = candidates[(best_idx - 1).clamp(0, grid - 1), cols].log()
        right = candidates[(best_idx + 1).clamp(0, grid - 1), cols].log()
        golden = (math.sqrt(5) - 1) / 2
        for _ in range(40):
            x1 = right - golden * (right - left)
            x2 = left + golden * (right - left)
            lower = _profile(x1.exp(), Mp, Mm, n1p, n1m) < _profile(x2.exp(), Mp, Mm, n1p, n1m)
            right = torch.where(lower, x2, right)
            left = torch.where(lower, left, x1)
        start = torch.where(worse, ((left + right) / 2).exp(), a)
        a2, R2, F2 = _refine(start, worse, Mp, Mm, n1p, n1m, tol, max_iter)
        take = worse & (F2 < current)
        a = torch.where(take, a2, a)
        R = torch.where(take[:, None, None], R2, R)
    return R, torch.where(ok, a, torch.ones_like(a))
