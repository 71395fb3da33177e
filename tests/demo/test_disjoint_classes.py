"""Models trained on disjoint halves of the classes (issue 42 item 5): the class subset, the pair's training
(each model sees only its half, 10-way head), the benchmark's scores and its ZipIt!-style partial merge
(checked by exact function equivalence), and ``python -m benchmarks.disjoint_classes --tiny`` end to end."""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import numpy as np
import pytest
import torch

from conftest import vit_folder
from symmerge.demo import datasets
from symmerge.demo.disjoint import TINY, class_subset, train_disjoint_pair
from symmerge.demo.train import load_report
from symmerge.errors import SymmergeError

pytestmark = pytest.mark.usefixtures("single_thread")


def test_class_subset_is_the_brute_force_selection():
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 255, (50, 4, 4)).astype(np.uint8), rng.integers(0, 10, 50)
    xs, ys = class_subset(x, y, (7, 2, 2))
    expect = [i for i in range(50) if y[i] in (2, 7)]
    assert np.array_equal(ys, y[expect]) and np.array_equal(xs, x[expect])
    with pytest.raises(SymmergeError, match="no example"):
        class_subset(x, y, [11])
    with pytest.raises(SymmergeError, match="at least one class"):
        class_subset(x, y, [])


def test_the_pair_sees_only_its_half_and_keeps_a_ten_way_head(tmp_path):
    rng = np.random.default_rng(1)
    x, y = rng.integers(0, 255, (200, 28, 28)).astype(np.uint8), np.arange(200) % 10
    recipe = replace(TINY, steps=3)
    folders = train_disjoint_pair(replace(recipe, halves=((0, 1, 2, 3, 4), (5, 6, 7, 8, 9))), x, y, root=tmp_path,
                                  progress=False, log=lambda *_: None)
    for f, half in zip(folders, ((0, 1, 2, 3, 4), (5, 6, 7, 8, 9))):
        assert len(json.loads((f / "config.json").read_text())["id2label"]) == 10
        assert load_report(f)["train_examples"] == 100  # its half only
    assert train_disjoint_pair(recipe, x, y, root=tmp_path, log=lambda *_: None) == folders  # the cache
    assert train_disjoint_pair(recipe, x, y, root=tmp_path, log=lambda *_: None, only="B") == folders[1:]
    with pytest.raises(SymmergeError, match="overlap"):
        train_disjoint_pair(replace(TINY, halves=((0, 1), (1, 2))), x, y, root=tmp_path)


def test_scores_are_the_definitions():
    from benchmarks.disjoint_classes import scores

    rng = np.random.default_rng(2)
    probs = torch.softmax(torch.from_numpy(rng.standard_normal((40, 10))), -1)
    labels = rng.integers(0, 10, 40)
    s = scores(probs, labels)
    pred = probs.argmax(-1).numpy()
    for name, keep in (("half_A", labels < 5), ("half_B", labels >= 5), ("all", labels >= 0)):
        assert s[name] == pytest.approx(np.mean([pred[i] == labels[i] for i in np.flatnonzero(keep)]))
        assert s[f"loss_{name}"] == pytest.approx(np.mean([-np.log(probs[i, labels[i]].item())
                                                           for i in np.flatnonzero(keep)]))


def _vit(tmp_path, seed):
    from transformers import ViTForImageClassification

    return ViTForImageClassification.from_pretrained(vit_folder(tmp_path / f"v{seed}", seed=seed,
                                                                num_hidden_layers=3)).eval()


def test_partial_merge_is_exact_at_its_ends(tmp_path):
    """k = all layers with both branches the merged model: the merged model; any k with the merged model as
    one branch and, as the other, a model that differs from it only in the embeddings and the first k layers
    (which the partial merge does not read): the merged model too; and the two-branch average is the
    average of the branches' own probabilities when they share the trunk."""
    from benchmarks.disjoint_classes import PartialMerge, probabilities

    m, other = _vit(tmp_path, 0), _vit(tmp_path, 1)
    x = torch.randn(5, 1, 8, 8)
    p_m = torch.softmax(m(pixel_values=x).logits.double(), -1)
    assert torch.allclose(PartialMerge(m, [m, m], 3)(x), p_m, atol=1e-6)
    for k in range(4):
        twin = copy.deepcopy(m)
        with torch.no_grad():  # what the partial merge takes from ``m`` only: the embeddings, layers < k
            for n, p in twin.named_parameters():
                if n.startswith("vit.embeddings") or any(f".{i}." in n for i in range(k)):
                    p.copy_(dict(other.named_parameters())[n])
        assert torch.allclose(PartialMerge(m, [m, twin], k)(x), p_m, atol=1e-6), k
    # k = 0 with two different branches: their probabilities averaged, on the merged model's embeddings
    twin = copy.deepcopy(other)
    twin.vit.embeddings.load_state_dict(m.vit.embeddings.state_dict())
    got = PartialMerge(m, [m, twin], 0)(x)
    want = (p_m + torch.softmax(twin(pixel_values=x).logits.double(), -1)) / 2
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.allclose(probabilities(PartialMerge(m, [m, twin], 0), x, batch=2), want, atol=1e-6)
    n = sum(p.numel() for p in m.parameters())
    assert PartialMerge(m, [m, twin], 3).parameters_count() == n + sum(
        p.numel() for k, p in twin.named_parameters() if k.startswith(("vit.layernorm", "classifier")))


def test_disjoint_classes_tiny_end_to_end(tmp_path, monkeypatch):
    from test_benchmark_smoke import run_tiny

    bench, out, r = run_tiny(tmp_path, monkeypatch, datasets.fashion_mnist_dir, "fashion-mnist", "Fashion-MNIST",
                             "disjoint_classes")
    rows = r["rows"]
    assert [k for k, v in rows.items() if v["kind"] == "endpoint"] == ["A (classes 0-4)", "B (classes 5-9)"]
    # each endpoint never predicts the other half's classes right: it never saw them
    assert rows["A (classes 0-4)"]["half_B"] == 0 and rows["B (classes 5-9)"]["half_A"] == 0
    for x in rows.values():  # the union's accuracy is the halves' weighted by their test images
        assert min(x["half_A"], x["half_B"]) - 1e-9 <= x["all"] <= max(x["half_A"], x["half_B"]) + 1e-9
    distilled = [k for k, v in rows.items() if v["kind"] == "distilled"]
    assert len(distilled) == 2 and all("distilled (not function-preserving)" in k for k in distilled)
    assert any(v["kind"] == "partial" for v in rows.values())
    assert sum(r["data"]["align_per_class"]) == r["data"]["align"] and min(r["data"]["align_per_class"]) > 0
    tables = (out / "tables.md").read_text()
    assert "distilled (not function-preserving)" in tables and "ensemble (average of probabilities)" in tables
