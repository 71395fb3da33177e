"""extract-lora on a fine-tune whose biased layers changed their bias while other targeted layers have none
(Qwen2: q/k/v biased, o_proj and the MLP not): the adapter PEFT loads has no missing key, merges with
``merge_and_unload`` and reproduces the fine-tune, in every dtype."""

from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")

from conftest import add_noise  # noqa: E402
from factories import make_model  # noqa: E402

from symmerge.merge.extract_lora import ExtractOptions, extract_lora  # noqa: E402


def _pair(tmp_path, family, dtype):
    base = make_model(family, head=True, dtype=torch.float32, seed=0)
    ft = make_model(family, head=True, dtype=torch.float32, seed=0)
    ft.load_state_dict(add_noise(base.state_dict(), 0.05, seed=1)[0])
    base.to(dtype).save_pretrained(str(tmp_path / "base"))
    ft.to(dtype).save_pretrained(str(tmp_path / "ft"))
    return type(base)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("embed_lora", [False, True])
def test_bias_changes_beside_unbiased_layers_load_and_merge_in_peft(tmp_path, dtype, embed_lora):
    import peft

    cls = _pair(tmp_path, "qwen2", dtype)
    extract_lora(tmp_path / "ft", tmp_path / "base", tmp_path / "out",
                 ExtractOptions(rank=1000, embed_lora=embed_lora, write_model_card=False))
    lines: list = []

    class H(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    h = H()
    logging.getLogger("peft").addHandler(h)
    try:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            model = peft.PeftModel.from_pretrained(cls.from_pretrained(str(tmp_path / "base")).float(),
                                                   str(tmp_path / "out"))
    finally:
        logging.getLogger("peft").removeHandler(h)
    said = [x for x in lines + [str(m.message) for m in w] if "bias" in x or "missing" in x.lower()]
    assert not said, said
    ft = cls.from_pretrained(str(tmp_path / "ft")).float().eval()
    ids = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        want = ft(input_ids=ids).logits
        got = model.eval()(input_ids=ids).logits
        merged = model.merge_and_unload()(input_ids=ids).logits
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    scale = want.abs().max()
    assert (got - want).abs().max() / scale < bound
    assert (merged - want).abs().max() / scale < bound
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["lora_bias"] is False and config["bias"] == "lora_only"


def test_bias_changes_on_layers_that_all_have_a_bias_stay_lora_bias(tmp_path):
    """llama-bias: every targeted layer has a bias: the change stays ``lora_B.bias`` (mergekit's tensor)."""
    _pair(tmp_path, "llama-bias", torch.float32)
    report = extract_lora(tmp_path / "ft", tmp_path / "base", tmp_path / "out",
                          ExtractOptions(rank=4, write_model_card=False))
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert report["lora_bias"] and config["lora_bias"] is True and config["bias"] == "none"


def test_the_lora_only_adapter_as_base_plus_adapter_gives_the_finetune(tmp_path):
    """symmerge's own reader of ``BASE+ADAPTER`` takes the carried biases as PEFT does."""
    from safetensors.torch import load_file

    from symmerge.io.lora import resolve_input

    _pair(tmp_path, "qwen2", torch.float32)
    extract_lora(tmp_path / "ft", tmp_path / "base", tmp_path / "out", ExtractOptions(rank=1000, write_model_card=False))
    merged = load_file(str(next(Path(resolve_input(f"{tmp_path / 'base'}+{tmp_path / 'out'}")).glob("*.safetensors"))))
    ft = load_file(str(tmp_path / "ft" / "model.safetensors"))
    assert merged.keys() == ft.keys()
    for k, v in ft.items():
        assert torch.allclose(merged[k], v, rtol=0, atol=1e-5 * v.abs().max().item()), k
