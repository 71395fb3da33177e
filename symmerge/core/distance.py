"""L2 distances between state dicts: whole model, per group instance, per layer (one squared-distance
function; everything else sums it). Which layer a tensor belongs to is the bound model's knowledge
(:class:`symmerge.pipeline.bound.BoundModel`), passed in as ``layer_of``."""

from __future__ import annotations

import math

import torch


def sq_distance(sd_a: dict, sd_b: dict, keys, block: int = 1 << 15, weights: dict | None = None) -> float:
    """Squared L2 distance, summed in float64, a block of ``block`` elements at a time (a float64 copy
    of a whole 100 M-element embedding would be 0.8 GB per operand). Differences and squares in float64
    whatever the tensors' dtype: a 16-bit tensor and its float32 copy give the same value (an alignment of half
    files solved in memory on float32 copies and streamed from the files reports one distance). ``weights``:
    ``{key: w}``, each such tensor's part counted ``w`` times (the others once)."""
    total = 0.0
    for k in keys:
        a, b = sd_a[k].detach().reshape(-1), sd_b[k].detach().reshape(-1)
        w = weights.get(k, 1.0) if weights else 1.0
        for i in range(0, a.numel(), block):
            d = a[i:i + block].to(torch.float64) - b[i:i + block].to(torch.float64)
            part = d.square().sum(dtype=torch.float64).item()
            total += part if w == 1.0 else w * part
    return total


def distance(sd_a: dict, sd_b: dict, keys) -> float:
    return math.sqrt(sq_distance(sd_a, sd_b, keys))


def parameter_keys(model) -> list[str]:
    """Names of the model's parameters, tied parameters once."""
    return [name for name, _ in model.named_parameters()]


def per_module(instances, sd_a: dict, sd_b: dict) -> dict[str, float]:
    """Distance over each group instance's tensors, e.g. ``layer.0.attn.qk`` (each tensor's part summed exactly, as
    the align report sums them: :class:`symmerge.pipeline.report.Distances`)."""
    return {inst.name: math.sqrt(math.fsum(sq_distance(sd_a, sd_b, [s.key]) for s in inst.slots))
            for inst in instances}


def distance_table(sd_a: dict, sd_b: dict, keys, instances=(), layer_of=None) -> dict:
    """L2 distance A–B over the whole model, per layer (all of a layer's tensors; ``layer_of(key)`` gives a
    tensor's layer or None, e.g. :meth:`symmerge.pipeline.bound.BoundModel.layer_of`; without it there
    is no per-layer part), per group instance."""
    per_key = {k: sq_distance(sd_a, sd_b, [k]) for k in keys}
    per_layer: dict[int, list] = {}
    for k, v in per_key.items():
        layer = layer_of(k) if layer_of is not None else None
        if layer is not None:
            per_layer.setdefault(layer, []).append(v)
    return {  # sums exact (fsum), as the align report's (pipeline.report.Distances): the same in any order
        "whole": math.sqrt(math.fsum(per_key.values())),
        "per_layer": {str(i): math.sqrt(math.fsum(v)) for i, v in sorted(per_layer.items())},
        "per_module": per_module(instances, sd_a, sd_b),
    }


def distance_before_after(model, anchor, aligned, instances=(), aligned_anchor=None, layer_of=None) -> dict:
    """{"before": table(model, anchor), "after": table(aligned, anchor in aligned's parameterisation)}."""
    keys = parameter_keys(model)
    after_anchor = (aligned_anchor or anchor).state_dict()
    return {"before": distance_table(model.state_dict(), anchor.state_dict(), keys, instances, layer_of),
            "after": distance_table(aligned.state_dict(), after_anchor, keys, instances, layer_of)}
