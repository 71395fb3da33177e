"""Apply group elements to a state dict. Nothing else in symmerge changes weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .resolve import Instance
from .spec import HEAD_ORTHOGONAL


@dataclass
class HeadElement:
    """Per head: orthogonal ``R`` (H, d, d) and scale ``a`` (H,)."""

    R: torch.Tensor
    a: torch.Tensor

    @staticmethod
    def identity(heads: int, d: int) -> "HeadElement":
        eye = torch.eye(d, dtype=torch.float64).expand(heads, d, d).clone()
        return HeadElement(eye, torch.ones(heads, dtype=torch.float64))


@dataclass
class PermElement:
    """A permutation ``perm`` (n,): new unit ``j`` is old unit ``perm[j]``."""

    perm: torch.Tensor


def to_blocks(t: torch.Tensor, axis: int, blocks: int) -> torch.Tensor:
    """View a tensor as (blocks, block_size, rest) with the group axis first (float64)."""
    x = t.detach().to(torch.float64).movedim(axis, 0)
    return x.reshape(blocks, x.shape[0] // blocks, -1)


def from_blocks(x: torch.Tensor, like: torch.Tensor, axis: int) -> torch.Tensor:
    shape = list(like.movedim(axis, 0).shape)
    return x.reshape(shape).movedim(0, axis).to(like.dtype).contiguous()


def transform_tensor(t: torch.Tensor, axis: int, power: int, inst: Instance, element) -> torch.Tensor:
    """One member tensor after the group element acts on it."""
    if inst.group.kind == HEAD_ORTHOGONAL:
        x = to_blocks(t, axis, inst.blocks)
        y = element.R.mT @ x * element.a.pow(power)[:, None, None]
        return from_blocks(y, t, axis)
    return t.index_select(axis, element.perm.to(t.device)).contiguous()


def apply(state_dict: dict, instances: list[Instance], elements: dict) -> dict:
    """Return a new state dict with every instance's element applied (untouched tensors shared)."""
    out = dict(state_dict)
    for inst in instances:
        element = elements.get(inst.name)
        if element is None:
            continue
        for slot in inst.slots:
            out[slot.key] = transform_tensor(out[slot.key], slot.axis, slot.power, inst, element)
    return out


def random_elements(instances: list[Instance], generator: torch.Generator, scale: bool = True) -> dict:
    """A random group element for every instance (Haar rotations, log-normal scales, permutations)."""
    elements = {}
    for inst in instances:
        if inst.group.kind == HEAD_ORTHOGONAL:
            g = torch.randn(inst.blocks, inst.size, inst.size, dtype=torch.float64, generator=generator)
            q, r = torch.linalg.qr(g)
            q = q * torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))[:, None, :]
            a = torch.exp(0.3 * torch.randn(inst.blocks, dtype=torch.float64, generator=generator)) if scale else torch.ones(inst.blocks, dtype=torch.float64)
            elements[inst.name] = HeadElement(q, a)
        else:
            elements[inst.name] = PermElement(torch.randperm(inst.size, generator=generator))
    return elements
