"""DARE-TIES: DARE's random drop and rescale of each task vector, then TIES's sign election.

τ̃_i = m_i ⊙ τ_i with the DARE masks of :mod:`symmerge.merge.dare` (keep probability ``density`` = 1 −
``drop``, seeded per (``seed``, model, tensor)) and its ``rescale`` (true: L1 norm restored; ``inverse``:
/(1 − p)); γ = + where Σ_i w_i τ̃_i ≥ 0; the agreeing w_i τ̃_i summed (``normalize: false``), divided by the
agreeing weights (true) or by their count (``count``: symmerge's disjoint mean, γ = sign(Σ)); θ = θ_base + λ τ_m.
mergekit's ``dare_ties`` and its defaults (``density`` 1.0, ``rescale`` true, ``normalize`` false).

symmerge's earlier ``--method dare_ties`` (before 2026-11-28) is ``drop=0.9 rescale=inverse normalize=count``.
The parts (see :mod:`symmerge.merge.parts`): dare sparsifier, ties consensus.
"""

from __future__ import annotations

from .parts import task_vector_method

METHOD = task_vector_method("dare_ties", "dare", "ties",
                            {"drop": 0.0, "scale": 1.0, "seed": 0, "rescale": True, "normalize": False}, __doc__)
merge = METHOD.merge
