"""Joint alignment of N models into one common frame (MergeMany, Ainsworth et al. 2023, Alg. 3; for
the continuous groups, generalized Procrustes).

The objective is the spread of the models around their mean, in the parameterisation the groups act
on (norms folded where the residual group needs it)::

    J(g_1, ..., g_N) = Σ_i ‖g_i·θ_i − θ̄‖²,   θ̄ = (1/N) Σ_j g_j·θ_j.

With the others fixed, J as a function of model i alone is ``(N−1)/N · ‖g_i·θ_i − m_{−i}‖² + const``,
where ``m_{−i}`` is the mean of the *other* models. So aligning model i to ``m_{−i}`` (one pairwise
alignment with ``m_{−i}`` as the anchor) lowers J, and a result that would not lower it is rejected: J
never increases. The start is the star (every model aligned to one anchor); rounds of "each model to the
mean of the others" follow until a round lowers J by less than ``tol`` (relative) or nothing is accepted.

Data-free, a step is ONE sweep of the weight matcher's descent (:func:`~symmerge.pipeline.engine.solve`)
started from the model's current element — generalized Procrustes — on the state dicts, with the set-up
built once for the N models (:class:`_Sweeps`), the head pairings held between full rounds, and the
star's pairwise descents capped at :data:`STAR_SWEEPS` sweeps (the rounds continue them). With
activations, and with ``warm=False``, a step is a pairwise re-alignment
(:func:`~symmerge.pipeline.align.align_pair`) capped at 10 sweeps from the stream tensors, which costs
several times more (docs/results.md has the timings).

What the rounds re-solve (``refine``): ``all`` the options' groups (the definition above), or
``discrete`` only the groups whose elements form a finite set (``Kind.discrete``: head and FFN-unit
permutations, a permutation residual group), on the rotations and scales the star found — MergeMany as
Ainsworth et al. define it. ``all`` lowers the spread most but may move the non-anchor models to other
basins; ``discrete`` stays nearer the star (docs/merge.md, "N models in one frame", has the measurements).

The data-free objective's weights (``ends_weight``, ``depth_decay``:
:func:`~symmerge.pipeline.engine.objective_weights`) weigh J as they weigh the pair objective: the star's alignments
minimise the weighted distance, every step is solved on the weighted copies, and a step is accepted, and the rounds
stop, by the weighted J (with data, J is plain).

Every model stays in its own orbit throughout: its final form is checked against the model it came
from (outputs on sample inputs) once, at the end.

``--match learned`` starts from this closed form (with the matcher ``LearnSettings.start``) and then
learns every model's continuous elements but the anchor's so that random convex combinations of the N
models (Dirichlet weights) predict the same combination of their predictions
(:mod:`symmerge.pipeline.learn_joint`).
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import dataclass, field

from ..core.apply import apply
from ..core.distance import parameter_keys, sq_distance
from ..device import resolve_device
from ..errors import SymmergeError
from ..families import spec_for
from ..option_ranges import model_index
from ..progress import line, stage
from .align import align_pair, canonical, check_compatible
from .bound import bind
from .frame import JointAlignment, mean_state_dict, spread  # noqa: F401  (re-exported)
from .options import DEFAULT_REFINE, JOINT_REFINE, AlignOptions
from .engine import objective_weights, scaled, solve
from .matchers import MATCHERS
from .verify import in_dtype_of, verify_elements, verify_forward, with_state_dict, working_copies

# the matchers joint alignment runs: weights and activations align each model to the mean of the others (any
# anchor); learned starts from one of them and learns random convex combinations (pipeline/learn_joint.py)
JOINT_MATCHES = tuple(n for n, m in MATCHERS.items() if m.joint)  # the matchers that declare ``joint``


ROUND_SWEEPS = 10  # cap on the coordinate-descent sweeps of each re-alignment after the star (activations)
ROUND_TOL = 1e-4  # ... and the relative gain of a round below which they stop
# data-free (``--match weights``): each step after the star is ONE sweep of the descent, started from the
# model's current element; a round gains little by construction, so the rounds stop at a coarser gain, and the
# star's pairwise alignments, which the rounds continue, are capped at a few sweeps
SWEEP_ROUND_SWEEPS = 1
SWEEP_ROUND_TOL = 1e-3
STAR_SWEEPS = 3


def discrete_symmetries(model, options: AlignOptions) -> tuple[str, ...]:
    """The symmetries of ``options`` all of whose group instances in ``model`` are discrete (``Kind.discrete``);
    ``rescale`` is never one (it adds scales to other groups)."""
    kinds: dict[str, bool] = {}
    for inst in bind(model, options.layers, options.residual).instances:
        s = inst.group.symmetry
        kinds[s] = kinds.get(s, True) and inst.kind.discrete(inst)
    return tuple(s for s in options.symmetries if kinds.get(s))


class _Sweeps:
    """The data-free step of the rounds, on state dicts (no model copies, reports or forward checks in
    between): ``round_sweeps`` sweeps of the descent (:func:`~symmerge.pipeline.engine.solve`) of one model
    towards the mean of the others, started from its current element (the identity: every model is already
    in the common frame), every element checked valid. The set-up (bound instances, solver options) is built
    once for the N models. The lazy groups (head pairings: valuing every pairing is most of a step) are
    re-solved on full rounds only, as the descent re-solves them on full sweeps only: the star solved them, then
    they are held until the rounds converge, and one full round follows; the rounds end when a full round
    gains less than the rounds' ``tol``."""

    def __init__(self, current, step: AlignOptions, lazy: bool = True, weights: dict | None = None):
        device = None if step.device in (None, "cpu") else resolve_device(step.device)
        self.solver, self.sweeps, self.tol = step.solver_options(device), step.max_sweeps, step.descent_tol
        self.bound = [bind(x, step.layers, step.residual).instances for x in current]
        self.weights = weights or {}  # the objective's weights (engine.objective_weights): solved on scaled copies
        self.held = [{x.name for x in b if lazy and x.kind.lazy and x.kind.active(x, self.solver)} for b in self.bound]

    @property
    def lazy(self) -> bool:
        return any(self.held)

    def __call__(self, i: int, sd: dict, target: dict, full: bool) -> dict:
        insts = self.bound[i] if full else [x for x in self.bound[i] if x.name not in self.held[i]]
        elements = solve(insts, scaled(sd, self.weights), scaled(target, self.weights), self.solver,
                         max_sweeps=self.sweeps, init="all", tol=self.tol)
        verify_elements(insts, elements)
        return apply(sd, insts, elements)


