"""The one layout check: models that are aligned, merged or interpolated together must agree in model
type, attention heads, tensor names and shapes — else one clear error naming the two models."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SymmergeError


@dataclass
class Layout:
    name: str  # how messages call the model ("model", "anchor", a folder path)
    model_type: str | None
    heads: int | None
    shapes: dict  # {tensor name: shape}
    disk_names: dict | None = None  # in-memory → on-disk tensor names, for messages


def layout_of(model, name: str, keys=None) -> Layout:
    """The layout of a transformers model (optionally only ``keys``)."""
    sd = model.state_dict()
    keys = sd.keys() if keys is None else keys
    return Layout(name, model.config.model_type, getattr(model.config, "num_attention_heads", None),
                  {k: tuple(sd[k].shape) for k in keys})


def check_layouts(layouts: list[Layout], hint: str = "") -> None:
    """Every layout equal to the first, else :class:`SymmergeError` (``hint`` ends shape messages)."""
    ref = layouts[0]
    for other in layouts[1:]:
        if ref.model_type != other.model_type:
            raise SymmergeError(f"architectures differ: {ref.name} is {ref.model_type!r}, "
                                f"{other.name} is {other.model_type!r}")
        if ref.heads != other.heads:  # same shapes, but the head blocks would not correspond
            raise SymmergeError(f"architectures differ: {ref.name} has {ref.heads} attention heads, "
                                f"{other.name} has {other.heads}")
        if ref.shapes.keys() != other.shapes.keys():
            only = sorted(set(ref.shapes) ^ set(other.shapes))[:3]
            names = ref.disk_names or {}
            raise SymmergeError(f"architectures differ: tensors present in only one of {ref.name} and {other.name}, "
                                f"e.g. {[names.get(k, k) for k in only]}")
        for k, shape in ref.shapes.items():
            if tuple(shape) != tuple(other.shapes[k]):
                disk = (ref.disk_names or {}).get(k, k)
                raise SymmergeError(f"shapes differ for {disk}: {tuple(shape)} in {ref.name}, "
                                    f"{tuple(other.shapes[k])} in {other.name}{hint}")
