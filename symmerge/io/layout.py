"""The layout (:class:`symmerge.core.layout.Layout`) of a loaded transformers model."""

from __future__ import annotations

from ..core.layout import Layout
from .hf import DiskNames, attention_heads


def layout_of(model, name: str, keys=None) -> Layout:
    """The layout of a transformers model (optionally only ``keys``)."""
    sd = model.state_dict()
    keys = sd.keys() if keys is None else keys
    return Layout(name, model.config.model_type, attention_heads(model.config),
                  {k: tuple(sd[k].shape) for k in keys}, DiskNames(model), type(model).__name__)
