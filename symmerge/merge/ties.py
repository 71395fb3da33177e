"""TIES merging (Yadav et al., 2023): trim each task vector, elect signs, disjoint mean.

For task vectors τ_i = θ_i − θ_base (scaled by the optional weights w_i):

1. trim: keep the ``density`` fraction of entries of largest magnitude of each τ_i (over the whole
   merged model by default, ``scope="model"``; or per tensor, ``scope="tensor"``), zero the rest;
2. elect: γ = sign(Σ_i τ̂_i) per entry;
3. disjoint mean: τ_m = mean of the τ̂_i whose sign equals γ (zeros excluded; 0 if none agree);

and θ = θ_base + λ τ_m (λ = ``scale``).
"""

from __future__ import annotations

import torch

from ..errors import SymmergeError
from .common import check_state_dicts, normalized_weights, require_base

NAME = "ties"
NEEDS = None
NEEDS_BASE = True
PARAMS = {"density": 0.2, "scale": 1.0, "scope": "model"}


def magnitude_threshold(tensors, density: float) -> float:
    """The smallest magnitude kept when keeping the top ``density`` fraction of all entries."""
    flat = torch.cat([t.reshape(-1).abs().float() for t in tensors])
    k = max(1, int(round(density * flat.numel())))
    return flat.kthvalue(flat.numel() - k + 1).values.item()


def trim(tensors, density: float) -> list[torch.Tensor]:
    """Zero all entries below the top-``density`` magnitude threshold taken over ``tensors`` together."""
    if density >= 1.0:
        return list(tensors)
    thr = magnitude_threshold(tensors, density)
    return [torch.where(t.abs() >= thr, t, torch.zeros_like(t)) for t in tensors]


def disjoint_mean(vectors) -> torch.Tensor:
    """Elect γ = sign(Σ τ̂_i) and average the entries agreeing with γ (non-zero ones only)."""
    stacked = torch.stack(vectors)
    elected = torch.sign(stacked.sum(0))
    agree = (torch.sign(stacked) == elected) & (stacked != 0)
    count = agree.sum(0)
    total = torch.where(agree, stacked, torch.zeros_like(stacked)).sum(0)
    return torch.where(count > 0, total / count.clamp(min=1), torch.zeros_like(total))


def merge(state_dicts, weights=None, stats=None, base=None, density: float = 0.2, scale: float = 1.0,
          scope: str = "model") -> dict:
    keys = check_state_dicts(state_dicts)
    base = require_base(base, state_dicts, NAME)
    if not 0.0 < float(density) <= 1.0:
        raise SymmergeError(f"ties: density must be in (0, 1], got {density}")
    if scope not in ("model", "tensor"):
        raise SymmergeError(f"ties: scope must be 'model' or 'tensor', got {scope!r}")
    w = normalized_weights(weights, len(state_dicts), normalize=False)
    fkeys = [k for k in keys if base[k].is_floating_point()]
    # task vectors per model: {key: τ_i[key]}
    tvs = [{k: v * wi for k, v in zip(fkeys, (sd[k].double() - base[k].double() for k in fkeys))}
           for sd, wi in zip(state_dicts, w)]
    trimmed = []
    for tv in tvs:
        if scope == "model":
            trimmed.append(dict(zip(fkeys, trim([tv[k] for k in fkeys], density))))
        else:
            trimmed.append({k: trim([tv[k]], density)[0] for k in fkeys})
    out = {k: base[k].clone() for k in keys if k not in fkeys}
    for k in fkeys:
        merged = disjoint_mean([t[k] for t in trimmed])
        out[k] = (base[k].double() + float(scale) * merged).to(base[k].dtype)
    return out


__all__ = ["merge", "trim", "disjoint_mean", "magnitude_threshold"]
