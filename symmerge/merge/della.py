"""DELLA (Deep et al., 2024): magnitude-ranked random drop of each task vector, then TIES or a sum.

Per tensor and model, along each row (a 1-D tensor is one row) the entries of τ_i = θ_i − θ_base ranked by
magnitude get keep probabilities from ``density`` − ``epsilon`` (smallest) to ``density`` + ``epsilon``
(largest), linear in the rank (:func:`symmerge.merge.parts.della_keep_probabilities`); each entry is kept
where its uniform — symmerge's seeded SplitMix64 stream of (``seed``, model, tensor), as DARE's — is below
its probability; ``rescale`` (true) scales the kept entries back to τ's L1 norm. ``della``: TIES's election,
agreeing entries divided by the agreeing weights (``normalize`` true); ``della_linear``: Σ w_i τ̂_i
(``normalize`` false). mergekit's names and defaults (``density`` 1.0 = keep all, ``epsilon`` 0.15, per model;
``lambda`` 1.0); density ± epsilon must lie in (0, 1) where density is in (0, 1); density 0 drops that model's
task vector (mergekit's branch, before its epsilon check). The masks are symmerge's, equal to mergekit's in
distribution only. Whole-tensor rule.
"""

from __future__ import annotations

from .parts import della_keep_probabilities, task_vector_method

METHOD = task_vector_method("della", "della", "ties",
                            {"density": 1.0, "epsilon": 0.15, "scale": 1.0, "seed": 0, "normalize": True}, __doc__)
LINEAR = task_vector_method("della_linear", "della", "sum",
                            {"density": 1.0, "epsilon": 0.15, "scale": 1.0, "seed": 0, "normalize": False},
                            "DELLA's magnitude-ranked random drop, then task arithmetic (no sign election).")
merge = METHOD.merge

__all__ = ["merge", "della_keep_probabilities"]
