"""A merge report's ``distances_between_inputs`` and ``distance_result_to_inputs``: one rule in every entry.

Each tensor's squared distances come from one function, :func:`symmerge.merge.kernels.sq_distances` (the inputs'
pairs and each input to the result, float64 differences), called with the same tensors by the in-memory report
(:func:`symmerge.merge.fuse._report`) and by the executor's steps (``symmerge merge --stream``, ``symmerge run``);
the per-tensor values are added exactly (:func:`exact_sum`, ``math.fsum``), so the order in which the tensors come
(the files' order, the state dict's, a step's thread) changes nothing: the same merge reports the same numbers,
bit for bit, loaded or streamed.
"""

from __future__ import annotations

import math

from .kernels import sq_distances


def exact_sum(values) -> float:
    """The sum of ``values`` rounded once (``math.fsum``: the same in any order); +inf where it exceeds the
    largest float (fsum raises there)."""
    try:
        return math.fsum(values)
    except OverflowError:
        return math.inf


class SquaredSums:
    """The report's squared distances over a merge's measured tensors: :meth:`add` one tensor's inputs (and result)
    at a time, :meth:`totals` at the end. Every pair's and every input's per-tensor values are kept and summed exactly
    once, at the end."""

    def __init__(self):
        self.pairs: dict = {}
        self.to_result: dict = {}

    def add(self, inputs, result=None) -> list:
        """One tensor's values added (:func:`~symmerge.merge.kernels.sq_distances` of ``inputs`` and ``result``);
        returns its squared distances to the result (empty without one)."""
        pairs, to_result = sq_distances(inputs, result)
        for key, v in pairs.items():
            self.pairs.setdefault(key, []).append(v)
        for i, v in enumerate(to_result):
            self.to_result.setdefault(i, []).append(v)
        return to_result

    def totals(self) -> tuple[dict, dict]:
        """(``{(i, k): Σ over the tensors}`` of the input pairs, ``{i: Σ}`` of each input to the result)."""
        return ({key: exact_sum(v) for key, v in self.pairs.items()},
                {i: exact_sum(v) for i, v in self.to_result.items()})
