"""The relabelling check of :class:`~symmerge.federated.AlignedFedAvg` (``OutlierPolicy(relabel=RelabelCheck())``,
with the consensus rule's unlabeled server data): does a client map the classes differently from the others, and
if so, by which permutation (no Flower needed here). A client found relabelled is left out.

A permutation of the label space is a symmetry of the *training problem*: training from a model θ on labels
σ(y) gives exactly the model, with the rows of its output layer permuted by σ, that training from θ with
its output rows permuted by σ⁻¹ on the labels y gives (every step is equivariant under the permutation of
the rows and the labels). A client trained on flipped labels (9 − y) is therefore an honest client, started
from a relabelled global model, seen through permuted output rows; what no class prior explains is that
its class i fires where the others' consensus says σ⁻¹(i).

:func:`relabelling` measures it on the server's unlabeled examples: C[i, j] = mean over the examples of
p′(i | x) q(j | x), p′ the client's probabilities with its class prior discounted to the consensus's
(:func:`~symmerge.federated.consensus.prior_corrected`), q the consensus (the unweighted mean of the others'
probabilities). The best one-to-one assignment of the client's classes to the consensus's (Hungarian:
``scipy.optimize.linear_sum_assignment``) gains ``best − trace(C)`` over the identity (in probability mass:
the fraction of the examples' joint mass that the relabelling moves onto the diagonal; 0 for a pure prior
shift, whose C after the correction is the consensus's own Gram matrix, for which the identity is optimal).
The permutation is split into cycles and only the cycles that gain at least ``min_cycle_gain`` each are kept
(the confidently estimated part; a weak client's noise gives small cycles among similar classes).
"""

from __future__ import annotations

import numpy as np
import torch

from .consensus import prior_corrected, with_consensus


def confusion(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """C[i, j] = mean over the examples of p′(i | x) q(j | x) (float64, (K, K), summing to 1): ``p`` (M, K)
    the client's probabilities with its class prior discounted to ``q``'s class marginal, ``q`` (M, K) the
    consensus's."""
    p, q = p.double(), q.double()
    return prior_corrected(p, q.mean(dim=0)).T @ q / p.shape[0]


def cycles(perm: list[int]) -> list[list[int]]:
    """The cycles of length > 1 of the permutation ``perm`` (``perm[i]``: where i goes)."""
    seen, out = set(), []
    for start in range(len(perm)):
        if start in seen or perm[start] == start:
            continue
        cycle, i = [], start
        while i not in seen:
            seen.add(i)
            cycle.append(i)
            i = perm[i]
        out.append(cycle)
    return out


def relabelling(p: torch.Tensor, q: torch.Tensor, min_cycle_gain: float = 0.0) -> dict:
    """The best relabelling of a client's classes onto the consensus's (see the module docstring):
    ``{"gain": best − trace, "permutation": [π(0), ..., π(K − 1)] (the whole assignment), "kept": the
    permutation with only the cycles that gain at least min_cycle_gain each (the others left at the
    identity), "kept_gain": what those cycles gain}``."""
    from scipy.optimize import linear_sum_assignment

    c = confusion(p, q).numpy()
    rows, cols = linear_sum_assignment(-c)
    perm = [0] * len(rows)
    for r, k in zip(rows, cols):
        perm[int(r)] = int(k)
    gain = float(c[rows, cols].sum() - np.trace(c))
    kept, kept_gain = list(range(len(perm))), 0.0
    for cycle in cycles(perm):
        g = float(sum(c[i, perm[i]] - c[i, i] for i in cycle))
        if g >= min_cycle_gain and g > 0:
            for i in cycle:
                kept[i] = perm[i]
            kept_gain += g
    return {"gain": max(gain, 0.0), "permutation": perm, "kept": kept, "kept_gain": kept_gain}


def relabellings(probs: list[torch.Tensor], min_cycle_gain: float = 0.0) -> list[dict]:
    """:func:`relabelling` of each client's probabilities (a list of (M, K) tensors) against the consensus,
    the unweighted mean of the others'."""
    if len(probs) < 2:
        return [relabelling(p, p, min_cycle_gain) for p in probs]
    return [relabelling(p, q, min_cycle_gain) for p, q in with_consensus(probs)]
