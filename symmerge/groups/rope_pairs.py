"""The QK group of a rotary-embedding attention (``transformers``' ``rotate_half`` layout).

Per head and per frequency pair (dims ``j`` and ``j + r/2`` of the ``r`` rotary dims) a 2-D rotation
by ``θ_j`` and a scale ``ρ_j > 0`` (Q rows ``ρ R(θ)ᵀ``, K rows ``R(θ)ᵀ / ρ``: a complex scalar per pair,
the only transforms commuting with every position's rotation); the ``d - r`` non-rotated dims keep
the full orthogonal group + scale. Solved in closed form per pair (:mod:`symmerge.core.solvers.rope`).

With ``pair_norms`` (Qwen3's ``q_norm``/``k_norm``: an RMSNorm with weight ``w`` over each head's dims
between the projection and the rotary embedding) the element must also commute with ``diag(w)`` and
keep each head's norm: no scale (``ρ = 1``), and a pair keeps its free rotation only where
``w_j = w_{j+r/2}`` for every such norm; elsewhere only ``θ ∈ {0, π}`` (a sign flip of the pair).
A norm over the whole projection (OLMo 2: one weight per dim of every head, the RMS over all heads)
is kept by per-head orthogonal maps without scale that commute with each head's ``diag(w_h)``: a pair
is locked when its weights differ in any head (the same locked set for every head, so it does not
change under the head permutation, which moves such norm weights with their heads).
The element is a :class:`~symmerge.groups.head_orthogonal.HeadElement` with a per-dimension scale.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..core.slots import precise_dtype, segment, with_segment
from ..core.solvers import scale_for_rotation
from ..core.solvers.rescale import quartic_scale
from ..core.solvers.rope import pair_objective, pair_products, rope_element, solve_pairs
from ..errors import SymmergeError
from .base import Kind, haar, scales, segment_update
from .head_orthogonal import HeadElement, HeadGL, blocks, check_gl, check_head_element, head_values, products, \
    solve_heads, transform_blocks, transform_gl


@dataclass(frozen=True)
class RopeInfo:
    rotary: int  # rotary dims per head (pairs j, j + rotary/2); the rest are not rotated
    locked: tuple[int, ...] = ()  # pairs restricted to θ ∈ {0, π} by per-head norms


def locked_pairs(ctx, norm_keys: list[str], size: int, rotary: int) -> tuple[int, ...]:
    """Rotary pairs ``(j, j + r/2)`` whose per-head norm weights differ in some norm: only a sign flip
    (θ = π) commutes with ``diag(w)`` there."""
    if not norm_keys:
        return ()
    if rotary != size:
        raise SymmergeError("per-head query/key norms with partial rotary embeddings are not supported")
    h = rotary // 2
    locked = torch.zeros(h, dtype=torch.bool)
    for key in norm_keys:
        w = ctx.state_dict.get(key)
        if w is None:
            raise SymmergeError(f"checkpoint lacks tensor {ctx.disk(key)!r} (a per-head query/key norm)")
        if w.is_meta:
            raise SymmergeError(f"{ctx.disk(key)}: the QK group depends on this norm's values; resolve against "
                                "real weights")
        if w.dim() != 1 or w.shape[0] % size:
            raise SymmergeError(f"{ctx.disk(key)}: shape {tuple(w.shape)}, expected ({size},) (one weight per "
                                "head dim) or a multiple (one per dim of every head)")
        w = w.reshape(-1, size)  # a norm over the whole projection: a pair is locked if it is in any head
        locked |= (w[:, :h] != w[:, h:rotary]).any(0)
    return tuple(int(j) for j in torch.nonzero(locked).flatten())


def _solve(xa: dict, xb: dict, info: RopeInfo, size: int, rotate: bool, rescale: str, normed: bool):
    """(R, a, values) for stacked head blocks: the element per block and the squared distance after it."""
    r = info.rotary
    if normed:
        rescale = "none"
    cp, P = pair_products(xa[1], xb[1], r)
    cm, M = pair_products(xa[-1], xb[-1], r)
    theta, rho = solve_pairs(cp, cm, P, M, rotate, rescale)
    if normed and info.locked:
        locked = torch.zeros(theta.shape, dtype=torch.bool)
        locked[:, list(info.locked)] = True
        flip = ((cp + cm).real < 0).to(theta.dtype) * torch.pi  # best of θ ∈ {0, π} (π in float64)
        theta = torch.where(locked, flip, theta)
    values = pair_objective(rho, theta, cp, cm, P, M).sum(-1)
    values = values + sum(x[:, :r].square().sum((1, 2), dtype=torch.float64) for x in xb.values())
    R_pass = a_pass = None
    if r < size:  # partial rotary: the non-rotated dims keep the full orthogonal group + scale
        pa, pb = {p: x[:, r:] for p, x in xa.items()}, {p: x[:, r:] for p, x in xb.items()}
        R_pass, a_pass = solve_heads(*products(pa, pb), rotate=rotate, rescale=rescale)
        values = values + head_values(pa, pb, rotate, rescale)
    R, a = rope_element(theta, rho, R_pass, a_pass, size)
    return R, a, values


def _joined(xs: list) -> dict:
    """The blocks ``{power: (H, d, n)}`` of instances solved together, one after another along the heads; one
    instance's (a streamed layer's) as they are, not a second float64 copy of them."""
    return {p: xs[0][p] if len(xs) == 1 else torch.cat([x[p] for x in xs]) for p in (1, -1)}


class RopePairs(Kind):
    name = "rope_pairs"
    description = "per-head 2x2 rotation of each RoPE frequency pair"

    def scale_text(self, group) -> str | None:
        return None if group.param("pair_norms") else "a scale s > 0"
    blocked = True

    def bind(self, group, ctx, layer):
        inst = ctx.instance(group, layer, blocked=True)
        rotary = inst.size if ctx.rotary_dim is None else ctx.rotary_dim
        if rotary % 2 or not 0 < rotary <= inst.size:
            raise SymmergeError(f"rotary dims {rotary} do not fit head dim {inst.size} in pairs")
        norms = [ctx.key_of(n, layer) for n in group.param("pair_norms", ())]
        return replace(inst, info=RopeInfo(rotary, locked_pairs(ctx, norms, inst.size, rotary)))

    def active(self, inst, opts) -> bool:
        return opts.rotate or (opts.rescale != "none" and not inst.group.param("pair_norms"))

    def complete(self, insts, prepared, sd_a, sd_b, opts, ctx=None) -> dict:
        out = {}
        by_info: dict = {}
        for inst in insts:  # instances sharing rotary dims and locked pairs are solved together
            by_info.setdefault(inst.info, []).append(inst)
        for info, group in by_info.items():
            xa = [blocks(i, sd_a) for i in group]
            xb = [blocks(i, sd_b) for i in group]
            R, a, _ = _solve(_joined(xa), _joined(xb), info, group[0].size, opts.rotate, opts.rescale,
                             bool(group[0].group.param("pair_norms")))
            k = 0
            for inst in group:
                out[inst.name] = HeadElement(R[k:k + inst.blocks], a[k:k + inst.blocks])
                k += inst.blocks
        return out

    def weight_scales(self, insts, elements, sd_a, sd_b, opts, scales_fitted) -> None:
        """Per rotary pair the scale closest in the weights for the pair's (activation-fitted) rotation;
        the non-rotated dims as a head. Pairs locked by per-head norms keep their scales."""
        if scales_fitted:
            return
        for inst in insts:
            if not inst.group.param("pair_norms"):
                elements[inst.name] = self._pair_scales(inst, elements[inst.name], sd_a, sd_b)

    @staticmethod
    def _pair_scales(inst, element: HeadElement, sd_a, sd_b) -> HeadElement:
        r, d = inst.info.rotary, inst.size
        h = r // 2
        j = torch.arange(h)
        R = element.R.double()
        theta = torch.atan2(R[:, j + h, j], R[:, j, j])
        xa, xb = blocks(inst, sd_a), blocks(inst, sd_b)
        cp, P = pair_products(xa[1], xb[1], r)
        cm, M = pair_products(xa[-1], xb[-1], r)
        w = torch.polar(torch.ones_like(theta), -theta)
        rho = quartic_scale((w * cp).real, (w * cm).real, P, M).reshape(theta.shape)
        R_pass = a_pass = None
        if r < d:
            R_pass = R[:, r:, r:]
            Mp, Mm, n1p, n1m, _, _ = products({p: x[:, r:] for p, x in xa.items()},
                                              {p: x[:, r:] for p, x in xb.items()})
            a_pass = scale_for_rotation(R_pass, Mp, Mm, n1p, n1m)
        return HeadElement(*rope_element(theta, rho, R_pass, a_pass, d))

    def block_values(self, inst, xa: dict, xb: dict, opts) -> torch.Tensor:
        return _solve(xa, xb, inst.info, inst.size, opts.rotate, opts.rescale,
                      bool(inst.group.param("pair_norms")))[2]

    # learned alignment: the complex scalar of each pair (rotation + scale), a general map on non-rotated dims
    def learn_init(self, inst, opts, dtype, model_facts):
        if inst.group.param("pair_norms"):
            return None  # norm-locked pairs: only the sign flips solved in closed form
        h, rest = inst.info.rotary // 2, inst.size - inst.info.rotary
        values = {"theta": torch.zeros(inst.blocks, h, dtype=dtype), "logrho": torch.zeros(inst.blocks, h, dtype=dtype)}
        if rest:
            values["gl"] = torch.zeros(inst.blocks, rest, rest, dtype=dtype)
        return values

    def learn_prepare(self, inst, values) -> HeadGL:
        theta, rho = values["theta"], values["logrho"].exp()
        H, h = theta.shape
        r, d = 2 * h, inst.size
        c, s = rho * torch.cos(theta), rho * torch.sin(theta)
        M = torch.zeros(H, d, d, dtype=theta.dtype, device=theta.device)
        j = torch.arange(h, device=theta.device)
        M[:, j, j] = c
        M[:, j + h, j + h] = c
        M[:, j + h, j] = s
        M[:, j, j + h] = -s
        if "gl" in values:
            M[:, r:, r:] = torch.linalg.matrix_exp(values["gl"])
        return HeadGL(M)

    def learn_apply(self, t, slot, inst, prepared):
        return segment_update(t, slot, lambda x: transform_gl(x, slot, inst, prepared))

    def learn_element(self, inst, values) -> HeadGL:
        return HeadGL(self.learn_prepare(inst, values).M.double())

    def identity(self, inst) -> HeadElement:
        return HeadElement.identity(inst.blocks, inst.size)

    def random(self, inst, generator, scale: bool = True) -> HeadElement:
        info = inst.info
        half, rest = info.rotary // 2, inst.size - info.rotary
        theta = 2 * torch.pi * torch.rand(inst.blocks, half, dtype=torch.float64, generator=generator)
        rho = scales(inst.blocks, generator, scale and not inst.group.param("pair_norms"), half)
        if info.locked:  # per-head norms: these pairs may only flip sign
            flips = torch.randint(0, 2, (inst.blocks, len(info.locked)), generator=generator).to(torch.float64)
            theta[:, list(info.locked)] = torch.pi * flips
        R_pass, a_pass = (haar(inst.blocks, rest, generator), scales(inst.blocks, generator, scale)) if rest \
            else (None, None)
        return HeadElement(*rope_element(theta, rho, R_pass, a_pass, inst.size))

    def check(self, inst, element, tol: float = 1e-6) -> None:
        if isinstance(element, HeadGL):  # must commute with every position's rotation of the rotary pairs
            check_gl(inst.name, element)
            r, h = inst.info.rotary, inst.info.rotary // 2
            J = torch.zeros(inst.size, inst.size, dtype=torch.float64)
            j = torch.arange(h)
            J[j + h, j], J[j, j + h] = 1.0, -1.0
            M = element.M.double()
            err = (M @ J - J @ M)[:, :r].abs().max().item() / max(M.abs().max().item(), 1e-300)
            if err > tol or (r < inst.size and M[:, :r, r:].abs().max().item() > tol * M.abs().max().item()):
                raise SymmergeError(f"{inst.name}: invalid element (does not commute with the rotary embedding)")
        else:
            check_head_element(inst.name, element, tol)

    def transform(self, t, slot, inst, element) -> torch.Tensor:
        seg = segment(t, slot).to(precise_dtype(t))
        fn = transform_gl if isinstance(element, HeadGL) else transform_blocks
        return with_segment(t, slot, fn(seg, slot, inst, element))


KIND = RopePairs()
