"""What a user gets on disk through the CLI, checked with ``transformers`` itself: half-precision and
mixed-precision inputs of ``align`` / ``merge`` in memory, and mergekit configs on every T5-like architecture."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from conftest import hf_load, make_inputs, output_rel_diff, run_cli, write_tokenizer
from factories import make_model

pytestmark = pytest.mark.usefixtures("single_thread")


def _folder(path, family, seed, dtype, head: bool = True):
    make_model(family, head=head, dtype=torch.float32, seed=seed).to(dtype).save_pretrained(str(path))
    write_tokenizer(path)
    return path


def _stored(folder) -> tuple[set, str]:
    """(the safetensors dtypes on disk, config.json's dtype)."""
    dtypes = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as s:
            dtypes |= {str(s.get_slice(k).get_dtype()) for k in s.keys()}
    config = json.loads((folder / "config.json").read_text())
    return dtypes, config.get("dtype", config.get("torch_dtype"))


@pytest.mark.parametrize("family", ["llama", "mixtral"])
def test_bfloat16_pair_aligns_and_merges_in_memory(tmp_path, family):
    """A bfloat16 pair (the hub's usual dtype) was refused by align and by merge's default alignment: the
    alignment was computed and verified in bfloat16 arithmetic ('not equivalent: 0.0795 > 0.05' on a tiny
    Llama). It is computed and verified in float32, the output rounded once to bfloat16."""
    a, b = (_folder(tmp_path / f"m{s}", family, s, torch.bfloat16) for s in (0, 1))
    assert run_cli("align", a, b, "-o", tmp_path / "al", "--progress", "none") == 0
    assert _stored(tmp_path / "al") == ({"BF16"}, "bfloat16")
    report = json.loads((tmp_path / "al" / "symmerge_report.json").read_text())
    assert report["verify_max_rel_diff"] <= 1e-5  # the alignment itself, in float32 from the stored bf16 values
    # the report says what that figure measured, and that the written model was rounded after it
    assert report["working_copies"]["dtype"] == "float32" and report["working_copies"]["stored"] == ["bfloat16"] * 2
    model, aligned = hf_load(a).float(), hf_load(tmp_path / "al").float()
    # the one rounding to bfloat16 of the aligned weights: no more than rounding the rotated model once
    assert output_rel_diff(model, aligned, make_inputs(model)) <= 5e-2
    assert run_cli("merge", a, b, "--method", "average", "-o", tmp_path / "mm", "--progress", "none") == 0
    assert _stored(tmp_path / "mm") == ({"BF16"}, "bfloat16")


def test_mixed_dtype_pair_aligns_in_the_models_dtype(tmp_path):
    """A float32 model and a bfloat16 anchor stopped with torch's RuntimeError ('expected scalar type Float but
    found Double') and a traceback; the model keeps its float32 and its function to 1e-5."""
    a, b = _folder(tmp_path / "a", "llama", 0, torch.float32), _folder(tmp_path / "b", "llama", 1, torch.bfloat16)
    assert run_cli("align", a, b, "-o", tmp_path / "al", "--progress", "none") == 0
    assert _stored(tmp_path / "al") == ({"F32"}, "float32")
    model, aligned = hf_load(a), hf_load(tmp_path / "al")
    assert output_rel_diff(model, aligned, make_inputs(model)) <= 1e-5
    work = json.loads((tmp_path / "al" / "symmerge_report.json").read_text())["working_copies"]
    assert work["dtype"] == "float32" and work["stored"] == ["float32", "bfloat16"]
    assert run_cli("merge", a, b, "--method", "average", "-o", tmp_path / "mm", "--progress", "none") == 0


@pytest.mark.parametrize("family,head", [("mt5", True), ("t5", False), ("t5-relu", False), ("mt5", False)])
def test_every_t5_class_runs_a_plain_mergekit_config(tmp_path, family, head):
    """MT5ForConditionalGeneration, T5EncoderModel, T5Model and MT5EncoderModel (T5's tensors, of both stacks or
    the encoder's) were refused by a plain ``models:`` config, 'layer 1 has different tensors than layer 0 ...
    slices and gradients need layers of one template': only T5ForConditionalGeneration had the module map that
    knows the relative attention bias is in block 0 only."""
    a, b = (_folder(tmp_path / f"m{s}", family, s, torch.float32, head) for s in (0, 1))
    config = tmp_path / "c.yml"
    config.write_text(f"models:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n  - model: {b}\n"
                      "    parameters: {weight: 0.5}\nmerge_method: linear\n")
    assert run_cli("run", config, tmp_path / "out") == 0
    merged, m0, m1 = hf_load(tmp_path / "out"), hf_load(a), hf_load(b)
    sd, s0, s1 = merged.state_dict(), m0.state_dict(), m1.state_dict()
    assert all(torch.allclose(sd[k], (s0[k] + s1[k]) / 2, atol=1e-6) for k in sd)


@pytest.mark.parametrize("mode", ["stream", "memory"])
def test_default_label_names_written_or_not_are_the_same_labels(tmp_path, mode):
    """transformers 4 wrote the default ``id2label`` ({0: LABEL_0, 1: LABEL_1}) into every config.json,
    transformers 5 leaves it out: the streamed merge compared config.json as written and refused such a pair
    of causal LMs (the cached SmolLM2 and a copy saved again), 'label names differ ...; use --heads keep'."""
    a, b = (_folder(tmp_path / f"m{s}", "llama", s, torch.float32) for s in (0, 1))
    config = json.loads((a / "config.json").read_text())
    assert "id2label" not in config
    config.update(id2label={"0": "LABEL_0", "1": "LABEL_1"}, label2id={"LABEL_0": 0, "LABEL_1": 1})
    (a / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert run_cli("merge", a, b, "--method", "average", "--align", "none", "--mode", mode, "-o", out,
                   "--progress", "none") == 0
    merged, m0, m1 = hf_load(out), hf_load(a), hf_load(b)
    s0, s1 = m0.state_dict(), m1.state_dict()
    assert all(torch.allclose(v, (s0[k] + s1[k]) / 2, atol=1e-6) for k, v in merged.state_dict().items())
    # label names that do differ are still refused, in one line
    config["id2label"] = {"0": "NEG", "1": "POS"}
    (a / "config.json").write_text(json.dumps(config))
    assert run_cli("merge", a, b, "--method", "average", "--align", "none", "--mode", mode, "-o", tmp_path / "o2",
                   "--progress", "none") == 2


def test_joint_and_dual_alignments_of_half_and_mixed_models(tmp_path):
    """The joint alignment of three models (merge, barrier) and the dual learned frame had the pair's defect:
    three bfloat16 Llamas refused ('not equivalent: 0.111 > 0.05'), the dual frame too (0.0783), and a float32
    model beside two bfloat16 ones stopped with torch's RuntimeError. Each model keeps its own dtype."""
    half = [_folder(tmp_path / f"h{s}", "llama", s, torch.bfloat16) for s in range(3)]
    text = tmp_path / "t.txt"
    text.write_text("the cat sat on the mat\nthe dog ran fast\na cat ran slow\nthe dog sat on a mat\n")
    assert run_cli("merge", *half, "--method", "average", "-o", tmp_path / "j", "--progress", "none") == 0
    assert _stored(tmp_path / "j") == ({"BF16"}, "bfloat16")
    report = json.loads((tmp_path / "j" / "symmerge_report.json").read_text())
    assert all(m["verify_max_rel_diff"] <= 1e-4 for m in report["alignment"]["models"])  # float32's tolerance
    assert run_cli("merge", *half[:2], "--method", "average", "--match", "learned", "--learn-frame", "dual",
                   "--align-data", text, "--learn-steps", "2", "-o", tmp_path / "d", "--progress", "none") == 0
    assert _stored(tmp_path / "d") == ({"BF16"}, "bfloat16")
    mixed = [_folder(tmp_path / "f", "llama", 5, torch.float32), *half[1:]]
    assert run_cli("merge", *mixed, "--method", "average", "-o", tmp_path / "m", "--progress", "none") == 0
    assert run_cli("barrier", *half, "--data", text, "-o", tmp_path / "b", "--progress", "none") == 0


@pytest.mark.parametrize("given", [False, True])
def test_generation_config_in_the_output_exactly_when_the_input_has_one(tmp_path, given):
    """In memory, transformers' save_pretrained derived a generation_config.json from config.json for a causal LM
    whose folder had none, where the streamed commands wrote none: now both write one exactly when the input had
    one, and then the input's settings."""
    a, b = (_folder(tmp_path / f"m{s}", "llama", s, torch.float32) for s in (0, 1))
    for folder in (a, b):
        (folder / "generation_config.json").unlink(missing_ok=True)
        if given:
            (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 7, "do_sample": False}))
    runs = {"align": ["align", a, b], "align-stream": ["align", a, b, "--stream"],
            "merge": ["merge", a, b, "--method", "average", "--mode", "memory"],
            "merge-stream": ["merge", a, b, "--method", "average", "--mode", "stream"]}
    for name, argv in runs.items():
        assert run_cli(*argv, "-o", tmp_path / name, "--progress", "none") == 0, name
        written = tmp_path / name / "generation_config.json"
        assert written.is_file() is given, name
        if given:
            assert json.loads(written.read_text())["max_new_tokens"] == 7, name
