"""Generic solvers, one per group kind: orthogonal Procrustes, scalar rescale, linear assignment,
RoPE frequency pairs (closed form per pair), residual stream (Procrustes / signed permutation)."""

from .assignment import match_permutation, solve_assignments
from .procrustes import procrustes
from .rescale import head_objective, joint_scale, quartic_scale, scale_for_rotation, sequential_scale
from .residual import orthogonal_residual, signed_permutation_residual
from .rope import pair_products, rope_element, solve_pairs

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
    "signed_permutation_residual",
    "match_permutation",
    "solve_assignments",
]
