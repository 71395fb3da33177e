"""The one layout check: models that are aligned, merged or interpolated together must agree in model
type, attention heads, tensor names and shapes — else one clear error naming the two models. The
layout of a loaded model is :func:`symmerge.io.layout.layout_of`."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import SymmergeError


@dataclass
class Layout:
    name: str  # how messages call the model ("model", "anchor", a folder path)
    model_type: str | None
    heads: int | None
    shapes: dict  # {tensor name: shape}
    disk_names: object = None  # in-memory → on-disk tensor names (a mapping), for messages
    class_name: str | None = None  # the model class (T5EncoderModel), for messages

    def disk(self, key: str) -> str:
        return (self.disk_names or {}).get(key, key)


def check_layouts(layouts: list[Layout], hint: str = "") -> None:
    """Every layout equal to the first, else :class:`SymmergeError` (``hint`` ends shape messages)."""
    ref = layouts[0]
    for other in layouts[1:]:
        if ref.model_type != other.model_type:
            raise SymmergeError(f"architectures differ: {ref.name} is {ref.model_type!r}, "
                                f"{other.name} is {other.model_type!r}")
        if ref.heads != other.heads:  # same shapes, but the head blocks would not correspond
            raise SymmergeError(f"architectures differ: {ref.name} has {_heads(ref.heads)} attention heads, "
                                f"{other.name} has {_heads(other.heads)}")
        if ref.shapes.keys() != other.shapes.keys():
            _part_of(ref, other)
            _experts_stored_apart(ref, other)
            only_ref = sorted(set(ref.shapes) - set(other.shapes))[:3]
            only_other = sorted(set(other.shapes) - set(ref.shapes))[:3]
            where = [f"only in {x.name}: {[x.disk(k) for k in keys]}" for x, keys in ((ref, only_ref),
                                                                                   (other, only_other)) if keys]
            raise SymmergeError(f"architectures differ: tensors present in only one of {ref.name} and {other.name} "
                                f"({'; '.join(where)})")
        for k in sorted(ref.shapes, key=ref.disk):  # one order for models loaded and files read: the first named
            shape = ref.shapes[k]
            if tuple(shape) != tuple(other.shapes[k]):
                raise SymmergeError(f"shapes differ for {ref.disk(k)}: {tuple(shape)} in {ref.name}, "
                                    f"{tuple(other.shapes[k])} in {other.name}{hint}")


def _heads(heads) -> str:
    """A head count, or the per-sub-config counts of a model made of several (CLIP: text_config 8, ...)."""
    return ", ".join(f"{name} {h}" for name, h in heads) if isinstance(heads, tuple) else str(heads)


PER_EXPERT = re.compile(r"\.experts\.\d+\.")  # experts.3.gate_proj.weight: one stored tensor per expert
FUSED_EXPERTS = re.compile(r"\.experts\.[A-Za-z_]+$")  # experts.gate_up_proj: every expert in one tensor


def experts_fused_hint(name: str, shapes) -> str:
    """For a tensor stored per expert (``experts.3.up_proj.weight``) missing from a checkpoint that stores its
    experts fused (``experts.gate_up_proj``): why, and the ways out ('' otherwise)."""
    if PER_EXPERT.search(name) and any(FUSED_EXPERTS.search(k) for k in shapes):
        return ("; that model stores its experts fused over the experts (transformers' in-memory layout), the others "
                "one tensor per expert: merge in memory (symmerge merge --mode memory), or save it again with "
                "transformers' save_pretrained, which writes a tensor per expert")
    return ""


def _experts_stored_apart(a: Layout, b: Layout) -> None:
    """Two checkpoints of one mixture of experts, one storing a tensor per expert (as ``save_pretrained`` writes
    it), the other the experts fused (transformers 5's in-memory layout, saved as it is): the tensors read as
    stored do not pair. One error saying so, and the ways out, not "architectures differ"."""
    for per, fused in ((a, b), (b, a)):
        only_per = list(set(per.shapes) - set(fused.shapes))
        only_fused = list(set(fused.shapes) - set(per.shapes))
        if (only_per and only_fused and all(PER_EXPERT.search(per.disk(k)) for k in only_per)
                and all(FUSED_EXPERTS.search(fused.disk(k)) for k in only_fused)):
            raise SymmergeError(
                f"{per.name} stores its experts one tensor per expert ({per.disk(min(only_per, key=per.disk))}), "
                f"{fused.name} fused over the experts ({fused.disk(min(only_fused, key=fused.disk))}): one model "
                "in two layouts, whose tensors read as stored do not pair; merge in memory (--mode memory), or save "
                f"{fused.name} again with transformers' save_pretrained, which writes a tensor per expert")


def _part_of(a: Layout, b: Layout) -> None:
    """One of two checkpoints of different classes holding a part of the other's tensors under the same names
    and shapes (``T5EncoderModel`` and ``T5ForConditionalGeneration``: no prefix, the encoder is a subset): one
    error saying how to merge the shared part."""
    small, big = (a, b) if set(a.shapes) < set(b.shapes) else (b, a) if set(b.shapes) < set(a.shapes) else (None, None)
    if small is None or small.class_name == big.class_name or not small.class_name or not big.class_name:
        return
    if any(tuple(small.shapes[k]) != tuple(big.shapes[k]) for k in small.shapes):
        return
    extra = sorted(set(big.shapes) - set(small.shapes))
    raise SymmergeError(
        f"{small.name} is a {small.class_name} and {big.name} a {big.class_name}: the {small.class_name}'s "
        f"{len(small.shapes)} tensors are a part of the {big.class_name}'s, under the same names, which also has "
        f"{len(extra)} more ({', '.join(big.disk(k) for k in extra[:2])}{' ...' if len(extra) > 2 else ''}); "
        f"symmerge merges and aligns checkpoints of one class: to merge the shared part, save {big.name} as a "
        f"{small.class_name} first ({small.class_name}.from_pretrained(...).save_pretrained(DIR) keeps only those "
        "tensors) and give DIR instead")
