"""Softmax-temperature calibration of an interpolated model, without labels (the baseline of Ito et al.,
ICLR 2026: a merged model's logits divided by one temperature T).

At a point θ(α) of the path the temperature is fitted on unlabeled data against the endpoints' mixed
predictions — the same target as the learned alignment's, α·p_A + (1 − α)·p_B — by a one-dimensional
minimisation of the soft cross-entropy over log T (bounded, T ∈ [1/20, 20]). At an endpoint the target is
the endpoint's own prediction, so T = 1 there (cross-entropy is least at the distribution itself): the
calibration changes the path, never its ends. Dividing the logits by T changes neither a prediction's
argmax nor anything but the loss.
"""

from __future__ import annotations

import math

import torch

from ..errors import SymmergeError
from .metrics import undefined_rows

T_RANGE = (1 / 20, 20.0)


class Tempered(torch.nn.Module):
    """``model`` with its logits divided by ``temperature`` (evaluated as the model is: same config)."""

    def __init__(self, model, temperature: float):
        super().__init__()
        self.model, self.temperature, self.config = model, float(temperature), model.config

    def forward(self, **inputs):
        out = self.model(**inputs)
        out.logits = out.logits / self.temperature
        return out


def scored(model, batches: list) -> torch.Tensor:
    """The logits (M, C) of the scored items of ``batches`` (every example, or every next token), float64."""
    from ..pipeline.learn import scored_logits

    device = next(model.parameters()).device
    with torch.no_grad():
        return torch.cat([scored_logits(model(**b.inputs).logits, b).double().cpu()
                          for b in (batch.to(device) for batch in batches)])


def fit_temperature(logits: torch.Tensor, target: torch.Tensor) -> float:
    """The T in :data:`T_RANGE` minimising the mean cross-entropy of softmax(logits / T) against the
    probabilities ``target`` (rows summing to 1); NaN when a logit is NaN or +inf or a target not finite (the
    objective is then NaN for every T: no T fits)."""
    from scipy.optimize import minimize_scalar

    if logits.shape != target.shape or logits.numel() == 0:
        raise SymmergeError(f"temperature calibration needs logits and targets of one shape, got "
                            f"{tuple(logits.shape)} and {tuple(target.shape)}")

    if not bool(target.isfinite().all()) or undefined_rows(logits):
        return float("nan")

    def loss(log_t: float) -> float:
        return -(target * torch.log_softmax(logits / math.exp(log_t), -1)).sum(-1).mean().item()

    lo, hi = (math.log(t) for t in T_RANGE)
    res = minimize_scalar(loss, bounds=(lo, hi), method="bounded", options={"xatol": 1e-6})
    return math.exp(res.x)


class Calibrator:
    """Fits T(α) on ``batches`` (unlabeled) for any model on the path between ``model_a`` (α = 1) and
    ``model_b`` (α = 0): the endpoints' predicted probabilities are computed once."""

    def __init__(self, model_a, model_b, batches: list):
        if not batches:
            raise SymmergeError("temperature calibration needs unlabeled data (--align-data)")
        self.batches = list(batches)
        self.p_a = torch.softmax(scored(model_a, self.batches), -1)
        self.p_b = torch.softmax(scored(model_b, self.batches), -1)
        self.fitted: dict = {}

    def temperature(self, model, alpha: float) -> float:
        t = fit_temperature(scored(model, self.batches), alpha * self.p_a + (1 - alpha) * self.p_b)
        self.fitted[float(alpha)] = t
        return t

    def __call__(self, model, alpha: float):
        """``model`` (θ(α)) with its fitted temperature: a transform for ``interpolation_curve``."""
        return Tempered(model, self.temperature(model, alpha))
