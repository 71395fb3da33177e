"""The config-driven commands (``run``, ``moe``) and ``BASE+ADAPTER`` inputs, audited as the flag-driven commands
were: every fault is one ``symmerge: error:`` line naming what is wrong, before any work, nothing written into an
input; what works keeps working."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import mergekit_oracle as mk
from test_user_audit import one_error_line, run_cli  # the flag-driven commands' audit

pytestmark = pytest.mark.usefixtures("single_thread")


def causal_lm(path: Path, seed: int, head: bool = True) -> Path:
    """A tiny Llama folder (``LlamaForCausalLM``, or with ``head=False`` the base model ``LlamaModel``: tensors
    named ``layers.0...`` without ``model.``) with a tokenizer."""
    from transformers import AutoModel, AutoModelForCausalLM

    torch.manual_seed(seed)
    auto = AutoModelForCausalLM if head else AutoModel
    auto.from_config(mk._config("llama", 2), dtype=torch.float32).save_pretrained(str(path))
    mk.save_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamas")
    return {name: causal_lm(root / name, seed) for seed, name in enumerate(("a", "b"))}


def snapshot(folder: Path) -> dict:
    return {p: p.stat().st_mtime_ns for p in Path(folder).rglob("*")}


def linear_config(path: Path, *models) -> Path:
    path.write_text("merge_method: linear\ndtype: float32\nmodels:\n" + "".join(
        f"  - model: {m}\n    parameters: {{weight: 0.5}}\n" for m in models))
    return path


def moe_config(path: Path, base, *experts, gate_mode: str = "random") -> Path:
    path.write_text(f"base_model: {base}\ngate_mode: {gate_mode}\nexperts:\n" + "".join(
        f"  - source_model: {e}\n    positive_prompts: [w{5 + i}]\n" for i, e in enumerate(experts)))
    return path


# ------------------------------------------------------------------ the output inside an input's folder


@pytest.mark.parametrize("command", ["run", "moe"])
@pytest.mark.parametrize("inside", ["a/merged", "b/deep/merged"])
def test_an_output_inside_a_model_named_in_the_config_is_refused(llamas, tmp_path, capsys, monkeypatch, command,
                                                                 inside):
    """``symmerge run cfg.yml a/merged`` with ``a`` in the config wrote the merge (and its lock file) into the input;
    align, merge, extract-lora and barrier refuse it for the models on their command line."""
    monkeypatch.chdir(llamas["a"].parent)
    config = (linear_config(tmp_path / "c.yml", "a", "b") if command == "run"
              else moe_config(tmp_path / "c.yml", "a", "a", "b"))
    before = {name: snapshot(llamas[name]) for name in llamas}
    rc, out, err = run_cli(capsys, command, config, inside, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and "inside the input folder" in line and "change an input" in line and out == "", line
    assert {name: snapshot(llamas[name]) for name in llamas} == before


def test_a_base_model_and_slices_sources_are_inputs_too(llamas, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(llamas["a"].parent)
    config = tmp_path / "s.yml"
    config.write_text("merge_method: passthrough\ndtype: float32\nslices:\n  - sources:\n      - model: a\n"
                      "        layer_range: [0, 1]\n  - sources:\n      - model: b\n        layer_range: [1, 2]\n")
    line = one_error_line(run_cli(capsys, "run", config, "b/out", "--progress", "none")[2])
    assert "inside the input folder" in line and str(llamas["b"]) in line, line
    config = tmp_path / "t.yml"
    config.write_text("merge_method: task_arithmetic\nbase_model: a\ndtype: float32\nmodels:\n  - model: b\n"
                      "    parameters: {weight: 0.5}\n")
    line = one_error_line(run_cli(capsys, "run", config, "a/out", "--progress", "none")[2])
    assert "inside the input folder" in line and str(llamas["a"]) in line, line
    assert not (llamas["a"] / "out").exists() and not (llamas["b"] / "out").exists()


@pytest.mark.parametrize("command", ["run", "moe"])
def test_an_output_beside_the_models_of_the_config_is_written(llamas, tmp_path, capsys, monkeypatch, command):
    """The check compares folders, not names: 'a-merged' beside 'a' is no folder of 'a'."""
    monkeypatch.chdir(llamas["a"].parent)
    out = llamas["a"].parent / f"a-{command}"
    config = (linear_config(tmp_path / "c.yml", "a", "b") if command == "run"
              else moe_config(tmp_path / "c.yml", "a", "a", "b"))
    rc, _, err = run_cli(capsys, command, config, out.name, "--progress", "none")
    assert rc == 0, err
    assert (out / "config.json").is_file()


# ------------------------------------------------------------------ run: an aligned config's own keys


@pytest.mark.parametrize("key,value,meant,flag", [
    ("anchro", "0", "anchor", []),
    ("anchro", "0", "anchor", ["--align", "ffn"]),
    ("rescal", "none", "rescale", []),
    ("mtach", "weights", "match", []),
])
def test_a_misspelt_alignment_key_of_an_aligned_config_is_an_error(llamas, tmp_path, capsys, key, value, meant, flag):
    """``anchro: 0`` beside ``align:`` was a warning (an unknown mergekit key, ignored) and the models were aligned
    to another anchor than asked: the alignment keys are symmerge's own, whose unknown keys are errors."""
    config = linear_config(tmp_path / "c.yml", llamas["a"], llamas["b"])
    config.write_text(config.read_text() + ("" if flag else "align: [ffn]\n") + f"{key}: {value}\n")
    out = tmp_path / "out"
    rc, printed, err = run_cli(capsys, "run", config, out, *flag, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and f"unknown key {key!r}" in line and f"did you mean {meant!r}?" in line and printed == "", line
    assert "line 8" in line or "line 9" in line, line
    assert not out.exists()


def test_a_misspelt_mergekit_key_of_an_aligned_config_is_still_ignored_as_mergekit_does(llamas, tmp_path, capsys):
    config = linear_config(tmp_path / "c.yml", llamas["a"], llamas["b"])
    config.write_text(config.read_text() + "align: [ffn]\ntokenzer_source: base\n")
    rc, printed, err = run_cli(capsys, "run", config, tmp_path / "out", "--print-command", "--progress", "none")
    assert rc == 0 and "align ffn" in printed, err
    assert "tokenzer_source: not a mergekit key (did you mean 'tokenizer_source'?)" in err, err


# ------------------------------------------------------------------ moe: a non-finite input tensor


def with_value(src: Path, dst: Path, key: str, value: float, row: int = 0) -> Path:
    """A copy of the model folder ``src`` whose tensor ``key`` holds ``value`` in one entry of row ``row``."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors[key][row, 0] = value
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
@pytest.mark.parametrize("gate_mode", ["random", "hidden"])
def test_a_non_finite_expert_tensor_names_the_input_folder_and_tensor(llamas, tmp_path, capsys, value, gate_mode):
    """It was 'tensor model.layers.1.block_sparse_moe.experts.1.w3.weight of the output has non-finite values':
    neither the folder nor the tensor the user can look at."""
    key = "model.layers.1.mlp.up_proj.weight"
    bad = with_value(llamas["b"], tmp_path / "bad", key, value)
    out = tmp_path / "out"
    config = moe_config(tmp_path / "c.yml", llamas["a"], llamas["a"], bad, gate_mode=gate_mode)
    rc, _, err = run_cli(capsys, "moe", config, out, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and f"{bad}: tensor {key!r} holds NaN or Inf values" in line, line
    assert not out.exists()


def test_a_non_finite_embedding_row_of_the_prompts_is_no_zero_router_row(llamas, tmp_path, capsys):
    """cheap_embed averages the base's embedding rows of the prompts' tokens: a NaN there was 'its prompts give a zero
    router row (positive and negative prompts tokenize alike...)', which they do not."""
    key = "model.embed_tokens.weight"
    bad = with_value(llamas["a"], tmp_path / "bad", key, float("nan"), row=5)  # w5: the first expert's prompt
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "moe", moe_config(tmp_path / "c.yml", bad, llamas["a"], llamas["b"],
                                                   gate_mode="cheap_embed"), out, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and f"{bad}: tensor {key!r} holds NaN or Inf values" in line and "zero" not in line, line
    assert not out.exists()


@pytest.mark.parametrize("role", ["expert", "base_model"])
def test_a_tensor_that_overflows_the_output_dtype_names_the_input_folder_and_tensor(llamas, tmp_path, capsys, role):
    """A weight of 1e5 cast to float16 (largest 65504) was 'tensor model.layers.1.block_sparse_moe.experts.1.w3.weight
    of the output has non-finite values': neither the folder nor the tensor the user can look at, nor why."""
    key = "model.layers.1.mlp.up_proj.weight" if role == "expert" else "model.layers.0.self_attn.q_proj.weight"
    bad = with_value(llamas["b"] if role == "expert" else llamas["a"], tmp_path / "bad", key, 1e5)
    out = tmp_path / "out"
    base, experts = (llamas["a"], (llamas["a"], bad)) if role == "expert" else (bad, (llamas["a"], llamas["b"]))
    config = moe_config(tmp_path / "c.yml", base, *experts)
    config.write_text(config.read_text() + "dtype: float16\n")
    rc, _, err = run_cli(capsys, "moe", config, out, "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and f"{bad}: tensor {key!r}" in line and "float16" in line and "100000" in line, line
    output = ("model.layers.1.block_sparse_moe.experts.1.w3.weight" if role == "expert"
              else "model.layers.0.self_attn.q_proj.weight")
    assert f"output tensor {output!r}" in line, line
    assert not out.exists()


# ------------------------------------------------------------------ moe: a base model without its LM head


@pytest.mark.parametrize("role", ["base_model", "expert"])
@pytest.mark.parametrize("gate_mode", ["random", "hidden"])
def test_a_llama_model_checkpoint_is_refused_saying_what_it_is(llamas, tmp_path, capsys, role, gate_mode):
    """A ``LlamaModel`` folder (no LM head, tensors ``layers.0...``) as an expert was "has no 'model.layers.0...'"; as
    the base it was written as a Mixtral with the base's dense MLPs, under names no Mixtral reads, and no LM head.
    mergekit-moe reads ``model.layers.N.mlp.*`` by name (its experts) and the head: it takes neither either."""
    bare = causal_lm(tmp_path / "bare", 7, head=False)
    base, experts = (bare, (llamas["a"], llamas["b"])) if role == "base_model" else (llamas["a"], (llamas["b"], bare))
    out = tmp_path / "out"
    rc, _, err = run_cli(capsys, "moe", moe_config(tmp_path / "c.yml", base, *experts, gate_mode=gate_mode), out,
                         "--progress", "none")
    line = one_error_line(err)
    assert rc == 2 and f"{bare} is a base model without its LM head (LlamaModel" in line, line
    assert "LlamaForCausalLM" in line and ("base_model" if role == "base_model" else "experts[1]") in line, line
    assert not out.exists()


# ------------------------------------------------------------------ BASE+ADAPTER: named as the user wrote it


@pytest.mark.parametrize("role", ["base_model", "expert"])
def test_moe_refuses_base_plus_adapter_in_one_line_as_mergekit_moe_takes_none(tmp_path, capsys, monkeypatch, role):
    """``source_model: base+ad`` was "base+ad: not a model folder (no config.json)", which it is not meant to be:
    mergekit-moe 0.1.5 parses BASE+ADAPTER but never merges it (it stops on "LoRA not merged - use .merged() to get
    a local path", with --lora-merge-cache too). Refused in one line that says so and how to get a folder."""
    pytest.importorskip("peft")
    from test_lora import LLAMA_ALL, make_adapter, make_base

    monkeypatch.chdir(tmp_path)
    mk.save_tokenizer(make_base(tmp_path / "base"), 96)
    mk.save_tokenizer(make_base(tmp_path / "other", seed=3), 96)
    make_adapter(tmp_path / "base", tmp_path / "ad", r=4, lora_alpha=8, target_modules=LLAMA_ALL)
    base, experts = ("base+ad", ("base", "other")) if role == "base_model" else ("base", ("other", "base+ad"))
    rc, _, err = run_cli(capsys, "moe", moe_config(tmp_path / "c.yml", base, *experts), "out", "--progress", "none",
                         "--lora-merge-cache", "cache")
    line = one_error_line(err)
    assert rc == 2 and "base+ad: a LoRA input (BASE+ADAPTER)" in line and "mergekit-moe" in line, line
    assert ("line 1:" if role == "base_model" else "line 6:") in line and "passthrough" in line, line
    assert not Path("out").exists() and not Path("cache").exists()



@pytest.mark.parametrize("how", ["merge", "run"])
def test_the_tokenizer_note_names_base_plus_adapter_as_written(tmp_path, capsys, monkeypatch, how):
    """'note: tokenizers: no tokenizer in /tmp/symmerge-lora-XXXX/base+ad-1a2b3c...': the folder the adapter was merged
    into, which the user never named and which is gone when the command ends."""
    pytest.importorskip("peft")
    from test_lora import LLAMA_ALL, make_adapter, make_base

    monkeypatch.chdir(tmp_path)
    make_base(tmp_path / "base")  # no tokenizer
    mk.save_tokenizer(make_base(tmp_path / "other", seed=3), 96)
    make_adapter(tmp_path / "base", tmp_path / "ad", r=4, lora_alpha=8, target_modules=LLAMA_ALL)
    flags = ["--progress", "none", "--lora-merge-cache", "cache"]
    if how == "merge":
        argv = ["merge", "base+ad", "other", "-o", "out", "--method", "average", "--align", "none", *flags]
    else:
        (tmp_path / "c.yml").write_text("models: [base+ad, other]\nmethod: average\nalign: none\nmode: stream\n")
        argv = ["run", "c.yml", "out", *flags]
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 0, err
    notes = [line for line in err.splitlines() if line.startswith("note: tokenizers:")]
    assert len(notes) == 1 and "no tokenizer in base+ad;" in notes[0], err
    assert "cache" not in notes[0] and "symmerge-lora" not in notes[0], notes[0]


def test_an_output_inside_the_adapter_of_a_config_s_base_plus_adapter_is_refused(tmp_path, capsys, monkeypatch):
    pytest.importorskip("peft")
    from test_lora import LLAMA_ALL, make_adapter, make_base

    monkeypatch.chdir(tmp_path)
    make_base(tmp_path / "base")
    make_base(tmp_path / "other", seed=3)
    make_adapter(tmp_path / "base", tmp_path / "ad", r=4, lora_alpha=8, target_modules=LLAMA_ALL)
    before = snapshot(tmp_path / "ad")
    line = one_error_line(run_cli(capsys, "run", linear_config(tmp_path / "c.yml", "base+ad", "other"), "ad/merged",
                                  "--progress", "none")[2])
    assert "inside the input folder" in line and str(tmp_path / "ad") in line, line
    assert snapshot(tmp_path / "ad") == before


# ------------------------------------------------------------------ weights: read and checked where written


@pytest.mark.parametrize("value,words", [
    ("abc", "models[0].parameters.weight: a number expected, got 'abc'"),
    ("true", "models[0].parameters.weight: a number expected, got True"),
    (".nan", "models[0].parameters.weight: method 'linear': parameter 'weight' must be a finite number"),
    ("[1, .inf]", "models[0].parameters.weight: method 'linear': parameter 'weight' must be a finite number"),
])
def test_a_bad_weight_names_its_key_and_line(llamas, tmp_path, capsys, value, words):
    """A weight is a finite number, read like every declared parameter: the error names the file, the weight's line
    and key. Before, 'abc' and NaN were named by the first tensor (at line 1) and ``true`` merged as 1."""
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: linear\ndtype: float32\nmodels:\n  - model: {llamas['a']}\n    parameters:\n"
                      f"      weight: {value}\n  - model: {llamas['b']}\n    parameters: {{weight: 1}}\n")
    rc, _, err = run_cli(capsys, "run", config, tmp_path / "out", "--progress", "none")
    err = one_error_line(err)
    assert rc == 2
    assert f"c.yml line 6: {words}" in err, err  # line 6: the weight's own
    assert not (tmp_path / "out").exists()


def test_linear_weights_summing_to_zero_name_the_config_and_tensor(llamas, tmp_path, capsys):
    """The method's own weight rule (linear, normalize: the sum divides) is checked with each step's arguments, so
    the error names the file and the first tensor as every other value checked across a step does."""
    config = tmp_path / "z.yml"
    config.write_text(f"merge_method: linear\ndtype: float32\nmodels:\n  - model: {llamas['a']}\n"
                      f"    parameters: {{weight: 1}}\n  - model: {llamas['b']}\n    parameters: {{weight: -1}}\n")
    rc, _, err = run_cli(capsys, "run", config, tmp_path / "out", "--progress", "none")
    err = one_error_line(err)
    assert rc == 2
    assert "z.yml line 3: model.embed_tokens.weight: weights [1.0, -1.0] sum to 0" in err, err
    config.write_text(config.read_text().replace("merge_method: linear", "merge_method: linear\n"
                                                 "parameters: {normalize: false}"))
    assert run_cli(capsys, "run", config, tmp_path / "out", "--progress", "none")[0] == 0  # no division


def test_a_tokenizer_source_without_a_tokenizer_is_one_warning(llamas, tmp_path, capsys):
    """``tokenizer_source: base`` whose base has no tokenizer files: the output has none, and a warning naming the
    key says so (it was silent); a source with a tokenizer gives no warning."""
    import shutil

    from symmerge.io.tokenizers import TOKENIZER_FILES

    bare = shutil.copytree(llamas["a"], tmp_path / "bare")
    for name in TOKENIZER_FILES:
        (bare / name).unlink(missing_ok=True)
    for base, warned in ((bare, True), (llamas["a"], False)):
        config = tmp_path / "t.yml"
        config.write_text(f"merge_method: task_arithmetic\nbase_model: {base}\ndtype: float32\nmodels:\n"
                          f"  - model: {llamas['b']}\n    parameters: {{weight: 1}}\ntokenizer_source: base\n")
        out = tmp_path / f"out-{warned}"
        rc, _, err = run_cli(capsys, "run", config, out, "--progress", "none")
        assert rc == 0, err
        lines = [x for x in err.splitlines() if "tokenizer files" in x]
        assert lines == ([f"symmerge: warning: {config} line 7: tokenizer_source: '{base}' has no tokenizer files: "
                          "the output has no tokenizer (name a source that has one)"] if warned else []), err
        assert (out / "tokenizer.json").is_file() != warned
