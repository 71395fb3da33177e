"""TIES merging (Yadav et al., 2023): trim each task vector, elect signs, disjoint mean.

For task vectors τ_i = θ_i − θ_base (scaled by the optional weights w_i):

1. trim: keep the ``density`` fraction of entries of largest magnitude of each τ_i (over the whole
   merged model by default, ``scope="model"``; or per tensor, ``scope="tensor"``; or mergekit's exact
   per-tensor top-k, ``scope="topk"``: max(1, ⌊density·n⌋) entries), zero the rest;
2. elect: γ = sign(Σ_i τ̂_i) per entry;
3. disjoint mean: τ_m = mean of the τ̂_i whose sign equals γ (zeros excluded; 0 if none agree);

and θ = θ_base + λ τ_m (λ = ``scale``, alias ``lambda``). The parts (see :mod:`symmerge.merge.parts`):
magnitude sparsifier, ties consensus.

mergekit's ``ties`` differs in three defaults, set by ``METHOD.mergekit_params`` (the config path applies
them; ``symmerge merge --method ties`` keeps symmerge's): ``scope: topk`` (per tensor, not model-wide),
``density: 1.0`` (mergekit trims nothing unless told), ``normalize: true``: the agreeing weighted entries
are summed and divided by the sum of the agreeing *weights* (γ = + where Σ w_i τ̂_i ≥ 0) instead of their
count — with weights 0.5/0.5 symmerge's disjoint mean of w_i τ̂_i is half of mergekit's task vector.
``normalize: false`` sums the agreeing entries; ``rescale: true`` scales each trimmed τ back to its L1 norm.
``density`` may be per model.
"""

from __future__ import annotations

from .parts import disjoint_mean, magnitude_threshold, task_vector_method

METHOD = task_vector_method("ties", "magnitude", "ties", {"density": 0.2, "scale": 1.0, "scope": "model"}, __doc__,
                            mergekit_params={"scope": "topk", "density": 1.0, "normalize": True})
merge = METHOD.merge

__all__ = ["merge", "disjoint_mean", "magnitude_threshold"]
