"""RegMean (Jin et al., 2023): per linear layer, the weight whose outputs best match every model's.

For a layer y = x Wᵀ with input Gram matrices G_i = X_iᵀ X_i (gathered on the *aligned* models),
W* = argmin_W Σ_i w_i ‖X_i Wᵀ − X_i W_iᵀ‖², i.e. (Σ_i w_i G̃_i) W*ᵀ = Σ_i w_i G̃_i W_iᵀ, solved with
``torch.linalg.solve`` in float64 (least squares ``lstsq`` only if the sum is singular). The
non-diagonal reduction G̃ = α G + (1 − α) diag(G) interpolates between the exact solution (α = 1)
and a per-input-column weighted average (α = 0). Biases and all non-linear parameters (embeddings,
LayerNorms, convolutions) are averaged with the weights. ``stats[i]`` maps the weight name of each
``nn.Linear`` (``<module>.weight``, out × in) or ``Conv1D`` (in × out; its Gram an
:class:`~symmerge.merge.statistics.InOutGram`) to G_i (in × in), see
:func:`symmerge.merge.statistics.gram_stats`.
"""

from __future__ import annotations

import torch

from ..errors import SymmergeError
from .base import Method, weighted_sum
from .statistics import InOutGram


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


def prepare(state_dicts, base, weights, params):
    if not 0.0 <= float(params["alpha"]) <= 1.0:
        raise SymmergeError(f"regmean: alpha must be in [0, 1], got {params['alpha']}")


def tensor(key, tensors, weights, stats, base, params, context):
    first = tensors[0]
    if first.dim() != 2 or stats is None:  # biases, embeddings, norms, …: weighted average
        return weighted_sum(tensors, weights)
    in_out = isinstance(stats[0], InOutGram)  # a Conv1D weight (in × out): no transpose
    grams = [g.as_subclass(torch.Tensor).to(first.device) for g in stats]
    n_in = first.shape[0] if in_out else first.shape[1]
    if any(g.shape != (n_in, n_in) for g in grams):
        raise SymmergeError(f"regmean: Gram of {key} is {tuple(grams[0].shape)}, weight is {tuple(first.shape)}")
    if in_out:
        return solve_layer(list(tensors), grams, weights, float(params["alpha"]))
    return solve_layer([t.T for t in tensors], grams, weights, float(params["alpha"])).T.contiguous()


METHOD = Method("regmean", tensor, needs="gram", params={"alpha": 0.9}, doc=__doc__, prepare=prepare)
merge = METHOD.merge
