"""Distillation of a merged model toward the ensemble of its inputs (issue 42 item 3's extra mode).

After aligning and merging, a few hundred optimiser steps move **every parameter** of the merged model
to lower the KL divergence ``KL(p_ens ‖ p_merged)`` on unlabeled data, where ``p_ens = Σ_k w_k p_k`` is the
weighted average of the endpoints' **probabilities** (softmax outputs; ``w``: the merge weights,
normalised). The endpoints are the aligned inputs: alignment does not change their functions, so the
target is the ensemble of the models given. No label is read.

This is **not** function-preserving alignment: the result is a new model trained toward the ensemble,
and every report of it says so (:data:`LABEL`, ``function_preserving: false``).

The unlabeled examples are split into a training part and a held-out part (the last ``holdout`` of the examples, at
least one when there are two or more), each cut into minibatches of at most ``batch``; the KL is measured on both before
and after, so the report shows whether the distillation generalised beyond the examples it saw. Adam with a cosine decay
to 0 over the steps; batches drawn in a fresh random order per pass (seeded).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass

import torch

from ..errors import SymmergeError
from ..io.data import Batch, Data
from ..option_ranges import MAXIMA
from ..progress import bar
from .data import nothing_scored, scoring
from .learn import cosine_adam, scored_logits, shuffled

LABEL = "distilled (not function-preserving)"
CACHE_BYTES = 1 << 30  # the ensemble's targets are kept for every batch when they fit in this; else recomputed
TARGET = "weighted average of the aligned endpoints' probabilities (softmax outputs)"


@dataclass(frozen=True)
class DistillSettings:
    steps: int = 300
    lr: float = 1e-4
    holdout: float = 0.1  # fraction of the examples held out for the KL check
    batch: int = 32  # examples per minibatch (the data's batches are cut into pieces of at most this many)
    seed: int = 0

    def __post_init__(self):
        check_steps(self.steps, minimum=1)
        check_lr(self.lr)
        if not 0 <= self.holdout < 1:
            raise SymmergeError(f"the distillation's held-out fraction must lie in [0, 1), got {self.holdout!r}")
        if isinstance(self.batch, bool) or not isinstance(self.batch, int) or self.batch < 1:
            raise SymmergeError(f"the distillation's batch size must be an integer >= 1, got {self.batch!r}")


def check_steps(steps, minimum: int = 0) -> int:
    """``steps`` as the number of distillation steps (``--distill``), refused in one line unless an
    integer >= ``minimum`` (0: no distillation)."""
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < minimum:
        raise SymmergeError(f"--distill takes a number of steps >= {minimum}, got {steps!r}")
    if steps > MAXIMA["learn_steps"]:
        raise SymmergeError(f"--distill takes a number of steps <= {MAXIMA['learn_steps']:g}, got {steps!r}")
    return steps


def check_lr(lr) -> float:
    """The distillation's learning rate (``--distill-lr``; its text too), refused in one line unless a positive
    finite number."""
    try:
        value = float(lr) if isinstance(lr, str) else lr
    except ValueError:
        value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise SymmergeError(f"--distill-lr must be a positive number, got {lr if value is None else value!r}")
    return value


def _weights(weights, n: int) -> list[float]:
    if weights is None:
        return [1.0 / n] * n
    if len(weights) != n or any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise SymmergeError(f"distillation needs {n} non-negative weights with a positive sum, got {weights}")
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def _piece(batch: Batch, i: int, j: int) -> Batch:
    cut = lambda t: None if t is None else t[i:j]  # noqa: E731
    return Batch({k: cut(v) for k, v in batch.inputs.items()}, cut(batch.labels), cut(batch.mask))


def split(data: Data, holdout: float, size: int) -> tuple[list, list]:
    """(train, held out) minibatches of at most ``size`` examples, in the data's order: the last
    ``holdout`` of the examples held out (at least one when there are two or more and ``holdout`` > 0;
    never all of them)."""
    n = sum(b.size for b in data.batches)
    n_hold = 0 if n < 2 or holdout <= 0 else min(max(1, round(holdout * n)), n - 1)
    parts, start = ([], []), 0
    for b in data.batches:  # each batch cut where the held-out part begins, then into minibatches
        edge = min(max(n - n_hold - start, 0), b.size)
        for side, (i, j) in enumerate(((0, edge), (edge, b.size))):
            parts[side].extend(_piece(b, k, min(k + size, j)) for k in range(i, j, size))
        start += b.size
    return parts


def ensemble_probabilities(teachers, batch, weights) -> torch.Tensor:
    """``Σ_k w_k softmax(logits_k)`` over the batch's scored items (examples, or next tokens), no grad."""
    with torch.no_grad():
        probs = None
        for w, t in zip(weights, teachers):
            p = w * torch.softmax(scored_logits(t(**batch.inputs).logits, batch).double(), -1)
            probs = p if probs is None else probs + p
    return probs


def kl_to(model, batch, target: torch.Tensor) -> torch.Tensor:
    """Mean over the scored items of ``KL(target ‖ softmax(model))`` (nats)."""
    logits = scored_logits(model(**batch.inputs).logits, batch)
    if logits.shape != target.shape:
        raise SymmergeError(f"the merged model predicts {tuple(logits.shape[1:])} classes per item, the ensemble "
                            f"{tuple(target.shape[1:])}: distillation needs the same output space")
    logq = torch.log_softmax(logits.double(), -1)
    plogp = torch.where(target > 0, target * torch.log(target.clamp_min(1e-300)), torch.zeros_like(target))
    return (plogp - target * logq).sum(-1).mean()


