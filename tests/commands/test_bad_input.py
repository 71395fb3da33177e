"""The CLI on bad input: one clear 'symmerge: error:' line, non-zero exit, nothing written.
And the happy path: a loadable HF folder with side files and a report, inputs untouched."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch

from conftest import make_inputs, output_rel_diff, save_folder, with_weights, write_tokenizer
from factories import make_model
from symmerge.pipeline.align import instances_for
from symmerge.core.apply import apply, random_elements
from symmerge.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

SUPPORTED = ("bert", "roberta", "distilbert", "deberta-v2", "vit")


# ------------------------------------------------------------------ helpers


def bert_folder(path: Path, seed=0, **overrides) -> Path:
    return save_folder(make_model("bert", seed=seed, **overrides), path)


def disguised_folder(anchor, path: Path, seed=1) -> Path:
    _, instances = instances_for(anchor)
    instances = [i for i in instances if i.group.symmetry in ("attn", "ffn")]  # the default symmetries
    elements = random_elements(instances, torch.Generator().manual_seed(seed))
    return save_folder(with_weights(anchor, apply(anchor.state_dict(), instances, elements)), path)


def tree_hash(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def run_cli(capsys, *argv):
    capsys.readouterr()  # drop what the test's own setup printed
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's refusal (a flag's value its reader refuses)
        rc = e.code
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


PROGRESS_LINE = re.compile(r"^\[\d+\.\d s\] ")  # symmerge.progress in lines mode (stderr is not a terminal)


def temp_leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if "tmp-" in p.name]


def assert_clean_failure(rc, err, out: Path, *needles):
    assert rc != 0
    lines = [line for line in err.splitlines() if line.strip() and not PROGRESS_LINE.match(line)]
    assert len(lines) == 1, f"expected one error line on stderr (besides progress lines), got: {err!r}"
    assert re.match(r"symmerge(: | [a-z-]+: error: argument )", lines[0]) and " error: " in lines[0], lines[0]
    for needle in needles:
        assert needle.lower() in lines[0].lower(), (needle, lines[0])
    assert not out.exists(), "output written despite the error"
    assert temp_leftovers(out.parent) == []


@pytest.fixture
def anchor_dir(tmp_path):
    return bert_folder(tmp_path / "anchor")


@pytest.fixture
def out(tmp_path):
    parent = tmp_path / "outs"
    parent.mkdir()
    return parent / "aligned"


# ------------------------------------------------------------------ bad input


def test_mismatched_architectures(tmp_path, anchor_dir, out, capsys):
    other = save_folder(make_model("distilbert"), tmp_path / "distil")
    rc, _, err = run_cli(capsys, "align", other, anchor_dir, "-o", out)
    assert_clean_failure(rc, err, out, "architectures differ", "distilbert", "bert")


def test_mismatched_shapes(tmp_path, anchor_dir, out, capsys):
    wide = save_folder(make_model("bert", hidden_size=36, num_attention_heads=3), tmp_path / "wide")
    rc, _, err = run_cli(capsys, "align", wide, anchor_dir, "-o", out)
    assert_clean_failure(rc, err, out, "shapes differ")


def test_mismatched_head_count(tmp_path, anchor_dir, out, capsys):
    """Same tensor shapes, different head split: the head groups would not correspond."""
    other = save_folder(make_model("bert", num_attention_heads=4), tmp_path / "heads4")
    rc, _, err = run_cli(capsys, "align", other, anchor_dir, "-o", out)
    assert_clean_failure(rc, err, out, "architectures differ", "heads")


def _bloom(path):
    from transformers import BloomConfig, BloomModel

    return save_folder(BloomModel(BloomConfig(hidden_size=24, n_layer=1, n_head=3, vocab_size=60)), path)


def _whisper(path):
    from transformers import WhisperConfig, WhisperModel

    return save_folder(WhisperModel(WhisperConfig(d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                                                  decoder_attention_heads=4, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                                  vocab_size=60, num_mel_bins=8, max_source_positions=16,
                                                  max_target_positions=16, pad_token_id=0, bos_token_id=1,
                                                  eos_token_id=2, decoder_start_token_id=1)), path)


@pytest.mark.parametrize("which", ["model", "anchor"])
@pytest.mark.parametrize("maker,model_type", [(_bloom, "bloom"), (_whisper, "whisper")])
def test_unsupported_model_type(tmp_path, anchor_dir, out, capsys, maker, model_type, which):
    bad = maker(tmp_path / model_type)
    args = (bad, anchor_dir) if which == "model" else (anchor_dir, bad)
    rc, _, err = run_cli(capsys, "align", *args, "-o", out)
    assert_clean_failure(rc, err, out, model_type, "unsupported", *SUPPORTED)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_weights(tmp_path, anchor_dir, out, capsys, value):
    model = make_model("bert", seed=3)
    with torch.no_grad():
        model.encoder.layer[1].intermediate.dense.weight[3, 5] = value
    bad = save_folder(model, tmp_path / "bad")
    rc, _, err = run_cli(capsys, "align", bad, anchor_dir, "-o", out)
    assert_clean_failure(rc, err, out, "NaN or Inf", "intermediate.dense.weight")
    # also as the anchor
    rc, _, err = run_cli(capsys, "align", anchor_dir, bad, "-o", out)
    assert_clean_failure(rc, err, out, "NaN or Inf")


def test_missing_safetensors(tmp_path, anchor_dir, out, capsys):
    bad = bert_folder(tmp_path / "bad", seed=2)
    (bad / "model.safetensors").unlink()
    rc, _, err = run_cli(capsys, "align", bad, anchor_dir, "-o", out)
    assert_clean_failure(rc, err, out, "no weights")


def test_missing_folder_and_config(tmp_path, anchor_dir, out, capsys):
    rc, _, err = run_cli(capsys, "align", tmp_path / "nowhere", anchor_dir, "-o", out)
    assert_clean_failure(rc, err, out, "not a directory")
    bad = bert_folder(tmp_path / "bad", seed=2)
    (bad / "config.json").unlink()
    rc, _, err = run_cli(capsys, "align", bad, anchor_dir, "-o", out)
    assert_clean_failure(rc, err, out, "config.json")


@pytest.mark.parametrize("keep", [0.5, 10])
def test_truncated_safetensors(tmp_path, anchor_dir, out, capsys, keep):
    bad = bert_folder(tmp_path / "bad", seed=2)
    f = bad / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: int(len(data) * keep) if keep < 1 else keep])
    rc, _, err = run_cli(capsys, "align", bad, anchor_dir, "-o", out)
    assert_clean_failure(rc, err, out, "safetensors")


def _pickle_only(model, path: Path) -> Path:
    save_folder(model, path)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    torch.save(state, path / "pytorch_model.bin")
    (path / "model.safetensors").unlink()
    return path


def test_pickle_only_checkpoint(tmp_path, out, capsys):
    anchor = make_model("bert", dtype=torch.float32)
    anchor_dir = save_folder(anchor, tmp_path / "anchor")
    model_dir = disguised_folder(anchor, tmp_path / "model_st")
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir))
    pkl = _pickle_only(model, tmp_path / "pkl")
    rc, _, err = run_cli(capsys, "align", pkl, anchor_dir, "-o", out)
    assert_clean_failure(rc, err, out, "pickle", "--allow-pickle")
    rc, stdout, err = run_cli(capsys, "align", pkl, anchor_dir, "-o", out, "--allow-pickle")
    assert rc == 0, err
    assert (out / "model.safetensors").is_file() and not (out / "pytorch_model.bin").exists()
    aligned = AutoModel.from_pretrained(str(out))
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["distance_after"] < 1e-4 * report["distance_before"]
    assert output_rel_diff(model, aligned, make_inputs(model)) <= 1e-5


def test_existing_nonempty_output(tmp_path, anchor_dir, out, capsys):
    model_dir = bert_folder(tmp_path / "model", seed=5)
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    rc, _, err = run_cli(capsys, "align", model_dir, anchor_dir, "-o", out)
    assert rc != 0
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("symmerge: error:") and "refusing to overwrite" in lines[0]
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    assert (out / "keep.txt").read_text() == "precious"
    assert temp_leftovers(out.parent) == []
    # an output path that is a file is refused the same way
    file_out = out.parent / "a_file"
    file_out.write_text("x")
    rc, _, err = run_cli(capsys, "align", model_dir, anchor_dir, "-o", file_out)
    assert rc != 0 and err.startswith("symmerge: error:") and file_out.read_text() == "x"


@pytest.mark.parametrize("text", ['{"model_type": "bert", "hidden_size": 24', "", "[1, 2]", '{"hidden_size": 24}'])
def test_malformed_config(tmp_path, anchor_dir, out, capsys, text):
    bad = bert_folder(tmp_path / "bad", seed=2)
    (bad / "config.json").write_text(text)
    rc, _, err = run_cli(capsys, "align", bad, anchor_dir, "-o", out)
    assert_clean_failure(rc, err, out, "config.json")


@pytest.mark.parametrize("extra,needle", [
    (["--layers", "0,x"], "--layers"),
    (["--layers", "7"], "out of range"),
    (["--symmetries", "attn,rows"], "unknown symmetry"),
    (["--verify-tol", "1e-30"], "not equivalent"),  # verification fails after solving: still nothing written
    (["--verify-tol", "-1"], "--verify-tol"),  # out of range: refused before solving
])
def test_bad_options(tmp_path, anchor_dir, out, capsys, extra, needle):
    model_dir = bert_folder(tmp_path / "model", seed=5)
    rc, _, err = run_cli(capsys, "align", model_dir, anchor_dir, "-o", out, *extra)
    assert_clean_failure(rc, err, out, needle)


# ------------------------------------------------------------------ happy path


def test_align_happy_path(tmp_path, out, capsys):
    from transformers import AutoModel, AutoTokenizer

    anchor = make_model("bert", dtype=torch.float32)
    anchor_dir = save_folder(anchor, tmp_path / "anchor")
    model_dir = disguised_folder(anchor, tmp_path / "model", seed=11)
    tok_files = write_tokenizer(model_dir)
    hashes = {d: tree_hash(d) for d in (model_dir, anchor_dir)}

    rc, stdout, err = run_cli(capsys, "align", model_dir, anchor_dir, "-o", out)
    assert rc == 0, err
    assert "distance to anchor" in stdout

    # inputs untouched
    for d, h in hashes.items():
        assert tree_hash(d) == h, f"{d} was modified"
    assert temp_leftovers(out.parent) == []

    # a loadable HF folder computing the model's function, near the anchor
    aligned = AutoModel.from_pretrained(str(out)).eval()
    model = AutoModel.from_pretrained(str(model_dir)).eval()
    inputs = make_inputs(model)
    assert output_rel_diff(model, aligned, inputs) <= 1e-5
    assert aligned.config.to_dict()["hidden_size"] == anchor.config.hidden_size

    # tokenizer files copied byte for byte, and the tokenizer loads from the output
    for name in tok_files:
        assert (out / name).read_bytes() == (model_dir / name).read_bytes(), name
    sentence = "the cat sat on the mat"
    src_tok, out_tok = AutoTokenizer.from_pretrained(str(model_dir)), AutoTokenizer.from_pretrained(str(out))
    assert out_tok(sentence)["input_ids"] == src_tok(sentence)["input_ids"]

    report = json.loads((out / "symmerge_report.json").read_text())
    for key in ("distance_before", "distance_after", "per_module", "verify_max_abs_diff", "seconds"):
        assert key in report, key
    assert report["distance_before"] > 10
    assert report["distance_after"] < 1e-4 * report["distance_before"]
    assert 0 <= report["verify_max_abs_diff"] < 1e-3
    assert report["seconds"] > 0
    assert set(report["per_module"]) == {f"layer.{i}.{g}" for i in range(2) for g in ("heads", "attn.qk", "attn.vo", "ffn")}
    for d in report["per_module"].values():
        assert d["after"] <= d["before"]
    # the report's distance is the real distance of the written weights
    sa, sb = aligned.state_dict(), anchor.state_dict()
    real = sum((sa[k].double() - sb[k].double()).square().sum().item() for k, _ in anchor.named_parameters()) ** 0.5
    assert real == pytest.approx(report["distance_after"], rel=1e-3, abs=1e-5)


def test_align_task_model_options(tmp_path, out, capsys):
    """A task model (architectures: BertForSequenceClassification) with --layers and --symmetries."""
    from transformers import AutoModelForSequenceClassification

    anchor = make_model("bert", head=True, dtype=torch.float32)
    anchor_dir = save_folder(anchor, tmp_path / "anchor")
    model_dir = disguised_folder(anchor, tmp_path / "model", seed=12)
    rc, _, err = run_cli(capsys, "align", model_dir, anchor_dir, "-o", out, "--layers", "1",
                         "--symmetries", "attn,ffn", "--rescale", "sequential")
    assert rc == 0, err
    aligned = AutoModelForSequenceClassification.from_pretrained(str(out)).eval()
    model = AutoModelForSequenceClassification.from_pretrained(str(model_dir)).eval()
    assert type(aligned).__name__ == "BertForSequenceClassification"
    assert output_rel_diff(model, aligned, make_inputs(model)) <= 1e-5
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["layers"] == [1] and report["symmetries"] == ["attn", "ffn"] and report["rescale"] == "none"
    assert set(report["per_module"]) == {"layer.1.attn.qk", "layer.1.attn.vo", "layer.1.ffn"}
    sm, sa = model.state_dict(), aligned.state_dict()
    for k in sm:
        if "layer.1." not in k:
            assert torch.equal(sm[k], sa[k]), k  # layer 0, embeddings, pooler, classifier untouched


@pytest.mark.parametrize("exc", [KeyboardInterrupt, OSError])
def test_interrupted_write_leaves_nothing(tmp_path, out, capsys, monkeypatch, exc):
    """A failure while the output folder is being written removes the partial folder."""
    import symmerge.io.model

    anchor_dir = bert_folder(tmp_path / "anchor")
    model_dir = bert_folder(tmp_path / "model", seed=5)

    def boom(*args, **kwargs):
        raise exc("simulated failure while writing")

    monkeypatch.setattr(symmerge.io.model, "write_json", boom)
    if exc is KeyboardInterrupt:
        rc, _, err = run_cli(capsys, "align", model_dir, anchor_dir, "-o", out)
        assert rc == 130 and "interrupted" in err
    else:  # an operating-system failure is one line too (issue 40), not a traceback
        rc, _, err = run_cli(capsys, "align", model_dir, anchor_dir, "-o", out)
        errors = [line for line in err.splitlines() if line.startswith("symmerge: error: ")]
        assert rc == 2 and len(errors) == 1 and "simulated failure while writing" in errors[0]
        assert "Traceback" not in err
    assert not out.exists()
    assert temp_leftovers(out.parent) == []
