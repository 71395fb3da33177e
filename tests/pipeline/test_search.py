"""The data-free solver's search (``pipeline/engine.search``): several starts and restarts, the lowest objective
kept. Checked against brute force on models small enough to enumerate every element of every discrete group
(a one-layer ViT, stream of 4 dims as permutations, 2 heads, 3 FFN units), on cases where the plain descent
from the identity stops in a worse local optimum; the objective never worse than any plain start's; the same
result from the same seed; every move a valid, function-preserving element."""

from __future__ import annotations

import itertools

import pytest
import torch

from factories import disguised, make_model
from symmerge.core.apply import apply, canonicalize
from symmerge.core.distance import sq_distance
from symmerge.errors import SymmergeError
from symmerge.groups.heads import HeadPerm
from symmerge.groups.permutation import PermElement
from symmerge.groups.residual import StreamElement
from symmerge.pipeline import engine
from symmerge.pipeline.align import align_pair, instances_for
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.verify import verify_forward, with_state_dict

pytestmark = pytest.mark.usefixtures("single_thread")  # no thread count checked here; 2-3x faster on 2 loaded cores

SYMS = "heads,ffn,residual"


def tiny_pair(seed: int):
    """Two independent one-layer ViTs (hidden 4, 2 heads, 3 FFN units): B from ``seed``, A from ``seed + 50``."""
    sizes = dict(hidden_size=4, num_attention_heads=2, intermediate_size=3, num_hidden_layers=1)
    return (make_model("vit", head=True, seed=seed + 50, **sizes), make_model("vit", head=True, seed=seed, **sizes))


def problem(a, b, syms=SYMS, residual="permutation"):
    opts = AlignOptions(symmetries=syms, residual=residual).solver_options()
    _, instances = instances_for(a, residual=residual)
    wide = [i for i in instances if not i.kind.per_layer and i.kind.active(i, opts)]
    return instances, opts, canonicalize(a.state_dict(), wide), canonicalize(b.state_dict(), wide)


def objective(instances, opts, sd_a, sd_b, elements) -> float:
    act = [i for i in instances if i.kind.active(i, opts)]
    keys = sorted({s.key for i in act for s in i.slots})
    return sq_distance(apply(sd_a, act, elements), sd_b, keys)


def brute_force(instances, opts, sd_a, sd_b) -> float:
    """The lowest objective over every stream permutation × head pairing × FFN unit permutation."""
    act = [i for i in instances if i.kind.active(i, opts)]
    res = next(i for i in act if not i.kind.per_layer)
    heads = next(i for i in act if i.group.symmetry == "heads")
    ffn = next(i for i in act if i.group.symmetry == "ffn")
    best = float("inf")
    for p in itertools.permutations(range(res.size)):
        for h in itertools.permutations(range(heads.blocks)):
            for f in itertools.permutations(range(ffn.size)):
                el = {res.name: StreamElement(perm=torch.tensor(p)), heads.name: HeadPerm(torch.tensor(h), torch.tensor(h)),
                      ffn.name: PermElement(torch.tensor(f))}
                best = min(best, objective(instances, opts, sd_a, sd_b, el))
    return best


@pytest.mark.parametrize("seed", [11, 12, 28])
def test_search_finds_the_brute_force_optimum_where_the_descent_from_identity_does_not(seed):
    instances, opts, sd_a, sd_b = problem(*tiny_pair(seed))
    optimum = brute_force(instances, opts, sd_a, sd_b)
    plain = []
    engine.solve(instances, sd_a, sd_b, opts, history=plain, init="local", tol=1e-4)
    assert min(plain) > optimum * (1 + 1e-6)  # the plain descent from the identity settles higher
    elements, record = engine.search(instances, sd_a, sd_b, opts, tol=1e-4, starts=engine.Restarts(10, seed=0))
    assert record["objective"] == pytest.approx(optimum, rel=1e-9)
    assert objective(instances, opts, sd_a, sd_b, elements) == pytest.approx(optimum, rel=1e-9)
    for inst in instances:
        if inst.name in elements:
            inst.kind.check(inst, elements[inst.name])


def test_search_is_never_worse_than_any_start_and_reports_each():
    instances, opts, sd_a, sd_b = problem(*tiny_pair(12))
    kept: dict = {}
    elements, record = engine.search(instances, sd_a, sd_b, opts, tol=1e-4, starts=engine.Restarts(5, seed=1), keep=kept)
    names = [r["start"] for r in record["starts"]]
    assert names[:3] == ["current", "identity", "canonical"] and len(names) == 3 + 5 and record["restarts"] == 5
    assert record["objective"] == min(r["objective"] for r in record["starts"])
    assert record["winner"] == min(record["starts"], key=lambda r: r["objective"])["start"]
    for r in record["starts"]:  # each start's reported objective is that of its elements
        assert objective(instances, opts, sd_a, sd_b, kept[r["start"]]) == pytest.approx(r["objective"], rel=1e-9)
    assert objective(instances, opts, sd_a, sd_b, elements) == pytest.approx(record["objective"], rel=1e-9)


