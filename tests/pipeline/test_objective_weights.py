"""The data-free objective with the layers weighted by depth (``--depth-decay F``: the k-th of n layers counts
``F^(-k/(n-1))`` times). Checked against brute force on two-layer ViTs small enough to enumerate every stream
permutation, head pairing and FFN unit permutation, with the weights computed here from the key names; the
weighting changes the optimum; F = 1 is the plain descent bit for bit. For both of the objective's weights (this
and ``--ends-weight``): the alignment found on the weighted copies preserves the function, and bad values are
refused by the API and the CLI."""

from __future__ import annotations

import itertools
import json
import re

import pytest
import torch

from factories import make_model
from symmerge.core.apply import apply, canonicalize
from symmerge.core.distance import sq_distance
from symmerge.errors import SymmergeError
from symmerge.groups.heads import HeadPerm
from symmerge.groups.permutation import PermElement
from symmerge.groups.residual import StreamElement
from symmerge.pipeline import engine
from symmerge.pipeline.align import align_pair, instances_for
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.verify import verify_forward

pytestmark = pytest.mark.usefixtures("single_thread")  # no thread count checked here; 2-3x faster on 2 loaded cores

SYMS = "heads,ffn,residual"
DECAY = 8.0


def tiny_pair(seed: int):
    """Two independent two-layer ViTs (hidden 4, 2 heads, 3 FFN units): B from ``seed``, A from ``seed + 50``."""
    sizes = dict(hidden_size=4, num_attention_heads=2, intermediate_size=3, num_hidden_layers=2)
    return (make_model("vit", head=True, seed=seed + 50, **sizes), make_model("vit", head=True, seed=seed, **sizes))


def problem(a, b):
    opts = AlignOptions(symmetries=SYMS, residual="permutation").solver_options()
    _, instances = instances_for(a, residual="permutation")
    wide = [i for i in instances if not i.kind.per_layer and i.kind.active(i, opts)]
    return instances, opts, canonicalize(a.state_dict(), wide), canonicalize(b.state_dict(), wide)


def weight_of(key: str, local_keys: set, decay: float, layers: int = 2) -> float:
    """The rule, written from the key's name: a per-layer group's tensor in layer l weighs decay^(-l/(L-1)); every
    other tensor (the stream's ends, the writers' biases) once."""
    m = re.search(r"\.layers\.(\d+)\.", key)
    return decay ** (-int(m.group(1)) / (layers - 1)) if key in local_keys and m else 1.0


def weighted_objective(instances, opts, sd_a, sd_b, elements, decay: float, keys=None) -> float:
    act = [i for i in instances if i.kind.active(i, opts)]
    local_keys = {s.key for i in act if i.kind.per_layer for s in i.slots}
    keys = sorted({s.key for i in act for s in i.slots}) if keys is None else keys
    moved = apply(sd_a, act, elements)
    return sum(weight_of(k, local_keys, decay) * sq_distance(moved, sd_b, [k]) for k in keys)


def brute_force(instances, opts, sd_a, sd_b, decay: float) -> float:
    """The lowest weighted objective over every stream permutation × head pairing × FFN permutation of each layer.
    Given the stream, the objective is a sum of independent parts (the ends; each layer's head tensors, moved by its
    pairing; each layer's FFN tensors, moved by its unit permutation), so each part is minimised over all its
    elements on its own: the same minimum as the full product, at a fraction of the evaluations."""
    act = [i for i in instances if i.kind.active(i, opts)]
    res = next(i for i in act if not i.kind.per_layer)
    local = [i for i in act if i.kind.per_layer]
    local_keys = {s.key for i in local for s in i.slots}
    ends = sorted({s.key for s in res.slots} - local_keys)

    def options(inst):
        if inst.group.symmetry == "heads":
            return [HeadPerm(torch.tensor(h), torch.tensor(h)) for h in itertools.permutations(range(inst.blocks))]
        return [PermElement(torch.tensor(f)) for f in itertools.permutations(range(inst.size))]

    best = float("inf")
    for p in itertools.permutations(range(res.size)):
        stream = {res.name: StreamElement(perm=torch.tensor(p))}
        total = weighted_objective([res], opts, sd_a, sd_b, stream, decay, ends)
        for inst in local:
            keys = sorted({s.key for s in inst.slots})
            total += min(weighted_objective([res, inst], opts, sd_a, sd_b, {**stream, inst.name: e}, decay, keys)
                         for e in options(inst))
        best = min(best, total)
    return best


def test_depth_weights_follow_the_layers():
    instances, opts, _, _ = problem(*tiny_pair(0))
    weights = engine.depth_weights(instances, opts, 9.0)
    local_keys = {s.key for i in instances if i.kind.per_layer and i.kind.active(i, opts) for s in i.slots}
    assert set(weights) == local_keys and not set(weights) & engine.ends_keys(instances, opts)
    assert {k: weight_of(k, local_keys, 9.0) for k in local_keys} == pytest.approx(weights, rel=1e-12)
    assert sorted(set(round(w, 12) for w in weights.values())) == [round(1 / 9, 12), 1.0]
    assert set(engine.depth_weights(instances, opts, 1.0).values()) == {1.0}


