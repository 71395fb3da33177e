"""Learned alignment: the continuous group elements optimised on a little unlabeled data.

Start from the best closed-form alignment (data-free weight matching, every group iterated to
convergence). Then, keeping the permutations fixed, optimise the continuous elements of the full
symmetry group — each exactly function-preserving whatever its value:

* the residual stream: an orthogonal map through the exponential of a skew matrix — acting only on the
  complement of the all-ones direction for a folded pre-LN LayerNorm stream (O(d−1)), on the whole
  stream for RMSNorm (O(d)) — and one global scale ``c = e^γ`` of every writer (exact up to the norms'
  ε, since ``LN(c·x) = LN(x)``); post-LN streams keep their permutation;
* per attention head a general invertible map ``M = exp(A)`` on QK (``W_Q → Mᵀ W_Q``, ``W_K → M⁻¹ W_K``)
  and on VO (``W_V → Mᵀ W_V``, ``W_O → W_O M⁻ᵀ``): the full group of a head's bilinear forms, larger
  than the rotations and scales of the paper; for RoPE groups the complex scalar of each frequency pair
  (rotation and scale, the maps that commute with RoPE) and a general map on non-rotated dims; shared
  by the query heads of a KV head (GQA); Qwen3's norm-locked pairs stay as solved;
* SwiGLU unit scales ``s = e^σ`` (the sign stays as solved).

so that the interpolated model θ(α) = α·θ_A + (1 − α)·θ_B, with α drawn from U(low, high) at every
step, minimises the soft cross-entropy against α·p_A + (1 − α)·p_B (the endpoints' predictions: class
probabilities, or next-token distributions for language models) on the unlabeled set — no labels.
Adam with cosine decay, one forward and backward of the interpolated model per step, early stopping on
a held-out part of the set, a seed and an optional time budget. The result is returned as group
elements composed after the closed-form ones, so the usual validity check and verification apply;
the held-out objective is never worse than at the start (the start is kept otherwise).
"""

from __future__ import annotations

import copy
import math
import time

import torch

from ..core.apply import apply
from ..groups.base import Options
from ..io.data import Data
from .engine import solve


def scored_logits(logits: torch.Tensor, batch) -> torch.Tensor:
    """Logits (M, C) of the batch's scored items: every example, or every next token of a sequence
    (padding excluded)."""
    if logits.dim() == 2:
        return logits
    keep = batch.mask[:, 1:] if batch.mask is not None else torch.ones(logits.shape[:2], dtype=torch.bool)[:, 1:]
    return logits[:, :-1][keep]


class _Parameters(torch.nn.Module):
    """The learned deltas: for every active instance whose kind has continuous freedom, the kind's
    named tensors (zeros: the identity), as parameters."""

    def __init__(self, instances, opts: Options, dtype, model_facts: dict):
        super().__init__()
        self.p = torch.nn.ParameterDict()
        self.instances = []
        for inst in instances:
            values = inst.kind.learn_init(inst, opts, dtype, model_facts) if inst.kind.active(inst, opts) else None
            if values:
                for name, v in values.items():
                    self.p[self._key(inst, name)] = torch.nn.Parameter(v)
                self.instances.append((inst, tuple(values)))

    @staticmethod
    def _key(inst, name: str) -> str:
        return f"{inst.name.replace('.', '_')}__{name}"

    def values(self, inst, names) -> dict:
        return {n: self.p[self._key(inst, n)] for n in names}

    def transform(self, sd: dict) -> dict:
        """The tensors the learned elements change, as differentiable functions of the parameters."""
        out: dict = {}
        for inst, names in self.instances:
            kind = inst.kind
            prepared = kind.learn_prepare(inst, self.values(inst, names))
            for s in inst.slots:
                out[s.key] = kind.learn_apply(out.get(s.key, sd[s.key]), s, inst, prepared)
                for alias in s.aliases:
                    out[alias] = out[s.key]
        return out

    def elements(self) -> dict:
        """The learned deltas as group elements (float64)."""
        with torch.no_grad():
            return {inst.name: inst.kind.learn_element(inst, self.values(inst, names)) for inst, names in self.instances}


def norm_eps(config) -> float:
    """The ε of the model's norms (its config names it one of several ways); 1.0 when unknown."""
    for name in ("layer_norm_eps", "layer_norm_epsilon", "rms_norm_eps", "norm_eps"):
        value = getattr(config, name, None)
        if isinstance(value, (int, float)):
            return float(value)
    return 1.0


def _split(data: Data, holdout: float) -> tuple[list, list]:
    batches = list(data.batches)
    n_hold = int(round(holdout * len(batches))) if len(batches) > 1 else 0
    n_hold = min(max(n_hold, 1 if holdout > 0 and len(batches) > 1 else 0), len(batches) - 1)
    return batches[: len(batches) - n_hold], batches[len(batches) - n_hold:]


