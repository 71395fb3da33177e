"""L2 distances between state dicts: whole model, per group instance, per layer (one squared-distance
function; everything else sums it)."""

from __future__ import annotations

import math

import torch

from .slots import precise_dtype


def sq_distance(sd_a: dict, sd_b: dict, keys, block: int = 1 << 15) -> float:
    """Squared L2 distance, summed in float64, a block of ``block`` elements at a time (a float64 copy
    of a whole 100 M-element embedding would be 0.8 GB per operand). Differences of 16-bit tensors
    are taken in float32, where they are exact; float32/float64 ones in float64."""
    total = 0.0
    for k in keys:
        a, b = sd_a[k].detach().reshape(-1), sd_b[k].detach().reshape(-1)
        wide = precise_dtype(a, b)
        for i in range(0, a.numel(), block):
            d = a[i:i + block].to(wide) - b[i:i + block].to(wide)
            total += d.square().sum(dtype=torch.float64).item()
    return total


def distance(sd_a: dict, sd_b: dict, keys) -> float:
    return math.sqrt(sq_distance(sd_a, sd_b, keys))


def parameter_keys(model) -> list[str]:
    """Names of the model's parameters, tied parameters once."""
    return [name for name, _ in model.named_parameters()]


def per_module(instances, sd_a: dict, sd_b: dict) -> dict[str, float]:
    """Distance over each group instance's tensors, e.g. ``layer.0.attn.qk``."""
    return {inst.name: distance(sd_a, sd_b, [s.key for s in inst.slots]) for inst in instances}


LAYER_WORDS = ("layer", "layers", "h", "block")


def _layer_module(key: str):
    """(module path of the layer holding a state-dict key, its index), e.g. ``encoder.block.3`` → 3, or None."""
    parts = key.split(".")
    for i, p in enumerate(parts[:-1]):
        if p in LAYER_WORDS and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2]), int(parts[i + 1])
    return None


def layer_of(key: str):
    """Layer index of a state-dict key (``...layer.3.`` / ``...layers.3.`` / ``h.3.`` / ``block.3.``), else None."""
    found = _layer_module(key)
    return found[1] if found else None


def distance_table(sd_a: dict, sd_b: dict, keys, instances=()) -> dict:
    """L2 distance A–B over the whole model, per layer (all of a layer's tensors), per group instance.
    A layer is numbered as its group instances number it (several stacks: T5's decoder layers follow the
    encoder's), else by its key."""
    per_key = {k: sq_distance(sd_a, sd_b, [k]) for k in keys}
    numbered = {m[0]: i.layer for i in instances if i.layer >= 0 for s in i.slots
                if (m := _layer_module(s.key)) is not None}
    per_layer: dict[int, float] = {}
    for k, v in per_key.items():
        found = _layer_module(k)
        layer = None if found is None else numbered.get(found[0], found[1])
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0.0) + v
    return {
        "whole": math.sqrt(sum(per_key.values())),
        "per_layer": {str(i): math.sqrt(v) for i, v in sorted(per_layer.items())},
        "per_module": per_module(instances, sd_a, sd_b),
    }
