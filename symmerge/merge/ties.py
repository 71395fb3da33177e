"""TIES merging (Yadav et al., 2023): trim each task vector, elect signs, disjoint mean.

For task vectors τ_i = θ_i − θ_base (scaled by the optional weights w_i):

1. trim: keep the ``density`` fraction of entries of largest magnitude of each τ_i (over the whole
   merged model by default, ``scope="model"``; or per tensor, ``scope="tensor"``), zero the rest;
2. elect: γ = sign(Σ_i τ̂_i) per entry;
3. disjoint mean: τ_m = mean of the τ̂_i whose sign equals γ (zeros excluded; 0 if none agree);

and θ = θ_base + λ τ_m (λ = ``scale``). The parts (see :mod:`symmerge.merge.parts`): magnitude
sparsifier, ties consensus.
"""

from __future__ import annotations

from .parts import disjoint_mean, magnitude_threshold, task_vector_method

METHOD = task_vector_method("ties", "magnitude", "ties", {"density": 0.2, "scale": 1.0, "scope": "model"}, __doc__)
merge = METHOD.merge

__all__ = ["merge", "disjoint_mean", "magnitude_threshold"]
