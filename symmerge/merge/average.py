"""Weighted average of any number of models: θ = Σ_i w_i θ_i with Σ w_i = 1 (uniform by default)."""

from __future__ import annotations

from .common import check_state_dicts, normalized_weights, weighted_sum

NAME = "average"
NEEDS = None
PARAMS: dict = {}


def merge(state_dicts, weights=None, stats=None, **params) -> dict:
    keys = check_state_dicts(state_dicts)
    w = normalized_weights(weights, len(state_dicts))
    out = {}
    for k in keys:
        first = state_dicts[0][k]
        if not first.is_floating_point():
            out[k] = first.clone()  # integer buffers (ids): taken from the first model
            continue
        out[k] = weighted_sum([sd[k] for sd in state_dicts], w).to(first.dtype)
    return out
