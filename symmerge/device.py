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
    if dev.type not in ("cpu", "cuda"):  # 'meta' holds no values; other backends are not run here
        raise SymmergeError(f"unknown device {device!r}; use cpu or cuda")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SymmergeError("--device cuda requested but no CUDA device is available")
    return dev


def flag_device(device, cuda_flag: str | None, default: str | None = None) -> str | None:
    """The device of a mergekit-style command, one rule for ``run``, ``moe`` and ``extract-lora``: ``--device``
    given is checked (a GPU asked for and absent: one error); else mergekit's ``--cuda`` / ``--gpu-rich``
    (``cuda_flag``: the one given, or None) mean the GPU when there is one, and a warning and ``default`` (the
    CPU) when there is none."""
    if device is not None:
        return str(resolve_device(device))
    if cuda_flag is not None:
        if torch.cuda.is_available():
            return "cuda"
        import sys

        print(f"symmerge: warning: {cuda_flag}: no CUDA device here; running on the CPU", file=sys.stderr)
    return default


def cuda_flag_given(args) -> str | None:
    """``--cuda`` or ``--gpu-rich`` when one of mergekit's GPU flags was parsed into ``args``, else None."""
    if getattr(args, "cuda", False):
        return "--cuda"
    return "--gpu-rich" if getattr(args, "gpu_rich", False) else None
