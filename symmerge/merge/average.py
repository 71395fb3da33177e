"""Weighted average of any number of models: θ = Σ_i w_i θ_i with Σ w_i = 1 (uniform by default)."""

from __future__ import annotations

from .base import Method, weighted_sum


def tensor(key, tensors, weights, stats, base, params, context):
    return weighted_sum(tensors, weights)


METHOD = Method("average", tensor, doc=__doc__, elementwise=True)
merge = METHOD.merge
