"""``benchmarks.datafree_families``: its core (:func:`measure`) on a tiny random ViT pair — F = 1 finds the
elements of the plain data-free alignment (no weights at all, the recommended set spelled out), F = 10 elements
keep A's function (checked here on inputs of our own), the barrier and the accuracy at α = ½ are what the
interpolated models score — and the script end to end on that pair (files written, a non-empty --out refused).
Seconds."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch

from benchmarks import datafree_families as df
from factories import make_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Two independent tiny ViT classifiers (float32) and 40 random labelled images as a Data."""
    from symmerge.demo.datasets import write_npz
    from symmerge.io.data import load_data

    a, b = (make_model("vit", head=True, seed=s, dtype=torch.float32) for s in (0, 1))
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 3, 8, 8)).astype(np.float32)
    y = rng.integers(0, 3, size=40)
    data = load_data(write_npz(tmp_path_factory.mktemp("data") / "d.npz", x, y), a, batch_size=16)
    return a, b, data


def _tensors(x) -> list:
    """Every tensor and number of an element (dataclasses, dicts, sequences), in a fixed order; anything else
    is an error, so that two elements never compare equal by having nothing to compare."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (bool, int, float)):
        return [torch.tensor(float(x))]
    if x is None:
        return []
    if isinstance(x, dict):
        return [t for k in sorted(x) for t in _tensors(x[k])]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if dataclasses.is_dataclass(x):
        return [t for f in dataclasses.fields(x) for t in _tensors(getattr(x, f.name))]
    raise TypeError(f"cannot compare {type(x).__name__}")


def _same(e1: dict, e2: dict) -> bool:
    a, b = _tensors(e1), _tensors(e2)
    assert a, "nothing compared"
    return e1.keys() == e2.keys() and len(a) == len(b) and all(torch.equal(u, v) for u, v in zip(a, b))


def test_decay_one_is_the_plain_alignment_of_the_recommended_set(tiny):
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions

    a, b, data = tiny
    row, res = df.measure(a, b, data, 1.0, 5)
    plain = align_pair(a, b, AlignOptions(symmetries="heads,attn,ffn,rescale,residual"))  # no weights given
    assert row["symmetries"] == ["heads", "attn", "ffn", "rescale", "residual"]
    assert _same(res.elements, plain.elements)
    assert row["objective"] == pytest.approx(plain.report["residual_sweeps_sq_distance"][-1], rel=1e-12)
    assert row["sweeps"] == plain.report["sweeps"]
    # a pair's further alignment options reach the alignment (B4's untie; here the stream's group)
    assert res.report["residual_variant"] == "centered"
    assert df.measure(a, b, data, 1.0, 3, residual="permutation")[1].report["residual_variant"] == "permutation"


def test_decay_ten_elements_keep_the_function_and_the_row_scores_the_path(tiny):
    from symmerge.evaluate.metrics import evaluate

    a, b, data = tiny
    row, res = df.measure(a, b, data, 10.0, 5)
    _, plain = df.measure(a, b, data, 1.0, 5)
    assert not _same(res.elements, plain.elements)  # the weights moved the optimum on this pair
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        la, lm = a(pixel_values=x).logits, res.model(pixel_values=x).logits
    assert float((la - lm).abs().max() / la.abs().max()) < 1e-5
    assert row["verify_max_rel_diff"] < 1e-5
    # barrier: max over α of loss − the chord between the endpoints (α = 1: A)
    chord = [al * row["loss"][-1] + (1 - al) * row["loss"][0] for al in row["alphas"]]
    assert row["barrier"] == pytest.approx(max(l - c for l, c in zip(row["loss"], chord)), abs=1e-12)
    mid = res.anchor.__class__(res.anchor.config).eval()
    sa, sb = res.model.state_dict(), res.anchor.state_dict()
    mid.load_state_dict({k: (sa[k] + sb[k]) / 2 for k in sa})
    score = evaluate(mid, data, progress=False)
    assert row["accuracy_mid"] == pytest.approx(score["accuracy"], abs=1e-12)
    assert row["loss_mid"] == pytest.approx(score["loss"], rel=1e-6)
    assert row["accuracy_endpoints"][0] == pytest.approx(evaluate(a, data, progress=False)["accuracy"], abs=1e-12)


def test_script_writes_its_files_and_refuses_a_full_folder(tiny, tmp_path, monkeypatch):
    a, b, data = tiny
    monkeypatch.setitem(df.PAIRS, "tiny", lambda _, log=print: df.Pair("tiny", "ViT (random)", a, b, data, 3))
    out = tmp_path / "out"
    assert df.main(["--pairs", "tiny", "--decays", "1,10", "--out", str(out)]) == 0
    result = json.loads((out / "results.json").read_text())
    assert [r["depth_decay"] for r in result["pairs"][0]["rows"]] == [1.0, 10.0]
    assert "| tiny | 10 |" in (out / "tables.md").read_text()
    with pytest.raises(SystemExit, match="not empty"):
        df.main(["--pairs", "tiny", "--out", str(out)])
    with pytest.raises(SystemExit, match="unknown pair"):
        df.load("gpt9")
