"""Apply group elements to a state dict — the only code that changes weights — and the other loops
over elements (canonical form, random and identity elements, validity checks). Kind-agnostic: each
instance's kind does the work."""

from __future__ import annotations

import torch

from .slots import HALF


def stages(element) -> tuple:
    """An element, or a composition given as a tuple of elements applied first to last."""
    return element if isinstance(element, tuple) else (element,)


def apply(state_dict: dict, instances, elements: dict) -> dict:
    """A new state dict with every instance's element applied, in instance order (untouched tensors
    are shared; a tensor's declared aliases receive the same new tensor). An element may be a tuple of
    elements of the instance's kind, applied first to last (a closed-form solution then a learned one)."""
    out = dict(state_dict)
    lifted: dict = {}  # float16/bfloat16 tensors carried in float32 until every element is applied: key -> (dtype,
    # aliases); rounded once at the end, not after every instance and stage (the stored values upcast exactly)
    for inst in instances:
        element = elements.get(inst.name)
        if element is None:
            continue
        kind = inst.kind
        for slot in inst.slots:
            new = out[slot.key]
            if new.dtype in HALF:
                lifted.setdefault(slot.key, (new.dtype, set()))[1].update(slot.aliases)
                new = new.float()
            for stage in stages(element):
                new = kind.transform(new, slot, inst, stage)
            out[slot.key] = new
            for alias in slot.aliases:
                out[alias] = new
    for key, (dtype, aliases) in lifted.items():
        out[key] = out[key].to(dtype)
        for alias in aliases:
            out[alias] = out[key]
    return out


def canonicalize(state_dict: dict, instances) -> dict:
    """The same function in the parameterisation the instances' groups act on (the residual stream
    folds its norms into their readers); a no-op for most kinds."""
    out = state_dict
    for inst in instances:
        out = inst.kind.canonicalize(out, inst)
    return out


def random_elements(instances, generator: torch.Generator, scale: bool = True) -> dict:
    """A random group element for every instance (Haar rotations, log-normal scales, permutations)."""
    return {inst.name: inst.kind.random(inst, generator, scale) for inst in instances}


def identity_elements(instances) -> dict:
    return {inst.name: inst.kind.identity(inst) for inst in instances}


def check_elements(instances, elements: dict, tol: float = 1e-6) -> None:
    """Raise unless every element is a valid group element (hence function-preserving when applied)."""
    for inst in instances:
        for stage in stages(elements.get(inst.name, ())):
            inst.kind.check(inst, stage, tol)
