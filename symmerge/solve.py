"""Find the group element that moves model A closest (L2) to anchor B, for every group instance.

Head groups of the same kind are batched across all layers (one GEMM per cost matrix, one batched
SVD per group kind); FFN assignments run on a thread pool (scipy releases the GIL). The model-wide
residual group couples with all the others (it acts on the other axis of the same tensors; the two
commute): they are solved by coordinate descent, each step exact for its group given the rest.
"""

from __future__ import annotations

from collections import defaultdict

import torch

from .apply import HeadElement, PermElement, apply, segment, slot_blocks
from .errors import SymmergeError
from .resolve import Instance
from .solvers import joint_scale, procrustes, scale_for_rotation, sequential_scale, solve_assignments
from .solvers.rescale import quartic_scale
from .solvers.residual import orthogonal_residual, permutation_residual, signed_permutation_residual
from .solvers.rope import pair_products, rope_element, solve_pairs
from .spec import HEAD_ORTHOGONAL, PERMUTATION, RESIDUAL, ROPE_PAIRS

RESCALE_MODES = ("joint", "sequential", "none")


def stacked_blocks(inst: Instance, sd: dict, power: int) -> torch.Tensor | None:
    """All slots of one scale power as (H, d, n), or None if there are none. float64, except for
    16-bit checkpoints (float32: half the memory of a large layer's head blocks; the products and
    norms computed from them are handed to the solvers in float64)."""
    slots = [s for s in inst.slots if s.power == power]
    if not slots:
        return None
    half = all(sd[s.key].dtype in (torch.float16, torch.bfloat16) for s in inst.slots)
    dtype = torch.float32 if half else torch.float64
    return torch.cat([slot_blocks(sd[s.key], s, inst.blocks, dtype) for s in slots], dim=2)


def head_costs(inst: Instance, sd_a: dict, sd_b: dict, rows: slice = slice(None)):
    """Per-head ``Mp, Mm`` (H, d, d) and squared norms ``n1p, n1m, n2p, n2m`` (H,) (optionally of a
    subset of each head's ``rows``)."""
    H, d = inst.blocks, len(range(inst.size)[rows])
    M = {1: torch.zeros(H, d, d, dtype=torch.float64), -1: torch.zeros(H, d, d, dtype=torch.float64)}
    n1 = {1: torch.zeros(H, dtype=torch.float64), -1: torch.zeros(H, dtype=torch.float64)}
    n2 = {1: torch.zeros(H, dtype=torch.float64), -1: torch.zeros(H, dtype=torch.float64)}
    for p in (1, -1):
        x1 = stacked_blocks(inst, sd_a, p)
        if x1 is None:
            continue
        x1, x2 = x1[:, rows], stacked_blocks(inst, sd_b, p)[:, rows]
        M[p] = (x1 @ x2.mT).double()
        n1[p] = x1.square().sum((1, 2), dtype=torch.float64)
        n2[p] = x2.square().sum((1, 2), dtype=torch.float64)
    return M[1], M[-1], n1[1], n1[-1], n2[1], n2[-1]


def _unit_matrix(t: torch.Tensor, slot, dtype) -> torch.Tensor:
    """The slot's units as rows (n, rest), converted to ``dtype`` (None: as stored, a view if it can)."""
    x = segment(t, slot)
    x = x.reshape(x.shape[0], -1)
    return x if dtype is None else x.to(dtype)


