"""CLI behaviours end to end, each checked against values the test computes itself from the input
folders: task-vector methods (the written weights are θ_base + scale · the combined task vectors),
one ``--data`` file per model (each scored with its own model's head), ``--head-from`` and
``--weights``, ``--anchor FOLDER``, ``symmerge specs``, and ``symmerge align`` on a model of every
family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import (add_noise, body_keys, hf_load, jsonl_eval, lm_eval, make_inputs, npz_eval, npz_file,
                      output_rel_diff, run_cli, save_folder, sq_dist, vit_folder, with_weights, write_tokenizer)
from factories import FAMILIES, disguised, make_model
from symmerge.merge.parts import dare_keep_mask

pytestmark = pytest.mark.usefixtures("single_thread")


def read_report(out) -> dict:
    return json.loads((out / "symmerge_report.json").read_text())


def finetune_like(base_folder, out, seed: int, rel: float = 0.3):
    """``base_folder``'s model with every tensor moved by Gaussian noise (a task vector)."""
    base = hf_load(base_folder)
    sd, _ = add_noise(base.state_dict(), rel, seed)
    return str(save_folder(with_weights(base, sd), out))


def aligned_by_cli(folder, anchor, out, symmetries: str = "attn,ffn") -> dict:
    """``symmerge align folder anchor`` (the alignment a merge must reuse), loaded back."""
    assert run_cli("align", folder, anchor, "-o", out, "--symmetries", symmetries) == 0
    return hf_load(out).state_dict()


# ------------------------------------------------------------------ task-vector methods


def expected_task_vector_merge(method: str, base: dict, sds: list, keys: list, params: dict, weights) -> dict:
    """θ_base + scale · combine(sparsify(w_i τ_i)), written out from the methods' definitions."""
    taus = [{k: w * (sd[k].double() - base[k].double()) for k in keys} for sd, w in zip(sds, weights)]
    if method in ("dare", "dare_ties"):  # drop with probability p (the library's seeded masks), rescale
        p = params["drop"]
        taus = [{k: torch.where(dare_keep_mask(t.shape, p, params["seed"], i, k), t / (1 - p), 0.0)
                 for k, t in tau.items()} for i, tau in enumerate(taus)]
    if method == "ties":  # keep each model's top density fraction of entries by magnitude, model-wide
        trimmed = []
        for tau in taus:
            flat = torch.cat([t.abs().reshape(-1) for t in tau.values()])
            threshold = flat.sort(descending=True).values[round(params["density"] * flat.numel()) - 1]
            trimmed.append({k: torch.where(t.abs() >= threshold, t, 0.0) for k, t in tau.items()})
        taus = trimmed
    combined = {}
    for k in keys:
        stacked = torch.stack([tau[k] for tau in taus])
        if method in ("task_arithmetic", "dare"):
            combined[k] = stacked.sum(0)
            continue
        # sign election and disjoint mean: the mean of the entries on the side of the larger sum
        pos, neg = stacked.clamp(min=0), stacked.clamp(max=0)
        n_pos, n_neg = (stacked > 0).sum(0), (stacked < 0).sum(0)
        total = stacked.sum(0)
        combined[k] = torch.where(total > 0, pos.sum(0) / n_pos.clamp(min=1),
                                  torch.where(total < 0, neg.sum(0) / n_neg.clamp(min=1), 0.0))
    return {k: base[k].double() + params["scale"] * combined[k] for k in keys}


@pytest.fixture
def finetuned(tmp_path):
    """A base ViT classifier and two models fine-tuned from it (different task vectors on every tensor)."""
    base = str(vit_folder(tmp_path / "base", 0))
    return base, [finetune_like(base, tmp_path / f"ft{i}", seed=i) for i in (1, 2)]


