"""Did a fusion work? Loss/accuracy on data, linear-interpolation curves and barriers, distance tables,
subset-of-layers matching, plots.

Interpolation: θ(α) = α·θ_A + (1 − α)·θ_B (``torch.lerp``; at α ∈ {0, 1} exactly B's and A's tensors); α = 1 is
model A.
Barrier: max_α [L(θ(α)) − (α·L_A + (1 − α)·L_B)] over the evaluated α (≥ 0: the endpoints count).
"""

from __future__ import annotations

import copy
import math

import torch

from ..io.data import Data, predictions
from ..io.arguments import keeps_models
from ..core.layout import check_layouts
from ..io.layout import layout_of
from ..errors import SymmergeError
from ..progress import bar


@keeps_models
def evaluate(model, data: Data, device=None, progress: bool = True, desc: str = "evaluating") -> dict:
    """Mean cross-entropy and accuracy over all of ``data`` (examples, or next tokens for lm data); when
    ``data`` is only the first part of its file (``--max-examples``), ``examples_in_file`` and ``cut_by``
    say so, so that a score never stands for the whole file silently. Where the model's logits are NaN or
    +inf for some scored items (``undefined``: how many), their prediction is undefined: the loss and the
    accuracy are NaN (null in a report), never a figure over the other items or of an arbitrary argmax."""
    device = device or next(model.parameters()).device
    model = model.to(device).eval()
    loss_sum, correct, count, undefined = 0.0, 0, 0, 0
    with torch.no_grad():
        for batch in bar(data, desc=desc, total=len(data), unit="batches", disable=None if progress else True):
            logits, targets = predictions(model, batch.to(device))
            loss_sum += torch.nn.functional.cross_entropy(logits.double(), targets, reduction="sum").item()
            correct += (logits.argmax(-1) == targets).sum().item()
            count += targets.numel()
            undefined += undefined_rows(logits)
    if count == 0:
        raise SymmergeError(f"{data.path}: nothing to evaluate")
    if undefined:
        nan = float("nan")
        return {"loss": nan, "accuracy": nan, "n": count, "undefined": undefined, **_cut_info(data)}
    return {"loss": loss_sum / count, "accuracy": correct / count, "n": count, **_cut_info(data)}


def undefined_rows(logits: torch.Tensor) -> int:
    """How many rows of ``logits`` (M, C) hold a NaN or +inf: rows whose softmax and argmax mean nothing
    (a −inf logit, a class ruled out, is a prediction)."""
    return int((logits.isnan() | logits.isposinf()).any(-1).sum().item())


def _cut_info(data) -> dict:
    info = getattr(data, "cut_info", None)
    return info() if info is not None else {}


@keeps_models
def evaluate_ensemble(models, data: Data, device=None, progress: bool = True,
                      desc: str = "evaluating the ensemble") -> dict:
    """The ensemble of ``models`` (the mean of their predicted probabilities): cross-entropy of the mean
    probabilities and accuracy of their argmax, as :func:`evaluate` scores one model."""
    device = device or next(models[0].parameters()).device
    models = [m.to(device).eval() for m in models]
    loss_sum, correct, count, undefined = 0.0, 0, 0, 0
    with torch.no_grad():
        for batch in bar(data, desc=desc, total=len(data), unit="batches", disable=None if progress else True):
            batch = batch.to(device)
            outputs = [predictions(m, batch) for m in models]
            targets = outputs[0][1]
            log_probs = mean_log_probs([logits for logits, _ in outputs])
            loss_sum += -log_probs.gather(-1, targets[:, None]).sum().item()
            correct += (log_probs.argmax(-1) == targets).sum().item()
            count += targets.numel()
            undefined += undefined_rows(log_probs)
    if count == 0:
        raise SymmergeError(f"{data.path}: nothing to evaluate")
    if undefined:  # a member's NaN or +inf logits: that item's mean probabilities are NaN
        return {"loss": float("nan"), "accuracy": float("nan"), "n": count, "undefined": undefined}
    return {"loss": loss_sum / count, "accuracy": correct / count, "n": count}