def learn_alignment(instances, model, anchor, ca: dict, cb: dict, data: Data, options, progress=None,
                    start: dict | None = None, on_step=None):
    """Elements aligning A (``ca``, canonical) to B (``cb``) learned on ``data``; returns
    ``(elements, report)``. ``start``: closed-form elements to start from (default: data-free weight
    matching); ``on_step(step, transformed_state_dict)`` is called after every update (tests)."""
    from ..progress import bar

    settings = options.learn
    t0 = time.perf_counter()
    opts = options.solver_options()
    given = start is not None
    if start is None:
        start = solve(instances, ca, cb, opts, max_sweeps=options.max_sweeps)
    a0 = apply(ca, instances, start)
    closed_seconds = time.perf_counter() - t0

    dtype = torch.float32
    work_a = {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in a0.items()}
    work_b = {k: v.detach().to(dtype) if v.is_floating_point() else v for k, v in cb.items()}
    skeleton = copy.deepcopy(anchor).to(dtype).eval()
    for p in skeleton.parameters():
        p.requires_grad_(False)
    params = _Parameters(instances, opts, dtype, {"norm_eps": norm_eps(model.config)})
    train, held = _split(data, settings.holdout)
    g = torch.Generator().manual_seed(settings.seed)

    def forward(sd, batch):
        out = torch.func.functional_call(skeleton, sd, args=(), kwargs=batch.inputs)
        return scored_logits(out.logits, batch)

    with torch.no_grad():  # the endpoints' predictions: fixed, alignment does not change them
        targets = [(torch.softmax(forward(work_a, b).float(), -1), torch.softmax(forward(work_b, b).float(), -1))
                   for b in train + held]
    t_train, t_held = targets[:len(train)], targets[len(train):]

    def interpolated(alpha: float, changed: dict) -> dict:
        return {k: alpha * changed.get(k, v) + (1 - alpha) * work_b[k] if v.is_floating_point() else work_b[k]
                for k, v in work_a.items()}

    def objective(alpha, batch, target) -> torch.Tensor:
        logp = torch.log_softmax(forward(interpolated(alpha, params.transform(work_a)), batch).float(), -1)
        t = alpha * target[0] + (1 - alpha) * target[1]
        return -(t * logp).sum(-1).mean()

    def held_out() -> float:
        if not held:
            return float("nan")
        with torch.no_grad():
            values = [objective(al, b, t).item() for al in (0.25, 0.5, 0.75) for b, t in zip(held, t_held)]
        return sum(values) / len(values)

    history = {"step": [], "train": [], "held_out": []}
    best_state = {k: v.detach().clone() for k, v in params.state_dict().items()}
    best = start_value = held_out()
    report = {"start": "given" if given else "weights (data-free, every group to convergence)",
              "closed_form_seconds": closed_seconds, "parameters": sum(p.numel() for p in params.parameters()),
              "held_out_start": start_value, "history": history}
    if not params.p:
        report.update(steps=0, note="no continuous group elements to learn", seconds=time.perf_counter() - t0)
        return start, report
    opt = torch.optim.Adam(params.parameters(), lr=settings.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, settings.steps) / settings.steps)))
    order, pos, stale, step = torch.randperm(len(train), generator=g), 0, 0, 0
    running = None
    pbar = bar(range(settings.steps), desc="learned alignment", unit="step", disable=None if progress else True)
    for step in pbar:
        if settings.budget is not None and time.perf_counter() - t0 > settings.budget:
            report["stopped"] = f"time budget of {settings.budget} s"
            break
        if pos >= len(train):
            order, pos = torch.randperm(len(train), generator=g), 0
        i = order[pos].item()
        pos += 1
        alpha = settings.alpha_low + (settings.alpha_high - settings.alpha_low) * torch.rand(1, generator=g).item()
        loss = objective(alpha, train[i], t_train[i])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        pbar.set_postfix(loss=f"{running:.4f}", refresh=False)
        if on_step is not None:
            on_step(step, params)
        if (step + 1) % settings.check_every == 0 or step + 1 == settings.steps:
            value = held_out()
            history["step"].append(step + 1)
            history["train"].append(running)
            history["held_out"].append(value)
            if not held or value < best - 1e-7 * abs(best):
                best, stale = value, 0
                best_state = {k: v.detach().clone() for k, v in params.state_dict().items()}
            else:
                stale += 1
                if stale >= settings.patience:
                    report["stopped"] = f"early stopping after {settings.patience} checks without improvement"
                    break
    pbar.close()
    params.load_state_dict(best_state)
    learned = params.elements()
    elements = dict(start)
    for name, el in learned.items():
        elements[name] = (start[name], el) if name in start else el
    report.update(steps=step + 1, held_out_best=best, seconds=time.perf_counter() - t0,
                  learned_instances=len(learned))
    return elements, report
