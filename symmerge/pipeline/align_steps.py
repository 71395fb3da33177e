"""The steps of an alignment — one per output tensor (:class:`AlignStep`: the maps acting on it, :class:`AlignMap`),
made from the bound group instances by :func:`plan_steps` — and the align executor (:func:`execute_steps`), which
runs an :class:`~symmerge.pipeline.align_plan.AlignPlan`'s steps once the group elements are solved, over tensors
held in memory (a whole state dict, :func:`~symmerge.pipeline.align.align_pair`) or
read from the checkpoint files (one part of one layer at a time, :func:`~symmerge.pipeline.stream.align_streaming`).

A step names one output tensor and the maps acting on it, in the order the plan lists them (the instances'
order): each map is its instance's element acting on the tensor's slot (axis, slice, sub-tensor), by the
instance's kind (:meth:`~symmerge.groups.base.Kind.transform`, the same call :func:`symmerge.core.apply.apply`
makes). A ``copy`` step leaves the tensor as it is. A declared tie's alias receives its source's new tensor
(the very same tensor, as in memory the tie shares it). The norms a step lists as folded were folded before the
elements were solved (the canonical form both models are solved in, :func:`symmerge.core.apply.canonicalize`):
the executor maps the canonical tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..core.apply import stages
from ..core.slots import HALF
from ..errors import SymmergeError


@dataclass(frozen=True)
class AlignMap:
    """One alignment map acting on a tensor: the group instance (``layer.3.attn.qk``, ``residual``), its
    symmetry and kind, the axis it acts on, the slice of that axis (``start``, ``length``; None: the whole
    axis) and the sub-tensor of a stacked tensor (``index``: one expert of fused experts)."""

    instance: str
    symmetry: str
    kind: str
    axis: int
    start: int = 0
    length: int | None = None
    index: int | None = None
    slot: object = field(default=None, compare=False, repr=False)  # the bound Slot the executor maps

    def describe(self) -> dict:
        out = {"instance": self.instance, "symmetry": self.symmetry, "kind": self.kind, "axis": self.axis}
        if self.length is not None:
            out["slice"] = [self.start, self.start + self.length]
        if self.index is not None:
            out["index"] = self.index
        return out


@dataclass(frozen=True)
class AlignStep:
    """One output tensor: the maps acting on it (``transform``), the norms folded into it, or ``copy``."""

    tensor: str
    maps: tuple[AlignMap, ...] = ()
    folds: tuple[str, ...] = ()  # the canonical form's changes: '<norm weight> folded' (the residual stream's)

    @property
    def op(self) -> str:
        return "transform" if self.maps or self.folds else "copy"

    def describe(self) -> dict:
        out = {"tensor": self.tensor, "op": self.op}
        if self.maps:
            out["maps"] = [m.describe() for m in self.maps]
        if self.folds:
            out["folds"] = list(self.folds)
        return out


def plan_steps(keys, instances) -> tuple[AlignStep, ...]:
    """Every key of ``keys`` (the output's tensors, in order) with the maps of ``instances`` acting on it (a
    slot's aliases, tied tensors, receive the same maps) and what the kinds' canonical forms change in it (the
    norms the residual stream folds into its readers: :meth:`~symmerge.groups.base.Kind.canonical_changes`)."""
    keys = list(keys)
    maps: dict[str, list[AlignMap]] = {}
    folds: dict[str, list[str]] = {}
    for inst in instances:
        for s in inst.slots:
            m = AlignMap(inst.name, inst.group.symmetry, inst.group.kind, s.axis, s.start, s.length, s.index, s)
            for key in (s.key, *s.aliases):
                maps.setdefault(key, []).append(m)
        for key, why in inst.kind.canonical_changes(inst, keys).items():
            folds.setdefault(key, []).extend(why)
    return tuple(AlignStep(k, tuple(maps.get(k, ())), tuple(folds.get(k, ()))) for k in keys)


def transformed(step, tensor: torch.Tensor, instances: dict, elements: dict, rounded: bool = True) -> torch.Tensor:
    """``tensor`` with the maps of ``step`` applied, first to last (``instances``: by name; a map whose instance
    has no element — a group the matcher left as it is — changes nothing). A float16/bfloat16 tensor is carried in
    float32 through every map and rounded once at the end, as :func:`~symmerge.core.apply.apply` does (``rounded``
    False: returned in float32, unrounded)."""
    stored = tensor.dtype
    if stored in HALF:
        tensor = tensor.float()
    for m in step.maps:
        inst = instances[m.instance]
        element = elements.get(inst.name)
        if element is None:
            continue
        for stage in stages(element):
            tensor = inst.kind.transform(tensor, m.slot, inst, stage)
    return tensor.to(stored) if rounded else tensor


def source(step) -> str:
    """The tensor whose maps ``step`` runs: its own, or — a declared tie's alias — the tensor it is tied to."""
    sources = {m.slot.key for m in step.maps}
    if len(sources) != 1:
        raise SymmergeError(f"{step.tensor}: its maps act on several tensors ({', '.join(sorted(sources))})")
    return sources.pop()


def execute_steps(steps, tensors: dict, instances, elements: dict, rounded: bool = True) -> dict:
    """Run ``steps`` over ``tensors`` (``{name: tensor}``, in the canonical form the elements were solved in; every
    tensor a transformed step names must be there): a new dict, the copied tensors shared with ``tensors``, a
    declared alias given its source's new tensor. ``instances``: those the steps' maps name. ``rounded`` False: a
    transformed float16/bfloat16 tensor is returned in float32, before its one rounding (:func:`transformed`)."""
    by_name = {i.name: i for i in instances}
    out = dict(tensors)
    for step in steps:
        if not step.maps or source(step) != step.tensor:
            continue  # a copy (the tensor as it is), or an alias: its source's new tensor, below
        new = transformed(step, tensors[step.tensor], by_name, elements, rounded)
        out[step.tensor] = new
        for alias in {a for m in step.maps for a in m.slot.aliases}:
            out[alias] = new
    return out
