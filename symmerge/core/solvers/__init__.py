"""Closed-form solvers (pure mathematics on tensors): orthogonal Procrustes, scalar rescale, linear
assignment, RoPE frequency pairs, the residual stream's groups. The group kinds (symmerge.groups)
build their costs and call these. Also the optimal transport plans (POT) of OT fusion (symmerge.merge.ot)."""

from .assignment import match_permutation
from .procrustes import procrustes
from .rescale import head_objective, joint_scale, quartic_scale, scale_for_rotation, sequential_scale
from .residual import (centered_residual, complement_basis, orthogonal_residual, permutation_residual,
                       signed_permutation_residual)
from .rope import pair_products, rope_element, solve_pairs
from .transport import as_permutation, column_map, ground_cost, transport_plan

__all__ = [
    "procrustes",
    "head_objective",
    "joint_scale",
    "scale_for_rotation",
    "sequential_scale",
    "quartic_scale",
    "pair_products",
    "rope_element",
    "solve_pairs",
    "orthogonal_residual",
    "centered_residual",
    "complement_basis",
    "permutation_residual",
    "signed_permutation_residual",
    "match_permutation",
    "ground_cost",
    "transport_plan",
    "column_map",
    "as_permutation",
]
