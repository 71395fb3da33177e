"""Rules that are linear combinations of their inputs with coefficients from the inputs' Gram matrix.

On the flattened tensor the spherical rules (:mod:`symmerge.merge.spherical`) and Model Stock
(:mod:`symmerge.merge.specialized`) are Σ c_i x_i over their inputs (the models, and the base with the
coefficient 1 − Σ c_i when the rule works on task vectors), the c_i a function of the inputs' Gram matrix. Each
runs as an elementwise method: the Gram matrix taken chunk by chunk (its ``tensor_context``, float64), then
the weighted sum of the inputs chunk by chunk (:func:`symmerge.merge.base.weighted_sum`), or in one fused pass
(:func:`symmerge.merge.kernels.average_into`, the same bits), never a whole-tensor float64 copy.
"""

from __future__ import annotations

import torch

from . import kernels
from .base import CHUNK, weighted_sum


def gram(tensors, base=None) -> torch.Tensor:
    """G_ij = Σ over the entries of x_i x_j with x_i = t_i − base (t_i without a base), float64, chunk by chunk."""
    flat = [t.reshape(-1) for t in tensors]
    b = None if base is None else base.reshape(-1)
    g = torch.zeros(len(flat), len(flat), dtype=torch.float64)
    for i in range(0, flat[0].numel(), CHUNK):
        x = torch.stack([f[i:i + CHUNK].double() for f in flat])
        if b is not None:
            x -= b[i:i + CHUNK].double()
        g += x @ x.T
    return g


def inputs(tensors, base) -> list:
    """The tensors a combination weighs: the models, then the base when there is one."""
    return list(tensors) if base is None else [*tensors, base]


def with_base(coefficients, base) -> list[float]:
    """Coefficients of task vectors as coefficients of ``[*models, base]`` (the base's: 1 − Σ c_i)."""
    c = [float(x) for x in coefficients]
    return c if base is None else [*c, 1.0 - sum(c)]


def linear_tensor(coefficients):
    """The tensor rule of a method whose ``tensor_context`` is ``coefficients``: Σ c_i x_i in float64 (the
    coefficients computed here, on the whole tensor, when called without them)."""
    def tensor(key, tensors, weights, stats, base, params, context):
        if context is None:
            context = coefficients(key, tensors, base, weights, params, None)
        return weighted_sum(inputs(tensors, base), context)

    return tensor


def linear_into(key, tensors, weights, base, params, context, out) -> bool:
    """Σ c_i x_i cast into ``out`` in one pass (:func:`symmerge.merge.kernels.average_into`; the chunks' bits)."""
    return context is not None and kernels.average_into(inputs(tensors, base), context, out)
