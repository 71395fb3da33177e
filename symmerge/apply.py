"""Apply group elements to a state dict. Nothing else in symmerge changes weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SymmergeError
from .resolve import Instance, Slot
from .spec import HEAD_ORTHOGONAL, PERMUTATION, RESIDUAL, ROPE_PAIRS
from .solvers.rope import rope_element


@dataclass
class HeadElement:
    """Per group head: orthogonal ``R`` (H, d, d) and scale ``a`` (H,), or per dimension (H, d)
    (rope groups: one scale per frequency pair). The residual group is a HeadElement with H = 1."""

    R: torch.Tensor
    a: torch.Tensor

    @staticmethod
    def identity(heads: int, d: int) -> "HeadElement":
        eye = torch.eye(d, dtype=torch.float64).expand(heads, d, d).clone()
        return HeadElement(eye, torch.ones(heads, dtype=torch.float64))


@dataclass
class PermElement:
    """A permutation ``perm`` (n,): new unit ``j`` is old unit ``perm[j]``, times ``scale[j]**power``
    when ``scale`` (n,) is given (SwiGLU unit scales)."""

    perm: torch.Tensor
    scale: torch.Tensor | None = None


def segment(t: torch.Tensor, slot: Slot) -> torch.Tensor:
    """The slot's slice of its axis, moved first (a view)."""
    x = t.detach().movedim(slot.axis, 0)
    return x if slot.length is None else x[slot.start: slot.start + slot.length]


def slot_blocks(t: torch.Tensor, slot: Slot, blocks: int, dtype=torch.float64) -> torch.Tensor:
    """The slot as (blocks, block_size, rest) in ``dtype``; with ``repeat`` r > 1 the r member heads of
    a group head are stacked along ``rest`` (GQA: query heads sharing a KV head's element)."""
    x = segment(t, slot).to(dtype)
    r = slot.repeat
    x = x.reshape(blocks, r, x.shape[0] // (blocks * r), -1)
    return x.transpose(1, 2).reshape(blocks, x.shape[2], -1)


@dataclass
class _SignedPerm:
    """A residual element that is a signed permutation, applied exactly by indexing (internal)."""

    perm: torch.Tensor
    signs: torch.Tensor

    @staticmethod
    def of(R: torch.Tensor) -> "_SignedPerm | None":
        if not (bool(((R != 0).sum(-2) == 1).all()) and bool((R.abs().sum(-2) == 1).all())):
            return None
        perm = R.abs().argmax(0)
        return _SignedPerm(perm, R[perm, torch.arange(len(perm))])


def _transform_segment(x: torch.Tensor, slot: Slot, inst: Instance, element) -> torch.Tensor:
    """New values of one slot's segment (axis first; float64 unless the element is a permutation)."""
    if isinstance(element, (PermElement, _SignedPerm)):
        y = x.index_select(0, element.perm.to(x.device))
        factor = element.signs if isinstance(element, _SignedPerm) and not slot.diag else None
        if isinstance(element, PermElement) and element.scale is not None and slot.power:
            factor = element.scale.pow(slot.power)
        if factor is not None:  # (a norm weight moves with the stream; its signs drop out)
            y = y * factor.to(y).reshape(-1, *([1] * (y.dim() - 1)))
        return y
    R = element.R.to(x)
    if slot.diag:  # diag(Qᵀ diag(γ) Q) is diagonal only for uniform γ (signed permutations: above)
        if not bool((x == x[0]).all()):
            raise SymmergeError(f"{slot.key}: an orthogonal residual transform needs the norm weights folded "
                                "first (symmerge.apply.fold_norms)")
        return x.clone()
    r = slot.repeat
    xb = x.reshape(inst.blocks, r, inst.size, -1)
    y = R.mT[:, None] @ xb
    if slot.power:
        a = element.a.to(y).pow(slot.power)
        y = y * (a[:, None, None, None] if a.dim() == 1 else a[:, None, :, None])
    return y.reshape(x.shape)


def _permute_in_place_axis(t: torch.Tensor, slot: Slot, element) -> torch.Tensor:
    """Permutation (+ signs) of a whole axis, indexed along that axis (no transposed copies)."""
    y = t.detach().index_select(slot.axis, element.perm.to(t.device))
    if isinstance(element, _SignedPerm) and not slot.diag:
        shape = [1] * y.dim()
        shape[slot.axis] = -1
        y = y * element.signs.to(y).reshape(shape)
    return y.contiguous()


def transform_tensor(t: torch.Tensor, slot: Slot, inst: Instance, element) -> torch.Tensor:
    """One member tensor after the group element acts on (its slice of) the slot's axis."""
    exact = isinstance(element, _SignedPerm) or (
        isinstance(element, PermElement) and (element.scale is None or not slot.power))
    if exact and slot.length is None:
        return _permute_in_place_axis(t, slot, element)
    x = t.detach().movedim(slot.axis, 0)
    seg = segment(t, slot)
    # float64 arithmetic for float32/float64 tensors; 16-bit tensors (whose result is rounded to 8 or 11
    # mantissa bits anyway) and the residual's dense d × d product on float32 ones run in float32
    work = torch.float64
    if t.dtype in (torch.float16, torch.bfloat16) or (inst.group.kind == RESIDUAL and t.dtype != torch.float64):
        work = torch.float32
    new = _transform_segment(seg if exact else seg.to(work), slot, inst, element).to(t.dtype)
    if slot.length is None:
        out = new
    else:
        out = x.clone()
        out[slot.start: slot.start + slot.length] = new
    return out.movedim(0, slot.axis).contiguous()


def fold_norms(state_dict: dict, instances: list[Instance]) -> dict:
    """Fold each norm weight of the residual instances into the weight columns of its readers
    (``W ← W diag(γ)``, ``γ ← 1``): the same function, a parameterisation on which any orthogonal
    residual transform acts exactly. A no-op for other instances (and the signed-permutation variant)."""
    out = dict(state_dict)
    for inst in instances:
        for norm_key, readers in inst.folds:
            gamma = out[norm_key].detach().to(torch.float64)
            for k in readers:
                out[k] = (out[k].detach().to(torch.float64) * gamma).to(out[k].dtype)
            out[norm_key] = torch.ones_like(out[norm_key])
    return out


def apply(state_dict: dict, instances: list[Instance], elements: dict) -> dict:
    """Return a new state dict with every instance's element applied (untouched tensors shared)."""
    out = dict(state_dict)
    for inst in instances:
        element = elements.get(inst.name)
        if element is None:
            continue
        if inst.group.kind == RESIDUAL:
            element = _SignedPerm.of(element.R[0]) or element
        for slot in inst.slots:
            out[slot.key] = transform_tensor(out[slot.key], slot, inst, element)
    return out


def haar(n: int, d: int, generator: torch.Generator) -> torch.Tensor:
    """``n`` Haar-random orthogonal d × d matrices."""
    g = torch.randn(n, d, d, dtype=torch.float64, generator=generator)
    q, r = torch.linalg.qr(g)
    return q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]


