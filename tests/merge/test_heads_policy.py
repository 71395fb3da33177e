"""``--heads auto`` (the default): a language model's untied head — its rows are the vocabulary — is merged
like the body (as mergekit does); a task head is kept from ``--head-from``. In memory and streamed alike."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertConfig, BertForSequenceClassification, LlamaConfig, LlamaForCausalLM

from symmerge.cli import main
from symmerge.errors import SymmergeError
from symmerge.merge.fuse import MergeOptions
from symmerge.merge.heads import head_policy


def _tensors(folder):
    return load_file(str(folder / "model.safetensors"))


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamas")
    out = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                             max_position_embeddings=64)
        LlamaForCausalLM(config).save_pretrained(str(root / f"m{seed}"))
        out.append(root / f"m{seed}")
    return out


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_an_untied_lm_head_is_merged_by_default(llamas, tmp_path, mode, capsys):
    a, b = (_tensors(f) for f in llamas)
    out = tmp_path / "auto"
    assert main(["merge", *map(str, llamas), "--method", "average", "--align", "none", "--mode", mode,
                 "--progress", "none", "-o", str(out)]) == 0
    got = _tensors(out)
    torch.testing.assert_close(got["lm_head.weight"], (a["lm_head.weight"] + b["lm_head.weight"]) / 2,
                               rtol=0, atol=1e-7)
    head = json.loads((out / "symmerge_report.json").read_text())["head"]
    assert head["policy"] == "merge" and head["requested"] == "auto" and head["keys"] == ["lm_head.weight"]
    kept = tmp_path / "keep"
    assert main(["merge", *map(str, llamas), "--method", "average", "--align", "none", "--mode", mode,
                 "--heads", "keep", "--head-from", "1", "--progress", "none", "-o", str(kept)]) == 0
    assert torch.equal(_tensors(kept)["lm_head.weight"], b["lm_head.weight"])
    head = json.loads((kept / "symmerge_report.json").read_text())["head"]
    assert head["policy"] == "keep" and head["requested"] == "keep" and head["from_index"] == 1


def test_a_task_head_is_kept_by_default(tmp_path):
    folders = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        BertForSequenceClassification(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                 num_attention_heads=4, intermediate_size=48,
                                                 max_position_embeddings=32)).save_pretrained(str(tmp_path / f"b{seed}"))
        folders.append(tmp_path / f"b{seed}")
    out = tmp_path / "out"
    assert main(["merge", *map(str, folders), "--method", "average", "--align", "none", "--progress", "none",
                 "-o", str(out)]) == 0
    assert torch.equal(_tensors(out)["classifier.weight"], _tensors(folders[0])["classifier.weight"])
    head = json.loads((out / "symmerge_report.json").read_text())["head"]
    assert head["policy"] == "keep" and head["requested"] == "auto"


def test_head_policy_rule():
    assert MergeOptions().heads == "auto"
    assert head_policy("auto", LlamaForCausalLM) == "merge"
    assert head_policy("auto", BertForSequenceClassification) == "keep"
    assert head_policy("keep", LlamaForCausalLM) == "keep" and head_policy("merge", BertForSequenceClassification) == "merge"
    with pytest.raises(SymmergeError, match="unknown head policy"):
        head_policy("both", LlamaForCausalLM)
