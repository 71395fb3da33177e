"""Model Breadcrumbs (Davari & Belilovsky, 2023): keep the mid band of each task vector's magnitudes.

Per tensor and model, of the entries of τ_i = θ_i − θ_base sorted by magnitude, drop the ⌊``gamma``·n⌋
largest and keep the next ⌊``density``·n⌋ (fewer largest dropped where the two would not fit: the
⌊density·n⌋ smallest kept); ``density`` ≥ 1 keeps all. Then task arithmetic
(``breadcrumbs``: θ_b + λ Σ w_i τ̂_i; ``normalize`` divides by Σ w_i) or TIES's election
(``breadcrumbs_ties``: agreeing entries summed, divided by the agreeing weights when ``normalize``).
mergekit's names and defaults (``density`` 1.0, ``gamma`` 0.01, per model; ``lambda`` 1.0; ``normalize`` false;
``rescale`` false: true scales each τ̂ back to τ's L1 norm).
Whole-tensor rule (the band needs the tensor's order).
"""

from __future__ import annotations

from .parts import breadcrumbs_band, task_vector_method

_PARAMS = {"density": 1.0, "gamma": 0.01, "scale": 1.0, "normalize": False}
METHOD = task_vector_method("breadcrumbs", "breadcrumbs", "sum", _PARAMS, __doc__)
TIES = task_vector_method("breadcrumbs_ties", "breadcrumbs", "ties", _PARAMS,
                          "Model Breadcrumbs' mid-band masks, then TIES's sign election (agreeing entries summed).")
merge = METHOD.merge

__all__ = ["merge", "breadcrumbs_band"]
