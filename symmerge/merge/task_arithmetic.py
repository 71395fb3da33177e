"""Task arithmetic: θ = θ_base + λ Σ_i w_i (θ_i − θ_base) (weights default to 1 each, not normalised).

The parts (see :mod:`symmerge.merge.parts`): no sparsification, sum consensus. mergekit's parameters:
``lambda`` (= ``scale``), ``normalize`` (false, as mergekit's default: true divides by Σ w_i).
"""

from __future__ import annotations

from .parts import task_vector_method

METHOD = task_vector_method("task_arithmetic", "none", "sum", {"scale": 1.0}, __doc__)
merge = METHOD.merge
