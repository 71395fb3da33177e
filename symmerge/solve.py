"""Find the group element that moves model A closest (L2) to anchor B, for every group instance.

Head groups of the same kind are batched across all layers (one GEMM per cost matrix, one batched
SVD per group kind); FFN assignments run on a thread pool (scipy releases the GIL).
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .apply import HeadElement, PermElement, to_blocks
from .errors import SymmergeError
from .resolve import Instance
from .solvers import joint_scale, procrustes, scale_for_rotation, sequential_scale, solve_assignments
from .spec import HEAD_ORTHOGONAL

RESCALE_MODES = ("joint", "sequential", "none")


def head_costs(inst: Instance, sd_a: dict, sd_b: dict):
    """Per-head ``Mp, Mm`` (H, d, d) and squared norms ``n1p, n1m, n2p, n2m`` (H,)."""
    H, d = inst.blocks, inst.size
    M = {1: torch.zeros(H, d, d, dtype=torch.float64), -1: torch.zeros(H, d, d, dtype=torch.float64)}
    n1 = {1: torch.zeros(H, dtype=torch.float64), -1: torch.zeros(H, dtype=torch.float64)}
    n2 = {1: torch.zeros(H, dtype=torch.float64), -1: torch.zeros(H, dtype=torch.float64)}
    for p in (1, -1):
        slots = [s for s in inst.slots if s.power == p]
        if not slots:
            continue
        x1 = torch.cat([to_blocks(sd_a[s.key], s.axis, H) for s in slots], dim=2)
        x2 = torch.cat([to_blocks(sd_b[s.key], s.axis, H) for s in slots], dim=2)
        M[p] = x1 @ x2.mT
        n1[p] = x1.square().sum((1, 2))
        n2[p] = x2.square().sum((1, 2))
    return M[1], M[-1], n1[1], n1[-1], n2[1], n2[-1]


def permutation_cost(inst: Instance, sd_a: dict, sd_b: dict) -> torch.Tensor:
    """C[i, j] = Σ_members ⟨unit i of A, unit j of B⟩, one GEMM over the stacked members.

    Computed in float64 for float64 models, else in float32: the assignment needs only the order
    of the costs, and float32 halves the GEMM time on large FFNs."""
    dtype = torch.float64 if any(sd_a[s.key].dtype == torch.float64 for s in inst.slots) else torch.float32
    x1 = torch.cat([to_blocks(sd_a[s.key], s.axis, 1)[0].to(dtype) for s in inst.slots], dim=1)
    x2 = torch.cat([to_blocks(sd_b[s.key], s.axis, 1)[0].to(dtype) for s in inst.slots], dim=1)
    return x1 @ x2.T


def solve_heads(Mp, Mm, n1p, n1m, n2p, n2m, rotate: bool, rescale: str):
    """(R, a) for a batch of heads under the chosen rotation/rescale options."""
    B, d = Mp.shape[0], Mp.shape[-1]
    if not rotate:
        R = torch.eye(d, dtype=torch.float64).expand(B, d, d).clone()
        a = scale_for_rotation(R, Mp, Mm, n1p, n1m) if rescale != "none" else torch.ones(B, dtype=torch.float64)
        return R, a
    if rescale == "none":
        return procrustes(Mp + Mm)[0], torch.ones(B, dtype=torch.float64)
    if rescale == "sequential":
        return sequential_scale(Mp, Mm, n1p, n1m)
    return joint_scale(Mp, Mm, n1p, n1m, n2p, n2m)


def solve(instances: list[Instance], sd_a: dict, sd_b: dict, symmetries, rescale: str = "joint",
          progress=None) -> dict:
    """Group elements ``{instance name: element}`` aligning ``sd_a`` to the anchor ``sd_b``."""
    if rescale not in RESCALE_MODES:
        raise SymmergeError(f"unknown rescale mode {rescale!r}; choose one of {', '.join(RESCALE_MODES)}")
    symmetries = set(symmetries)
    rotate = "attn" in symmetries
    scale_mode = rescale if "rescale" in symmetries else "none"
    elements: dict = {}
    by_group: dict[str, list[Instance]] = defaultdict(list)
    for inst in instances:
        by_group[inst.group.name].append(inst)
    for name, group_insts in by_group.items():
        kind = group_insts[0].group.kind
        if kind == HEAD_ORTHOGONAL:
            if not rotate and scale_mode == "none":
                continue
            parts = [head_costs(i, sd_a, sd_b) for i in group_insts]
            stacked = [torch.cat(x) for x in zip(*parts)]
            R, a = solve_heads(*stacked, rotate=rotate, rescale=scale_mode)
            for k, inst in enumerate(group_insts):
                sl = slice(k * inst.blocks, (k + 1) * inst.blocks)
                elements[inst.name] = HeadElement(R[sl], a[sl])
        else:
            if group_insts[0].group.symmetry not in symmetries:
                continue
            costs = (permutation_cost(i, sd_a, sd_b) for i in group_insts)
            for inst, perm in zip(group_insts, solve_assignments(costs)):
                elements[inst.name] = PermElement(perm)
        if progress is not None:
            progress(name)
    return elements
