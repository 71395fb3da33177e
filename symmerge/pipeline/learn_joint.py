"""Learned joint alignment of N models: the continuous group elements of every model but one, optimised
together so that random convex combinations of the N models predict the same combination of their
predictions.

The pairwise learned alignment (:mod:`symmerge.pipeline.learn`) trains the interpolated model
α·θ_A + (1 − α)·θ_B against α·p_A + (1 − α)·p_B. With N models in one frame the interpolation is a
point of the simplex: at every step a weight vector w ~ Dirichlet(c·1_N) is drawn, and the mixture

    θ(w) = Σ_i w_i · T_i(θ_i)

(``T_i``: model i's learned element, through each group kind's declared continuous parameterisation,
``Kind.learn_*``; the identity for the frame model, which fixes the common frame) is trained with soft
cross-entropy against Σ_i w_i · p_i (``LearnSettings.target="probabilities"``) or the normalised
geometric mean softmax(Σ_i w_i · log p_i) (``"log-probabilities"``, the default). The endpoints'
predictions p_i do not depend on the elements (each T_i preserves model i's function): they are computed
once per batch. For N = 2 and w = (α, 1 − α) this is the pairwise objective; the weights are
Dirichlet(1) = U(0, 1) there instead of U(``alpha_low``, ``alpha_high``).

The start is the closed-form joint alignment (:func:`symmerge.pipeline.joint.align_joint` with the
matcher ``LearnSettings.start``: ``activations`` on the same unlabeled data, or ``weights``), the FFN and
head permutations of which stay fixed. Adam with cosine decay on all N − 1 models' parameters at once,
one forward and backward of the mixture per step, the same settings as the pairwise case (steps, batch,
lr, hold-out and patience, augmented image views, positions, seed, time budget, ``precision`` — the steps and
the models' predictions under bf16 autocast, the checks float32 — and ``check_batches``); the objective is
checked at the uniform average and at the points halfway between it and each model, which for N = 2
are the pairwise check points α = ½, ¾, ¼. The end is kept only if that check is not
worse than at the start. Every learned element is then rounded back to an exact element of its group
(``Kind.learn_element``, float64), checked as a group element, and every model's final form is run
against the model it came from.

``LearnSettings.frame = "dual"`` (``--learn-frame dual``): every model moves, the frame model too, each with its
own norm splits (:func:`symmerge.pipeline.dual.learn_dual`: normalisation absorption, a per-coordinate scale and
shift per folded norm), from the same closed-form start; the merged model is their mean in that shared frame.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import time

import numpy as np
import torch

from ..core.apply import apply
from ..core.distance import parameter_keys
from ..errors import SymmergeError
from ..families import spec_for
from ..progress import bar, stage
from .align import instances_for, load_align_data, untied
from .learn import (Checks, Parameters, budget_spent, cosine_adam, examples_word, norm_eps, prepared_batches,
                    scored_logits, shuffled)
from .frame import JointAlignment, spread
from .matchers import matcher
from .mixture import check_points, mixture_weights
from .options import DIRICHLET_AUTO
from .verify import verify_elements, verify_forward, with_state_dict

DIRICHLET = 1.0  # a fixed concentration of the mixture weights (Dirichlet(1): uniform on the simplex); the settings'
# default is "auto" (chosen on held-out data, choose_concentration)


class Mixture:
    """The N models (state dicts in one frame, float32 for learning) and the skeleton that runs any
    state dict of their architecture: the mixture θ(w) and its loss against the mixed predictions."""

    def __init__(self, skeleton, state_dicts: list[dict], frame: int, target: str):
        self.skeleton = copy.deepcopy(skeleton).to(torch.float32).eval()
        for p in self.skeleton.parameters():
            p.requires_grad_(False)
        self.work = [{k: v.detach().to(torch.float32) if v.is_floating_point() else v for k, v in sd.items()}
                     for sd in state_dicts]
        self.frame, self.target = frame, target

    def forward(self, sd: dict, batch) -> torch.Tensor:
        # tied weights (an LM head sharing the embeddings) arrive under both names, with the same values
        out = torch.func.functional_call(self.skeleton, sd, args=(), kwargs=batch.inputs, tie_weights=False)
        return scored_logits(out.logits, batch)

    def predictions(self, batch) -> torch.Tensor:
        """(N, M, C): every model's probabilities (``target="probabilities"``) or log-probabilities on
        ``batch``'s scored items; fixed, since the elements preserve each model's function."""
        norm = torch.softmax if self.target == "probabilities" else torch.log_softmax
        with torch.no_grad():
            return torch.stack([norm(self.forward(sd, batch).float(), -1) for sd in self.work])

    def mixed(self, w: torch.Tensor, changed: list[dict]) -> dict:
        """θ(w) = Σ_i w_i · θ_i, with ``changed[i]`` (the tensors model i's learned element changes)
        replacing model i's own; integer buffers from the frame model."""
        out = {}
        for k, v in self.work[self.frame].items():
            if not v.is_floating_point():
                out[k] = v
                continue
            acc = None
            for i, sd in enumerate(self.work):
                term = w[i] * changed[i].get(k, sd[k])
                acc = term if acc is None else acc + term
            out[k] = acc
        return out

    def loss(self, w: torch.Tensor, changed: list[dict], batch, predictions: torch.Tensor) -> torch.Tensor:
        """Soft cross-entropy of θ(w) against the same mixture of the models' predictions."""
        logp = torch.log_softmax(self.forward(self.mixed(w, changed), batch).float(), -1)
        t = (w.to(predictions.dtype)[:, None, None] * predictions).sum(0)
        if self.target != "probabilities":  # the normalised geometric mean of the predictions
            t = torch.softmax(t, -1)
        return -(t * logp).sum(-1).mean()


def learn_mixture(instances, skeleton, state_dicts: list[dict], frame: int, data, settings, opts,
                  model_facts: dict, progress: bool = False, concentration: float = DIRICHLET, on_step=None):
    """Learn every model's continuous elements but the ``frame`` model's, in the parameterisation of
    ``state_dicts`` (one frame); returns ``(elements, info)``: ``elements[i]`` is model i's
    ``{instance name: element}`` (empty for the frame model and when nothing can be learned), to be
    applied to ``state_dicts[i]``. ``on_step(step, parameters)`` is called after every update (tests;
    ``parameters``: one :class:`~symmerge.pipeline.learn.Parameters` per model, None for the frame)."""
    t0 = time.perf_counter()
    n = len(state_dicts)
    mix = Mixture(skeleton, state_dicts, frame, settings.target)
    params = [None if i == frame else Parameters(instances, opts, torch.float32, model_facts) for i in range(n)]
    learners = [p for p in params if p is not None]
    g = torch.Generator().manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed)
    train, p_train, check, p_check, held, checked_on = prepared_batches(mix.predictions, data, settings, g)

    def changed() -> list[dict]:
        return [{} if p is None else p.transform(mix.work[i]) for i, p in enumerate(params)]

    points = check_points(n, concentration)

    def held_out() -> float:
        with torch.no_grad():
            moved = changed()
            values = [mix.loss(w, moved, b, p).item() for w in points for b, p in zip(check, p_check)]
        return sum(values) / len(values)

    def snapshot() -> list:
        return [None if p is None else {k: v.detach().clone() for k, v in p.state_dict().items()} for p in params]

    history: dict = {"step": [], "train": []}
    info = {"models_learned": len(learners), "dirichlet": concentration, "weights_checked": len(points),
            "parameters": sum(x.numel() for p in learners for x in p.parameters())}
    checks = Checks(settings, held, held_out, snapshot, history, info)
    best = checks.start
    info.update(held_out_start=best, precision=settings.precision, checked_on=checked_on)
    everything = [x for p in learners for x in p.parameters()]
    if not everything:
        info.update(steps=0, held_out_best=best, history=history, seconds=time.perf_counter() - t0,
                    note="no continuous group elements to learn")
        return [{} for _ in range(n)], info
    steps = settings.steps
    opt, sched = cosine_adam(everything, settings.lr, steps)
    order, step, running = shuffled(len(train), g), 0, None
    pbar = bar(range(steps), desc=f"joint learned alignment ({n} models)", unit="step",
               disable=None if progress else True)
    for step in pbar:
        if budget_spent(settings, t0, info):
            break
        i = next(order)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=settings.precision == "bfloat16"):
            loss = mix.loss(mixture_weights(n, concentration, rng), changed(), train[i], p_train[i])  # the step
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        pbar.set_postfix(loss=f"{running:.4f}", refresh=False)
        if on_step is not None:
            on_step(step, params)
        if ((step + 1) % settings.check_every == 0 or step + 1 == steps) and checks.after(step + 1, running):
            break
    pbar.close()
    best, best_state = checks.finish()  # never worse than the start on the objective
    for p, state in zip(params, best_state):
        if p is not None:
            p.load_state_dict(state)
    elements = [{} if p is None else p.elements() for p in params]
    info.update(steps=step + 1, held_out_best=best, history=history, seconds=time.perf_counter() - t0)
    return elements, info