def test_search_is_deterministic_with_a_fixed_seed():
    instances, opts, sd_a, sd_b = problem(*tiny_pair(28), syms="heads,attn,ffn,rescale,residual", residual="largest")
    runs = [engine.search(instances, sd_a, sd_b, opts, tol=1e-4, starts=engine.Restarts(6, seed=3)) for _ in range(2)]
    (e1, r1), (e2, r2) = runs
    assert [(x["start"], x["objective"], x["sweeps"]) for x in r1["starts"]] == \
        [(x["start"], x["objective"], x["sweeps"]) for x in r2["starts"]]
    assert torch.equal(apply(sd_a, instances, e1)["classifier.weight"], apply(sd_a, instances, e2)["classifier.weight"])


def test_budget_zero_is_the_descent_as_it_was():
    instances, opts, sd_a, sd_b = problem(*tiny_pair(0), syms="heads,attn,ffn,rescale,residual", residual="largest")
    old = engine.solve(instances, sd_a, sd_b, opts, tol=1e-4)
    new, record = engine.search(instances, sd_a, sd_b, opts, tol=1e-4, starts=engine.Restarts(budget=0))
    assert [r["start"] for r in record["starts"]] == ["current"]
    assert objective(instances, opts, sd_a, sd_b, new) == objective(instances, opts, sd_a, sd_b, old)


def test_no_model_wide_group_no_search():
    instances, opts, sd_a, sd_b = problem(*tiny_pair(0), syms="heads,attn,ffn")
    elements, record = engine.search(instances, sd_a, sd_b, opts, starts=engine.Restarts(3))
    assert record is None and elements


@pytest.mark.parametrize("family,residual", [("vit", "largest"), ("vit", "permutation"), ("llama", "largest"),
                                             ("llama", "permutation")])
def test_every_move_is_a_valid_function_preserving_element(family, residual):
    """The search's kicks and swaps (``Kind.perturb``) and its canonical start (``Kind.spectral_start``) are
    group elements: checked, and the model they move computes what it did (GQA heads in the Llama)."""
    model = make_model(family, head=True)
    anchor = disguised(model, seed=5, noise=0.5, residual=residual)[0]
    syms = "heads,attn,ffn,rescale,residual"
    instances, opts, sd_a, sd_b = problem(model, anchor, syms, residual)
    elements = engine.solve(instances, sd_a, sd_b, opts, tol=1e-4)
    g = torch.Generator().manual_seed(0)
    moved = {}
    for inst in instances:
        if inst.name not in elements:
            continue
        new = inst.kind.perturb(inst, elements[inst.name], g)
        if inst.kind.discrete(inst) or not inst.kind.per_layer:
            assert new is not None, inst.name
        if new is None:
            continue
        inst.kind.check(inst, new)
        moved[inst.name] = new
        if not inst.kind.per_layer:
            start = inst.kind.spectral_start(inst, sd_a, sd_b)
            inst.kind.check(inst, start)
    assert any(not i.kind.per_layer for i in instances if i.name in moved)
    spec = instances_for(model, residual=residual)[0]
    # the criterion (1e-5 relative); float64 here, the tiny Llama's solved alignment alone is at ~1e-6
    report = verify_forward(model, with_state_dict(model, apply(sd_a, instances, {**elements, **moved})), spec, 1e-5)
    assert report["verify_max_rel_diff"] <= 1e-5


def test_align_pair_reports_the_search_and_verifies():
    a, b = make_model("vit", head=True, seed=3), make_model("vit", head=True, seed=4)
    res = align_pair(a, b, AlignOptions(symmetries="heads,attn,ffn,rescale,residual", restarts=4, solver_seed=2))
    solver = res.report["solver"]
    assert [s["start"] for s in solver["starts"]][:3] == ["current", "identity", "canonical"]
    assert len(solver["starts"]) >= 4 and solver["restarts"] == 4
    assert solver["objective"] == min(s["objective"] for s in solver["starts"])
    assert res.report["verify_max_rel_diff"] <= 1e-5


@pytest.mark.parametrize("bad", [dict(restarts=-1), dict(restarts=1.5), dict(solver_budget=-2.0),
                                 dict(solver_budget="x"), dict(solver_seed="0")])
def test_bad_search_options_are_refused(bad):
    with pytest.raises(SymmergeError):
        AlignOptions(symmetries="heads,residual", **bad)