def mean_log_probs(logits: list) -> torch.Tensor:
    """log of the mean of the members' softmax probabilities (M, C), in float64 and in log space (a running
    ``logaddexp`` of log-softmaxes): exact where the probabilities themselves underflow (a target at −1000 nats
    scores 1000 nats, not a floor's 690.8), with one (M, C) array kept whatever the number of members. NaN rows
    where a member's logits are NaN or +inf."""
    total = None
    for x in logits:
        lp = torch.log_softmax(x.double(), -1)
        total = lp if total is None else torch.logaddexp(total, lp)
    return total - math.log(len(logits))


def interpolate(sd_a: dict, sd_b: dict, alpha: float) -> dict:
    """α·θ_A + (1 − α)·θ_B for floating tensors (others from B); α = 0 is B's tensors and α = 1 A's exactly
    (a NaN or an overflowing difference in A does not reach θ(0))."""
    alpha = float(alpha)
    if alpha in (0.0, 1.0):
        return {k: (sd_a[k].to(b.dtype) if alpha == 1.0 and b.is_floating_point() else b).clone()
                for k, b in sd_b.items()}
    return {k: torch.lerp(b, sd_a[k].to(b.dtype), alpha) if b.is_floating_point() else b.clone()
            for k, b in sd_b.items()}


def barrier(alphas, losses) -> float:
    """max_α [loss(α) − (α·loss(1) + (1 − α)·loss(0))]; ``alphas`` must contain 0 and 1. NaN when a loss is
    NaN or an endpoint's is infinite (undefined: never the maximum over the other points); +inf when an
    interior loss is +inf and the endpoints' are finite."""
    alphas = [float(a) for a in alphas]
    if 0.0 not in alphas or 1.0 not in alphas:
        raise SymmergeError("the barrier needs the endpoints α = 0 and α = 1")
    la, lb = losses[alphas.index(1.0)], losses[alphas.index(0.0)]
    gaps = [loss - (a * la + (1.0 - a) * lb) for a, loss in zip(alphas, losses)]
    return float("nan") if any(g != g for g in gaps) else max(gaps)


def nonfinite_note(alphas, losses) -> str | None:
    """Why a curve's barrier is not a finite number (its losses that are not), or None when every loss is finite."""
    bad = [(a, loss) for a, loss in zip(alphas, losses) if not math.isfinite(loss)]
    if not bad:
        return None
    where = ", ".join(f"{a:.3g} ({loss})" for a, loss in bad)
    return (f"the loss is not finite at α = {where} (NaN: logits NaN or +inf on some scored items): "
            f"the barrier is {barrier(alphas, losses)}, null in barrier.json")


def alpha_grid(points: int) -> list[float]:
    if points < 2:
        raise SymmergeError(f"--points must be >= 2 (the endpoints), got {points}")
    return [i / (points - 1) for i in range(points)]


def check_same_shapes(model_a, model_b, names=("model A", "model B")) -> None:
    """One error naming both models (``names``: their folders) unless they have one layout: interpolation needs the
    same tensors of the same shapes — widths, image or context sizes, label spaces."""
    check_layouts([layout_of(model_a, str(names[0])), layout_of(model_b, str(names[1]))],
                  hint=" (models interpolated together need the same tensors of the same shapes)")


@keeps_models
def interpolation_curve(model_a, model_b, data: Data, alphas, device=None, progress: bool = True,
                        label: str = "", transform=None) -> dict:
    """Loss and accuracy of θ(α) for each α, and the barrier; ``transform(model, α)`` (e.g. REPAIR)
    returns the model to evaluate in place of θ(α)."""
    check_same_shapes(model_a, model_b)
    sd_a, sd_b = model_a.state_dict(), model_b.state_dict()
    probe = copy.deepcopy(model_b)
    if device is not None:  # θ(α) is loaded and evaluated there (evaluate puts a model back where it found it)
        probe.to(device)
    loss, acc = [], []
    for a in bar(alphas, desc=f"interpolating {label}".strip(), unit="points", disable=None if progress else True):
        probe.load_state_dict(interpolate(sd_a, sd_b, a))
        r = evaluate(probe if transform is None else transform(probe, a), data, device=device, progress=False)
        loss.append(r["loss"])
        acc.append(r["accuracy"])
    note = nonfinite_note(alphas, loss)
    return {"loss": loss, "accuracy": acc, "barrier": barrier(alphas, loss), **({"note": note} if note else {})}