@pytest.mark.parametrize("seed", [11, 12, 28])
def test_depth_weighted_search_finds_the_brute_force_optimum(seed):
    """The search on the depth-weighted objective reaches its brute-force minimum (enumerated with the weights of
    :func:`weight_of`), reports that objective and the decay, and its elements are valid."""
    instances, opts, sd_a, sd_b = problem(*tiny_pair(seed))
    optimum = brute_force(instances, opts, sd_a, sd_b, DECAY)
    elements, record = engine.search(instances, sd_a, sd_b, opts, tol=1e-4,
                                     starts=engine.Restarts(10, seed=0, depth_decay=DECAY))
    assert record["depth_decay"] == DECAY and record["objective"] == pytest.approx(optimum, rel=1e-9)
    assert weighted_objective(instances, opts, sd_a, sd_b, elements, DECAY) == pytest.approx(optimum, rel=1e-9)
    for inst in instances:
        if inst.name in elements:
            inst.kind.check(inst, elements[inst.name])


def objective_of(option: str):
    """The weighted objective of ``option`` as a function of (instances, opts, sd_a, sd_b, elements, value): the
    depth weights from the key names (above), the ends' weight from the objective's two parts (test_search)."""
    from test_search import weighted_objective as ends_weighted

    return weighted_objective if option == "depth_decay" else ends_weighted


@pytest.mark.parametrize("option,value", [("depth_decay", DECAY), ("ends_weight", 10.0)])
def test_the_weight_changes_the_optimum(option, value):
    """Not vacuous: on some brute-force pair the plain optimum's elements are not optimal for the weighted objective,
    and never better than the weighted search's."""
    weighted = objective_of(option)
    gaps = []
    for seed in (11, 12, 28):
        instances, opts, sd_a, sd_b = problem(*tiny_pair(seed))
        plain, _ = engine.search(instances, sd_a, sd_b, opts, tol=1e-4, starts=engine.Restarts(10, seed=0))
        found, _ = engine.search(instances, sd_a, sd_b, opts, tol=1e-4,
                                 starts=engine.Restarts(10, seed=0, **{option: value}))
        gaps.append(weighted(instances, opts, sd_a, sd_b, plain, value)
                    - weighted(instances, opts, sd_a, sd_b, found, value))
    assert min(gaps) > -1e-9 and max(gaps) > 1e-6


def test_decay_one_is_the_plain_descent():
    a, b = tiny_pair(0)
    opts = AlignOptions(symmetries="heads,attn,ffn,rescale,residual").solver_options()
    _, instances = instances_for(a)
    wide = [i for i in instances if not i.kind.per_layer and i.kind.active(i, opts)]
    sd_a, sd_b = canonicalize(a.state_dict(), wide), canonicalize(b.state_dict(), wide)
    assert engine.weighted(instances, sd_a, sd_b, opts, depth_decay=1.0) == (sd_a, sd_b)
    plain, r1 = engine.search(instances, sd_a, sd_b, opts, tol=1e-4, starts=engine.Restarts(2))
    same, r2 = engine.search(instances, sd_a, sd_b, opts, tol=1e-4, starts=engine.Restarts(2, depth_decay=1.0))
    assert [x["objective"] for x in r1["starts"]] == [x["objective"] for x in r2["starts"]]
    for key in ("classifier.weight", "vit.layers.1.mlp.fc1.weight"):
        assert torch.equal(apply(sd_a, instances, plain)[key], apply(sd_a, instances, same)[key])


# the objective's weights: (option, value, flag, the name in the error)
WEIGHTS = [("ends_weight", 30.0, "--ends-weight", "ends weight"), ("depth_decay", 32.0, "--depth-decay", "depth decay")]


@pytest.mark.parametrize("option,value", [w[:2] for w in WEIGHTS])
@pytest.mark.parametrize("family", ["vit", "gpt2"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_weighted_alignment_preserves_the_function(option, value, family, dtype):
    """The elements found on the weighted copies are applied to the model as it is: the aligned model computes what
    it did (fp64 and fp32, the issue's 1e-5 relative), and the weighted alignment differs from the plain one."""
    a, b = make_model(family, head=True, seed=3).to(dtype), make_model(family, head=True, seed=4).to(dtype)
    syms = "heads,attn,ffn,rescale,residual"
    plain = align_pair(a, b, AlignOptions(symmetries=syms))
    res = align_pair(a, b, AlignOptions(symmetries=syms, **{option: value}))
    assert res.report["solver"][option] == value
    assert res.report["verify_max_rel_diff"] <= 1e-5
    assert verify_forward(a, res.model, instances_for(a)[0], 1e-5)["verify_max_rel_diff"] <= 1e-5
    key = next(k for k in res.model.state_dict() if k.endswith("fc1.weight") or k.endswith("c_fc.weight"))
    assert not torch.equal(res.model.state_dict()[key], plain.model.state_dict()[key])


@pytest.mark.parametrize("option,name", [(w[0], w[3]) for w in WEIGHTS])
@pytest.mark.parametrize("bad", [0, -2.0, float("nan"), float("inf"), "32", True])
def test_bad_weight_is_refused(option, name, bad):
    with pytest.raises(SymmergeError, match=name):
        AlignOptions(symmetries="heads,residual", **{option: bad})


@pytest.mark.parametrize("option,value,flag,name", WEIGHTS)
def test_cli_weight(option, value, flag, name, tmp_path, capsys):
    from conftest import run_cli, vit_folder

    a, b = vit_folder(tmp_path / "a", 0), vit_folder(tmp_path / "b", 1)
    assert run_cli("align", a, b, "-o", tmp_path / "out", flag, f"{value:g}") == 0
    assert f"{name} {value:g}" in capsys.readouterr().out
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    assert report["solver"][option] == value and report["verify_max_rel_diff"] <= 1e-5
    with pytest.raises(SystemExit) as refused:  # read by the flag: argparse's line, naming the command and the flag
        run_cli("align", a, b, "-o", tmp_path / "bad", flag, "0")
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and f"symmerge align: error: argument {flag}: must be a finite number > 0" in err
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())
