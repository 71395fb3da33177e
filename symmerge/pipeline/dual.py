"""Dual (shared-frame) learned alignment: both models move, by exactly function-preserving maps, into a frame
between them, and the midpoint is trained there (``LearnSettings.frame = "dual"``, ``--learn-frame dual``).

Why moving both models adds anything. Every group element acts *linearly* on a model's parameters, and the
merged model has the same architecture, so for elements ``g_A``, ``g_B`` of one group

    α·g_A(θ_A) + (1 − α)·g_B(θ_B) = g_B( α·g_B⁻¹g_A(θ_A) + (1 − α)·θ_B ):

the dual midpoint is, as a function, the one-sided midpoint with ``g = g_B⁻¹ g_A``. Moving B too can only
change how the optimiser walks, not where it can go. What it adds is **normalisation absorption**: the
residual stream's groups act on the canonical form, each pre-LN norm folded into its readers (``γ = 1``,
``β`` in the readers' biases); from there every folded norm may take back any per-coordinate scale ``s`` and
shift ``e`` — the norm multiplies by ``s`` and adds ``e``, its readers' input columns are divided by ``s`` and
their biases lose ``(W / s)·e`` —, which is exact:

    (W / s)·(n ⊙ γ s + β s + e) + b − (W / s)·e = W·(n ⊙ γ + β) + b.

Each model chooses its own ``s``, ``e`` *in the shared frame* (after its residual rotation ``Q``): the merged
norm multiplies by ``α·s_A + (1 − α)·s_B`` while its readers are the mean of ``W_A Q_A / s_A`` and
``W_B Q_B / s_B`` — a product of means, not a mean of products, and no single one-sided map reproduces it
(the diagonal lives in B's rotated frame: ``Q_B diag(s) Q_Bᵀ`` is no diagonal). So the stream gains a
per-coordinate scaling, "diagonal × orthogonal", wherever a norm can fold: a norm whose reader is tied to
another tensor (GPT-2's final norm before the LM head shared with the embeddings) keeps its form, as in the
one-sided path.

The loop: both models' continuous elements (the kinds' ``learn_*`` parameterisations, as in
:mod:`symmerge.pipeline.learn`) and both models' norm splits are trained together, from the closed-form start
(A moved onto B, ``LearnSettings.start``), so that θ(α) = α·T_A(θ_A) + (1 − α)·T_B(θ_B), α ~ U(alpha_low,
alpha_high), predicts the endpoints' mixed predictions — the same objective, target, augmentation, hold-out,
checks (α = ¼, ½, ¾; on at most ``check_batches`` batches), early stopping, seed, budget and ``precision`` (the
steps and the models' predictions under bf16 autocast, the checks in float32) as the one-sided path; the end is
kept only where the check is better than the start. The learned elements are rounded to exact group elements
(float64), checked as every alignment's, applied with the norm splits (float64), and each moved model is run against
the model it came from (``verify``): both must be the same function.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from pathlib import Path

import numpy as np
import torch

from ..core.apply import apply, stages
from ..errors import SymmergeError
from ..families import spec_for
from ..groups.residual import _bias_key as _reader_bias
from ..io.sentence_transformers import check_pipelines
from ..io.tokenizers import check_tokenizers
from ..progress import bar, stage
from .data import load_align_data
from .learn import (Checks, Parameters, budget_spent, cosine_adam, head_forward, norm_eps, prepared_batches,
                    shuffled)
from .mixture import check_points, mixture_weights  # check_points(2): the pairwise checks α = ½, ¾, ¼
from .options import DIRICHLET_AUTO
from .verify import check_runs_on, in_dtype_of, verify_elements, verify_forward, with_state_dict, working_copies


def stream_folds(instances) -> tuple:
    """The folded norms of the residual stream (the instances' ``info.folds``; empty where the stream keeps
    its norms: post-LN, permutation variants, or no residual group)."""
    return tuple(f for inst in instances for f in getattr(getattr(inst, "info", None), "folds", ()) or ())


FROM_ONE_SIDED = False  # start from the one-sided learned alignment instead of its closed-form start (experiments)


def can_shift(fold, sd: dict) -> bool:
    """Whether a shift of fold's norm can be taken back from its readers: the norm has a bias and every
    reader one."""
    return fold.bias is not None and fold.bias in sd and all(_reader_bias(k) in sd for k, _ in fold.readers)


def split_norms(sd: dict, folds, scales: list, shifts: list, changed: dict | None = None) -> dict:
    """The tensors a norm split changes: for every fold ``f`` (its norm's output ``y = n ⊙ (offset + γ) + β``
    read by ``f.readers``), ``y → y ⊙ s + e`` with the readers' input columns divided by ``s`` and their biases
    less ``(W / s)·e`` — the same function. ``scales[i]`` (> 0) and ``shifts[i]`` (or None) are fold ``i``'s;
    ``changed``: tensors already moved (taken instead of ``sd``'s). Differentiable in ``scales``/``shifts``."""
    changed = changed or {}
    if any(e is not None and not can_shift(f, sd) for f, e in zip(folds, shifts)):
        raise SymmergeError("a norm split shifts a norm whose readers have no biases to take the shift back")
    out: dict = {}
    get = lambda k: out.get(k, changed.get(k, sd[k]))  # noqa: E731
    for f, s, e in zip(folds, scales, shifts):
        out[f.weight] = (get(f.weight) + f.offset) * s - f.offset
        if f.bias is not None and f.bias in sd:
            out[f.bias] = get(f.bias) * s + (0 if e is None else e)
        for key, axis in f.readers:
            w = get(key)
            shape = [1] * w.dim()
            shape[axis] = -1
            out[key] = w / s.reshape(shape)
            if e is not None:
                b = _reader_bias(key)
                out[b] = get(b) - torch.tensordot(out[key], e, dims=([axis], [0]))
    return out


class NormSplit(torch.nn.Module):
    """One model's learned norm splits: per fold a log-scale (``s = e^δ``) and, where the norm has a bias and
    every reader one, a shift; zeros: the identity."""

    def __init__(self, folds, sd: dict, dtype=torch.float32):
        super().__init__()
        self.folds = tuple(folds)
        self.log_scale = torch.nn.ParameterList()
        self.shift = torch.nn.ParameterList()
        self.shifted = []
        for f in self.folds:
            d = sd[f.weight].shape[0]
            self.log_scale.append(torch.nn.Parameter(torch.zeros(d, dtype=dtype)))
            can = can_shift(f, sd)
            self.shifted.append(can)
            self.shift.append(torch.nn.Parameter(torch.zeros(d if can else 0, dtype=dtype)))

    def values(self, dtype=None) -> tuple[list, list]:
        cast = (lambda t: t) if dtype is None else (lambda t: t.detach().to(dtype))  # noqa: E731
        scales = [torch.exp(cast(p)) for p in self.log_scale]
        shifts = [cast(p) if can else None for p, can in zip(self.shift, self.shifted)]
        return scales, shifts

    def transform(self, sd: dict, changed: dict) -> dict:
        scales, shifts = self.values()
        return {**changed, **split_norms(sd, self.folds, scales, shifts, changed)}

    def final(self, sd: dict) -> dict:
        """``sd`` split with the learned values, in float64 (the tensors' own dtypes kept)."""
        scales, shifts = self.values(torch.float64)
        wide = {k: v.detach().to(torch.float64) if v.is_floating_point() else v for k, v in sd.items()}
        moved = split_norms(wide, self.folds, scales, shifts)
        return {**sd, **{k: v.to(sd[k].dtype) for k, v in moved.items()}}

    def summary(self) -> dict:
        with torch.no_grad():
            scales = torch.cat([p.exp() for p in self.log_scale]) if self.folds else torch.zeros(0)
            return {"norms": len(self.folds), "with_shift": sum(self.shifted),
                    "scale_min": float(scales.min()) if len(scales) else None,
                    "scale_max": float(scales.max()) if len(scales) else None}


@dataclasses.dataclass
class DualSide:
    """One model's learned parts: its continuous elements and its norm splits."""

    params: Parameters
    split: NormSplit | None

    def modules(self) -> list:
        return [m for m in (self.params, self.split) if m is not None]

    def changed(self, sd: dict) -> dict:
        moved = self.params.transform(sd)
        return moved if self.split is None else self.split.transform(sd, moved)

    def snapshot(self) -> list:
        return [{k: v.detach().clone() for k, v in m.state_dict().items()} for m in self.modules()]

    def restore(self, state: list) -> None:
        for m, s in zip(self.modules(), state):
            m.load_state_dict(s)


class Interpolation:
    """The models (state dicts in one frame, float32) and a skeleton that runs any state dict of their
    architecture: the interpolated model Σ_i w_i·θ_i and its soft cross-entropy against the same mixture of
    the models' own predictions (``target``: probabilities, or the normalised geometric mean of them).
    (Its own small copy of :class:`~symmerge.pipeline.learn_joint.Mixture`'s job: that module imports
    ``pipeline.align``, which dispatches here.)"""

    def __init__(self, skeleton, state_dicts: list[dict], target: str):
        self.skeleton = copy.deepcopy(skeleton).to(torch.float32).eval().requires_grad_(False)
        self.work = [{k: v.detach().to(torch.float32) if v.is_floating_point() else v for k, v in sd.items()}
                     for sd in state_dicts]
        self.geometric = target != "probabilities"

    def predictions(self, batch) -> torch.Tensor:
        """(N, M, C): each model's (log-)probabilities on ``batch``; fixed, as every map preserves its model."""
        norm = torch.log_softmax if self.geometric else torch.softmax
        with torch.no_grad():
            return torch.stack([norm(head_forward(self.skeleton, sd, batch).float(), -1) for sd in self.work])

    def loss(self, w: torch.Tensor, changed: list[dict], batch, predictions: torch.Tensor) -> torch.Tensor:
        theta = {}
        for k, v in self.work[0].items():  # integer buffers: the first model's
            theta[k] = sum(w[i] * changed[i].get(k, sd[k]) for i, sd in enumerate(self.work)) \
                if v.is_floating_point() else v
        logp = torch.log_softmax(head_forward(self.skeleton, theta, batch).float(), -1)
        target = torch.einsum("n,nmc->mc", w.to(predictions.dtype), predictions)
        if self.geometric:
            target = torch.softmax(target, -1)
        return -(target * logp).sum(-1).mean()


def _descend(opt, sched, loss: torch.Tensor, running: float | None) -> float:
    """One optimiser step on ``loss``; the running (exponential) mean of the training loss."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return loss.item() if running is None else 0.9 * running + 0.1 * loss.item()


def learn_dual(instances, skeleton, state_dicts: list[dict], data, settings, opts, model_facts: dict,
               norms: bool = True, progress: bool = False, on_step=None):
    """Learn every model's continuous elements (and with ``norms`` its norm splits) at once, all models
    moving, from ``state_dicts`` (canonical, one frame). Returns ``(sides, info)``: one :class:`DualSide`
    per model holding the best state. Two models: α ~ U(alpha_low, alpha_high); more: weights drawn from
    Dirichlet(C, …), C = ``settings.dirichlet`` (1 when ``"auto"``: the joint learned alignment,
    :mod:`symmerge.pipeline.learn_joint`, chooses it and passes it in the settings). ``settings.precision``
    ``"bfloat16"``: every step (the maps, the norm splits, the forward and the backward) and the models'
    predictions under bf16 autocast; the checks stay float32
    (:func:`~symmerge.pipeline.learn.prepared_batches`)."""
    concentration = 1.0 if settings.dirichlet == DIRICHLET_AUTO else settings.dirichlet
    t0 = time.perf_counter()
    n = len(state_dicts)
    mix = Interpolation(skeleton, state_dicts, settings.target)
    folds = stream_folds(instances) if norms else ()
    sides = [DualSide(Parameters(instances, opts, torch.float32, model_facts),
                      NormSplit(folds, sd) if folds else None) for sd in mix.work]
    g = torch.Generator().manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed)
    train, p_train, check, p_check, held, checked_on = prepared_batches(mix.predictions, data, settings, g)
    points = check_points(n, concentration if n > 2 else None)

    def changed() -> list[dict]:
        return [side.changed(sd) for side, sd in zip(sides, mix.work)]

    def held_out() -> float:
        with torch.no_grad():
            moved = changed()
            values = [mix.loss(w, moved, b, p).item() for w in points for b, p in zip(check, p_check)]
        return sum(values) / len(values)

    def weights() -> torch.Tensor:
        if n == 2:
            a = settings.draw_alpha(g)
            return torch.tensor([a, 1 - a], dtype=torch.float32)
        return mixture_weights(n, concentration, rng)

    history: dict = {"step": [], "train": []}
    everything = [x for side in sides for m in side.modules() for x in m.parameters()]
    info = {"frame": "dual", "models_moved": n, "norm_splits": len(folds),
            **({"dirichlet": concentration} if n > 2 else {}),
            "parameters": sum(x.numel() for x in everything)}
    checks = Checks(settings, held, held_out, lambda: [s.snapshot() for s in sides], history, info)
    info.update(held_out_start=checks.start, precision=settings.precision, checked_on=checked_on)
    step = -1
    if everything:
        opt, sched = cosine_adam(everything, settings.lr, settings.steps)
        order, running = shuffled(len(train), g), None
        pbar = bar(range(settings.steps), desc=f"dual learned alignment ({n} models)", unit="step",
                   disable=None if progress else True)
        for step in pbar:
            if budget_spent(settings, t0, info):
                break
            i = next(order)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.precision == "bfloat16"):
                loss = mix.loss(weights(), changed(), train[i], p_train[i])  # the step: transform, forward
            running = _descend(opt, sched, loss, running)
            pbar.set_postfix(loss=f"{running:.4f}", refresh=False)
            if on_step is not None:
                on_step(step, sides)
            if ((step + 1) % settings.check_every == 0 or step + 1 == settings.steps) and \
                    checks.after(step + 1, running):
                break
        pbar.close()
    else:
        info["note"] = "no continuous group elements and no folded norm to learn"
    best, state = checks.finish()  # never worse than the start on the objective
    for side, s in zip(sides, state):
        side.restore(s)
    info.update(steps=step + 1, held_out_best=best, history=history, seconds=time.perf_counter() - t0)
    return sides, info


def moved_state(sd: dict, instances, side: DualSide) -> tuple[dict, dict]:
    """``(state dict, elements)``: ``sd`` moved by the side's learned elements (exact group elements, checked)
    and then by its norm splits (float64)."""
    elements = side.params.elements()
    verify_elements(instances, elements)
    out = apply(sd, instances, elements) if elements else dict(sd)
    return (out if side.split is None else side.split.final(out)), elements


def align_dual(model, anchor, options, inputs: dict | None = None, progress=None, allow_pickle: bool = False,
               allow_tokenizer_mismatch: bool = False, *, closed_form, load, result):
    """:func:`~symmerge.pipeline.align.align_pair` with ``options.dual`` (the learned dual frame): the closed-form
    start (``options.learn.start``; A onto B), then :func:`learn_dual` on both models with their norm splits.
    Returns an :class:`~symmerge.pipeline.align.Alignment` whose ``model`` is A and whose ``anchor`` is B,
    each moved into the shared frame and verified against its original (``options.verify``); ``elements``:
    A's (the start's composed with the learned ones). The report is the start's with ``match="learned"``,
    ``frame="dual"``, ``learned`` (the loop's record, the norm splits, B's learned instance count) and the
    verification of both models (``verify_*``: the larger of the two; ``verify_anchor_*``: B's).
    ``closed_form``, ``load``, ``result``: :func:`~symmerge.pipeline.align.align_pair`, its loader and its
    ``Alignment`` class, passed in by it (this module does not import it back)."""
    settings = options.learn
    if settings.layerwise:
        raise SymmergeError("--learn-frame dual builds both models' moved tensors at every step: it does not run "
                            "layer-wise (--learn-layerwise); use the one-sided frame for that")
    t0 = time.perf_counter()
    tokenizer = check_tokenizers([(str(x) if isinstance(x, (str, Path)) else label, x)
                                  for x, label in ((model, "model"), (anchor, "anchor"))], allow_tokenizer_mismatch)
    if isinstance(model, (str, Path)):
        check_pipelines([(str(model), model)])
    stored = [load(x, allow_pickle, progress is not None) for x in (model, anchor)]
    check_runs_on(stored[0], inputs)
    model, anchor = working_copies(stored)  # half or mixed dtypes: learned and verified in float32
    # the start: the closed form A onto B, or (``FROM_ONE_SIDED``, an experiment of benchmarks/dual_learned.py)
    # the whole one-sided learned alignment, which the dual loop then refines
    # the data read once, as the learning reads it (``--learn-max-length``, the learned batch), and the closed
    # form's statistics taken on the same batches, as the one-sided path and the joint alignment take them: a
    # file and the Data it reads to give one alignment
    data = load_align_data(options, model, sources=[model, anchor])
    closed = options.with_(match="learned" if FROM_ONE_SIDED else settings.start, verify=False, align_data=data,
                           learn=dataclasses.replace(settings, frame="one-sided"))
    start = closed_form(model, anchor, closed, progress=progress, allow_tokenizer_mismatch=True)
    instances = start.instances
    sds = [start.model.state_dict(), start.anchor.state_dict()]
    facts = {"norm_eps": norm_eps(model.config)}
    with stage("dual learned alignment", enabled=progress is not None):
        sides, info = learn_dual(instances, start.anchor, sds, data, settings, options.solver_options(), facts,
                                 progress=progress is not None)
    (sd_a, learned_a), (sd_b, learned_b) = (moved_state(sd, instances, s) for sd, s in zip(sds, sides))
    elements = dict(start.elements)
    for name, el in learned_a.items():
        elements[name] = (*stages(start.elements[name]), el) if name in start.elements else el
    moved_a = with_state_dict(start.model, sd_a)
    moved_b = with_state_dict(start.anchor, sd_b)
    info.update(norm_split_a=sides[0].split.summary() if sides[0].split else None,
                norm_split_b=sides[1].split.summary() if sides[1].split else None,
                learned_instances=len(learned_a), learned_instances_anchor=len(learned_b))
    report = dict(start.report)
    start_text = "learned, one-sided (A onto B)" if FROM_ONE_SIDED else f"{settings.start} (closed form, A onto B)"
    report.update(match="learned", frame="dual", start=start_text, learned=info,
                  align_samples_used=data.n, tokenizer=tokenizer, match_seconds=time.perf_counter() - t0)
    if options.verify:
        spec = spec_for(model.config.model_type)
        with stage("verified both moved models' outputs", enabled=progress is not None):
            va = verify_forward(model, moved_a, spec, options.verify_tol, inputs)
            vb = verify_forward(anchor, moved_b, spec, options.verify_tol, inputs)
        report.update({k: max(va[k], vb[k]) if k != "verify_tolerance" else va[k] for k in va})
        report.update({k.replace("verify_", "verify_anchor_"): v for k, v in vb.items() if k != "verify_tolerance"})
    else:
        report.update(verify_max_abs_diff=None, verify_max_rel_diff=None, verify_tolerance=None)
    report["seconds"] = time.perf_counter() - t0
    moved_a, moved_b = (in_dtype_of(m, x) for m, x in zip((moved_a, moved_b), stored))
    return result(moved_a, moved_b, report, elements, instances, start.bound)
