"""Where statistics and evaluation run: ``--device cpu|cuda|cuda:N|auto``."""

from __future__ import annotations

import torch

from .errors import SymmergeError


def resolve_device(device) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or None (cuda when available, else cpu)."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise SymmergeError(f"unknown device {device!r}; use cpu or cuda") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SymmergeError("--device cuda requested but no CUDA device is available")
    return dev
