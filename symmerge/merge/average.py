"""Weighted average of any number of models: θ = Σ_i w_i θ_i with Σ w_i = 1 (uniform by default)."""

from __future__ import annotations

import torch

from . import kernels
from .base import Method, boolean, weighted_sum
from .in_dtype import HALF


def tensor(key, tensors, weights, stats, base, params, context):
    return weighted_sum(tensors, weights)


def fused_into(key, tensors, weights, base, params, context, out) -> bool:
    """The weighted sum and its cast in one pass (:func:`symmerge.merge.kernels.average_into`)."""
    return kernels.average_into(tensors, weights, out)


METHOD = Method("average", tensor, doc=__doc__, elementwise=True, fused_into=fused_into)
merge = METHOD.merge


def linear_tensor(key, tensors, weights, stats, base, params, context):
    """``linear``: the weights as given, divided by their sum when ``normalize``; float32, float16 and bfloat16
    inputs as mergekit computes them (:func:`linear_in_float32`), float64 ones exactly (``average``'s rule)."""
    from .base import normalized_weights

    normalize = bool(params["normalize"])
    w = normalized_weights(weights, len(tensors), normalize, signed=True)  # checks them
    if tensors[0].dtype in FLOAT32_ORDER:
        return linear_in_float32(tensors, [1.0] * len(tensors) if weights is None else weights, normalize)
    return weighted_sum(tensors, w)


FLOAT32_ORDER = (*HALF, torch.float32)  # the dtypes mergekit's linear computes in float32


def linear_in_float32(tensors, weights, normalize: bool) -> torch.Tensor:
    """Σ w_i t_i (/ Σ w_i with ``normalize``) of float32/float16/bfloat16 tensors as mergekit 0.1.5 computes it: the
    weights in float32, each product added in model order to a float32 accumulator by ``torch.addcmul_`` (its
    fused multiply-add is part of the rounding), the sum divided by the weights' float32 sum, rounded once to the
    inputs' dtype. Where weights do not sum to 1 many entries lie at a rounding tie of the half dtype, and the
    float64 form (one rounding of the exact value) rounds 1–3 % of them the other way (2026-12-03); in float32 it
    was 5e-7 of the change off mergekit's result, now its bits."""
    w = torch.tensor([[float(x) for x in weights]], dtype=torch.float32, device=tensors[0].device)
    acc = torch.zeros(tensors[0].shape, dtype=torch.float32, device=tensors[0].device)
    for t, c in zip(tensors, w.unbind(1)):
        acc.addcmul_(t, c)
    if normalize:
        acc.div_(w.sum(dim=1))
    return acc.to(tensors[0].dtype)


def linear_weights(weights, params) -> None:
    """``linear``'s weights under its parameters: finite, and with ``normalize`` a sum that is not 0."""
    from .base import normalized_weights

    if weights is not None:
        normalized_weights(weights, len(weights), bool(params["normalize"]), signed=True)


def linear_fused_into(key, tensors, weights, base, params, context, out) -> bool:
    from .base import normalized_weights

    if tensors[0].dtype in FLOAT32_ORDER:  # the chunks run mergekit's float32 order (linear_tensor)
        return False
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
