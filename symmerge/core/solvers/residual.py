"""Residual stream: one transform ``Q`` of the hidden dims, model-wide.

Every stream member (embeddings, reader columns, writer rows and biases, LM head) moves as
``X → Qᵀ X`` with the hidden index first, so the distance to the anchor is ``const − 2 tr(Qᵀ C)``
with ``C = Σ X₁ X₂ᵀ`` over all members (d × d); norm weights that move with a permutation add
``tr(Pᵀ D)``, ``D = Σ γ₁ γ₂ᵀ``.

* any orthogonal ``Q`` (RMSNorm, norms folded): Procrustes of ``C``;
* orthogonal ``Q`` with ``Q·1 = ±1`` (LayerNorm, norms folded: the map commutes with mean-centring
  and the RMS): ``Q = s·uuᵀ + B R Bᵀ`` with ``u = 1/√d``, ``B`` an orthonormal basis of the complement
  of ``1``, ``R`` = Procrustes of ``BᵀCB`` and ``s = sign(uᵀCu)``;
* a permutation (LayerNorm with its own γ, β): linear assignment on ``C + D``;
* a signed permutation (RMSNorm whose norm cannot be folded): assignment on ``|C| + D``, each sign
  that of ``C[π(j), j]``.
"""

from __future__ import annotations

import math

import torch

from .assignment import match_permutation
from .procrustes import procrustes


def orthogonal_residual(C: torch.Tensor) -> torch.Tensor:
    """Orthogonal ``Q`` (d × d) maximising ``tr(Qᵀ C)``."""
    return procrustes(C.to(torch.float64)[None])[0][0]


def complement_basis(d: int) -> torch.Tensor:
    """An orthonormal basis (d × (d−1)) of the complement of the all-ones vector (a Householder
    reflection that maps ``e₁`` to ``1/√d``; its other columns)."""
    v = torch.full((d,), 1 / math.sqrt(d), dtype=torch.float64)
    v[0] -= 1.0
    H = torch.eye(d, dtype=torch.float64) - 2 * torch.outer(v, v) / v.dot(v)
    return H[:, 1:]


def centered_residual(C: torch.Tensor) -> torch.Tensor:
    """Orthogonal ``Q`` with ``Q·1 = ±1`` maximising ``tr(Qᵀ C)``."""
    C = C.to(torch.float64)
    d = C.shape[0]
    B = complement_basis(d)
    u = torch.full((d, 1), 1 / math.sqrt(d), dtype=torch.float64)
    s = 1.0 if (u.T @ C @ u).item() >= 0 else -1.0
    R = orthogonal_residual(B.T @ C @ B)
    return s * (u @ u.T) + B @ R @ B.T


def signed_permutation_residual(C: torch.Tensor, D: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(perm, signs)`` maximising ``Σ_j signs[j] C[perm[j], j] + D[perm[j], j]``."""
    C = C.to(torch.float64)
    perm = match_permutation(C.abs() + (0 if D is None else D.to(torch.float64)), consume=True)
    signs = torch.where(C[perm, torch.arange(C.shape[0])] < 0, -1.0, 1.0).to(torch.float64)
    return perm, signs


def permutation_residual(C: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """``perm`` maximising ``Σ_j (C + D)[perm[j], j]``."""
    return match_permutation(C.to(torch.float64) + (0 if D is None else D.to(torch.float64)), consume=True)
