"""DARE (Yu et al., 2024): drop each task-vector entry with probability p, rescale survivors by 1/(1 − p).

τ̃_i = m_i ⊙ τ_i / (1 − p), m_i ~ Bernoulli(1 − p) drawn from a generator seeded with ``seed``
(models in order, tensors in key order), then task arithmetic: θ = θ_base + λ Σ_i w_i τ̃_i.
"""

from __future__ import annotations

import torch

from ..errors import SymmergeError
from .common import check_state_dicts, normalized_weights, require_base

NAME = "dare"
NEEDS = None
NEEDS_BASE = True
PARAMS = {"drop": 0.9, "scale": 1.0, "seed": 0}


def drop_and_rescale(tensor: torch.Tensor, p: float, generator: torch.Generator) -> torch.Tensor:
    keep = torch.rand(tensor.shape, generator=generator, dtype=torch.float64) >= p
    return torch.where(keep, tensor / (1.0 - p), torch.zeros_like(tensor))


def merge(state_dicts, weights=None, stats=None, base=None, drop: float = 0.9, scale: float = 1.0,
          seed: int = 0) -> dict:
    keys = check_state_dicts(state_dicts)
    base = require_base(base, state_dicts, NAME)
    p = float(drop)
    if not 0.0 <= p < 1.0:
        raise SymmergeError(f"dare: drop probability must be in [0, 1), got {drop}")
    w = normalized_weights(weights, len(state_dicts), normalize=False)
    g = torch.Generator().manual_seed(int(seed))
    fkeys = [k for k in keys if base[k].is_floating_point()]
    delta = {k: torch.zeros_like(base[k], dtype=torch.float64) for k in fkeys}
    for sd, wi in zip(state_dicts, w):
        for k in fkeys:
            tv = sd[k].double() - base[k].double()
            delta[k].add_(drop_and_rescale(tv.cpu(), p, g).to(tv.device), alpha=wi)
    out = {k: base[k].clone() for k in keys if k not in fkeys}
    for k in fkeys:
        out[k] = (base[k].double() + float(scale) * delta[k]).to(base[k].dtype)
    return out
