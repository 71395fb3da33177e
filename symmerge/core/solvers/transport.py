"""Optimal transport between two sets of units (POT): ground cost, plan, normalised map.

Units of the moved model A (rows, marginal μ) are transported onto units of the anchor B (columns,
marginal ν); both marginals are uniform (every unit carries the same mass).

* :func:`ground_cost` — pairwise Euclidean (or squared Euclidean) distances between the units'
  feature vectors, in float64, optionally divided by their largest value (so that an entropic
  regularisation means the same thing in every layer);
* :func:`transport_plan` — the plan T (n × m, row sums μ, column sums ν): the exact Earth Mover's
  plan (``ot.emd``, network simplex) for ``reg = 0``, else the entropic plan of Sinkhorn's algorithm
  (``ot.sinkhorn``, log-stabilised: scaling iterations with the large scalings absorbed into log
  potentials, as fast as plain Sinkhorn and stable for small ``reg``);
* :func:`column_map` — M = T diag(1/colsum(T)): column j holds the convex weights with which A's units
  make up B's unit j (Σ_i M_ij = 1). For an exact plan on equal uniform marginals M is a permutation
  matrix (Birkhoff), detected by :func:`as_permutation`.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from ...errors import SymmergeError

METRICS = ("euclidean", "sqeuclidean")
SINKHORN_ITERATIONS = 20_000
SINKHORN_TOLERANCE = 1e-9


def ground_cost(xa: torch.Tensor, xb: torch.Tensor, metric: str = "euclidean", normalize: bool = True) -> torch.Tensor:
    """C[i, j] = ‖xa_i − xb_j‖ (``euclidean``) or its square (``sqeuclidean``), float64; divided by
    max C when ``normalize`` (and max C > 0)."""
    if metric not in METRICS:
        raise SymmergeError(f"unknown ground metric {metric!r}; choose {' or '.join(METRICS)}")
    if xa.dim() != 2 or xb.dim() != 2 or xa.shape[1] != xb.shape[1]:
        raise SymmergeError(f"unit features must be (units, features) with equal widths, got {tuple(xa.shape)} "
                            f"and {tuple(xb.shape)}")
    xa, xb = xa.double(), xb.double()
    # |a|² + |b|² − 2⟨a, b⟩ (one GEMM), clamped at 0 against rounding
    sq = (xa.square().sum(1)[:, None] + xb.square().sum(1)[None, :] - 2.0 * xa @ xb.T).clamp_min_(0.0)
    cost = sq if metric == "sqeuclidean" else sq.sqrt_()
    if normalize:
        top = cost.max()
        if top > 0:
            cost = cost / top
    return cost


def check_reg(reg) -> float:
    """``reg`` as a float: 0 (exact transport) or a finite positive number."""
    try:
        value = float(reg)
    except (TypeError, ValueError):
        raise SymmergeError(f"the regularisation reg must be a number >= 0, got {reg!r}") from None
    if not (value >= 0.0 and math.isfinite(value)):
        raise SymmergeError(f"the regularisation reg must be finite and >= 0 (0: exact EMD), got {reg!r}")
    return value


def transport_plan(cost: torch.Tensor, reg: float = 0.0) -> torch.Tensor:
    """Plan between uniform marginals for ``cost`` (n × m): exact EMD for ``reg = 0``, else entropic
    (log-stabilised Sinkhorn, regularisation ``reg`` in the units of ``cost``; at most
    :data:`SINKHORN_ITERATIONS` iterations, stopping when the marginals are met to
    :data:`SINKHORN_TOLERANCE`). float64."""
    reg = check_reg(reg)
    M = np.ascontiguousarray(cost.detach().cpu().double().numpy())
    if not np.isfinite(M).all():
        raise SymmergeError("the transport cost holds NaN or Inf (non-finite weights or activations)")
    n, m = M.shape
    a, b = np.full(n, 1.0 / n), np.full(m, 1.0 / m)
    import ot

    if reg == 0.0:
        plan = ot.emd(a, b, M)
    else:
        with warnings.catch_warnings():  # not converged: the column normalisation (column_map) still holds
            warnings.simplefilter("ignore")
            plan = ot.sinkhorn(a, b, M, reg, method="sinkhorn_stabilized", numItermax=SINKHORN_ITERATIONS,
                               stopThr=SINKHORN_TOLERANCE)
    plan = torch.from_numpy(np.asarray(plan, dtype=np.float64))
    if not bool(torch.isfinite(plan).all()) or bool((plan.sum(0) <= 0).any()):
        raise SymmergeError(f"optimal transport failed (reg={reg}): the plan is not finite or leaves a unit empty")
    return plan


def column_map(plan: torch.Tensor) -> torch.Tensor:
    """M = T diag(1/colsum(T)): columns are convex weights over A's units (ν up to the solver's tolerance)."""
    return plan / plan.sum(0, keepdim=True)


def as_permutation(M: torch.Tensor, tol: float = 1e-9) -> torch.Tensor | None:
    """``perm`` with ``M[perm[j], j] = 1`` if the map ``M`` is a permutation matrix (within ``tol``), else None."""
    if M.shape[0] != M.shape[1]:
        return None
    perm = M.argmax(0)
    hit = M[perm, torch.arange(M.shape[1])]
    if bool(((hit - 1.0).abs() > tol).any()) or len(set(perm.tolist())) != len(perm):
        return None
    rest = M.abs().sum() - hit.abs().sum()
    return perm if rest <= tol * M.shape[1] else None
