"""The data-free objective's weights (``--ends-weight``, ``--depth-decay``) and the solver's search options
(``--restarts``) mean the same wherever the weight objective is minimised: the pair alignment (test_objective_weights),
the joint alignment's rounds (the spread of N models around their mean, weighted as the pair objective is, and every
step solved on it), and the learned alignment's data-free start (``LearnSettings.start="weights"``: the weight
matcher's search, with its options). Before, the rounds minimised the plain spread and the learned start ran the
plain descent: both silently ignored the three options."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

from factories import make_model
from symmerge.core.apply import apply, canonicalize
from symmerge.core.distance import parameter_keys, sq_distance
from symmerge.pipeline import engine
from symmerge.pipeline.align import instances_for
from symmerge.pipeline.bound import bind
from symmerge.pipeline.frame import mean_state_dict, spread
from symmerge.pipeline.joint import align_joint
from symmerge.pipeline.learn import learn_alignment
from symmerge.pipeline.options import AlignOptions, LearnSettings
from symmerge.pipeline.verify import verify_forward

pytestmark = pytest.mark.usefixtures("single_thread")
SYMS = "heads,attn,ffn,rescale,residual"
SIZES = dict(hidden_size=8, num_attention_heads=2, intermediate_size=12, num_hidden_layers=3)


def vits(n: int, seed: int = 0, dtype=torch.float64):
    return [make_model("vit", head=True, seed=seed + 7 * i, dtype=dtype, **SIZES) for i in range(n)]


def weights_by_name(model, options: AlignOptions) -> dict:
    """The objective's weights written from the key names: a per-layer group's tensor in layer l of L weighs
    decay^(-l/(L-1)); the stream's ends (the tensors only the residual group moves) ``ends_weight``; the rest 1."""
    opts = options.solver_options()
    _, instances = instances_for(model)
    act = [i for i in instances if i.kind.active(i, opts)]
    local = {s.key for i in act if i.kind.per_layer for s in i.slots}
    wide = {s.key for i in act if not i.kind.per_layer for s in i.slots}
    layers = SIZES["num_hidden_layers"]
    out = {}
    for key in wide | local:
        m = re.search(r"\.layers?\.(\d+)\.", key)
        if key in local and m:
            out[key] = options.depth_decay ** (-int(m.group(1)) / (layers - 1))
        elif key not in local:
            out[key] = options.ends_weight
    return out


@pytest.mark.parametrize("option,value", [("depth_decay", 20.0), ("ends_weight", 10.0)])
def test_joint_rounds_minimise_the_weighted_spread(option, value):
    """The reported objective is the spread weighted as the pair objective (recomputed here from the key names), it
    never rises over the rounds, the rounds move the models, and the result differs from the plain joint alignment;
    every model keeps its function (fp64)."""
    models = vits(3)
    options = AlignOptions(symmetries=SYMS, **{option: value})
    joint = align_joint(models, options, max_rounds=6)
    objective = joint.report["objective"]
    weights = weights_by_name(models[0], options)
    assert len(set(weights.values())) > 1  # the rule weighs something
    sds = [m.state_dict() for m in joint.models]
    assert objective[-1] == pytest.approx(spread(sds, parameter_keys(joint.models[0]), weights), rel=1e-9)
    assert all(b <= a * (1 + 1e-12) for a, b in zip(objective, objective[1:]))
    assert sum(joint.report["moved_per_round"]) > 0 and "depth decay" in joint.report["objective_note"]
    plain = align_joint(models, AlignOptions(symmetries=SYMS), max_rounds=6)
    key = next(k for k in sds[1] if re.search(r"\.layers?\.1\.", k) and k.endswith("fc1.weight"))
    assert not torch.equal(plain.models[1].state_dict()[key], joint.models[1].state_dict()[key])
    for model in joint.report["models"]:
        assert model["verify_max_rel_diff"] <= 1e-10


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_joint_rounds_end_at_a_weighted_step_optimum(seed):
    """The rounds' steps solve the weighted objective: where they stop, one more step of any model toward the mean
    of the others (a sweep of the descent on the weighted copies) gains little of its weighted distance (here
    ≤ 0.38 %). Steps solved on the plain distance, accepted by the weighted one, stop where such a step still gains
    0.8-1.5 % for every model of these three sets (measured by mutating the step)."""
    models = vits(3, seed=seed)
    options = AlignOptions(symmetries=SYMS, depth_decay=20.0)
    joint = align_joint(models, options, max_rounds=10)
    opts = options.solver_options()
    sds = [m.state_dict() for m in joint.models]
    keys = parameter_keys(joint.models[0])
    gains = []
    for i, model in enumerate(joint.models):
        instances = bind(model, None, options.residual).instances
        weights = engine.objective_weights(instances, opts, 1.0, 20.0)
        target = mean_state_dict([sd for k, sd in enumerate(sds) if k != i], keys)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the one-sweep cap
            step = engine.solve(instances, engine.scaled(sds[i], weights), engine.scaled(target, weights), opts,
                                max_sweeps=1, init="all")
        before = sq_distance(sds[i], target, keys, weights=weights)
        gains.append((before - sq_distance(apply(sds[i], instances, step), target, keys, weights=weights)) / before)
    assert max(gains) < 6e-3, gains


