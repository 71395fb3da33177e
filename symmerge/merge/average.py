"""Weighted average of any number of models: θ = Σ_i w_i θ_i with Σ w_i = 1 (uniform by default)."""

from __future__ import annotations

from . import kernels
from .base import Method, weighted_sum


def tensor(key, tensors, weights, stats, base, params, context):
    return weighted_sum(tensors, weights)


def fused_into(key, tensors, weights, base, params, context, out) -> bool:
    """The weighted sum and its cast in one pass (:func:`symmerge.merge.kernels.average_into`)."""
    return kernels.average_into(tensors, weights, out)


METHOD = Method("average", tensor, doc=__doc__, elementwise=True, fused_into=fused_into)
merge = METHOD.merge
