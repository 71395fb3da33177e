"""Resolve a spec against a concrete state dict: real tensor names, layers and head counts."""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SymmergeError
from .spec import HEAD_ORTHOGONAL, Group, Spec


@dataclass(frozen=True)
class Slot:
    """One member tensor of one group instance: state-dict key, axis and scale power."""

    key: str
    axis: int
    power: int


@dataclass(frozen=True)
class Instance:
    """A group in one layer, e.g. ``layer.3.attn.qk``."""

    name: str
    layer: int
    group: Group
    slots: tuple[Slot, ...]
    blocks: int  # number of heads (head groups) or 1 (permutations)
    size: int  # head dim, or number of permuted units


def find_prefix(spec: Spec, keys) -> str:
    """Prefix of the base model inside the state dict ('' for AutoModel, 'bert.' for task models)."""
    probe = spec.groups[0].members[0].name.format(i=0)
    hits = sorted(k[: -len(probe)] for k in keys if k.endswith(probe) and (k == probe or k[-len(probe) - 1] == "."))
    if len(hits) != 1:
        raise SymmergeError(
            f"cannot locate the {spec.family} layers in the checkpoint (looked for '*{probe}', found {len(hits)})"
        )
    return hits[0]


def resolve(spec: Spec, state_dict, num_layers: int, num_heads: int, layers=None) -> list[Instance]:
    """All group instances of ``spec`` in ``state_dict`` (optionally only the given ``layers``)."""
    prefix = find_prefix(spec, state_dict.keys())
    chosen = range(num_layers) if layers is None else layers
    out = []
    for i in chosen:
        if not 0 <= i < num_layers:
            raise SymmergeError(f"layer {i} out of range: the model has {num_layers} layers")
        for group in spec.groups:
            slots = []
            for m in group.members:
                key = prefix + m.name.format(i=i)
                if key not in state_dict:
                    if m.optional:
                        continue
                    raise SymmergeError(f"checkpoint lacks tensor {key!r} expected by the {spec.family} spec")
                slots.append(Slot(key, m.axis, m.power))
            first = state_dict[slots[0].key]
            n = first.shape[slots[0].axis]
            blocks = num_heads if group.kind == HEAD_ORTHOGONAL else 1
            if n % blocks:
                raise SymmergeError(f"{slots[0].key}: {n} rows do not split into {blocks} heads")
            for s in slots:
                if state_dict[s.key].shape[s.axis] != n:
                    raise SymmergeError(f"{s.key}: axis {s.axis} has size {state_dict[s.key].shape[s.axis]}, expected {n}")
            out.append(Instance(f"layer.{i}.{group.name}", i, group, tuple(slots), blocks, n // blocks))
    return out