def _work_dtype(tensors) -> torch.dtype:
    """float64 if any tensor is float64, else float32 (16-bit checkpoints are computed in float32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _row_chunks(n: int, width: int, budget: int = 1 << 24):
    """Row slices of an (n, width) matrix holding about ``budget`` elements each."""
    step = max(256, budget // max(width, 1))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def permutation_cost(inst: Instance, sd_a: dict, sd_b: dict, signed: bool = False, device=None) -> torch.Tensor:
    """C[i, j] = Σ_members ⟨unit i of A, unit j of B⟩ (n × n, float64, CPU), built block by block
    with one GEMM per block and member.

    ``signed`` (units that may also flip sign, SwiGLU under ``rescale``): the members that the unit
    scale acts on count with the better sign, ``C₀ + |C_±|`` (the cost at the best ``s = ±1``).
    The GEMMs run in float64 for float64 members, else in float32 (the assignment needs only the order
    of the costs; float32 halves the GEMM time on large FFNs), on ``device`` (e.g. ``cuda``). Members
    are converted a block of units at a time and each product is accumulated straight into the
    float64 result, which the assignment consumes: besides the result, memory holds one member of
    each model as stored and a few ~30 MB blocks. Each member is read from ``sd_a``/``sd_b`` once
    (they may be on-demand mappings)."""
    n = inst.size
    C = torch.zeros(n, n, dtype=torch.float64)
    parts = [[s for s in inst.slots if signed and s.power], [s for s in inst.slots if not (signed and s.power)]]
    for k, slots in enumerate(parts):  # the signed members first: |C_±| is taken before C₀ is added
        for s in slots:
            ua, ub = _unit_matrix(sd_a[s.key], s, None), _unit_matrix(sd_b[s.key], s, None)
            work = _work_dtype([ua])
            blocks = _row_chunks(n, ua.shape[1], 1 << 22)
            for cols in blocks:
                x2t = ub[cols].to(device=device, dtype=work).T
                for rows in blocks:
                    C[rows, cols] += (ua[rows].to(device=device, dtype=work) @ x2t).cpu()
                del x2t
            del ua, ub
        if k == 0 and slots:
            C.abs_()
    return C


def permutation_plan(group, symmetries, scale_mode: str) -> tuple[bool, bool, bool]:
    """(permute, scaled, signed) for a permutation group: whether its units are matched, whether
    they also get a unit scale (SwiGLU under ``rescale``), and whether that scale may flip signs."""
    permute = group.symmetry in symmetries
    scaled = group.unit_scale is not None and scale_mode != "none"
    return permute, scaled, scaled and group.unit_scale == "nonzero"


def unit_scales(inst: Instance, sd_a: dict, sd_b: dict, perm: torch.Tensor) -> torch.Tensor:
    """Per unit after ``perm``, the scale ``s ≠ 0`` (``s**power`` on each member) closest to B
    (float64 sums, a block of units at a time)."""
    n = len(perm)
    sums = {k: torch.zeros(n, dtype=torch.float64) for k in ("p", "m", "cp", "cm")}
    for s in inst.slots:
        if not s.power:
            continue
        ua, ub = _unit_matrix(sd_a[s.key], s, None), _unit_matrix(sd_b[s.key], s, None)
        side = "p" if s.power > 0 else "m"
        for rows in _row_chunks(n, ua.shape[1], 1 << 22):
            x1, x2 = ua[perm[rows]].to(torch.float64), ub[rows].to(torch.float64)
            sums[side][rows] += x1.square().sum(1)
            sums["c" + side][rows] += (x1 * x2).sum(1)
    return quartic_scale(sums["cp"], sums["cm"], sums["p"], sums["m"], signed=inst.group.unit_scale == "nonzero")


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


def solve_rope(insts: list[Instance], sd_a: dict, sd_b: dict, rotate: bool, rescale: str) -> list[HeadElement]:
    """RoPE QK groups of many layers at once: per pair in closed form, non-rotated dims as heads."""
    r, d = insts[0].rotary, insts[0].size
    normed = bool(insts[0].group.pair_norms)  # per-head norms: no scale, locked pairs only flip sign
    if normed:
        rescale = "none"
    products = []
    for inst in insts:
        x1p, x2p = stacked_blocks(inst, sd_a, 1), stacked_blocks(inst, sd_b, 1)
        x1m, x2m = stacked_blocks(inst, sd_a, -1), stacked_blocks(inst, sd_b, -1)
        products.append(pair_products(x1p, x2p, r) + pair_products(x1m, x2m, r))
    cp, P, cm, M = (torch.cat(x) for x in zip(*products))
    theta, rho = solve_pairs(cp, cm, P, M, rotate, rescale)
    if normed:
        H = insts[0].blocks
        locked = torch.zeros(theta.shape, dtype=torch.bool)
        for k, inst in enumerate(insts):
            locked[k * H:(k + 1) * H, list(inst.locked)] = True
        flip = ((cp + cm).real < 0).to(theta.dtype) * torch.pi  # best of θ ∈ {0, π} (π in float64)
        theta = torch.where(locked, flip, theta)
    R_pass, a_pass = None, None
    if r < d:  # partial rotary: the non-rotated dims keep the full orthogonal group + scale
        parts = [head_costs(i, sd_a, sd_b, slice(r, None)) for i in insts]
        R_pass, a_pass = solve_heads(*(torch.cat(x) for x in zip(*parts)), rotate=rotate, rescale=rescale)
    R, a = rope_element(theta, rho, R_pass, a_pass, d)
    H = insts[0].blocks
    return [HeadElement(R[k * H:(k + 1) * H], a[k * H:(k + 1) * H]) for k in range(len(insts))]


def residual_cost(inst: Instance, sd_a: dict, sd_b: dict, keys=None):
    """``C = Σ X₁ X₂ᵀ`` (d × d) over the stream members (optionally only ``keys``) and ``D = Σ γ₁ γ₂ᵀ``
    over the norm weights; float32 for non-float64 models (only the optimum's direction matters)."""
    dtype = _work_dtype([sd_a[s.key] for s in inst.slots])
    C = torch.zeros(inst.size, inst.size, dtype=dtype)
    D = torch.zeros(inst.size, inst.size, dtype=torch.float64)
    for s in inst.slots:
        if keys is not None and s.key not in keys:
            continue
        x1, x2 = _unit_matrix(sd_a[s.key], s, dtype), _unit_matrix(sd_b[s.key], s, dtype)
        if s.diag:
            D += x1.double() @ x2.double().T
        else:
            C += x1 @ x2.T
    return C.double(), D


def solve_residual(inst: Instance, sd_a: dict, sd_b: dict, keys=None) -> HeadElement:
    C, D = residual_cost(inst, sd_a, sd_b, keys)
    if inst.variant == "signed_permutation":
        Q = signed_permutation_residual(C, D)
    elif inst.variant == "permutation":
        Q = permutation_residual(C, D)
    else:
        Q = orthogonal_residual(C)
    return HeadElement(Q[None], torch.ones(1, dtype=torch.float64))


def solve_local(instances: list[Instance], sd_a: dict, sd_b: dict, symmetries, scale_mode: str,
                progress=None) -> dict:
    """Elements of the per-layer groups (attention heads, RoPE pairs, FFN units)."""
    rotate = "attn" in symmetries
    elements: dict = {}
    by_group: dict[str, list[Instance]] = defaultdict(list)
    for inst in instances:
        by_group[inst.group.name].append(inst)
    for name, group_insts in by_group.items():
        group = group_insts[0].group
        if group.kind in (HEAD_ORTHOGONAL, ROPE_PAIRS):
            if not rotate and (scale_mode == "none" or group.pair_norms):
                continue
            if group.kind == ROPE_PAIRS:
                elements.update(zip([i.name for i in group_insts],
                                    solve_rope(group_insts, sd_a, sd_b, rotate, scale_mode)))
            else:
                parts = [head_costs(i, sd_a, sd_b) for i in group_insts]
                stacked = [torch.cat(x) for x in zip(*parts)]
                R, a = solve_heads(*stacked, rotate=rotate, rescale=scale_mode)
                for k, inst in enumerate(group_insts):
                    sl = slice(k * inst.blocks, (k + 1) * inst.blocks)
                    elements[inst.name] = HeadElement(R[sl], a[sl])
        elif group.kind == PERMUTATION:
            permute, scaled, signed = permutation_plan(group, symmetries, scale_mode)
            if not permute and not scaled:
                continue
            if permute:
                costs = (permutation_cost(i, sd_a, sd_b, signed) for i in group_insts)
                perms = solve_assignments(costs, consume=True)  # fresh costs, negated in place
            else:
                perms = [torch.arange(i.size) for i in group_insts]
            for inst, perm in zip(group_insts, perms):
                elements[inst.name] = PermElement(perm, unit_scales(inst, sd_a, sd_b, perm) if scaled else None)
        if progress is not None:
            progress(name)
    return elements


def _sq_distance(sd_a: dict, sd_b: dict, keys) -> float:
    """Squared L2 distance, accumulated in the tensors' own precision (a stopping rule needs no more)."""
    total = 0.0
    for k in keys:
        d = (sd_a[k] - sd_b[k]).reshape(-1)
        total += torch.dot(d, d).item() if d.is_floating_point() and d.dtype in (torch.float32, torch.float64) \
            else d.double().square().sum().item()
    return total


def solve(instances: list[Instance], sd_a: dict, sd_b: dict, symmetries, rescale: str = "joint",
          progress=None, sweeps: int = 3, history: list | None = None) -> dict:
    """Group elements ``{instance name: element}`` aligning ``sd_a`` to the anchor ``sd_b``.

    With ``residual`` in ``symmetries`` both state dicts must have their norms folded
    (:func:`symmerge.apply.fold_norms`); the residual and per-layer groups are then solved by up to
    ``sweeps`` rounds of coordinate descent (the first residual step uses only the tensors no other
    group touches: embeddings, LM head, norms). The squared distance over the matched tensors after
    each sweep is appended to ``history``; the best sweep's elements are returned."""
    if rescale not in RESCALE_MODES:
        raise SymmergeError(f"unknown rescale mode {rescale!r}; choose one of {', '.join(RESCALE_MODES)}")
    symmetries = set(symmetries)
    scale_mode = rescale if "rescale" in symmetries else "none"
    local = [i for i in instances if i.group.kind != RESIDUAL]
    residual = [i for i in instances if i.group.kind == RESIDUAL]
    if "residual" not in symmetries:
        return solve_local(local, sd_a, sd_b, symmetries, scale_mode, progress)
    if not residual:
        raise SymmergeError("the residual symmetry needs a model whose outputs do not expose the residual stream "
                            "(a head reads it: e.g. LlamaForCausalLM, ViTForImageClassification) of a family "
                            "with a residual spec (llama, mistral, qwen2, vit); this model has no residual group")
    res = residual[0]
    local_keys = {s.key for i in local for s in i.slots}
    pure = {s.key for s in res.slots if s.key not in local_keys} or None
    matched = sorted(local_keys | {s.key for s in res.slots})
    elements: dict = {}
    best, best_value = {}, float("inf")
    for sweep in range(max(1, sweeps)):
        moved = apply(sd_a, local, elements)
        elements[res.name] = solve_residual(res, moved, sd_b, keys=pure if sweep == 0 else None)
        moved = apply(sd_a, [res], elements)
        elements.update(solve_local(local, moved, sd_b, symmetries, scale_mode))
        value = _sq_distance(apply(moved, local, elements), sd_b, matched)
        if history is not None:
            history.append(value)
        if progress is not None:
            progress(f"residual sweep {sweep + 1}")
        if value >= best_value * (1 - 1e-12):
            break
        best, best_value = dict(elements), value
    return best
