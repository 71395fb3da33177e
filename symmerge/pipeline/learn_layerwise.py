"""Learned alignment in the memory of a few layers (issue 42, item 6): the working tensors of the layer-wise
learned steps built one layer at a time (the whole learned alignment of two checkpoints read layer by layer
from their files is :mod:`symmerge.pipeline.learn_layerwise_files`).

* :class:`LayerTensors` — a read-only mapping of a model's tensors with group elements applied (the
  closed-form start), converted to the working dtype and device, computed for one layer (or the tensors
  outside the layers) when one of its tensors is asked for and kept for the last ``keep`` such groups. The
  layer-wise learned steps (``LearnSettings.layerwise``) read A moved by the start and B through it, inside
  each layer's checkpointed forward, instead of a float32 copy of both whole models: the same values (the
  same operations per tensor), recomputed when the backward recomputes the layer.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import replace

import torch

from ..core.apply import apply
from ..core.resolve import config_sizes, layer_paths
from ..families import spec_for


def paths_of(model) -> list[str]:
    """Module paths of the model's layers, from its spec and config alone (no tensor read: works on a
    weightless ``meta`` skeleton)."""
    spec = spec_for(model.config.model_type)
    return layer_paths(spec, model.state_dict().keys(), config_sizes(spec, model.config))


def layer_groups(keys, paths) -> dict[str, list[str]]:
    """``{layer path or "": its tensor names}``: every name under a layer's path, the rest under ``""``."""
    out: dict[str, list[str]] = {p: [] for p in paths}
    out[""] = []
    prefixes = sorted(paths, key=len, reverse=True)
    for k in keys:
        out[next((p for p in prefixes if k.startswith(p + ".")), "")].append(k)
    return out


def _read(base, keys) -> dict:
    """``base``'s tensors ``keys``: a state dict's, or read at once from a checkpoint (``base.read``)."""
    return base.read(keys) if hasattr(base, "read") and not isinstance(base, dict) else {k: base[k] for k in keys}


def _wide(stored: torch.dtype, wanted: torch.dtype) -> torch.dtype:
    """The dtype a group element acts on a tensor in: the wider of its stored and wanted dtypes, float32 at least."""
    return max((stored, wanted, torch.float32), key=lambda d: torch.finfo(d).bits)


class LayerTensors(Mapping):
    """``base``'s tensors (a state dict, or a :class:`CheckpointTensors`) with ``elements`` applied to the
    ``instances``' slots, floating ones as ``dtype`` (None: as they are) on ``device``: one layer's at a time (see the
    module text), the last ``keep`` layers kept. The elements act in float32 at least (the wider of the stored dtype and
    ``dtype``), the result rounded to ``dtype`` once: a bfloat16 checkpoint is moved as its float32 upcast is."""

    def __init__(self, base, keys, paths, instances=(), elements=None, dtype=torch.float32, device="cpu",
                 keep: int = 2):
        self.base, self.names, self.dtype, self.device, self.keep = base, list(keys), dtype, device, keep
        self.groups = {g: ks for g, ks in layer_groups(self.names, paths).items() if ks}
        self.group_of = {k: g for g, ks in self.groups.items() for k in ks}
        elements = elements or {}
        self.moves: dict[str, list] = {}
        for g, ks in self.groups.items():
            inside = set(ks)
            self.moves[g] = [replace(i, slots=tuple(s for s in i.slots if s.key in inside))
                             for i in instances if i.name in elements and any(s.key in inside for s in i.slots)]
        self.elements = elements
        self.cache: OrderedDict = OrderedDict()
        self.reads = 0  # groups computed (tests: each layer computed when asked, not kept)

    def group(self, g: str) -> dict:
        if g in self.cache:
            self.cache.move_to_end(g)
            return self.cache[g]
        sd = _read(self.base, self.groups[g])
        want = {k: self.dtype or v.dtype for k, v in sd.items() if v.is_floating_point()}
        # in float32 at least (stored bfloat16 moved in bfloat16 was rounded twice): rounded once below
        if self.moves[g]:
            sd = apply({k: v.to(_wide(v.dtype, want[k])) if k in want else v for k, v in sd.items()}, self.moves[g],
                       self.elements)
        out = {k: (v.detach().to(self.device, want[k]) if k in want else v.to(self.device))
               for k, v in sd.items() if k in self.group_of}
        self.reads += 1
        self.cache[g] = out
        while len(self.cache) > self.keep:
            self.cache.popitem(last=False)
        return out

    def __getitem__(self, key):
        if key not in self.group_of:
            raise KeyError(key)
        return self.group(self.group_of[key])[key]

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def working_tensors(skeleton, ca, cb, instances, start: dict, dtype, device):
    """``(A moved by start, B)`` as :class:`LayerTensors` over the canonical ``ca``/``cb`` (the layer-wise
    learned steps' working tensors, one layer at a time)."""
    paths = paths_of(skeleton)
    return (LayerTensors(ca, list(ca.keys()), paths, instances, start, dtype, device),
            LayerTensors(cb, list(cb.keys()), paths, (), None, dtype, device))
