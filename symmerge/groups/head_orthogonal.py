"""Per-head orthogonal rotation + scalar rescale (the paper's attention symmetry).

Per head ``h`` an orthogonal ``R_h`` and a scale ``a_h > 0``. Each member's head block ``X_h``
(``d_h`` x rest, head index on the member's axis) becomes ``a_h**power R_hᵀ X_h``.
QK: ``W_Q, b_Q`` (power +1) and ``W_K, b_K`` (power -1) — ``(aQR)(KR/a)ᵀ = QKᵀ``.
VO: ``W_V, b_V`` (power +1) and the head's column block of ``W_O`` (power -1).

Best element (moved model 1 to anchor 2), with ``Mp = Σ₊ X1 X2ᵀ``, ``Mm = Σ₋ X1 X2ᵀ`` and the
squared norms ``n1p, n1m`` of the moved blocks: rotation only — Procrustes of ``Mp + Mm`` (paper
Algorithm 1); ``sequential`` — that rotation, then the best scale (paper eq. 11–12); ``joint`` — the
exact joint optimum (:mod:`symmerge.core.solvers.rescale`). All heads of all given instances are
solved in one batched SVD.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.slots import precise_dtype, segment, slot_blocks, stored, with_segment, working_dtype
from ..core.solvers import joint_scale, procrustes, scale_for_rotation, sequential_scale
from ..core.solvers.rescale import head_objective
from ..errors import SymmergeError
from .base import Kind, haar, orthogonality_error, scales, segment_update


@dataclass
class HeadElement:
    """Per group head: orthogonal ``R`` (H, d, d) and scale ``a`` (H,), or per dimension (H, d)
    (RoPE groups: one scale per frequency pair)."""

    R: torch.Tensor
    a: torch.Tensor

    @staticmethod
    def identity(heads: int, d: int) -> "HeadElement":
        eye = torch.eye(d, dtype=torch.float64).expand(heads, d, d).clone()
        return HeadElement(eye, torch.ones(heads, dtype=torch.float64))


@dataclass
class HeadGL:
    """Per group head an invertible ``M`` (H, d, d): the full group of a head's bilinear form — power +1
    members become ``Mᵀ X``, power -1 members ``M⁻¹ X`` (``(QM)(KM⁻ᵀ)ᵀ = QKᵀ``, ``(VM)(W_O M⁻ᵀ)ᵀ = V W_Oᵀ``);
    rotations and scales are special cases. Learned alignment produces it (no closed form)."""

    M: torch.Tensor


COND_LIMIT = 1e8  # an invertible map whose condition number exceeds this is refused as numerically singular


def check_gl(name: str, element: HeadGL) -> None:
    M = element.M.double()
    if not bool(torch.isfinite(M).all()):
        raise SymmergeError(f"{name}: invalid element (non-finite invertible map)")
    cond = torch.linalg.cond(M)
    if not bool((cond < COND_LIMIT).all()):
        raise SymmergeError(f"{name}: invalid element (invertible map with condition number {cond.max().item():.3g})")


def transform_gl(x: torch.Tensor, slot, inst, element: HeadGL) -> torch.Tensor:
    """A segment (axis first) after the invertible maps (differentiable in ``element.M``)."""
    M = element.M.to(x)
    xb = x.reshape(inst.blocks, slot.repeat, M.shape[-1], -1)
    if slot.power > 0:
        y = M.mT[:, None] @ xb
    elif slot.power < 0:
        y = torch.linalg.solve(M[:, None], xb)
    else:
        y = xb
    return y.reshape(x.shape)


def stacked(inst, sd: dict, power: int, rows: slice = slice(None), sub: torch.Tensor | None = None):
    """All slots of one scale power as (H, d, n) (optionally a subset of each head's ``rows``), or None.
    ``sub`` (H, r): for members repeated r times per group head (GQA query heads), the order of the r
    member heads within each group head (the ``heads`` kind tries pairings with it)."""
    slots = [s for s in inst.slots if s.power == power]
    if not slots:
        return None
    dtype = precise_dtype(*(working_dtype(sd, s.key) for s in inst.slots))  # of the working copies, not made
    parts = []
    for s in slots:  # converted from the tensor as stored: a half tensor's float32 copy would give the same values
        x = slot_blocks(stored(sd, s.key), s, inst.blocks, dtype)
        if sub is not None and s.repeat > 1:
            H, d = x.shape[0], x.shape[1]
            x = x.reshape(H, d, s.repeat, -1)
            x = x[torch.arange(H)[:, None], :, sub].permute(0, 2, 1, 3).reshape(H, d, -1)
        parts.append(x)
    return (parts[0] if len(parts) == 1 else torch.cat(parts, dim=2))[:, rows]  # one slot: no copy


def blocks(inst, sd: dict, rows: slice = slice(None), sub: torch.Tensor | None = None) -> dict:
    """``{power: (H, d, n)}`` for the powers present (+1 and/or -1)."""
    out = {}
    for p in (1, -1):
        x = stacked(inst, sd, p, rows, sub)
        if x is not None:
            out[p] = x
    return out


def products(xa: dict, xb: dict):
    """Per head ``Mp, Mm`` (B, d, d) and squared norms ``n1p, n1m, n2p, n2m`` (B,), float64."""
    some = next(iter(xa.values()))
    B, d = some.shape[0], some.shape[1]
    M = {p: torch.zeros(B, d, d, dtype=torch.float64) for p in (1, -1)}
    n1 = {p: torch.zeros(B, dtype=torch.float64) for p in (1, -1)}
    n2 = {p: torch.zeros(B, dtype=torch.float64) for p in (1, -1)}
    for p, x1 in xa.items():
        x2 = xb[p]
        M[p] = (x1 @ x2.mT).double()
        n1[p] = x1.square().sum((1, 2), dtype=torch.float64)
        n2[p] = x2.square().sum((1, 2), dtype=torch.float64)
    return M[1], M[-1], n1[1], n1[-1], n2[1], n2[-1]


def instance_products(inst, sd_a: dict, sd_b: dict):
    """``products(blocks(inst, sd_a), blocks(inst, sd_b))``, one scale power at a time: the float64 blocks of one
    power of both models in memory (a layer's q of A and B, then its k), not of every power at once."""
    out = None
    for i, p in enumerate((1, -1)):  # (Mp, Mm, n1p, n1m, n2p, n2m): power +1 at even places, -1 at odd ones
        xa = stacked(inst, sd_a, p)
        if xa is None:
            continue
        part = products({p: xa}, {p: stacked(inst, sd_b, p)})
        del xa
        out = list(part) if out is None else [part[k] if k % 2 == i else out[k] for k in range(6)]
    return tuple(out)


def all_pair_products(xa: dict, xb: dict):
    """``products`` for every pairing of a block of A with a block of B, without materialising the pairs:
    blocks (L, H, d, n) → ``Mp, Mm`` (L·H·H, d, d) and norms (L·H·H,), pair (i, j) of layer l at
    ``l·H² + i·H + j``."""
    some = next(iter(xa.values()))
    L, H, d = some.shape[0], some.shape[1], some.shape[2]
    zero_m = torch.zeros(L, H, H, d, d, dtype=torch.float64)
    zero_n = torch.zeros(L, H, H, dtype=torch.float64)
    M, n1, n2 = {1: zero_m, -1: zero_m}, {1: zero_n, -1: zero_n}, {1: zero_n, -1: zero_n}
    for p, x1 in xa.items():
        x2 = xb[p]
        M[p] = torch.einsum("lidn,ljen->lijde", x1, x2).double()
        n1[p] = x1.square().sum((2, 3), dtype=torch.float64)[:, :, None].expand(L, H, H)
        n2[p] = x2.square().sum((2, 3), dtype=torch.float64)[:, None, :].expand(L, H, H)
    flat = lambda t: t.reshape(L * H * H, *t.shape[3:])  # noqa: E731
    return flat(M[1]), flat(M[-1]), flat(n1[1]), flat(n1[-1]), flat(n2[1]), flat(n2[-1])


def stack_blocks(insts, sd: dict) -> dict:
    """``blocks`` of instances of one group (same shapes) stacked: {power: (L, H, d, n)}."""
    parts = [blocks(i, sd) for i in insts]
    return {p: torch.stack([x[p] for x in parts]) for p in parts[0]}


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


def head_values(xa: dict, xb: dict, rotate: bool, rescale: str) -> torch.Tensor:
    """Squared distance over the blocks after the best element, per block pair (B,)."""
    Mp, Mm, n1p, n1m, n2p, n2m = products(xa, xb)
    R, a = solve_heads(Mp, Mm, n1p, n1m, n2p, n2m, rotate, rescale)
    return head_objective(a, R, Mp, Mm, n1p, n1m) + n2p + n2m


def transform_blocks(x: torch.Tensor, slot, inst, element: HeadElement) -> torch.Tensor:
    """A segment (axis first) after ``X_h → a_h**power R_hᵀ X_h`` per block (GQA: repeated blocks)."""
    R = element.R.to(x)
    xb = x.reshape(inst.blocks, slot.repeat, R.shape[-1], -1)
    y = R.mT[:, None] @ xb
    if slot.power:
        a = element.a.to(y).pow(slot.power)
        y = y * (a[:, None, None, None] if a.dim() == 1 else a[:, None, :, None])
    return y.reshape(x.shape)


class HeadOrthogonal(Kind):
    name = "head_orthogonal"
    description = "per-head orthogonal rotation"

    def scale_text(self, group) -> str | None:
        return "a scale s > 0"
    blocked = True

    def active(self, inst, opts) -> bool:
        return opts.rotate or opts.rescale != "none"

    def complete(self, insts, prepared, sd_a, sd_b, opts, ctx=None) -> dict:
        parts = [instance_products(i, sd_a, sd_b) for i in insts]
        R, a = solve_heads(*(torch.cat(x) for x in zip(*parts)), rotate=opts.rotate, rescale=opts.rescale)
        out, k = {}, 0
        for inst in insts:
            out[inst.name] = HeadElement(R[k:k + inst.blocks], a[k:k + inst.blocks])
            k += inst.blocks
        return out

    def weight_scales(self, insts, elements, sd_a, sd_b, opts, scales_fitted) -> None:
        """Per head the scale closest in the weights for the head's (activation-fitted) rotation."""
        if scales_fitted or not insts:
            return
        parts = [instance_products(i, sd_a, sd_b) for i in insts]
        Mp, Mm, n1p, n1m, _, _ = (torch.cat(x) for x in zip(*parts))
        R = torch.cat([elements[i.name].R for i in insts])
        a = scale_for_rotation(R, Mp, Mm, n1p, n1m)
        k = 0
        for inst in insts:
            elements[inst.name] = HeadElement(elements[inst.name].R, a[k:k + inst.blocks])
            k += inst.blocks

    # pairing heads (used by the ``heads`` kind)
    def block_values(self, inst, xa: dict, xb: dict, opts) -> torch.Tensor:
        """Squared distance after this group's best element, for block pairs stacked along dim 0."""
        return head_values(xa, xb, opts.rotate, opts.rescale)

    def pair_value_matrices(self, insts, sd_a: dict, sd_b: dict, opts) -> torch.Tensor:
        """(L, H, H): for each instance, the squared distance left after the best element when A's head i
        is paired with B's head j — every pair of every instance in one batched solve."""
        products_ = all_pair_products(stack_blocks(insts, sd_a), stack_blocks(insts, sd_b))
        R, a = solve_heads(*products_, rotate=opts.rotate, rescale=opts.rescale)
        Mp, Mm, n1p, n1m, n2p, n2m = products_
        values = head_objective(a, R, Mp, Mm, n1p, n1m) + n2p + n2m
        H = insts[0].blocks
        return values.reshape(len(insts), H, H)

    # learned alignment: per head a general invertible map M = exp(A)
    def learn_init(self, inst, opts, dtype, model_facts):
        return {"gl": torch.zeros(inst.blocks, inst.size, inst.size, dtype=dtype)}

    def learn_prepare(self, inst, values) -> HeadGL:
        return HeadGL(torch.linalg.matrix_exp(values["gl"]))

    def learn_apply(self, t, slot, inst, prepared):
        return segment_update(t, slot, lambda x: transform_gl(x, slot, inst, prepared))

    def learn_element(self, inst, values) -> HeadGL:
        return HeadGL(self.learn_prepare(inst, values).M.double())

    # elements
    def identity(self, inst) -> HeadElement:
        return HeadElement.identity(inst.blocks, inst.size)

    def random(self, inst, generator, scale: bool = True) -> HeadElement:
        return HeadElement(haar(inst.blocks, inst.size, generator), scales(inst.blocks, generator, scale))

    def check(self, inst, element, tol: float = 1e-6) -> None:
        if isinstance(element, HeadGL):
            check_gl(inst.name, element)
        else:
            check_head_element(inst.name, element, tol)

    def transform(self, t, slot, inst, element) -> torch.Tensor:
        seg = segment(t, slot).to(precise_dtype(t))
        fn = transform_gl if isinstance(element, HeadGL) else transform_blocks
        return with_segment(t, slot, fn(seg, slot, inst, element))


def check_head_element(name: str, element: HeadElement, tol: float) -> None:
    err = orthogonality_error(element.R)
    a = element.a.double()
    if not (math.isfinite(err) and err <= tol) or not bool(torch.isfinite(a).all()) or not bool((a > 0).all()):
        raise SymmergeError(f"{name}: solver returned an invalid element (orthogonality error {err:.2e})")


KIND = HeadOrthogonal()
