"""Generic solvers, one per group kind: orthogonal Procrustes, scalar rescale, linear assignment."""

from .assignment import match_permutation, solve_assignments
from .procrustes import procrustes
from .rescale import head_objective, joint_scale, scale_for_rotation, sequential_scale

__all__ = [
    "procrustes",
    "head_objective",
    "joint_scale",
    "scale_for_rotation",
    "sequential_scale",
    "match_permutation",
    "solve_assignments",
]
