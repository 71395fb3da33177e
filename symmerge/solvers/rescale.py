"""Rotation + scalar rescale of a head group, batched over heads.

For one head, with the moved model's blocks ``X1`` and the anchor's ``X2`` split by scale power
(``+``: scaled by ``a``, ``-``: by ``1/a``), ``Mp = Σ₊ X1 X2ᵀ``, ``Mm = Σ₋ X1 X2ᵀ``, ``n1p = ‖X1₊‖²``,
``n1m = ‖X1₋‖²``, the squared distance after the element (R, a), minus the anchor's ‖X2‖², is

    f(a, R) = a² n1p + n1m / a² − 2 tr(Rᵀ (a Mp + Mm / a)).

* rotation only: ``a = 1``, ``R`` = Procrustes of ``Mp + Mm`` (paper Algorithm 1);
* sequential (paper eq. 11–12): that ``R``, then the best ``a`` for it, a root of the quartic
  ``n1p a⁴ − cp a³ + cm a − n1m = 0`` with ``cp = tr(RᵀMp)``, ``cm = tr(RᵀMm)``;
* joint: ``min_a F(a)``, ``F(a) = a² n1p + n1m / a² − 2 ‖a Mp + Mm / a‖_*`` (for fixed ``a`` the best
  ``R`` is Procrustes of ``a Mp + Mm / a``). Solved by alternating exact R- and a-steps from the
  sequential solution (monotone, ends at a stationary point), then a bounded search: F on a log grid
  over a bracket that provably contains the minimiser, restarting from any grid point that is
  lower, and golden-section refinement around the best point.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .procrustes import procrustes


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
    cp = torch.einsum("bij,bij->b", R, Mp).numpy()
    cm = torch.einsum("bij,bij->b", R, Mm).numpy()
    p, m = n1p.numpy(), n1m.numpy()
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
        usable = (np.abs(roots.imag) <= 1e-7 * np.maximum(1.0, np.abs(real))) & (real > 0)
        a = np.where(usable, real, np.nan)
        # polish each candidate with Newton steps on the quartic
        for _ in range(3):
            poly = a**4 + c3[:, None] * a**3 + c1[:, None] * a + c0[:, None]
            der = 4 * a**3 + 3 * c3[:, None] * a**2 + c1[:, None]
            a = np.where(der != 0, a - poly / np.where(der != 0, der, 1), a)
        g = a * a * p[ok, None] - 2 * a * cp[ok, None] + m[ok, None] / (a * a) - 2 * cm[ok, None] / a
        g = np.where(np.isfinite(g) & (a > 0), g, np.inf)
        best = np.argmin(g, axis=1)
        chosen = a[np.arange(len(best)), best]
        out[ok] = np.where(np.isfinite(chosen), chosen, 1.0)
    return torch.from_numpy(out)


def sequential_scale(Mp, Mm, n1p, n1m):
    """Paper's rescale: rotate at a = 1, then the best scale for that rotation."""
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


def joint_scale(Mp, Mm, n1p, n1m, n2p, n2m, grid: int = 16, tol: float = 1e-12, max_iter: int = 200):
    """Jointly optimal (R, a) per head; F(joint) ≤ F(sequential) by construction."""
    R, a = sequential_scale(Mp, Mm, n1p, n1m)
    ok = (n1p > 0) & (n1m > 0)
    if not ok.any():
        return R, a

    def descend(a):
        for _ in range(max_iter):
            R, _ = procrustes(a[:, None, None] * Mp + Mm / a[:, None, None])
            new = torch.where(ok, scale_for_rotation(R, Mp, Mm, n1p, n1m), a)
            if torch.max(torch.abs(torch.log(new / a))) < tol:
                return new
            a = new
        return a

    a = descend(a)
    lo, hi = _bracket(Mp, Mm, n1p, n1m, n2p, n2m)
    t = torch.linspace(0, 1, grid, dtype=torch.float64)[:, None]
    candidates = torch.exp(torch.log(lo) + t * (torch.log(hi) - torch.log(lo)))  # (grid, B)
    values = _profile(candidates, Mp, Mm, n1p, n1m)
    current = _profile(a, Mp, Mm, n1p, n1m)
    best_val, best_idx = values.min(0)
    worse = ok & (best_val < current - 1e-12 * current.abs().clamp_min(1.0))
    if worse.any():  # another basin is lower: refine there by golden section, then descend again
        idx = best_idx.clamp(1, grid - 2)
        left = candidates[idx - 1, torch.arange(len(idx))].log()
        right = candidates[idx + 1, torch.arange(len(idx))].log()
        golden = (math.sqrt(5) - 1) / 2
        for _ in range(60):
            x1 = right - golden * (right - left)
            x2 = left + golden * (right - left)
            f1 = _profile(x1.exp(), Mp, Mm, n1p, n1m)
            f2 = _profile(x2.exp(), Mp, Mm, n1p, n1m)
            right = torch.where(f1 < f2, x2, right)
            left = torch.where(f1 < f2, left, x1)
        refined = descend(torch.where(worse, ((left + right) / 2).exp(), a))
        a = torch.where(worse & (_profile(refined, Mp, Mm, n1p, n1m) < current), refined, a)
    R, _ = procrustes(a[:, None, None] * Mp + Mm / a[:, None, None])
    return R, torch.where(ok, a, torch.ones_like(a))
