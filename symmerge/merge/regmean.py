"""RegMean (Jin et al., 2023): per linear layer, the weight whose outputs best match every model's.

For a layer y = x Wᵀ with input Gram matrices G_i = X_iᵀ X_i (gathered on the *aligned* models),
W* = argmin_W Σ_i w_i ‖X_i Wᵀ − X_i W_iᵀ‖², i.e. (Σ_i w_i G̃_i) W*ᵀ = Σ_i w_i G̃_i W_iᵀ, solved with
``torch.linalg.solve`` in float64 (least squares ``lstsq`` only if the sum is singular). The
non-diagonal reduction G̃ = α G + (1 − α) diag(G) interpolates between the exact solution (α = 1)
and a per-input-column weighted average (α = 0). Biases and all non-linear parameters (embeddings,
LayerNorms, convolutions) are averaged with the weights. ``stats[i]`` maps the weight name of each
``nn.Linear`` (``<module>.weight``, out × in) to G_i (in × in), see :func:`symmerge.stats.gram_stats`.
"""

from __future__ import annotations

import torch

from ..errors import SymmergeError
from .common import check_state_dicts, normalized_weights, weighted_sum

NAME = "regmean"
NEEDS = "gram"
PARAMS = {"alpha": 0.9}


def reduce(gram: torch.Tensor, alpha: float) -> torch.Tensor:
    """α G + (1 − α) diag(G)."""
    if alpha == 1.0:
        return gram
    return alpha * gram + (1.0 - alpha) * torch.diag_embed(torch.diagonal(gram))


def solve_layer(weights_in_out, grams, w, alpha: float) -> torch.Tensor:
    """W*ᵀ (in × out) from the models' Wᵀ (in × out) and their Grams (in × in)."""
    lhs = weighted_sum([reduce(g.double(), alpha) for g in grams], w)
    rhs = weighted_sum([reduce(g.double(), alpha) @ wt.double() for g, wt in zip(grams, weights_in_out)], w)
    sol, info = torch.linalg.solve_ex(lhs, rhs)
    if info.item() != 0 or not torch.isfinite(sol).all():
        sol = torch.linalg.lstsq(lhs, rhs, driver="gelsd" if lhs.device.type == "cpu" else None).solution
    return sol


def merge(state_dicts, weights=None, stats=None, alpha: float = 0.9) -> dict:
    keys = check_state_dicts(state_dicts)
    if stats is None or len(stats) != len(state_dicts):
        raise SymmergeError("regmean needs the Gram matrices of every model (gather them with data: --data)")
    alpha = float(alpha)
    if not 0.0 <= alpha <= 1.0:
        raise SymmergeError(f"regmean: alpha must be in [0, 1], got {alpha}")
    w = normalized_weights(weights, len(state_dicts))
    out = {}
    for k in keys:
        first = state_dicts[0][k]
        if not first.is_floating_point():
            out[k] = first.clone()
            continue
        if first.dim() == 2 and all(k in s for s in stats):
            grams = [s[k].to(first.device) for s in stats]
            if any(g.shape != (first.shape[1], first.shape[1]) for g in grams):
                raise SymmergeError(f"regmean: Gram of {k} is {tuple(grams[0].shape)}, weight is {tuple(first.shape)}")
            out[k] = solve_layer([sd[k].T for sd in state_dicts], grams, w, alpha).T.contiguous().to(first.dtype)
            continue
        out[k] = weighted_sum([sd[k] for sd in state_dicts], w).to(first.dtype)
    return out