@dataclass(frozen=True)
class JointSteps:
    """How the steps of a joint alignment run (:func:`align_joint`). ``tol``: a round that lowers the objective by
    less than this fraction ends the descent (None: :data:`SWEEP_ROUND_TOL` data-free, :data:`ROUND_TOL` else);
    ``round_sweeps``: the sweeps of a step after the star (None: :data:`SWEEP_ROUND_SWEEPS` data-free,
    :data:`ROUND_SWEEPS` else); ``star_sweeps``: the cap on the star's descents when the rounds continue them
    (None: converged); ``warm``: data-free, a step continues the descent from the model's current element."""

    tol: float | None = None
    round_sweeps: int | None = None
    star_sweeps: int | None = STAR_SWEEPS
    warm: bool = True


def align_joint(models, options: AlignOptions, anchor: int = 0, names=None, max_rounds: int = 10,
                inputs: dict | None = None, progress: bool = False, refine: str = DEFAULT_REFINE, on_round=None,
                steps: JointSteps = JointSteps()) -> JointAlignment:
    """Bring ``models`` (loaded transformers models of one architecture) into one frame; ``options``
    already resolved against the models (no 'recommended' left). ``anchor``: the model the star step
    aligns to. ``max_rounds``: cap on the rounds after the star; ``steps`` (:class:`JointSteps`): ``tol``, a round
    that lowers the objective by less than this fraction ends the descent, and the sweeps below; ``refine``: what
    the rounds re-solve (:data:`JOINT_REFINE`: ``all`` the options' groups, ``discrete`` only the permutations, on
    top of the star's continuous elements).

    Data-free (a matcher without ``needs_data``, ``warm``), a step after the star is ``round_sweeps``
    (default 1) sweeps of the descent from the model's current element — generalized Procrustes — and,
    with ``refine="all"`` and rounds to follow, the star's pairwise descents stop after ``star_sweeps``
    sweeps (None: converged): the rounds continue the same descent. Otherwise (activations, or
    ``warm=False``: the rounds before the sweeps) a step is a pairwise re-alignment capped at
    ``round_sweeps`` (default :data:`ROUND_SWEEPS`) sweeps, started from the stream tensors. A step that does
    not lower the objective is rejected. ``on_round(r, models)``: called with the models in the common
    frame after the star (``r = 0``) and after every round (benchmarks measure the average there).

    Named stages, each handing a frozen record to the next: :func:`_checked` → :class:`_Joint` →
    (learned: :mod:`symmerge.pipeline.learn_joint`) → :func:`_plan_steps` → :class:`_Steps` → :func:`_star` →
    :class:`_Frame` → :func:`_rounds` → :class:`_Frame` → :func:`_verified` → :func:`_report`."""
    stored, models = list(models), working_copies(models)  # half or mixed dtypes: solved in float32
    run = _checked(models, options, anchor, names, max_rounds, refine, steps, progress, on_round)
    if options.matcher.learns:  # a closed-form joint alignment, then the mixtures learned
        from .learn_joint import align_joint_learned

        done = align_joint_learned(models, options, run.anchor, run.names, run.max_rounds,
                                   JointSteps(tol=run.tol, round_sweeps=run.round_sweeps), inputs, progress,
                                   closed_form=functools.partial(align_joint, refine=refine))
    else:
        t0 = time.perf_counter()
        plan = _plan_steps(run)
        frame = _rounds(run, plan, _star(run, plan))
        done = JointAlignment(frame.current, _report(run, plan, frame, _verified(run, frame, inputs), t0))
    return JointAlignment([in_dtype_of(m, s) for m, s in zip(done.models, stored)], done.report)


