"""Fisher merging (Matena & Raffel, 2022): θ = Σ_i w_i F_i ⊙ θ_i / Σ_i w_i F_i, element-wise.

``stats[i]`` maps parameter names to model i's diagonal Fisher (see :func:`symmerge.stats.fisher_stats`),
gathered on the aligned model. ``eps`` is added to every Fisher so entries no model is sensitive to
fall back to the weighted average. Tensors without a Fisher (buffers) are averaged.
"""

from __future__ import annotations

from ..errors import SymmergeError
from .common import check_state_dicts, normalized_weights, weighted_sum

NAME = "fisher"
NEEDS = "fisher"
PARAMS = {"eps": 1e-8}


def merge(state_dicts, weights=None, stats=None, eps: float = 1e-8) -> dict:
    keys = check_state_dicts(state_dicts)
    if stats is None or len(stats) != len(state_dicts):
        raise SymmergeError("fisher merging needs one Fisher per model (gather them with data: --data)")
    w = normalized_weights(weights, len(state_dicts))
    out = {}
    for k in keys:
        first = state_dicts[0][k]
        if not first.is_floating_point():
            out[k] = first.clone()
            continue
        if any(k not in s for s in stats):
            out[k] = weighted_sum([sd[k] for sd in state_dicts], w).to(first.dtype)
            continue
        fishers = [s[k].double().to(first.device) + float(eps) for s in stats]
        num = weighted_sum([f * sd[k].double() for f, sd in zip(fishers, state_dicts)], w)
        den = weighted_sum(fishers, w)
        out[k] = (num / den).to(first.dtype)
    return out
