"""N models in one frame: the result type of joint alignment and its objective, the spread of the models
around their mean (shared by the closed-form joint alignment, :mod:`symmerge.pipeline.joint`, and its
learned form, :mod:`symmerge.pipeline.learn_joint`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.distance import sq_distance


@dataclass
class JointAlignment:
    """Every model in the common frame (the canonical parameterisation of the options' groups), in input
    order, and the report (``objective`` per round, rounds, per-model seconds and verification)."""

    models: list
    report: dict


def mean_state_dict(state_dicts: list[dict], keys) -> dict:
    """The element-wise mean of ``keys`` over ``state_dicts`` (summed in float64, stored in each tensor's
    own dtype); other entries (buffers) are taken from the first."""
    out = dict(state_dicts[0])
    for k in keys:
        acc = state_dicts[0][k].to(torch.float64).clone()
        for sd in state_dicts[1:]:
            acc += sd[k].to(torch.float64)
        out[k] = (acc / len(state_dicts)).to(state_dicts[0][k].dtype)
    return out


def spread(state_dicts: list[dict], keys, weights: dict | None = None) -> float:
    """J = Σ_i ‖θ_i − θ̄‖² over ``keys`` (``weights``: ``{key: w}``, that tensor's part counted ``w`` times)."""
    mean = mean_state_dict(state_dicts, keys)
    return sum(sq_distance(sd, mean, keys, weights=weights) for sd in state_dicts)