def _scales(n, generator, scale: bool, *shape) -> torch.Tensor:
    if not scale:
        return torch.ones(n, *shape, dtype=torch.float64)
    return torch.exp(0.3 * torch.randn(n, *shape, dtype=torch.float64, generator=generator))


def random_elements(instances: list[Instance], generator: torch.Generator, scale: bool = True) -> dict:
    """A random group element for every instance (Haar rotations, log-normal scales, permutations)."""
    elements = {}
    for inst in instances:
        kind, g = inst.group.kind, generator
        if kind == HEAD_ORTHOGONAL:
            elements[inst.name] = HeadElement(haar(inst.blocks, inst.size, g), _scales(inst.blocks, g, scale))
        elif kind == ROPE_PAIRS:
            half, rest = inst.rotary // 2, inst.size - inst.rotary
            theta = 2 * torch.pi * torch.rand(inst.blocks, half, dtype=torch.float64, generator=g)
            rho = _scales(inst.blocks, g, scale and not inst.group.pair_norms, half)
            if inst.locked:  # per-head norms: these pairs may only flip sign
                flips = torch.randint(0, 2, (inst.blocks, len(inst.locked)), generator=g).to(torch.float64)
                theta[:, list(inst.locked)] = torch.pi * flips
            R_pass, a_pass = (haar(inst.blocks, rest, g), _scales(inst.blocks, g, scale)) if rest else (None, None)
            elements[inst.name] = HeadElement(*rope_element(theta, rho, R_pass, a_pass, inst.size))
        elif kind == PERMUTATION:
            perm = torch.randperm(inst.size, generator=g)
            s = None
            if inst.group.unit_scale and scale:
                signs = torch.randint(0, 2, (inst.size,), generator=g).to(torch.float64) * 2 - 1
                s = signs * _scales(inst.size, g, True)
            elements[inst.name] = PermElement(perm, s)
        elif kind == RESIDUAL:
            if inst.variant in ("permutation", "signed_permutation"):
                Q = torch.zeros(inst.size, inst.size, dtype=torch.float64)
                signs = (torch.randint(0, 2, (inst.size,), generator=g).to(torch.float64) * 2 - 1
                         if inst.variant == "signed_permutation" else torch.ones(inst.size, dtype=torch.float64))
                Q[torch.randperm(inst.size, generator=g), torch.arange(inst.size)] = signs
                Q = Q[None]
            else:
                Q = haar(1, inst.size, g)
            elements[inst.name] = HeadElement(Q, torch.ones(1, dtype=torch.float64))
    return elements