def _rows(batch, start: int, stop: int):
    """Examples ``start:stop`` of ``batch`` (every tensor sliced along its first axis)."""
    cut = lambda t: None if t is None else t[start:stop]  # noqa: E731
    return type(batch)({k: cut(v) if isinstance(v, torch.Tensor) else v for k, v in batch.inputs.items()},
                       cut(batch.labels), cut(batch.mask))


def _size(batch) -> int:
    return len(next(v for v in batch.inputs.values() if isinstance(v, torch.Tensor)))


def split_batches(data, fraction: float):
    """``(fit, held)``: ``data`` (a loaded :class:`~symmerge.io.data.Data`) cut into its first batches and
    its last ``fraction`` of them (at least one each); with a single batch, its last ``fraction`` of
    examples (at least one each). The concentration's choice learns on ``fit`` and scores on ``held``."""
    batches = list(data.batches)
    if len(batches) == 1 and _size(batches[0]) >= 2:
        m = _size(batches[0])
        cut = m - min(max(1, int(round(fraction * m))), m - 1)
        fit, held = [_rows(batches[0], 0, cut)], [_rows(batches[0], cut, m)]
    elif len(batches) >= 2:
        n_held = min(max(1, int(round(fraction * len(batches)))), len(batches) - 1)
        fit, held = batches[:-n_held], batches[-n_held:]
    else:
        raise SymmergeError(f"--learn-dirichlet auto holds out part of the alignment data: it needs at least 2 "
                            f"examples, got {data.n} {examples_word(data)} (pass more, or a concentration: "
                            "--learn-dirichlet C)")
    return (dataclasses.replace(data, batches=fit, n=sum(map(_size, fit))),
            dataclasses.replace(data, batches=held, n=sum(map(_size, held))))