@pytest.mark.parametrize("method,params,weights", [
    ("task_arithmetic", {"scale": 0.5}, (0.7, 0.5)),  # task-vector weights are multipliers, not normalised
    # symmerge's own variants (model-wide threshold, 1/(1 - p), disjoint mean): explicit parameters, since every
    # name means mergekit's method with mergekit's defaults
    ("ties", {"density": 0.3, "scale": 0.8, "scope": "model", "normalize": "count"}, (1.0, 1.0)),
    ("dare", {"drop": 0.4, "seed": 3, "scale": 1.0, "rescale": "inverse"}, (1.0, 1.0)),
    ("dare_ties", {"drop": 0.4, "seed": 3, "scale": 0.9, "rescale": "inverse", "normalize": "count"}, (1.0, 1.0)),
])
def test_task_vector_methods_write_base_plus_combined_task_vectors(finetuned, tmp_path, method, params, weights):
    base, (m0, m1) = finetuned
    out = tmp_path / "out"
    argv = ["merge", m0, m1, "--base", base, "--method", method, "-o", out]
    argv += [x for k, v in params.items() for x in ("--param", f"{k}={v}")]
    if weights != (1.0, 1.0):
        argv += ["--weights", ",".join(map(str, weights))]
    assert run_cli(*argv) == 0
    report = read_report(out)
    assert report["method"] == method and report["base"] == base and report["alignment"]["symmetries"] == []
    assert {k: report["params"][k] for k in params} == params
    sds = [hf_load(m).state_dict() for m in (m0, m1)]
    base_sd = hf_load(base).state_dict()
    body = body_keys(base_sd)
    expect = expected_task_vector_merge(method, base_sd, sds, body, params, weights)
    got = hf_load(out).state_dict()
    for k in body:
        torch.testing.assert_close(got[k].double(), expect[k], rtol=0, atol=2e-6, msg=k)
    for k in set(got) - set(body):  # the task head: model 0's, bit for bit
        assert torch.equal(got[k], sds[0][k]), k
    if method in ("dare", "dare_ties"):  # the masks really dropped about 40% of the entries
        kept = [dare_keep_mask(base_sd[k].shape, params["drop"], params["seed"], 0, k) for k in body]
        frac = sum(m.sum().item() for m in kept) / sum(m.numel() for m in kept)
        assert 0.55 < frac < 0.65


def test_task_arithmetic_with_alignment_uses_the_base_as_anchor(finetuned, tmp_path):
    """--align with a base: both models are aligned to the base, then merged as task vectors of it."""
    base, (m0, m1) = finetuned
    out = tmp_path / "out"
    assert run_cli("merge", m0, m1, "--base", base, "--method", "task_arithmetic", "--align", "attn,ffn",
                   "--param", "scale=0.5", "-o", out) == 0
    report = read_report(out)
    assert report["alignment"]["anchor"] == {"index": None, "name": base, "rule": "base model"}
    base_sd = hf_load(base).state_dict()
    aligned = [aligned_by_cli(m, base, tmp_path / f"aligned{i}") for i, m in enumerate((m0, m1))]
    body = body_keys(base_sd)
    got = hf_load(out).state_dict()
    for k in body:
        expect = base_sd[k].double() + 0.5 * sum(a[k].double() - base_sd[k].double() for a in aligned)
        torch.testing.assert_close(got[k].double(), expect, rtol=0, atol=2e-6, msg=k)


def test_task_arithmetic_on_a_decoder_scores_lm_lines(tmp_path):
    """Causal LMs with .txt data: the merged body and the LM head (--heads auto merges a language model's
    head) are the task-arithmetic ones, and the evaluation is the written folder's own next-token loss."""
    base = str(save_folder(make_model("llama", head=True, dtype=torch.float32), tmp_path / "base"))
    m0, m1 = (finetune_like(base, tmp_path / f"ft{i}", seed=i, rel=0.1) for i in (1, 2))
    for folder in (base, m0, m1):
        write_tokenizer(Path(folder))
    lines = tmp_path / "lines.txt"
    lines.write_text("the cat sat on the mat\n\na dog ran fast\nthe mat\n")
    out = tmp_path / "out"
    assert run_cli("merge", m0, m1, "--base", base, "--method", "task_arithmetic", "--data", lines, "-o", out) == 0
    report = read_report(out)
    sds, base_sd, got = [hf_load(m).state_dict() for m in (m0, m1)], hf_load(base).state_dict(), hf_load(out)
    body = [k for k in base_sd if k.startswith("model.")] + ["lm_head.weight"]
    for k in body:
        expect = sds[0][k].double() + sds[1][k].double() - base_sd[k].double()
        torch.testing.assert_close(got.state_dict()[k].double(), expect, rtol=0, atol=2e-6, msg=k)
    assert report["head"]["policy"] == "merge" and report["head"]["requested"] == "auto"
    loss, n_tokens = lm_eval(got, lines, out)
    (row,) = report["evaluation"]["merged"]
    assert row["n"] == n_tokens and row["loss"] == pytest.approx(loss, abs=1e-5)
    for r, folder in zip(report["evaluation"]["models"], (m0, m1)):
        loss, n_tokens = lm_eval(hf_load(folder), lines, folder)
        assert r["model"] == folder and r["n"] == n_tokens and r["loss"] == pytest.approx(loss, abs=1e-5)


