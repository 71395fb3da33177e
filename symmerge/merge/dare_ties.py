"""DARE-TIES: DARE's random drop and rescale of each task vector, then TIES's sign election and disjoint mean.

τ̃_i = m_i ⊙ w_i τ_i / (1 − p) with the DARE masks of :mod:`symmerge.merge.dare` (drop probability
p = ``drop``, seeded per (``seed``, model, tensor)); γ = sign(Σ_i τ̃_i); τ_m = mean of the non-zero τ̃_i
agreeing with γ; θ = θ_base + λ τ_m. With ``drop=0`` this is TIES without trimming (``density=1``).
The parts (see :mod:`symmerge.merge.parts`): dare sparsifier, ties consensus.

mergekit's ``dare_ties`` (``METHOD.mergekit_params``, applied by the config path): ``density: 1.0``,
``rescale: true`` (L1-norm restoring, not 1/(1 − p)) and ``normalize: false``: the agreeing entries are
*summed* (symmerge always takes their mean); ``normalize: true`` divides by the agreeing weights.
``density`` (= 1 − ``drop``) is per model; ``lambda`` = ``scale``.
"""

from __future__ import annotations

from .parts import task_vector_method

METHOD = task_vector_method("dare_ties", "dare", "ties", {"drop": 0.9, "scale": 1.0, "seed": 0}, __doc__,
                            mergekit_params={"density": 1.0, "rescale": True, "normalize": False})
merge = METHOD.merge