def uniform_score(skeleton, state_dicts: list[dict], frame: int, target: str, batches) -> float:
    """The learned objective at the uniform mixture: the soft cross-entropy of the plain average of
    ``state_dicts`` against the uniform mixture of the N models' predictions (``target``), averaged over
    ``batches``. The target does not depend on any alignment (each model keeps its function), so the
    values of differently aligned versions of the same models compare directly (they differ by their KL
    divergence to the same target)."""
    mix = Mixture(skeleton, state_dicts, frame, target)
    w = torch.full((len(state_dicts),), 1.0 / len(state_dicts), dtype=torch.float32)
    none = [{} for _ in state_dicts]
    with torch.no_grad():
        values = [mix.loss(w, none, b, mix.predictions(b)).item() for b in batches]
    return sum(values) / len(values)


def choose_concentration(learn, instances, skeleton, state_dicts: list[dict], frame: int, data, settings,
                         progress: bool = False, move=None) -> tuple[float, dict]:
    """``--learn-dirichlet auto``: the Dirichlet concentration of the joint learned alignment chosen on
    held-out unlabeled data (no labels anywhere). ``data`` is split by :func:`split_batches`
    (``settings.dirichlet_holdout``); for every concentration of ``settings.dirichlet_grid`` the mixtures
    are learned on the first part (``learn(data, settings, concentration=c)``: :func:`learn_mixture` bound
    to the models, ``settings.dirichlet_steps`` steps, 0: half of ``settings.steps``) and scored on the
    held-out part by :func:`uniform_score`: how well the uniform average of the aligned models matches
    the uniform mixture of their predictions. That criterion is the same for every concentration (the
    per-concentration training objectives are not: each averages over its own distribution of
    mixtures) and it is measured where the aggregate is taken (the plain average; a size-weighted
    aggregate is near it). The lowest score wins (ties: the smaller concentration). Returns
    ``(concentration, report)``; the report is ``learned.dirichlet_choice``. ``move(result)``: the N state
    dicts that ``learn``'s result moves ``state_dicts`` to (default: its elements applied; the dual frame's
    sides, :func:`_learners`)."""
    t0 = time.perf_counter()
    fit, held = split_batches(data, settings.dirichlet_holdout)
    steps = settings.dirichlet_steps or max(1, settings.steps // 2)
    candidate = dataclasses.replace(settings, steps=steps, holdout=0.0, budget=None)
    start = uniform_score(skeleton, state_dicts, frame, settings.target, held.batches)
    scores = []
    for c in settings.dirichlet_grid:
        with stage(f"joint learned alignment: Dirichlet({c:g}) on {fit.n} {examples_word(data)}, scored on "
                   f"{held.n} held out", enabled=progress):
            result, _ = learn(fit, candidate, concentration=c)
        moved = (move(result) if move is not None else
                 [apply(sd, instances, e) if e else sd for sd, e in zip(state_dicts, result)])
        scores.append(uniform_score(skeleton, moved, frame, settings.target, held.batches))
    best = min(range(len(scores)), key=lambda i: (scores[i], i))
    report = {"grid": list(settings.dirichlet_grid), "held_out_uniform": scores, "held_out_uniform_start": start,
              "chosen": settings.dirichlet_grid[best], "candidate_steps": steps, "fit_examples": fit.n,
              "held_out_examples": held.n, "seconds": time.perf_counter() - t0,
              "criterion": "soft cross-entropy of the uniform average of the aligned models against the uniform "
                           "mixture of their predictions, on the held-out part (lower is better)"}
    return settings.dirichlet_grid[best], report


def _learners(instances, skeleton, sds: list[dict], frame: int, options, progress: bool):
    """``(learn, move)`` of the joint learned alignment: ``learn(data, settings, concentration=c)`` →
    ``(result, info)`` and ``move(result, check=False)`` → the N moved state dicts (the models that did not move:
    ``sds``' own objects). One-sided (``options.learn.frame``): every model but the ``frame`` model learns its
    continuous elements (:func:`learn_mixture`); dual: every model moves, each with its norm splits
    (:func:`symmerge.pipeline.dual.learn_dual`), and the merged model is their mean in that shared frame.
    ``check``: the learned elements checked as exact elements of their groups (the dual frame always checks)."""
    facts = {"norm_eps": norm_eps(skeleton.config)}
    if options.dual:
        from .dual import learn_dual, moved_state

        def learn(data, settings, concentration):
            return learn_dual(instances, skeleton, sds, data, dataclasses.replace(settings, dirichlet=concentration),
                              options.solver_options(), facts, progress=progress)

        def move(sides, check: bool = False):
            return [moved_state(sd, instances, side)[0] for sd, side in zip(sds, sides)]
        return learn, move

    def move(elements, check: bool = False):
        if check:
            for e in filter(None, elements):
                verify_elements(instances, e)  # exact elements of their groups
        return [apply(sd, instances, e) if e else sd for sd, e in zip(sds, elements)]
    return functools.partial(learn_mixture, instances, skeleton, sds, frame, opts=options.solver_options(),
                             model_facts=facts, progress=progress), move


def align_joint_learned(models, options, anchor: int = 0, names=None, max_rounds: int = 10, steps=None,
                        inputs: dict | None = None, progress: bool = False, concentration: float | None = None, *,
                        closed_form):
    """:func:`~symmerge.pipeline.joint.align_joint` for a matcher that ``learns`` (called from it,
    arguments already checked): the closed-form joint alignment with the matcher
    ``options.learn.start``, then :func:`learn_mixture` on ``options.align_data``; the frame is the
    star's anchor's. Returns a :class:`~symmerge.pipeline.joint.JointAlignment` whose report adds
    ``match``, ``start`` and ``learned``. ``concentration``: the Dirichlet's (default
    ``options.learn.dirichlet``). ``closed_form``: the closed-form joint alignment the start comes from
    (:func:`~symmerge.pipeline.joint.align_joint`, passed in by it: this module does not import it back);
    ``steps``: its :class:`~symmerge.pipeline.joint.JointSteps` (None: their defaults)."""
    settings = options.learn
    concentration = settings.dirichlet if concentration is None else concentration  # --learn-dirichlet
    concentration = dataclasses.replace(settings, dirichlet=concentration).dirichlet  # checked; inf: "uniform"
    n = len(models)
    anchor %= n
    names = list(names) if names is not None else [f"model {i}" for i in range(n)]
    t0 = time.perf_counter()
    source = getattr(options.align_data, "path", options.align_data)  # a file, or data loaded already: its file
    with stage(f"loaded the alignment data ({source})", enabled=progress):
        data = load_align_data(options, models[anchor], sources=models)
    closed = options.with_(match=settings.start, align_data=data if matcher(settings.start).needs_data else None,
                           verify=False)
    start = closed_form(models, closed, anchor=anchor, names=names, max_rounds=max_rounds, progress=progress,
                        **({} if steps is None else {"steps": steps}))
    base = untied(models[anchor]) if options.untie else models[anchor]
    spec, instances = instances_for(base, options.layers, options.residual)
    sds = [x.state_dict() for x in start.models]
    learn, move = _learners(instances, start.models[anchor], sds, anchor, options, progress)
    choice = None
    if concentration == DIRICHLET_AUTO:
        concentration, choice = choose_concentration(learn, instances, start.models[anchor], sds, anchor, data,
                                                     settings, progress=progress, move=move)
    result, info = learn(data, settings, concentration=concentration)
    if choice is not None:
        info["dirichlet_choice"] = choice
    final = [x if sd is sds[i] else with_state_dict(x, sd)
             for i, (x, sd) in enumerate(zip(start.models, move(result, check=True)))]
    keys = parameter_keys(final[0])
    info["spread_after"] = spread([x.state_dict() for x in final], keys)
    spec = spec_for(models[0].config.model_type)
    seconds = [m["seconds"] for m in start.report["models"]]
    report_models = []
    for i, x in enumerate(models):
        check = (verify_forward(x, final[i], spec, options.verify_tol, inputs) if options.verify
                 else {"verify_max_abs_diff": None, "verify_max_rel_diff": None})
        report_models.append({"model": names[i], "seconds": seconds[i], **check})
    report = {**{k: v for k, v in start.report.items() if k not in ("models", "seconds")},
              "match": "learned", "start": f"{settings.start} (closed-form joint alignment)",
              "align_samples_used": data.n, "learned": info, "models": report_models,
              "seconds": time.perf_counter() - t0}
    return JointAlignment(final, report)