def test_joint_plain_spread_unchanged_by_default():
    """Weights 1 (the defaults): the plain spread, as before."""
    models = vits(3, seed=1)
    joint = align_joint(models, AlignOptions(symmetries=SYMS), max_rounds=3)
    sds = [m.state_dict() for m in joint.models]
    assert joint.report["objective"][-1] == spread(sds, parameter_keys(joint.models[0]))
    assert "depth decay" not in joint.report["objective_note"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_joint_weighted_alignment_preserves_every_function(dtype):
    models = vits(3, seed=2, dtype=dtype)
    joint = align_joint(models, AlignOptions(symmetries=SYMS, depth_decay=20.0, ends_weight=3.0), max_rounds=4)
    spec = instances_for(models[0])[0]
    for model, moved in zip(models, joint.models):
        assert verify_forward(model, moved, spec, 1e-5)["verify_max_rel_diff"] <= 1e-5


def test_learned_start_from_weights_is_the_weight_matchers_search():
    """``start="weights"``: the closed form is :func:`engine.search` with the options' restarts and weights (its
    record in the report, its objective that of the same search run here), not the plain descent."""
    from test_learn import unlabeled

    a, b = vits(2, seed=3)
    options = AlignOptions(symmetries=SYMS, match="learned", align_data="unused", depth_decay=20.0, restarts=2,
                           learn=LearnSettings(steps=2, batch=8, lr=0.05, check_every=1, patience=100,
                                               start="weights"))
    _, instances = instances_for(a)
    opts = options.solver_options()
    wide = [i for i in instances if not i.kind.per_layer and i.kind.active(i, opts)]
    ca, cb = canonicalize(a.state_dict(), wide), canonicalize(b.state_dict(), wide)
    _, report = learn_alignment(instances, a, b, ca, cb, unlabeled(a), options)
    solver = report["solver"]
    assert solver["depth_decay"] == 20.0 and solver["restarts"] == 2
    _, record = engine.search(instances, ca, cb, opts, max_sweeps=options.max_sweeps, tol=options.descent_tol,
                              starts=engine.Restarts.of(options))
    assert solver["objective"] == record["objective"] and solver["winner"] == record["winner"]
    _, plain = engine.search(instances, ca, cb, opts, max_sweeps=options.max_sweeps, tol=options.descent_tol,
                             starts=engine.Restarts(2))
    assert plain["objective"] != record["objective"]  # the weights change the objective searched


def test_restarts_of_reads_every_option():
    options = AlignOptions(symmetries=SYMS, restarts=3, solver_budget=5.0, solver_seed=7, ends_weight=2.0,
                           depth_decay=4.0)
    assert engine.Restarts.of(options) == engine.Restarts(3, 5.0, 7, 2.0, 4.0)