@dataclass(frozen=True)
class _Joint:
    """A joint alignment's arguments, checked (:func:`_checked`), the defaults of the matcher's kind of step
    filled in."""

    models: list
    options: AlignOptions
    anchor: int
    names: list
    max_rounds: int
    tol: float
    round_sweeps: int
    refine: str
    star_sweeps: int | None
    sweeping: bool  # data-free: a step is sweeps of the descent on state dicts (:class:`_Sweeps`)
    progress: bool
    on_round: object


@dataclass(frozen=True)
class _Steps:
    """How the star and the rounds align (:func:`_plan_steps`)."""

    step: AlignOptions  # the options of a step of the rounds
    star: AlignOptions  # ... and of the star's pairwise alignments
    capped: bool  # the star's descents stop after ``star_sweeps`` sweeps (the rounds continue them)
    max_rounds: int  # the rounds to run at most (0: nothing discrete to re-solve)
    weights: dict  # data-free: the weight objective's weights (``ends_weight``, ``depth_decay``) in the spread


@dataclass(frozen=True)
class _Frame:
    """The models in the common frame: after the star (:func:`_star`), then after the rounds (:func:`_rounds`)."""

    current: list  # the models
    sds: list  # their state dicts
    keys: list  # the parameters the objective sums over
    objective: list  # after the star, then after each round
    seconds: list  # per model
    accepted_per_round: list = field(default_factory=list)
    full_rounds: int = 0  # rounds that re-solved the lazy groups


