"""Helpers shared by the merge methods: weights, task vectors, dtype handling."""

from __future__ import annotations

import torch

from ..errors import SymmergeError


def normalized_weights(weights, n: int, normalize: bool = True) -> list[float]:
    """``n`` weights (uniform when ``None``), finite and non-negative, summing to 1 if ``normalize``."""
    if weights is None:
        weights = [1.0] * n
    weights = [float(w) for w in weights]
    if len(weights) != n:
        raise SymmergeError(f"got {len(weights)} weights for {n} models")
    if any(not (w >= 0.0 and w < float("inf")) for w in weights) or sum(weights) <= 0:
        raise SymmergeError(f"weights must be finite, non-negative and not all zero, got {weights}")
    total = sum(weights) if normalize else 1.0
    return [w / total for w in weights]


def check_state_dicts(state_dicts) -> list[str]:
    """Keys of the first state dict after checking all agree in keys and shapes."""
    if not state_dicts:
        raise SymmergeError("nothing to merge: no models given")
    keys = list(state_dicts[0])
    for i, sd in enumerate(state_dicts[1:], 1):
        if sd.keys() != state_dicts[0].keys():
            raise SymmergeError(f"model {i} has different tensors than model 0")
        for k in keys:
            if sd[k].shape != state_dicts[0][k].shape:
                raise SymmergeError(f"shapes differ for {k}: {tuple(sd[k].shape)} vs {tuple(state_dicts[0][k].shape)}")
    return keys


def weighted_sum(tensors, weights) -> torch.Tensor:
    """Σ w_i t_i in float64 (exact enough for any input dtype); caller casts back."""
    out = torch.zeros_like(tensors[0], dtype=torch.float64)
    for t, w in zip(tensors, weights):
        out.add_(t.double(), alpha=w)
    return out


def require_base(base, state_dicts, method: str) -> dict:
    if base is None:
        raise SymmergeError(f"method {method!r} needs a base model (the common pre-trained model): pass base=/--base")
    missing = [k for k in state_dicts[0] if k not in base]
    if missing:
        raise SymmergeError(f"base model lacks tensor {missing[0]!r}")
    for k in state_dicts[0]:
        if base[k].shape != state_dicts[0][k].shape:
            raise SymmergeError(f"base shape differs for {k}: {tuple(base[k].shape)} vs {tuple(state_dicts[0][k].shape)}")
    return base


def task_vectors(state_dicts, base, key) -> list[torch.Tensor]:
    return [sd[key].double() - base[key].double() for sd in state_dicts]
