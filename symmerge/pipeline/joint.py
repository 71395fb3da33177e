"""Joint alignment of N models into one common frame (MergeMany, Ainsworth et al. 2023, Alg. 3; for
the continuous groups, generalized Procrustes).

The objective is the spread of the models around their mean, in the parameterisation the groups act
on (norms folded where the residual group needs it)::

    J(g_1, ..., g_N) = Σ_i ‖g_i·θ_i − θ̄‖²,   θ̄ = (1/N) Σ_j g_j·θ_j.

With the others fixed, J as a function of model i alone is ``(N−1)/N · ‖g_i·θ_i − m_{−i}‖² + const``,
where ``m_{−i}`` is the mean of the *other* models. So aligning model i to ``m_{−i}`` (one pairwise
alignment, :func:`~symmerge.pipeline.align.align_pair`, with ``m_{−i}`` as the anchor) lowers J, and a
result that would not lower it is rejected: J never increases. The start is the star (every model
aligned to one anchor); rounds of "each model to the mean of the others" follow until a round lowers J
by less than ``tol`` (relative) or nothing is accepted.

What the rounds re-solve (``refine``): ``all`` the options' groups (the definition above), or
``discrete`` only the groups whose elements form a finite set (``Kind.discrete``: head and FFN-unit
permutations, a permutation residual group), on the rotations and scales the star found — MergeMany as
Ainsworth et al. define it. Data-free on the MNIST-5k ViTs, ``all`` lowers the spread most but moves the
non-anchor models to other basins and merges 2–13 points worse than the star, while ``discrete`` stays
within −0.6 … +1.7 points of it; on B5's label-skewed clients ``all`` merges best (docs/results.md).

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
from ..core.distance import parameter_keys, sq_distance
from ..errors import SymmergeError
from ..families import spec_for
from ..progress import line, stage
from .align import align_pair, canonical, check_compatible
from .bound import bind
from .frame import JointAlignment, mean_state_dict, spread  # noqa: F401  (re-exported)
from .options import DEFAULT_REFINE, JOINT_REFINE, AlignOptions
from .verify import verify_forward, with_state_dict

# the matchers joint alignment runs: weights and activations align each model to the mean of the others (any
# anchor); learned starts from one of them and learns random convex combinations (pipeline/learn_joint.py)
JOINT_MATCHES = ("weights", "activations", "learned")


ROUND_SWEEPS = 10  # cap on the coordinate-descent sweeps of each step after the star (it starts near its optimum)


def discrete_symmetries(model, options: AlignOptions) -> tuple[str, ...]:
    """The symmetries of ``options`` all of whose group instances in ``model`` are discrete (``Kind.discrete``);
    ``rescale`` is never one (it adds scales to other groups)."""
    kinds: dict[str, bool] = {}
    for inst in bind(model, options.layers, options.residual).instances:
        s = inst.group.symmetry
        kinds[s] = kinds.get(s, True) and inst.kind.discrete(inst)
    return tuple(s for s in options.symmetries if kinds.get(s))


def align_joint(models, options: AlignOptions, anchor: int = 0, names=None, max_rounds: int = 10,
                tol: float = 1e-4, inputs: dict | None = None, progress: bool = False,
                round_sweeps: int = ROUND_SWEEPS, refine: str = DEFAULT_REFINE, on_round=None) -> JointAlignment:
    """Bring ``models`` (loaded transformers models of one architecture) into one frame; ``options``
    already resolved against the models (no 'recommended' left). ``anchor``: the model the star step
    aligns to. ``max_rounds``: cap on the rounds after the star; ``tol``: a round that lowers the
    objective by less than this fraction ends the descent; ``round_sweeps``: cap on the descent sweeps
    of each step after the star (the step starts near its optimum; a step that does not lower the
    objective is rejected whatever the cap); ``refine``: what the rounds re-solve (:data:`JOINT_REFINE`:
    ``all`` the options' groups, ``discrete`` only the permutations, on top of the star's continuous
    elements). ``on_round(r, models)``: called with the models in the common frame after the star
    (``r = 0``) and after every round (benchmarks measure the average there)."""
    n = len(models)
    if n < 2:
        raise SymmergeError(f"joint alignment needs at least 2 models, got {n}")
    if not -n <= anchor < n:
        raise SymmergeError(f"anchor index {anchor} out of range for {n} models")
    anchor %= n
    if options.match not in JOINT_MATCHES:
        raise SymmergeError(f"joint alignment runs the {', '.join(JOINT_MATCHES)} matchers; --match "
                            f"{options.match} aligns pairwise to one anchor (pass --anchor to merge that way)")
    if refine not in JOINT_REFINE:
        raise SymmergeError(f"unknown joint refinement {refine!r}; choose {', '.join(JOINT_REFINE)}")
    if max_rounds < 0 or not tol >= 0:
        raise SymmergeError(f"joint alignment needs max_rounds >= 0 and tol >= 0, got {max_rounds}, {tol}")
    names = list(names) if names is not None else [f"model {i}" for i in range(n)]
    for i, x in enumerate(models):
        if i != anchor:
            check_compatible(x, models[anchor])
    if options.match == "learned":  # a closed-form joint alignment, then the mixtures learned
        from .learn_joint import align_joint_learned

        return align_joint_learned(models, options, anchor, names, max_rounds, tol, inputs, progress, round_sweeps,
                                   closed_form=functools.partial(align_joint, refine=refine))
    t0 = time.perf_counter()
    quiet = options.with_(verify=False)
    step = quiet.with_(max_sweeps=max(1, min(options.max_sweeps, round_sweeps)))
    if refine == "discrete":
        step = step.with_(symmetries=discrete_symmetries(models[anchor], options))
        max_rounds = max_rounds if step.symmetries else 0  # nothing discrete to re-solve
    seconds = [0.0] * n

    # ---------------------------------------------------------------- the star: everyone to the anchor
    frame = canonical(models[anchor], options)
    current = []
    for i, x in enumerate(models):
        if i == anchor:
            current.append(frame)
            continue
        t = time.perf_counter()
        with stage(f"joint alignment, star: {names[i]} to {names[anchor]}", enabled=progress):
            current.append(align_pair(x, frame, quiet).model)
        seconds[i] += time.perf_counter() - t
    keys = parameter_keys(current[0])
    sds = [x.state_dict() for x in current]
    objective = [spread(sds, keys)]
    accepted_per_round: list[int] = []
    if on_round is not None:
        on_round(0, list(current))

    # ---------------------------------------------------------------- rounds: each to the mean of the others
    for r in range(max_rounds):
        accepted = 0
        for i in range(n):
            others = [sds[j] for j in range(n) if j != i]
            target = with_state_dict(current[i], mean_state_dict(others, keys))
            t = time.perf_counter()
            with warnings.catch_warnings():  # the sweep cap of a step is deliberate (see round_sweeps)
                warnings.simplefilter("ignore")
                moved = align_pair(current[i], target, step).model
            seconds[i] += time.perf_counter() - t
            new_sd = moved.state_dict()
            target_sd = target.state_dict()
            if sq_distance(new_sd, target_sd, keys) < sq_distance(sds[i], target_sd, keys):
                current[i], sds[i] = moved, new_sd
                accepted += 1
        objective.append(spread(sds, keys))
        accepted_per_round.append(accepted)
        if on_round is not None:
            on_round(r + 1, list(current))
        if progress:
            line(f"joint alignment, round {r + 1}: spread {objective[-1]:.6g} ({accepted}/{n} models moved)")
        if accepted == 0 or objective[-2] - objective[-1] <= tol * objective[-2]:
            break

    # ---------------------------------------------------------------- each model still computes its function
    spec = spec_for(models[0].config.model_type)
    verification = []
    for i, x in enumerate(models):
        if options.verify:
            verification.append(verify_forward(x, current[i], spec, options.verify_tol, inputs))
        else:
            verification.append({"verify_max_abs_diff": None, "verify_max_rel_diff": None})
    report = {
        "mode": "joint",
        "anchor_index": anchor,
        "refine": refine,
        "rounds": len(accepted_per_round),
        "objective": objective,
        "objective_note": "sum over models of the squared L2 distance to their mean (all parameters, in the "
                          "aligned parameterisation); [0] after the star alignment, then after each round",
        "moved_per_round": accepted_per_round,
        "models": [{"model": names[i], "seconds": seconds[i], **verification[i]} for i in range(n)],
        "seconds": time.perf_counter() - t0,
    }
    return JointAlignment(current, report)
