"""RoPE QK group: a complex scalar per frequency pair, solved in closed form per pair.

``transformers``' ``rotate_half`` layout pairs dims ``j`` and ``j + r/2`` of the ``r`` rotary dims of
a head; position ``m`` rotates each pair by ``m ω_j``. Reading the pair as ``z = x_j + i x_{j+r/2}``,
the transforms that commute with every position's rotation are ``z_Q → w z_Q``, ``z_K → z_K / w̄``
with ``w = ρ e^{-iθ}`` (the score ``Re(z_Q z̄_K)`` is unchanged): a 2-D rotation by ``θ`` on both, a
scale ``ρ`` on Q and ``1/ρ`` on K.

Aligning the moved model (1) to the anchor (2), per pair, with ``c₊ = Σ z̄₂ z₁`` over the Q rows
(power +1), ``c₋`` over the K rows, ``P = ‖z₁‖²`` (Q), ``M = ‖z₁‖²`` (K):

    f(ρ, θ) = ρ² P + M / ρ² − 2 Re(e^{-iθ} (ρ c₊ + c₋ / ρ))   (+ const)

For fixed ``ρ`` the best ``θ`` is ``arg(ρ c₊ + c₋/ρ)`` (2-D Procrustes), leaving
``F(t) = t P + M/t − 2 √(t A + B/t + 2c)`` with ``t = ρ²``, ``A = |c₊|²``, ``B = |c₋|²``,
``c = Re(c₊ c̄₋)``. Its stationary points are roots of a sextic in ``t`` (squaring
``F'(t) = 0``), solved for all pairs at once as companion-matrix eigenvalues.
"""

from __future__ import annotations

import numpy as np
import torch

from .rescale import quartic_scale


def pair_products(x1: torch.Tensor, x2: torch.Tensor, rotary: int):
    """For blocks (B, d, n) of the moved (1) and anchor (2) model: ``c = Σ z̄₂ z₁`` (B, r/2, complex)
    and ``‖z₁‖²`` (B, r/2) per rotary pair."""
    h = rotary // 2
    a1, b1, a2, b2 = x1[:, :h], x1[:, h:rotary], x2[:, :h], x2[:, h:rotary]
    f64 = torch.float64
    re = (a1 * a2).sum(-1, dtype=f64) + (b1 * b2).sum(-1, dtype=f64)
    im = (b1 * a2).sum(-1, dtype=f64) - (a1 * b2).sum(-1, dtype=f64)
    return torch.complex(re, im), (a1.square() + b1.square()).sum(-1, dtype=f64)


def pair_objective(rho, theta, cp, cm, P, M) -> torch.Tensor:
    """f(ρ, θ) per pair (up to the constant ‖z₂‖²)."""
    w = torch.polar(torch.ones_like(theta), -theta)
    return rho**2 * P + M / rho**2 - 2 * (w * (rho * cp + cm / rho)).real


def _joint_t(cp, cm, P, M) -> np.ndarray:
    """``t = ρ²`` minimising F(t), per pair, from the roots of the stationarity sextic."""
    cp, cm, P, M = (x.numpy() for x in (cp, cm, P, M))
    s = np.sqrt(M / P)  # natural scale: with t = s τ and F / √(PM) the problem has P = M = 1
    pm = np.sqrt(P * M)
    A, B = np.abs(cp) ** 2 * s / (pm * pm), np.abs(cm) ** 2 / (s * pm * pm)
    c = (cp * np.conj(cm)).real / (pm * pm)
    # (τ² − 1)² (A τ² + 2c τ + B) − τ (A τ² − B)² = 0, highest degree first
    coef = np.stack([A, 2 * c - A**2, B - 2 * A, 2 * A * B - 4 * c, A - 2 * B, 2 * c - B**2, B], axis=-1)
    candidates = [np.ones_like(A)]  # τ = 1: the optimum when c₊ = c₋ = 0
    lead = coef[:, 0]
    good = np.abs(lead) > 1e-12 * np.abs(coef).max(-1)
    if good.any():
        comp = np.zeros((good.sum(), 6, 6))
        comp[:, np.arange(1, 6), np.arange(5)] = 1.0
        comp[:, 0, :] = -coef[good, 1:] / lead[good, None]
        roots = np.linalg.eigvals(comp)
        real = np.where(np.abs(roots.imag) <= 1e-6 * np.maximum(1.0, np.abs(roots.real)), roots.real, np.nan)
        real = np.where(real > 0, real, np.nan)
        full = np.full((len(A), 6), np.nan)
        full[good] = real
        candidates += list(full.T)
    tau = np.stack(candidates, axis=-1)

    def F(t):
        return t + 1 / t - 2 * np.sqrt(np.maximum(t * A[:, None] + B[:, None] / t + 2 * c[:, None], 0))

    with np.errstate(invalid="ignore", divide="ignore"):
        values = np.where(np.isfinite(tau), F(tau), np.inf)
    best = tau[np.arange(len(tau)), values.argmin(-1)]
    return best * s


def solve_pairs(cp, cm, P, M, rotate: bool = True, rescale: str = "joint"):
    """``(θ, ρ)`` per pair (any leading shape): rotation only (ρ = 1), ``sequential`` (θ at ρ = 1,
    then the best ρ for it: a quartic) or ``joint`` (exact optimum over both)."""
    shape = cp.shape
    cp, cm, P, M = (x.reshape(-1) for x in (cp, cm, P, M))
    rho = torch.ones_like(P)
    theta = torch.angle(cp + cm) if rotate else torch.zeros_like(P)
    if rescale == "joint" and rotate:
        ok = (P > 0) & (M > 0)
        if ok.any():
            rho[ok] = torch.from_numpy(_joint_t(cp[ok], cm[ok], P[ok], M[ok])).sqrt()
        theta = torch.angle(rho * cp + cm / rho)
    elif rescale != "none":
        w = torch.polar(torch.ones_like(theta), -theta)
        rho = quartic_scale((w * cp).real, (w * cm).real, P, M)
    return theta.reshape(shape), rho.reshape(shape)


def rope_element(theta, rho, R_pass, a_pass, d: int):
    """``(R, a)`` of a head element from pair angles/scales (B, r/2) and the non-rotated dims'
    rotation (B, d−r, d−r) and scale (B,) (both None when r = d): R (B, d, d), a (B, d)."""
    B, h = theta.shape
    r = 2 * h
    R = torch.zeros(B, d, d, dtype=torch.float64)
    j = torch.arange(h)
    c, s = torch.cos(theta), torch.sin(theta)
    R[:, j, j] = c
    R[:, j + h, j + h] = c
    R[:, j + h, j] = s
    R[:, j, j + h] = -s
    a = torch.empty(B, d, dtype=torch.float64)
    a[:, :h] = rho
    a[:, h:r] = rho
    if r < d:
        R[:, r:, r:] = R_pass
        a[:, r:] = a_pass[:, None]
    return R, a
