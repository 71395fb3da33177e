"""Orthogonal Procrustes, batched: the orthogonal R maximising tr(Rᵀ M) is U Vᵀ (M = U Σ Vᵀ)."""

import torch


def procrustes(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(R, nuclear_norm)`` for a batch of square matrices ``M`` (..., d, d) in one SVD."""
    U, S, Vh = torch.linalg.svd(M)
    return U @ Vh, S.sum(-1)
