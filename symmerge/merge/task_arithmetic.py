"""Task arithmetic: θ = θ_base + λ Σ_i w_i (θ_i − θ_base) (weights default to 1 each, not normalised)."""

from __future__ import annotations

from .common import check_state_dicts, normalized_weights, require_base, task_vectors, weighted_sum

NAME = "task_arithmetic"
NEEDS = None
NEEDS_BASE = True
PARAMS = {"scale": 1.0}


def merge(state_dicts, weights=None, stats=None, base=None, scale: float = 1.0) -> dict:
    keys = check_state_dicts(state_dicts)
    base = require_base(base, state_dicts, NAME)
    w = normalized_weights(weights, len(state_dicts), normalize=False)
    out = {}
    for k in keys:
        if not base[k].is_floating_point():
            out[k] = base[k].clone()
            continue
        delta = weighted_sum(task_vectors(state_dicts, base, k), w)
        out[k] = (base[k].double() + float(scale) * delta).to(base[k].dtype)
    return out
