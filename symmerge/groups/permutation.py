"""Permutation of FFN hidden units, with an optional per-unit scale.

One permutation of the units on every member's axis: rows of every input Linear and their biases
(power +1; SwiGLU's ``gate`` power 0), columns of the output Linear (power -1). With the group
parameter ``unit_scale="nonzero"`` (SwiGLU: ``up`` is linear in its output) a per-unit scale
``s ≠ 0`` is also solved under ``rescale``, applied as ``s**power``.

Best element: the exact linear assignment of ``C[i, j] = Σ_members ⟨unit i of A, unit j of B⟩``
(one GEMM per block and member, accumulated in place in float32, or float64 for float64 models),
then per unit the scale in closed form
(a quartic). When the scale may flip signs, the scaled members count with the better sign
(``C₀ + |C_±|``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.slots import fast_dtype, index_axis, stored, unit_matrix
from ..core.parallel import layer_map
from ..core.solvers import match_permutation
from ..core.solvers.rescale import quartic_scale
from ..errors import SymmergeError
from .base import Kind, is_permutation, scales, segment_update, swap_blocks


@dataclass
class PermElement:
    """A permutation ``perm`` (n,): new unit ``j`` is old unit ``perm[j]``, times ``scale[j]**power``
    when ``scale`` (n,) is given (SwiGLU unit scales)."""

    perm: torch.Tensor
    scale: torch.Tensor | None = None


def row_chunks(n: int, width: int, budget: int = 1 << 24):
    """Row slices of an (n, width) matrix holding about ``budget`` elements each."""
    step = max(256, budget // max(width, 1))
    return [slice(i, min(i + step, n)) for i in range(0, n, step)]


def permutation_cost(inst, sd_a: dict, sd_b: dict, signed: bool = False, device=None) -> torch.Tensor:
    """C[i, j] = Σ_members ⟨unit i of A, unit j of B⟩ (n × n, CPU), built block by block with one GEMM
    per block and member, accumulated in place (``addmm_``), in the members' working precision: float32
    (float64 if a member is float64; on ``device``). The cost stays in that precision: its entries carry
    the float32 GEMMs' rounding (~1e-6 relative) anyway, and float32 halves its memory (300 MB at
    n = 8640) and the assignment's work (``lapx`` solves float32 costs natively, measured 1.4x faster).
    Each member is read from ``sd_a``/``sd_b`` once (they may be on-demand mappings); memory holds one
    member of each model as stored and a few ~30 MB blocks besides the result."""
    n = inst.size
    C = None
    on_cpu = device is None or torch.device(device).type == "cpu"
    parts = [[s for s in inst.slots if signed and s.power], [s for s in inst.slots if not (signed and s.power)]]
    for k, slots in enumerate(parts):  # the signed members first: |C_±| is taken before C₀ is added
        for s in slots:
            ua, ub = unit_matrix(sd_a[s.key], s), unit_matrix(sd_b[s.key], s)
            work = fast_dtype(ua, ub)
            first = C is None  # the first member's blocks are written, not added (no zero fill)
            if first:
                C = torch.empty(n, n, dtype=work)
            elif work == torch.float64 and C.dtype != work:  # a float64 member: the whole cost in float64
                C = C.to(work)
            chunks = row_chunks(n, ua.shape[1], 1 << 22)
            for cols in chunks:
                x2t = ub[cols].to(device=device, dtype=C.dtype).T
                for rows in chunks:
                    x1 = ua[rows].to(device=device, dtype=C.dtype)
                    block = C[rows, cols]
                    if on_cpu:  # beta=0: the uninitialised block is ignored, not read
                        block.addmm_(x1, x2t, beta=0 if first else 1)
                    elif first:
                        block.copy_((x1 @ x2t).cpu())
                    else:
                        block.add_((x1 @ x2t).cpu())
                del x2t
            del ua, ub
        if k == 0 and slots:
            C.abs_()
    return C if C is not None else torch.zeros(n, n)


def unit_scales(inst, sd_a: dict, sd_b: dict, perm: torch.Tensor) -> torch.Tensor:
    """Per unit after ``perm``, the scale ``s ≠ 0`` (``s**power`` on each member) closest to B
    (float64 sums, a block of units at a time)."""
    n = len(perm)
    sums = {k: torch.zeros(n, dtype=torch.float64) for k in ("p", "m", "cp", "cm")}
    for s in inst.slots:
        if not s.power:
            continue
        # as stored (a half tensor, not its float32 working copy): the sums below are float64 either way
        ua, ub = unit_matrix(stored(sd_a, s.key), s), unit_matrix(stored(sd_b, s.key), s)
        side = "p" if s.power > 0 else "m"
        for rows in row_chunks(n, ua.shape[1], 1 << 22):
            x1, x2 = ua[perm[rows]].to(torch.float64), ub[rows].to(torch.float64)
            sums[side][rows] += x1.square().sum(1)
            sums["c" + side][rows] += (x1 * x2).sum(1)
    return quartic_scale(sums["cp"], sums["cm"], sums["p"], sums["m"],
                         signed=inst.group.param("unit_scale") == "nonzero")


class Permutation(Kind):
    name = "permutation"
    description = "permutation of the FFN hidden units"

    def scale_text(self, group) -> str | None:
        return "a scale s ≠ 0 per unit" if group.param("unit_scale") else None
    streams_costs = True

    @staticmethod
    def plan(inst, opts) -> tuple[bool, bool, bool]:
        """(permute, scaled, signed): whether units are matched, whether they also get a unit scale
        (SwiGLU under ``rescale``), and whether that scale may flip signs."""
        permute = inst.group.symmetry in opts.symmetries
        scaled = inst.group.param("unit_scale") is not None and opts.rescale != "none"
        return permute, scaled, scaled and inst.group.param("unit_scale") == "nonzero"

    def active(self, inst, opts) -> bool:
        permute, scaled, _ = self.plan(inst, opts)
        return permute or scaled

    def prepare(self, insts, sd_a, sd_b, opts, ctx=None) -> dict:
        """``{name: perm}``: per instance (layer) its cost matrix and exact assignment, the layers on a
        pool of ``opts.workers`` threads (:func:`~symmerge.core.parallel.layer_map`); each cost is
        consumed by its assignment, so memory holds one cost per thread."""
        todo = [i for i in insts if self.plan(i, opts)[0]]

        def solve_one(inst):
            cost = permutation_cost(inst, sd_a, sd_b, self.plan(inst, opts)[2], device=opts.device)
            return match_permutation(cost, consume=True)

        return dict(zip([i.name for i in todo], layer_map(solve_one, todo, opts.workers)))

    # activation matching: the units only, by exact assignment on their correlations (|correlation| where
    # unit scales may flip signs); SwiGLU unit scales from the weights afterwards
    activation_sites = "units"
    activation_statistic = "correlation"

    def fit_activations(self, insts, act_a, act_b, opts) -> dict:
        perms = self.prepare(insts, act_a, act_b, opts)
        return {i.name: PermElement(perms[i.name]) for i in insts if i.name in perms}

    def weight_scales(self, insts, elements, sd_a, sd_b, opts, scales_fitted) -> None:
        for inst in insts:  # the assignment ran on correlations, which carry no scale: always from the weights
            if self.plan(inst, opts)[1]:
                perm = elements[inst.name].perm
                elements[inst.name] = PermElement(perm, unit_scales(inst, sd_a, sd_b, perm))

    def perturb(self, inst, element, generator) -> PermElement:
        """Two blocks of ``n/16`` units of the matching exchanged (their scales with them)."""
        if inst.size < 2:
            return None
        index = swap_blocks(inst.size, max(1, inst.size // 16), generator)
        return PermElement(element.perm[index], None if element.scale is None else element.scale[index])

    def discrete(self, inst) -> bool:  # the unit permutation (SwiGLU unit scales come with ``rescale``)
        return True

    def complete(self, insts, prepared, sd_a, sd_b, opts, ctx=None) -> dict:
        out = {}
        for inst in insts:
            _, scaled, _ = self.plan(inst, opts)
            perm = (prepared or {}).get(inst.name, torch.arange(inst.size))
            out[inst.name] = PermElement(perm, unit_scales(inst, sd_a, sd_b, perm) if scaled else None)
        return out

    # learned alignment: the unit scales s = e^σ (their signs stay as solved)
    def learn_init(self, inst, opts, dtype, model_facts):
        return {"logs": torch.zeros(inst.size, dtype=dtype)} if inst.group.param("unit_scale") else None

    def learn_prepare(self, inst, values):
        return values["logs"].exp()

    def learn_apply(self, t, slot, inst, prepared):
        if not slot.power:
            return t
        f = prepared.pow(slot.power)
        return segment_update(t, slot, lambda x: x * f.to(x).reshape(-1, *([1] * (x.dim() - 1))))

    def learn_element(self, inst, values) -> PermElement:
        return PermElement(torch.arange(inst.size), values["logs"].detach().double().exp())

    def identity(self, inst) -> PermElement:
        return PermElement(torch.arange(inst.size))

    def random(self, inst, generator, scale: bool = True) -> PermElement:
        perm = torch.randperm(inst.size, generator=generator)
        s = None
        if inst.group.param("unit_scale") and scale:
            signs = torch.randint(0, 2, (inst.size,), generator=generator).to(torch.float64) * 2 - 1
            s = signs * scales(inst.size, generator, True)
        return PermElement(perm, s)

    def check(self, inst, element, tol: float = 1e-6) -> None:
        if not is_permutation(element.perm, inst.size):
            raise SymmergeError(f"{inst.name}: solver returned a non-bijective permutation")
        s = element.scale
        if s is not None and (not bool(torch.isfinite(s).all()) or bool((s == 0).any())):
            raise SymmergeError(f"{inst.name}: solver returned a zero or non-finite unit scale")

    def transform(self, t, slot, inst, element) -> torch.Tensor:
        factor = element.scale.pow(slot.power) if element.scale is not None and slot.power else None
        return index_axis(t, slot, element.perm, factor)


KIND = Permutation()
