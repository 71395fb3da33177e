"""DARE (Yu et al., 2024): drop each task-vector entry with probability p, rescale survivors by 1/(1 − p).

τ̃_i = m_i ⊙ τ_i / (1 − p), m_i ~ Bernoulli(1 − p), then task arithmetic: θ = θ_base + λ Σ_i w_i τ̃_i.
The mask of model i for tensor k is drawn from a generator seeded with a hash of (``seed``, i, k)
(:func:`symmerge.merge.parts.dare_keep_mask`), independent of the order tensors are visited in.
The parts (see :mod:`symmerge.merge.parts`): dare sparsifier, sum consensus. Registered as ``dare`` and
as mergekit's ``dare_linear``: ``density`` = 1 − ``drop`` (per model), ``lambda`` = ``scale``.

mergekit's ``dare_linear`` (``METHOD.mergekit_params``, applied by the config path): ``density: 1.0`` (no
drop unless told) and ``rescale: true``: the survivors are scaled so each task vector keeps its L1 norm
(close to 1/(1 − p), not equal); ``rescale: false`` keeps them unscaled, ``normalize: true`` divides by Σ w_i.
The masks are symmerge's (seeded SplitMix64), not mergekit's torch generator: equal in distribution only.
"""

from __future__ import annotations

from dataclasses import replace

from .parts import dare_keep_mask, task_vector_method

METHOD = task_vector_method("dare", "dare", "sum", {"drop": 0.9, "scale": 1.0, "seed": 0}, __doc__,
                            mergekit_params={"density": 1.0, "rescale": True})
LINEAR = replace(METHOD, name="dare_linear")
merge = METHOD.merge

__all__ = ["merge", "dare_keep_mask"]
