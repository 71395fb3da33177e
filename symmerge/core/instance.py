"""A spec bound to one concrete state dict: slots (real keys, axes, slices) and group instances."""

from __future__ import annotations

from dataclasses import dataclass

from .kinds import get_kind
from .spec import Group


@dataclass(frozen=True)
class Slot:
    """One member tensor of one group instance: state-dict key, axis and scale power.

    ``start``/``length``: the slice of the axis the group acts on (``length`` None: the whole axis);
    ``repeat``: member heads per group head (GQA: a query-head member of a KV-head group has
    ``H / H_kv``); ``diag``: a norm weight transformed as a diagonal matrix (residual group);
    ``aliases``: keys declared tied to this one (they receive the same new tensor); ``period``: a strided
    slice (head-interleaved fused layouts): ``start``/``length`` repeat in every ``period`` rows of the axis;
    ``index``: the slot lies in the sub-tensor ``t[index]`` of a stacked tensor (one expert of fused
    experts); ``axis`` counts the whole tensor's axes."""

    key: str
    axis: int
    power: int
    start: int = 0
    length: int | None = None
    repeat: int = 1
    diag: bool = False
    aliases: tuple[str, ...] = ()
    period: int | None = None
    index: int | None = None


@dataclass(frozen=True)
class Instance:
    """A group in one layer, e.g. ``layer.3.attn.qk`` (or model-wide: ``residual``, layer -1).

    ``blocks``: group heads (head kinds) or 1; ``size``: head dim, permuted units or hidden size;
    ``info``: kind-specific binding facts (a frozen dataclass of the kind's module, or None)."""

    name: str
    layer: int
    group: Group
    slots: tuple[Slot, ...]
    blocks: int
    size: int
    info: object = None

    @property
    def kind(self):
        return get_kind(self.group.kind)

    def keys(self) -> list[str]:
        return [s.key for s in self.slots]