# ------------------------------------------------------------------ data, heads, weights, anchor


def test_one_data_file_per_model_scores_each_with_its_own_head(tmp_path):
    """Two label spaces (3 and 5 classes): file i is scored with the merged body and model i's head."""
    m0, m1 = str(vit_folder(tmp_path / "m0", 0)), str(vit_folder(tmp_path / "m1", 1, num_labels=5))
    d0, d1 = npz_file(tmp_path / "d0.npz", n=12, labels=3, seed=0), npz_file(tmp_path / "d1.npz", n=9, labels=5, seed=1)
    out = tmp_path / "out"
    assert run_cli("merge", m0, m1, "--method", "average", "--align", "attn,ffn", "--data", d0, "--data", d1,
                   "-o", out) == 0
    ev = read_report(out)["evaluation"]
    assert [(r["data"], r["head_from"], r["n"]) for r in ev["merged"]] == [(d0, m0, 12), (d1, m1, 9)]
    assert [(r["model"], r["data"], r["n"]) for r in ev["models"]] == [(m0, d0, 12), (m1, d1, 9)]
    merged = hf_load(out)  # the written folder: merged body, model 0's head
    assert merged.config.num_labels == 3
    probe1 = hf_load(m1)  # model 1's 5-class head on the merged body
    probe1.load_state_dict({**probe1.state_dict(), **{k: v for k, v in merged.state_dict().items()
                                                      if not k.startswith("classifier.")}})
    for row, model, data in zip(ev["merged"], (merged, probe1), (d0, d1)):
        loss, acc = npz_eval(model, data)
        assert row["loss"] == pytest.approx(loss, abs=1e-5) and row["accuracy"] == pytest.approx(acc)
    for row, folder, data in zip(ev["models"], (m0, m1), (d0, d1)):
        loss, acc = npz_eval(hf_load(folder), data)
        assert row["loss"] == pytest.approx(loss, abs=1e-5) and row["accuracy"] == pytest.approx(acc)


def tiny_bert_classifier(folder, seed: int, num_labels: int) -> str:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=30, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                     max_position_embeddings=32, num_labels=num_labels, initializer_range=0.3)
    BertForSequenceClassification(cfg).save_pretrained(folder)
    write_tokenizer(folder)
    return str(folder)


def test_head_from_and_weights(tmp_path):
    """--head-from 1 keeps model 1's 5-class head bit for bit (and its config), --weights 0.7,0.3 gives
    that weighted average of the bodies; .jsonl data is scored with the written folder's tokenizer."""
    m0, m1 = tiny_bert_classifier(tmp_path / "m0", 0, 3), tiny_bert_classifier(tmp_path / "m1", 1, 5)
    rows = [("the cat sat on the mat", 4), ("a dog ran fast", 0), ("the mat", 3), ("a cat ran slow", 1),
            ("the dog sat", 2), ("fast fast slow", 4)]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    out = tmp_path / "out"
    assert run_cli("merge", m0, m1, "--method", "average", "--align", "none", "--weights", "0.7,0.3", "--head-from", "1",
                   "--data", data, "-o", out) == 0
    report = read_report(out)
    assert report["weights"] == [0.7, 0.3]
    assert {k: report["head"][k] for k in ("policy", "from_index", "from")} == {"policy": "keep", "from_index": 1,
                                                                                "from": m1}
    sa, sb = hf_load(m0).state_dict(), hf_load(m1).state_dict()
    merged = hf_load(out)
    assert type(merged).__name__ == "BertForSequenceClassification" and merged.config.num_labels == 5
    got = merged.state_dict()
    for k in got:
        if k.startswith("classifier."):
            assert torch.equal(got[k], sb[k]), k
        else:
            torch.testing.assert_close(got[k].double(), 0.7 * sa[k].double() + 0.3 * sb[k].double(), rtol=0,
                                       atol=1e-6, msg=k)
    ev = report["evaluation"]
    loss, acc = jsonl_eval(merged, data, out)
    (row,) = ev["merged"]
    assert row["head_from"] == m1 and row["n"] == 6
    assert row["loss"] == pytest.approx(loss, abs=1e-5) and row["accuracy"] == pytest.approx(acc)
    # model 0 has 3 classes: labels 3 and 4 are out of its range, so it is skipped, not mis-scored
    rows_by_model = {r["model"]: r for r in ev["models"]}
    assert "out of range" in rows_by_model[m0]["skipped"]
    loss, acc = jsonl_eval(hf_load(m1), data, m1)
    assert rows_by_model[m1]["loss"] == pytest.approx(loss, abs=1e-5)
    assert rows_by_model[m1]["accuracy"] == pytest.approx(acc)


