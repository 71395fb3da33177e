"""L2 distances between state dicts: whole model, per group instance, per layer."""

from __future__ import annotations

import math


def sq_distance(sd_a: dict, sd_b: dict, keys) -> float:
    return sum((sd_a[k].double() - sd_b[k].double()).square().sum().item() for k in keys)


def distance(sd_a: dict, sd_b: dict, keys) -> float:
    return math.sqrt(sq_distance(sd_a, sd_b, keys))


def parameter_keys(model) -> list[str]:
    """Names of the model's parameters, tied parameters once."""
    return [name for name, _ in model.named_parameters()]


def per_module(instances, sd_a: dict, sd_b: dict) -> dict[str, float]:
    """Distance over each group instance's tensors, e.g. ``layer.0.attn.qk``."""
    return {inst.name: distance(sd_a, sd_b, [s.key for s in inst.slots]) for inst in instances}