def test_cli_flags_report_and_summary(tmp_path, capsys):
    """``--restarts``, ``--solver-seed`` and ``--solver-budget`` reach the search; ``align`` and ``merge`` print which
    start won and every start's objective, and the reports carry it; a bad value is one clear error, no output."""
    import json

    from conftest import run_cli, vit_folder

    a, b = vit_folder(tmp_path / "a", 0), vit_folder(tmp_path / "b", 1)
    assert run_cli("align", a, b, "-o", tmp_path / "out", "--restarts", "2", "--solver-seed", "1") == 0
    printed = capsys.readouterr().out
    solver = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())["solver"]
    assert [s["start"] for s in solver["starts"]][:3] == ["current", "identity", "canonical"]
    assert solver["restarts"] == 2 and solver["seed"] == 1
    assert f"data-free solver: kept {solver['winner']}" in printed and "identity " in printed
    assert run_cli("align", a, b, "-o", tmp_path / "plain", "--solver-budget", "0") == 0
    plain = json.loads((tmp_path / "plain" / "symmerge_report.json").read_text())["solver"]
    assert [s["start"] for s in plain["starts"]] == ["current"] and plain["objective"] >= solver["objective"]
    capsys.readouterr()
    assert run_cli("merge", a, b, "--method", "average", "--restarts", "1", "-o", tmp_path / "m") == 0
    assert "data-free solver: kept" in capsys.readouterr().out
    models = json.loads((tmp_path / "m" / "symmerge_report.json").read_text())["alignment"]["models"]
    assert any(m.get("solver", {}).get("restarts") == 1 for m in models)
    with pytest.raises(SystemExit) as refused:  # the flag's declared range: argparse's line, naming the command
        run_cli("align", a, b, "-o", tmp_path / "bad", "--restarts", "-1")
    err = capsys.readouterr().err
    assert refused.value.code == 2 and err.strip().count("\n") == 0
    assert "symmerge align: error: argument --restarts: must be >= 0, got -1" in err
    assert not (tmp_path / "bad").exists() or not any((tmp_path / "bad").iterdir())


# ---------------------------------------------------------------- the stream's ends weighted (--ends-weight)


def weighted_objective(instances, opts, sd_a, sd_b, elements, weight) -> float:
    """The plain objective with the stream's ends counted ``weight`` times, computed from its two parts."""
    act = [i for i in instances if i.kind.active(i, opts)]
    ends = engine.ends_keys(instances, opts)
    keys = sorted({s.key for i in act for s in i.slots})
    moved = apply(sd_a, act, elements)
    return (sq_distance(moved, sd_b, [k for k in keys if k not in ends])
            + weight * sq_distance(moved, sd_b, [k for k in keys if k in ends]))


def test_ends_are_the_tensors_only_the_stream_moves():
    instances, opts, _, _ = problem(*tiny_pair(0), syms="heads,attn,ffn,rescale,residual", residual="largest")
    ends = engine.ends_keys(instances, opts)
    assert {"classifier.weight", "vit.embeddings.position_embeddings", "vit.embeddings.cls_token"} <= ends
    assert not any(k.endswith(("q_proj.weight", "fc1.weight", "fc2.weight", "o_proj.weight")) for k in ends)


@pytest.mark.parametrize("seed", [11, 12, 28])
def test_weighted_ends_search_finds_the_brute_force_optimum_of_the_weighted_objective(seed):
    """With the ends weighted, the search reaches the brute-force minimum of the weighted objective (enumerated on
    the weighted copies and checked from its two parts), reports that objective, and the optimum differs from the
    plain objective's on at least one seed (the weight changes the answer)."""
    instances, opts, sd_a, sd_b = problem(*tiny_pair(seed))
    wa, wb = engine.weighted_ends(instances, sd_a, sd_b, opts, 10.0)
    optimum = brute_force(instances, opts, wa, wb)
    starts = engine.Restarts(10, seed=0, ends_weight=10.0)
    elements, record = engine.search(instances, sd_a, sd_b, opts, tol=1e-4, starts=starts)
    assert record["ends_weight"] == 10.0 and record["objective"] == pytest.approx(optimum, rel=1e-9)
    assert weighted_objective(instances, opts, sd_a, sd_b, elements, 10.0) == pytest.approx(optimum, rel=1e-9)
    for inst in instances:
        if inst.name in elements:
            inst.kind.check(inst, elements[inst.name])


def test_ends_weight_one_is_the_plain_descent():
    instances, opts, sd_a, sd_b = problem(*tiny_pair(0), syms="heads,attn,ffn,rescale,residual", residual="largest")
    plain, r1 = engine.search(instances, sd_a, sd_b, opts, tol=1e-4, starts=engine.Restarts(2))
    same, r2 = engine.search(instances, sd_a, sd_b, opts, tol=1e-4, starts=engine.Restarts(2, ends_weight=1.0))
    assert [x["objective"] for x in r1["starts"]] == [x["objective"] for x in r2["starts"]]
    key = "classifier.weight"
    assert torch.equal(apply(sd_a, instances, plain)[key], apply(sd_a, instances, same)[key])


# the weight changes the optimum, the weighted alignments' function, bad values and the CLI:
# tests/pipeline/test_objective_weights.py (both weights)
