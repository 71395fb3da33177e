"""The streamed executor (:func:`symmerge.merge.executor.execute_steps`): a list of TensorSteps whose sources
name other keys and models than the output, per-step weights and parameters, kept (copied) tensors, an output
dtype and config of its own, side files from a chosen folder; checked before anything is written."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from symmerge.errors import SymmergeError
from symmerge.merge import get_method
from symmerge.merge.executor import OutputFolder, execute_steps
from symmerge.merge.steps import TensorSource, TensorStep, uniform_steps


def llama(seed: int, layers: int = 2):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("executor")
    out = []
    for i in range(2):
        f = root / f"m{i}"
        llama(i).save_pretrained(str(f))
        (f / "tokenizer_config.json").write_text("{}\n")
        out.append(f)
    return out


def tensors(folder) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_steps_with_renamed_sources_weights_dtype_and_config(folders, tmp_path):
    a, b = tensors(folders[0]), tensors(folders[1])
    keys = list(LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1)).state_dict())
    # a one-layer output: its layer 0 merged from layer 1 of model 0 and layer 0 of model 1, weighted 3:1
    steps = []
    for k in keys:
        src0 = k.replace("layers.0.", "layers.1.")
        steps.append(TensorStep(k, (TensorSource(0, src0), TensorSource(1, k)), weights=(3.0, 1.0)))
    steps[-1] = TensorStep(keys[-1], (TensorSource(1, keys[-1]),), merge=False)  # lm_head kept from model 1
    config = json.loads((folders[0] / "config.json").read_text())
    config.update(num_hidden_layers=1, torch_dtype="bfloat16")
    facts = execute_steps(folders, steps, get_method("average"), tmp_path / "out",
                          OutputFolder(config=config, dtype=torch.bfloat16, side_files_from=folders[1]), progress=False)
    got = tensors(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_hidden_layers"] == 1
    assert "tokenizer_config.json" in facts["side_files"]["copied"]
    assert facts["tensors"] == len(keys) and facts["bytes_written"] > 0
    assert set(got) == set(keys)
    for k in keys[:-1]:
        src0 = k.replace("layers.0.", "layers.1.")
        want = ((a[src0].double() * 0.75 + b[k].double() * 0.25).float()).to(torch.bfloat16)
        assert got[k].dtype == torch.bfloat16
        assert torch.equal(got[k], want), k
    assert torch.equal(got[keys[-1]], b[keys[-1]].to(torch.bfloat16))
    LlamaForCausalLM.from_pretrained(str(tmp_path / "out"))  # loads


def test_uniform_steps_equal_the_plain_merge(folders, tmp_path):
    keys = list(tensors(folders[0]))
    facts = execute_steps(folders, uniform_steps(keys, 2), get_method("average"), tmp_path / "out",
                          OutputFolder(side_files_from=folders[0]), progress=False)
    a, b = tensors(folders[0]), tensors(folders[1])
    got = tensors(tmp_path / "out")
    for k in keys:
        assert torch.equal(got[k], ((a[k].double() + b[k].double()) / 2).to(a[k].dtype)), k
    assert set(facts["pairwise_sq"]) == {(0, 1)} and set(facts["result_sq"]) == {0, 1}


@pytest.mark.parametrize("bad,match", [
    (TensorStep("x", (TensorSource(0, "nope"),)), "has no tensor 'nope'"),
    (TensorStep("x", (TensorSource(2, "model.norm.weight"),)), "source model 2 out of range"),
    (TensorStep("x", (TensorSource(0, "model.norm.weight"), TensorSource(1, "lm_head.weight"))), "shapes differ"),
])
def test_bad_steps_refused_before_anything_is_written(folders, tmp_path, bad, match):
    with pytest.raises(SymmergeError, match=match):
        execute_steps(folders, [bad], get_method("average"), tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()
