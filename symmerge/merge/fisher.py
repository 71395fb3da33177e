"""Fisher merging (Matena & Raffel, 2022): θ = Σ_i w_i F_i ⊙ θ_i / Σ_i w_i F_i, element-wise.

``stats[i]`` maps parameter names to model i's diagonal Fisher (see :func:`symmerge.stats.fisher_stats`),
gathered on the aligned model. ``eps`` is added to every Fisher so entries no model is sensitive to
fall back to the weighted average. Tensors without a Fisher (buffers) are averaged.
"""

from __future__ import annotations

from .base import Method, weighted_sum


def tensor(key, tensors, weights, stats, base, params, context):
    if stats is None:  # no Fisher for this tensor (a buffer): weighted average
        return weighted_sum(tensors, weights)
    fishers = [f.double().to(tensors[0].device) + float(params["eps"]) for f in stats]
    num = weighted_sum([f * t.double() for f, t in zip(fishers, tensors)], weights)
    return num / weighted_sum(fishers, weights)


METHOD = Method("fisher", tensor, needs="fisher", params={"eps": 1e-8}, doc=__doc__)
merge = METHOD.merge
