"""Weighted average of any number of models: θ = Σ_i w_i θ_i with Σ w_i = 1 (uniform by default)."""

from __future__ import annotations

from . import kernels
from .base import Method, boolean, weighted_sum


def tensor(key, tensors, weights, stats, base, params, context):
    return weighted_sum(tensors, weights)


def fused_into(key, tensors, weights, base, params, context, out) -> bool:
    """The weighted sum and its cast in one pass (:func:`symmerge.merge.kernels.average_into`)."""
    return kernels.average_into(tensors, weights, out)


METHOD = Method("average", tensor, doc=__doc__, elementwise=True, fused_into=fused_into)
merge = METHOD.merge


def linear_tensor(key, tensors, weights, stats, base, params, context):
    """``linear``: the weights as given, divided by their sum when ``normalize`` (then the same bits as
    ``average``)."""
    from .base import normalized_weights

    return weighted_sum(tensors, normalized_weights(weights, len(tensors), bool(params["normalize"]), signed=True))


def linear_weights(weights, params) -> None:
    """``linear``'s weights under its parameters: finite, and with ``normalize`` a sum that is not 0."""
    from .base import normalized_weights

    if weights is not None:
        normalized_weights(weights, len(weights), bool(params["normalize"]), signed=True)


def linear_fused_into(key, tensors, weights, base, params, context, out) -> bool:
    from .base import normalized_weights

    weights = normalized_weights(weights, len(tensors), bool(params["normalize"]), signed=True)
    return kernels.average_into(tensors, weights, out)


# mergekit's name: ``average`` with ``normalize`` (true: Σ w_i θ_i / Σ w_i; false: Σ w_i θ_i). Weights of any sign,
# as mergekit takes them (a negative one extrapolates: ExPO-style configs), their sum not 0 with normalize (mergekit
# writes NaN there); ``average``, symmerge's own name, keeps them non-negative.
LINEAR = Method("linear", linear_tensor, params={"normalize": True}, ignores_base=True, weight_required=True,
                doc="Weighted average of any number of models "
                "(mergekit's linear): θ = Σ_i w_i θ_i / Σ_i w_i, or Σ_i w_i θ_i with normalize false.",
                normalize_weights=False, elementwise=True, fused_into=linear_fused_into,
                checks={"normalize": boolean()}, check_weights=linear_weights)
