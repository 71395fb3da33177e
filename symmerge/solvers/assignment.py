"""Linear assignment of permuted units (FFN hidden units), solved exactly with scipy."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment


def match_permutation(C: torch.Tensor) -> torch.Tensor:
    """Permutation ``perm`` maximising ``sum_j C[perm[j], j]`` (C[i, j]: unit i of the moved model
    against unit j of the anchor). Applying ``index_select(perm)`` puts unit ``perm[j]`` at ``j``."""
    rows, cols = linear_sum_assignment(C.detach().cpu().numpy(), maximize=True)
    perm = np.empty_like(rows)
    perm[cols] = rows
    return torch.from_numpy(perm).long()


def solve_assignments(costs, workers: int | None = None) -> list[torch.Tensor]:
    """Solve many assignment problems. ``costs`` may be a lazy iterable: each problem is handed to
    a thread as soon as its cost exists, so the next cost GEMM overlaps the running assignments
    (scipy releases the GIL)."""
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        return [match_permutation(c) for c in costs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(match_permutation, c) for c in costs]
        return [f.result() for f in futures]