class Targets:
    """The ensemble's probabilities for each batch of ``batches``: computed once and kept when all of them
    fit in :data:`CACHE_BYTES` (an image classifier's few classes), else recomputed at each use (a language
    model's vocabulary over every token would not fit)."""

    def __init__(self, teachers, batches, weights):
        self.teachers, self.batches, self.weights = teachers, batches, weights
        first = ensemble_probabilities(teachers, batches[0], weights) if batches else None
        items = sum(b.size if b.mask is None or b.mask.dim() != 2 else int(b.mask[:, 1:].sum()) for b in batches)
        size = 0 if first is None else first.element_size() * first.shape[-1] * items
        self.kept = [first] + [ensemble_probabilities(teachers, b, weights) for b in batches[1:]] \
            if first is not None and size <= CACHE_BYTES else None

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.kept[i] if self.kept is not None else ensemble_probabilities(self.teachers, self.batches[i],
                                                                                 self.weights)


def mean_kl(model, batches, targets: Targets) -> float | None:
    """The KL averaged over items of ``batches`` (None when there are none)."""
    if not batches:
        return None
    with torch.no_grad():
        total, items = 0.0, 0
        for i, b in enumerate(batches):
            t = targets[i]
            total += kl_to(model, b, t).item() * len(t)
            items += len(t)
    return total / items


def distill(merged, teachers, data: Data, weights=None, settings: DistillSettings = DistillSettings(),
            device="cpu", progress: bool = False):
    """``(model, report)``: a copy of ``merged`` trained for ``settings.steps`` steps to lower
    ``KL(Σ_k w_k p_k ‖ p_model)`` on the unlabeled ``data`` (``teachers``: the aligned endpoints, unchanged;
    ``weights``: the merge weights, uniform when None). The report carries :data:`LABEL`, the KL before and
    after on the training and held-out batches, and the seconds. Where the held-out KL (the training one when
    nothing is held out) is higher after than before, ``merged`` itself is returned and the report says so
    (``kept`` false, ``warning``): a distillation that moves away from the ensemble is not kept in silence."""
    if data is None or not data.batches:
        raise SymmergeError("distillation needs unlabeled data: pass --align-data FILE")
    if not teachers:
        raise SymmergeError("distillation needs the models that were merged (the ensemble's members)")
    t0 = time.perf_counter()
    w = _weights(weights, len(teachers))
    dev = torch.device(device)
    student = copy.deepcopy(merged).to(dev).eval()  # eval: no dropout; the gradient still flows
    teachers = [t.to(dev).eval() for t in teachers]
    train, held = split(data, settings.holdout, settings.batch)
    # minibatches whose texts are all one token score nothing: their KL was 0/0 (NaN, "diverged")
    train, held = scoring(train, data.format), scoring(held, data.format)
    if not train:
        raise nothing_scored(data.path, "distillation")
    train, held = [b.to(dev) for b in train], [b.to(dev) for b in held]
    t_train, t_held = Targets(teachers, train, w), Targets(teachers, held, w)
    before = {"train": mean_kl(student, train, t_train), "held_out": mean_kl(student, held, t_held)}
    params = [p for p in student.parameters() if p.is_floating_point()]
    flags = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(True)
    opt, sched = cosine_adam(params, settings.lr, settings.steps)
    order = shuffled(len(train), torch.Generator().manual_seed(settings.seed))
    losses = []
    for _ in bar(range(settings.steps), desc="distilling", unit="steps", disable=None if progress else True):
        i = next(order)
        loss = kl_to(student, train[i], t_train[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        value = loss.item()
        if not math.isfinite(value):
            raise SymmergeError(f"distillation diverged (KL {value}); lower --distill-lr")
        losses.append(value)
    for p, flag in zip(params, flags):  # as the merged model had them
        p.requires_grad_(flag)
    student.eval()
    after = {"train": mean_kl(student, train, t_train), "held_out": mean_kl(student, held, t_held)}
    for t in teachers:
        t.to("cpu")
    report = {"label": LABEL, "function_preserving": False, "target": TARGET, "weights": w,
              **asdict(settings), "data": data.path,
              "examples": {"train": sum(b.size for b in train), "held_out": sum(b.size for b in held)},
              "kl_before": before, "kl_after": after,
              "loss_first": losses[0], "loss_last": losses[-1], "seconds": time.perf_counter() - t0}
    if not held:
        report["note"] = "nothing held out (holdout 0, or one example): the KL is measured on the training part only"
    side = "held_out" if held else "train"
    report["kept"] = after[side] <= before[side]
    if not report["kept"]:  # the distilled model drifted from the ensemble: the merge is written as it was
        report["warning"] = (f"distillation raised the {side.replace('_', '-')} KL to the ensemble "
                             f"({before[side]:.4f} -> {after[side]:.4f}): the merged model is kept undistilled "
                             "(try a lower --distill-lr or fewer --distill steps)")
        return merged, report
    return student.to("cpu"), report
