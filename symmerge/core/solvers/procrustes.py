"""Orthogonal Procrustes, batched: the orthogonal R maximising tr(Rᵀ M) is U Vᵀ (M = U Σ Vᵀ)."""

import torch

from ...errors import SymmergeError

# the one line of a cost the weights overflowed (finite inputs near float32's range: their products are Inf)
OVERFLOW = ("the alignment's cost overflowed float32 (products of the two models' weights reached Inf or NaN): an "
            "input holds values too large for it (look for values of 1e19 or more in the checkpoints), or leave out "
            "the alignment (--align none, --symmetries none)")


def finite_cost(*costs: torch.Tensor) -> None:
    """One error (:data:`OVERFLOW`) when a solver's cost holds Inf or NaN: the SVD, the eigendecomposition or the
    assignment of it fails in the library's own words (an MKL message, a LinAlgError, scipy's ValueError)."""
    # one float64 sum per cost (no temporary as large as the cost; a float32 cost's sum cannot overflow float64):
    # finite exactly when every entry is
    if not all(bool(torch.isfinite(c.sum(dtype=torch.float64))) for c in costs):
        raise SymmergeError(OVERFLOW)


def procrustes(M: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Return ``(R, nuclear_norm)`` for a batch of square matrices ``M`` (..., d, d) in one SVD."""
    finite_cost(M)
    U, S, Vh = torch.linalg.svd(M)
    return U @ Vh, S.sum(-1)