def test_anchor_given_as_a_folder(tmp_path):
    """--anchor FOLDER (not one of the models): both models are aligned to it, distances and weights
    agree with `symmerge align` to that folder."""
    m0, m1, anchor = (str(vit_folder(tmp_path / f"m{s}", s)) for s in (0, 1, 7))
    out = tmp_path / "out"
    assert run_cli("merge", m0, m1, "--method", "average", "--align", "attn,ffn", "--anchor", anchor, "-o", out) == 0
    report = read_report(out)
    assert report["alignment"]["anchor"] == {"index": None, "name": anchor, "rule": "given"}
    rows = report["alignment"]["models"]
    assert [(r["model"], r["anchor"]) for r in rows] == [(m0, False), (m1, False)]
    anchor_sd = hf_load(anchor).state_dict()
    body = body_keys(anchor_sd)
    aligned = []
    for i, (row, folder) in enumerate(zip(rows, (m0, m1))):
        aligned.append(aligned_by_cli(folder, anchor, tmp_path / f"aligned{i}"))
        before = sq_dist(hf_load(folder).state_dict(), anchor_sd, body) ** 0.5
        after = sq_dist(aligned[i], anchor_sd, body) ** 0.5
        assert row["distance_before"] == pytest.approx(before, rel=1e-6)
        assert row["distance_after"] == pytest.approx(after, rel=1e-5) and after < before
    (after_pair,) = report["distances_between_inputs"]["after_alignment"].values()
    assert after_pair == pytest.approx(sq_dist(aligned[0], aligned[1], body) ** 0.5, rel=1e-5)
    got = hf_load(out).state_dict()
    for k in body:
        torch.testing.assert_close(got[k], (aligned[0][k] + aligned[1][k]) / 2, rtol=0, atol=2e-6, msg=k)


# ------------------------------------------------------------------ specs, align on every family


def test_specs_lists_every_model_type_and_group(capsys):
    from symmerge.families import SPECS, supported_model_types

    capsys.readouterr()
    assert run_cli("specs") == 0
    text = capsys.readouterr().out
    listed, groups, family = set(), {}, None
    for line in text.splitlines():
        if "(model_type:" in line:
            family = line.split()[0]
            types = line.split("(model_type:")[1].split(";")[0].rstrip(")")
            listed |= {t.strip() for t in types.split(",")}
            groups[family] = []
        elif family and line.startswith("  ") and line[2:3].strip() and "restricted by" not in line:
            groups[family].append(line.split()[0])
    assert sorted(listed) == supported_model_types()
    # the model types of every tiny model the tests build, whatever the spec tables say
    assert {make_model(f).config.model_type for f in FAMILIES} <= listed
    assert groups == {s.family: [g.name for g in s.groups] for s in SPECS}
    assert all(groups.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_align_cli_on_every_family(family, tmp_path):
    """`symmerge align M A --symmetries attn,heads,ffn,rescale` on a task model of every family (fp32):
    the written folder loads with transformers as the same class, computes M's function, and lies
    near A (M is A moved by a hidden group element plus a little noise)."""
    anchor = make_model(family, head=True, dtype=torch.float32)
    model, noise, _ = disguised(anchor, symmetries=("heads", "attn", "ffn", "rescale"), seed=3, noise=0.02)
    a_dir, m_dir, out = save_folder(anchor, tmp_path / "A"), save_folder(model, tmp_path / "M"), tmp_path / "out"
    assert run_cli("align", m_dir, a_dir, "-o", out, "--symmetries", "attn,heads,ffn,rescale") == 0
    m, a, aligned = hf_load(m_dir), hf_load(a_dir), hf_load(out)
    assert type(aligned) is type(m) is type(anchor)
    assert output_rel_diff(m, aligned, make_inputs(m)) <= 1e-4
    keys = [k for k, _ in m.named_parameters()]
    before = sq_dist(m.state_dict(), a.state_dict(), keys) ** 0.5
    after = sq_dist(aligned.state_dict(), a.state_dict(), keys) ** 0.5
    assert after < 1.5 * noise < 0.05 * before  # back near A: the hidden element is undone
    report = read_report(out)
    assert report["distance_before"] == pytest.approx(before, rel=1e-5)
    assert report["distance_after"] == pytest.approx(after, rel=1e-4)
    assert set(report["symmetries"]) == {"attn", "heads", "ffn", "rescale"} and report["rescale"] == "joint"
