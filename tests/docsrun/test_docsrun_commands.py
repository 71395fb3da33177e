"""Commands of docs/moe.md, docs/configs.md and docs/lora.md run as written that did not do what the docs say,
each test the doc's promise on tiny real Llama / Qwen2 checkpoints (written as strict xfails when found, turned on
with their fixes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

import mergekit_oracle as mk
from conftest import run_cli

pytestmark = pytest.mark.usefixtures("single_thread")


def _moe_config(path: Path, base: Path, experts: list[Path], **extra) -> Path:
    doc = {"base_model": str(base), "gate_mode": "hidden", "dtype": "float32",
           "experts": [{"source_model": str(e), "positive_prompts": [f"w{5 + 3 * i} w{6 + 3 * i}"]}
                       for i, e in enumerate(experts)], **extra}
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.mark.parametrize("flag,value", [("--match", "activations"),
                                        ("--symmetries", "ffn")])
def test_moe_alignment_flag_without_align_is_one_error(tmp_path, capsys, flag, value):
    base, experts = mk.family(tmp_path / "m", n=2, layers=2)
    config = _moe_config(tmp_path / "moe.yml", base, experts)
    capsys.readouterr()
    code = run_cli("moe", config, tmp_path / "out", flag, value, "--progress", "none")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not (tmp_path / "out").exists()
    assert len(err) == 1 and flag in err[0] and "--align" in err[0], err


def test_run_refuses_out_inside_an_adapter_before_merging_it(tmp_path, capsys):
    pytest.importorskip("peft")
    from test_lora import make_adapter, make_base

    base = make_base(tmp_path / "base")
    adapter = make_adapter(base, tmp_path / "adapter", target_modules=["q_proj", "v_proj"], r=2)
    config = tmp_path / "lin.yml"
    config.write_text(yaml.safe_dump({"merge_method": "linear", "models": [
        {"model": f"{base}+{adapter}", "parameters": {"weight": 0.5}},
        {"model": str(base), "parameters": {"weight": 0.5}}]}))
    cache = tmp_path / "cache"
    capsys.readouterr()
    code = run_cli("run", config, adapter / "out", "--lora-merge-cache", cache, "--progress", "none")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "inside the input folder" in err[0], err
    assert not (adapter / "out").exists()
    assert not cache.exists() or not any(cache.iterdir()), "the adapter was merged before the refusal"


def _qwen2_folder(path: Path, seed: int) -> Path:
    """A tiny Qwen2 whose tokenizer (read as a Qwen2Tokenizer under transformers 5) has a pad token, added at
    id 128, beyond the model's 128 embedding rows, and a BOS token inside them."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(path))
    mk.save_tokenizer(path)
    return path


def test_moe_hidden_pads_with_bos_as_mergekit(tmp_path):
    from transformers import AutoTokenizer

    base = _qwen2_folder(tmp_path / "base", 0)
    experts = [_qwen2_folder(tmp_path / f"e{i}", i + 1) for i in range(2)]
    tok = AutoTokenizer.from_pretrained(str(base))
    assert tok.pad_token_id is not None and tok.pad_token_id >= 128 and tok.bos_token_id < 128
    assert len(tok("</s> </s>")["input_ids"]) > len(tok("w9")["input_ids"])  # one batch of two lengths: padded
    config = tmp_path / "moe.yml"
    config.write_text(yaml.safe_dump({"base_model": str(base), "gate_mode": "hidden", "dtype": "float32", "experts": [
        {"source_model": str(experts[0]), "positive_prompts": ["</s> </s>", "w9"]},
        {"source_model": str(experts[1]), "positive_prompts": ["w20 w21"]}],
        "shared_experts": [{"source_model": str(base), "positive_prompts": ["w30"], "residual_scale": 0.1}]},
        sort_keys=False))
    assert run_cli("moe", config, tmp_path / "out", "--progress", "none") == 0


def test_extract_lora_with_every_layer_left_out_is_refused(tmp_path, capsys):
    peft = pytest.importorskip("peft")
    from test_lora import make_base
    from transformers import AutoModelForCausalLM

    base = make_base(tmp_path / "base")
    model = AutoModelForCausalLM.from_pretrained(str(base))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    model.save_pretrained(str(tmp_path / "ft"))
    out = tmp_path / "out"
    capsys.readouterr()
    code = run_cli("extract-lora", tmp_path / "ft", base, "-o", out, "--rank", 4, "--sv-epsilon", 1e9,
                   "--progress", "none")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not out.exists() and len(err) == 1, err  # refused: an adapter PEFT could not load
    assert "every LoRA module was left out, no singular value above --sv-epsilon 1e+09" in err[0], err
    assert run_cli("extract-lora", tmp_path / "ft", base, "-o", out, "--rank", 4, "--progress", "none") == 0
    peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(base)), str(out))  # without it: loads
    capsys.readouterr()
    assert run_cli("extract-lora", base, base, "-o", tmp_path / "same", "--sv-epsilon", 1, "--progress", "none") == 2
    assert "the fine-tune equals the base" in capsys.readouterr().err
