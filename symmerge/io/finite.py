"""The one finiteness check of weights: a folder's tensors when they are loaded, a model given in memory when an
entry takes it (:func:`symmerge.io.arguments.model_argument`), a streamed checkpoint's tensors as they are read, and
an aligned model rounded to its stored dtype (:func:`non_finite`: the tensor, for a caller's own message)."""

from __future__ import annotations

import torch

from ..errors import SymmergeError


def non_finite(state_dict: dict) -> str | None:
    """The first name of ``state_dict`` whose floating tensor holds NaN or Inf, or None."""
    for key, t in state_dict.items():
        # a finite sum proves every entry finite (NaN and Inf propagate) at the speed of one read; a sum
        # that overflowed is checked entry by entry
        if t.is_floating_point() and not torch.isfinite(t.reshape(-1).sum()) and not torch.isfinite(t).all():
            return key
    return None


def check_finite(state_dict: dict, where: str, disk_names=None) -> None:
    """NaN/Inf refused, naming the tensor as the checkpoint does (``disk_names``: in-memory → on-disk)."""
    key = non_finite(state_dict)
    if key is not None:
        name = (disk_names or {}).get(key, key)
        raise SymmergeError(f"{where}: tensor {name!r} holds NaN or Inf values")
