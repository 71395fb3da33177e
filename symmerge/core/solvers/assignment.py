"""Linear assignment of permuted units (FFN hidden units), solved exactly.

One function chooses the solver (:func:`linear_assignment`): ``lapx``'s ``lapjvh`` (Jonker-Volgenant in
the cost's own precision, releases the GIL) when the optional ``lapx`` package is importable — measured 1.5
to 4x faster than scipy on trained models' FFN costs and as fast on random ones (docs/results.md,
``python -m benchmarks.bench_assignment``) — else scipy's ``linear_sum_assignment``. Both are exact:
the optimum (the objective value) is the same; where several assignments tie, they may pick different
ones (tests/groups/test_solvers.py checks random, structured, integer-tied and constant costs).
``SYMMERGE_ASSIGNMENT=scipy`` forces scipy.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .procrustes import finite_cost


def _lapx():
    """``lap.lapjvh`` from ``lapx`` (≥ 0.9), or None (not installed, the older ``lap`` package, or
    ``SYMMERGE_ASSIGNMENT=scipy``)."""
    if os.environ.get("SYMMERGE_ASSIGNMENT", "").lower() == "scipy":
        return None
    try:
        import lap
    except ImportError:
        return None
    return getattr(lap, "lapjvh", None)


def assignment_solver() -> str:
    """The name of the exact solver :func:`linear_assignment` uses here."""
    return "lapx.lapjvh" if _lapx() is not None else "scipy.linear_sum_assignment"


def linear_assignment(cost: np.ndarray, solver: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Exact minimum-cost assignment of a finite float32 or float64 (n, m) ``cost`` (other dtypes are
    solved in float64): ``(rows, cols)`` with ``rows`` increasing, ``min(n, m)`` pairs, as scipy returns
    them. ``solver``: ``scipy``, ``lapx`` or None (the fastest available: ``lapx``'s ``lapjvh`` if
    installed, else scipy). ``lapjvh`` works in the cost's own precision (float32 costs: 1.4x faster
    than float64 on random 3072-wide costs; tests/pipeline/test_speed.py checks that its optimum equals scipy's
    float64 optimum of the same values); scipy always works in float64. ``cost`` is read, never
    changed."""
    lapjvh = None if solver == "scipy" else _lapx()
    if solver == "lapx" and lapjvh is None:
        raise ImportError("the lapx package (lap.lapjvh) is not installed: pip install lapx")
    if cost.dtype not in (np.float32, np.float64):
        cost = cost.astype(np.float64)
    if lapjvh is None or min(cost.shape, default=0) == 0:
        from scipy.optimize import linear_sum_assignment  # imported on first use: a plain merge never pays it

        return linear_sum_assignment(cost)
    rows, cols = lapjvh(cost, extend_cost=cost.shape[0] != cost.shape[1], return_cost=False, precision="native")
    return np.asarray(rows, dtype=np.int64), np.asarray(cols, dtype=np.int64)


def match_permutation(C: torch.Tensor, consume: bool = False) -> torch.Tensor:
    """Permutation ``perm`` maximising ``sum_j C[perm[j], j]`` (C[i, j]: unit i of the moved model
    against unit j of the anchor). Applying ``index_select(perm)`` puts unit ``perm[j]`` at ``j``.

    The solvers minimise a C-contiguous float32 or float64 matrix (solved in its own precision); any
    other dtype or layout is copied, to float64 (0.6 GB at n = 8640). ``consume=True`` negates a
    contiguous float32/float64 CPU ``C`` in place instead (``C`` is garbage afterwards), so the
    assignment needs no memory beyond the cost."""
    C = C.detach()
    finite_cost(C)
    if C.dtype not in (torch.float32, torch.float64):
        C, consume = C.to(torch.float64), True
    a = C.cpu().numpy()
    if consume and a.flags.c_contiguous and C.device.type == "cpu":
        a = np.negative(a, out=a)
    else:
        a = np.ascontiguousarray(np.negative(a))
    rows, cols = linear_assignment(a)
    perm = np.empty_like(rows)
    perm[cols] = rows
    return torch.from_numpy(perm).long()
