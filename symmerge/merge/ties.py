"""TIES merging (Yadav et al., 2023): trim each task vector, elect signs, merge the agreeing entries.

For task vectors τ_i = θ_i − θ_base and the weights w_i (multipliers, mergekit's ``weight``):

1. trim: keep the ``density`` fraction of entries of largest magnitude of each τ_i, per tensor
   (``scope="topk"``: max(1, ⌊density·n⌋) entries, ties at the cut in mergekit's order), zero the rest;
2. elect: γ = + where Σ_i w_i τ̂_i ≥ 0, else −;
3. merge: Σ of the w_i τ̂_i agreeing with γ, divided by the agreeing weights (``normalize: true``);

and θ = θ_base + λ τ_m (λ = ``scale``, alias ``lambda``). These are mergekit's ``ties`` and its defaults
(``density`` 1.0: nothing trimmed unless asked; ``normalize`` true; ``rescale`` false: true scales each trimmed
τ back to its L1 norm), the same from ``symmerge merge --method ties`` and from a config. ``density`` may be
per model; density 0 drops that model's task vector (mergekit's branch; every model at 0 gives the base).

symmerge's earlier ``--method ties`` (before 2026-11-28) is these parameters: ``density=0.2 scope=model
normalize=count`` — the threshold over the whole model's task vector (``scope="model"``; ``"tensor"``: per
tensor), γ = sign(Σ w_i τ̂_i) and the *mean* of the agreeing non-zero entries (``normalize: count``). The parts
(see :mod:`symmerge.merge.parts`): magnitude sparsifier, ties consensus.
"""

from __future__ import annotations

from .parts import magnitude_threshold, task_vector_method

METHOD = task_vector_method("ties", "magnitude", "ties",
                            {"density": 1.0, "scale": 1.0, "scope": "topk", "normalize": True}, __doc__)
merge = METHOD.merge

__all__ = ["merge", "magnitude_threshold"]
