"""Residual stream of a pre-RMSNorm decoder: one transform ``Q`` of the hidden dims, model-wide.

Every member (embeddings, reader columns, writer rows and biases, LM head) moves as ``X → Qᵀ X``
with the hidden index first, so the distance to the anchor is ``const − 2 tr(Qᵀ C)`` with
``C = Σ X₁ X₂ᵀ`` over all members (d × d).

* norms folded (or uniform): any orthogonal ``Q``; the best is Procrustes of ``C``.
* a norm that cannot be folded (final norm of a model with tied embeddings) and is not uniform
  survives only signed permutations (``γ`` is permuted with the stream): ``Q[π(j), j] = s_j``; the
  best is a linear assignment on ``|C| + D`` (``D = Σ γ₁ γ₂ᵀ`` over the norm weights), ``s_j`` the
  sign of ``C[π(j), j]``.
* LayerNorm models: only permutations (LayerNorm commutes with them, ``γ`` and ``β`` permuted with the
  stream); the best is a linear assignment on ``C + D``.
"""

from __future__ import annotations

import torch

from .assignment import match_permutation
from .procrustes import procrustes


def orthogonal_residual(C: torch.Tensor) -> torch.Tensor:
    """Orthogonal ``Q`` (d × d) maximising ``tr(Qᵀ C)``."""
    return procrustes(C.to(torch.float64)[None])[0][0]


def signed_permutation_residual(C: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """Signed permutation ``Q`` (d × d) maximising ``tr(Qᵀ C) + tr(Pᵀ D)`` (P: Q's pattern)."""
    C = C.to(torch.float64)
    perm = match_permutation(C.abs() + (0 if D is None else D.to(torch.float64)), consume=True)
    cols = torch.arange(C.shape[0])
    signs = torch.where(C[perm, cols] < 0, -1.0, 1.0).to(torch.float64)
    Q = torch.zeros_like(C)
    Q[perm, cols] = signs
    return Q


def permutation_residual(C: torch.Tensor, D: torch.Tensor | None = None) -> torch.Tensor:
    """Permutation matrix ``Q`` (d × d) maximising ``tr(Qᵀ (C + D))``."""
    C = C.to(torch.float64)
    perm = match_permutation(C + (0 if D is None else D.to(torch.float64)), consume=True)
    Q = torch.zeros_like(C)
    Q[perm, torch.arange(C.shape[0])] = 1.0
    return Q
