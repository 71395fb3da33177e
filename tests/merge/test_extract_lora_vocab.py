"""``extract-lora`` of a fine-tune whose vocabulary grew (added tokens): its embeddings and LM head are saved whole,
at the fine-tune's size, which PEFT refuses on the base as it is ("size mismatch … [160, 64] … [128, 64]"); the note
now says to resize the base's embeddings first, and the adapter then loads and reproduces the fine-tune's
embeddings."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from factories import make_model

peft = pytest.importorskip("peft")


def test_a_grown_vocabulary_is_saved_whole_and_loads_after_a_resize(tmp_path, capsys):
    import transformers

    base = make_model("llama", head=True, dtype=torch.float32, seed=0)
    base.save_pretrained(tmp_path / "base")
    ft = make_model("llama", head=True, dtype=torch.float32, seed=0)
    grown = base.config.vocab_size + 32
    ft.resize_token_embeddings(grown)
    with torch.no_grad():
        for p in ft.parameters():
            p.add_(0.01 * torch.randn_like(p))
    ft.save_pretrained(tmp_path / "ft")
    capsys.readouterr()
    assert run_cli("extract-lora", tmp_path / "ft", tmp_path / "base", "-o", tmp_path / "ad", "--rank", "2") == 0
    out = capsys.readouterr()
    assert f"base.resize_token_embeddings({grown})" in out.err + out.out
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    with pytest.raises(RuntimeError, match="size mismatch"):
        peft.PeftModel.from_pretrained(model, tmp_path / "ad")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    model.resize_token_embeddings(grown)
    merged = peft.PeftModel.from_pretrained(model, tmp_path / "ad").merge_and_unload()
    assert torch.equal(merged.get_input_embeddings().weight, ft.get_input_embeddings().weight)