def _checked(models, options, anchor, names, max_rounds, refine, steps: JointSteps, progress, on_round) -> _Joint:
    """The arguments checked, the defaults of the matcher's kind of step filled in, the models compared."""
    tol, round_sweeps, star_sweeps = steps.tol, steps.round_sweeps, steps.star_sweeps
    n = len(models)
    if n < 2:
        raise SymmergeError(f"joint alignment needs at least 2 models, got {n}")
    model_index(anchor, n)
    if not options.matcher.joint:
        raise SymmergeError(f"joint alignment runs the {', '.join(JOINT_MATCHES)} matchers; --match "
                            f"{options.match} aligns pairwise to one anchor (pass --anchor to merge that way)")
    if refine not in JOINT_REFINE:
        raise SymmergeError(f"unknown joint refinement {refine!r}; choose {', '.join(JOINT_REFINE)}")
    sweeping = not options.matcher.needs_data and steps.warm
    tol = (SWEEP_ROUND_TOL if sweeping else ROUND_TOL) if tol is None else tol
    round_sweeps = (SWEEP_ROUND_SWEEPS if sweeping else ROUND_SWEEPS) if round_sweeps is None else round_sweeps
    if max_rounds < 0 or not tol >= 0 or round_sweeps < 1 or (star_sweeps is not None and star_sweeps < 1):
        raise SymmergeError(f"joint alignment needs max_rounds >= 0, tol >= 0, round_sweeps >= 1 and star_sweeps "
                            f">= 1 (or None), got {max_rounds}, {tol}, {round_sweeps}, {star_sweeps}")
    names = list(names) if names is not None else [f"model {i}" for i in range(n)]
    for i, x in enumerate(models):
        if i != anchor:
            check_compatible(x, models[anchor])
    return _Joint(list(models), options, anchor, names, max_rounds, tol, round_sweeps, refine, star_sweeps, sweeping,
                  progress, on_round)


def _plan_steps(run: _Joint) -> _Steps:
    """The options of the star's alignments and of the rounds' steps (``refine``: what they re-solve)."""
    options, max_rounds = run.options, run.max_rounds
    quiet = options.with_(verify=False)
    step = quiet.with_(max_sweeps=max(1, min(options.max_sweeps, run.round_sweeps)))
    if run.refine == "discrete":
        step = step.with_(symmetries=discrete_symmetries(run.models[run.anchor], options))
        max_rounds = max_rounds if step.symmetries else 0  # nothing discrete to re-solve
    capped = run.sweeping and run.refine == "all" and max_rounds > 0 and run.star_sweeps is not None
    star = quiet.with_(max_sweeps=min(options.max_sweeps, run.star_sweeps)) if capped else quiet
    return _Steps(step, star, capped, max_rounds, _weights(run))


def _weights(run: _Joint) -> dict:
    """The spread's weights: data-free, the weight matcher's objective is the one the star and the steps minimise,
    so its weights (the stream's ends, the layers by depth: ``ends_weight``, ``depth_decay``) weigh every model's
    distance to the mean; with data (activations) the plain spread."""
    options = run.options
    if options.matcher.needs_data or (options.ends_weight == 1.0 and options.depth_decay == 1.0):
        return {}
    instances = bind(run.models[run.anchor], options.layers, options.residual).instances
    return objective_weights(instances, options.solver_options(), options.ends_weight, options.depth_decay)


def _star(run: _Joint, plan: _Steps) -> _Frame:
    """The star: every model aligned to the anchor (in the options' parameterisation); the objective's start."""
    anchor, names = run.anchor, run.names
    frame = canonical(run.models[anchor], run.options)
    current, seconds = [], [0.0] * len(run.models)
    for i, x in enumerate(run.models):
        if i == anchor:
            current.append(frame)
            continue
        t = time.perf_counter()
        with stage(f"joint alignment, star: {names[i]} to {names[anchor]}", enabled=run.progress), \
                warnings.catch_warnings():
            if plan.capped:  # the cap is deliberate: the rounds go on with the same descent
                warnings.simplefilter("ignore")
            current.append(align_pair(x, frame, plan.star).model)
        seconds[i] += time.perf_counter() - t
    keys = parameter_keys(current[0])
    sds = [x.state_dict() for x in current]
    objective = [spread(sds, keys, plan.weights)]
    if run.on_round is not None:
        run.on_round(0, list(current))
    return _Frame(current, sds, keys, objective, seconds)


