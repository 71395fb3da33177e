"""extract-lora on sequence classifiers: PEFT's sequence-classification model saves every module whose name ends
in ``classifier`` / ``score`` whole (DistilBERT's ``pre_classifier`` too), so the adapter saves them whole: before,
a LoRA of ``classifier`` stopped ``PeftModel.from_pretrained`` with a KeyError (BERT, RoBERTa) or a TypeError
(DistilBERT)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("peft")

from conftest import add_noise, make_inputs  # noqa: E402
from factories import make_model  # noqa: E402

from symmerge.merge.extract_lora import ExtractOptions, extract_lora  # noqa: E402


@pytest.mark.parametrize("family, whole", [("bert", ["classifier"]), ("roberta", ["classifier"]),
                                           ("distilbert", ["classifier", "pre_classifier"])])
def test_sequence_classifiers_load_in_peft_and_reproduce_the_finetune(tmp_path, family, whole):
    import peft

    base = make_model(family, head=True, dtype=torch.float32, seed=0)
    ft = make_model(family, head=True, dtype=torch.float32, seed=0)
    ft.load_state_dict(add_noise(base.state_dict(), 0.05, seed=1)[0])
    base.save_pretrained(str(tmp_path / "base"))
    ft.save_pretrained(str(tmp_path / "ft"))
    extract_lora(tmp_path / "ft", tmp_path / "base", tmp_path / "out", ExtractOptions(rank=1000,
                                                                                     write_model_card=False))
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert set(whole) <= set(config["modules_to_save"]) and not set(whole) & set(config["target_modules"])
    model = peft.PeftModel.from_pretrained(type(base).from_pretrained(str(tmp_path / "base")), str(tmp_path / "out"))
    inputs = make_inputs(ft)
    with torch.no_grad():
        want, got = ft.eval()(**inputs).logits, model.eval()(**inputs).logits
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
