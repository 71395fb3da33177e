"""Linear assignment of permuted units (FFN hidden units), solved exactly with scipy."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment


def match_permutation(C: torch.Tensor, consume: bool = False) -> torch.Tensor:
    """Permutation ``perm`` maximising ``sum_j C[perm[j], j]`` (C[i, j]: unit i of the moved model
    against unit j of the anchor). Applying ``index_select(perm)`` puts unit ``perm[j]`` at ``j``.

    scipy minimises a C-contiguous float64 matrix; ``maximize=True`` and any other dtype make it copy
    the whole matrix (0.6 GB at n = 8640). ``consume=True`` negates a float64 CPU ``C`` in place
    instead (``C`` is garbage afterwards), so the assignment needs no memory beyond the cost."""
    a = C.detach().cpu().numpy()
    if consume and a.dtype == np.float64 and a.flags.c_contiguous:
        a = np.negative(a, out=a)
    else:
        a = np.negative(a, dtype=np.float64)
    rows, cols = linear_sum_assignment(a)
    perm = np.empty_like(rows)
    perm[cols] = rows
    return torch.from_numpy(perm).long()


def solve_assignments(costs, workers: int | None = None, consume: bool = False) -> list[torch.Tensor]:
    """Solve many assignment problems. ``costs`` may be a lazy iterable: each problem is handed to
    a thread as soon as its cost exists, so the next cost GEMM overlaps the running assignments
    (scipy releases the GIL). ``consume``: as in :func:`match_permutation`."""
    workers = workers or os.cpu_count() or 1
    if workers == 1:
        return [match_permutation(c, consume) for c in costs]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures = [pool.submit(match_permutation, c, consume) for c in costs]
        return [f.result() for f in futures]