def _rounds(run: _Joint, plan: _Steps, star: _Frame) -> _Frame:
    """Rounds of each model to the mean of the others, a step kept only when it lowers the objective, until a
    round gains less than ``tol`` (with the lazy groups re-solved once more after converging without them)."""
    n, keys = len(run.models), star.keys
    sds, current, seconds, objective = list(star.sds), list(star.current), list(star.seconds), list(star.objective)
    accepted_per_round, full_rounds = [], 0
    sweep = _Sweeps(current, plan.step, weights=plan.weights) if run.sweeping and plan.max_rounds else None
    stale = [False] * n  # the model object lags its state dict (sweep steps work on state dicts only)
    # the lazy groups are re-solved in this round: the star has just solved them (on its first, full sweep),
    # so the sweep rounds start with them held, as the descent goes on after a full sweep
    full = sweep is None or not sweep.lazy
    for r in range(plan.max_rounds):
        accepted = 0
        for i in range(n):
            target_sd = mean_state_dict([sds[j] for j in range(n) if j != i], keys)
            t = time.perf_counter()
            with warnings.catch_warnings():  # the sweep cap of a step is deliberate (see round_sweeps)
                warnings.simplefilter("ignore")
                if sweep is not None:
                    new_sd, moved = sweep(i, sds[i], target_sd, full), None
                else:
                    moved = align_pair(current[i], with_state_dict(current[i], target_sd), plan.step).model
                    new_sd = moved.state_dict()
            seconds[i] += time.perf_counter() - t
            if sq_distance(new_sd, target_sd, keys, weights=plan.weights) < \
                    sq_distance(sds[i], target_sd, keys, weights=plan.weights):
                sds[i], stale[i] = new_sd, moved is None
                if moved is not None:
                    current[i] = moved
                accepted += 1
        objective.append(spread(sds, keys, plan.weights))
        accepted_per_round.append(accepted)
        full_rounds += full
        if run.on_round is not None:
            run.on_round(r + 1, [with_state_dict(x, sd) if s else x for x, sd, s in zip(current, sds, stale)])
        if run.progress:
            line(f"joint alignment, round {r + 1}: spread {objective[-1]:.6g} ({accepted}/{n} models moved)")
        lazy = sweep is not None and sweep.lazy
        if accepted == 0 or objective[-2] - objective[-1] <= run.tol * objective[-2]:
            if full or not lazy:
                break
            full = True  # converged with the lazy groups held: re-solve them once
            continue
        full = not lazy
    current = [with_state_dict(x, sd) if s else x for x, sd, s in zip(current, sds, stale)]
    return _Frame(current, sds, keys, objective, seconds, accepted_per_round, full_rounds)


def _verified(run: _Joint, frame: _Frame, inputs) -> list[dict]:
    """Each model still computes its function: its final form checked against the model it came from."""
    spec = spec_for(run.models[0].config.model_type)
    if not run.options.verify:
        return [{"verify_max_abs_diff": None, "verify_max_rel_diff": None} for _ in run.models]
    return [verify_forward(x, frame.current[i], spec, run.options.verify_tol, inputs)
            for i, x in enumerate(run.models)]


def _report(run: _Joint, plan: _Steps, frame: _Frame, verification: list[dict], t0: float) -> dict:
    """The joint alignment's report."""
    held = f"{run.round_sweeps} sweep(s) of the descent from the current element, lazy groups re-solved in " \
           f"{frame.full_rounds} round(s)"
    o = run.options
    weighted = f"; weighted as the data-free objective: ends weight {o.ends_weight:g}, depth decay " \
               f"{o.depth_decay:g}" if plan.weights else ""
    return {
        "mode": "joint",
        "anchor_index": run.anchor,
        "refine": run.refine,
        "rounds": len(frame.accepted_per_round),
        "objective": frame.objective,
        "objective_note": f"sum over models of the squared L2 distance to their mean (all parameters, in the "
                          f"aligned parameterisation{weighted}); [0] after the star alignment, then after each round",
        "moved_per_round": frame.accepted_per_round,
        "step": (f"{held}; the star capped at {run.star_sweeps} sweep(s)" if plan.capped else held) if run.sweeping
        else f"a pairwise re-alignment capped at {run.round_sweeps} sweeps",
        "models": [{"model": run.names[i], "seconds": frame.seconds[i], **verification[i]}
                   for i in range(len(run.models))],
        "seconds": time.perf_counter() - t0,
    }
