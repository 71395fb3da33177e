"""DARE (Yu et al., 2024): drop entries of each task vector at random and rescale, then task arithmetic.

τ̃_i = m_i ⊙ τ_i, each entry kept with probability ``density`` (= 1 − ``drop``), seeded per (``seed``, model,
tensor) (see :mod:`symmerge.merge.parts`); ``rescale: true`` scales the kept entries back to τ_i's L1 norm,
``rescale: inverse`` divides them by the keep probability (1 − p; the expectation kept), false keeps them;
θ = θ_base + λ Σ_i w_i τ̃_i (``normalize: true`` divides by Σ w_i). mergekit's ``dare_linear`` and its
defaults (``density`` 1.0: nothing dropped unless asked; density 0 (drop 1) drops the whole task vector, whatever
the rescale; ``rescale`` true; ``normalize`` false); ``dare`` is
the same method under symmerge's older name. The masks are symmerge's (seeded SplitMix64), not mergekit's torch
generator: equal in distribution only.

symmerge's earlier ``--method dare`` (before 2026-11-28) is ``drop=0.9 rescale=inverse``.
"""

from __future__ import annotations

from .parts import dare_keep_mask, task_vector_method

METHOD = task_vector_method("dare_linear", "dare", "sum",
                            {"drop": 0.0, "scale": 1.0, "seed": 0, "rescale": True, "normalize": False}, __doc__,
                            other_names=("dare",))
LINEAR = METHOD
merge = METHOD.merge

__all__ = ["merge", "dare_keep_mask"]
