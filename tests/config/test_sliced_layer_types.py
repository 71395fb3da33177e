"""A sliced merge keeps config.json's lists of one entry per layer in step with its layers: a Qwen2 or Gemma2
frankenmerge (slices [0, 3] + [1, 4]) or prune (slice [0, 2]) wrote the new ``num_hidden_layers`` beside the old
``layer_types``, and ``from_pretrained`` refused the output ("num_hidden_layers (6) must be equal to the number of
layer_types (4)"). Each output layer now takes its source layer's entry (a sliding-window layer stays one), and the
output loads and computes the function of the layers it was cut from."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as T

from conftest import run_cli

TYPES = ["sliding_attention", "full_attention", "full_attention", "sliding_attention"]


def _model(family: str, seed: int):
    common = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, layer_types=TYPES, sliding_window=4)
    config = T.Gemma2Config(head_dim=8, **common) if family == "gemma2" else \
        T.Qwen2Config(use_sliding_window=True, max_window_layers=2, **common)
    torch.manual_seed(seed)
    return (T.Gemma2ForCausalLM if family == "gemma2" else T.Qwen2ForCausalLM)(config).eval()


@pytest.mark.parametrize("family", ["gemma2", "qwen2"])
@pytest.mark.parametrize("ranges,origins", [([(0, 3), (1, 4)], [0, 1, 2, 1, 2, 3]), ([(0, 2)], [0, 1]),
                                             ([(2, 4), (0, 1)], [2, 3, 0])])
def test_a_sliced_merge_keeps_each_layer_s_type(tmp_path, family, ranges, origins):
    model = _model(family, 0)
    model.save_pretrained(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["layer_types"] == TYPES
    slices = "".join(f"  - sources:\n      - model: {tmp_path / 'm'}\n        layer_range: [{a}, {b}]\n"
                     for a, b in ranges)
    (tmp_path / "c.yml").write_text(f"slices:\n{slices}merge_method: passthrough\ndtype: float32\n")
    assert run_cli("run", tmp_path / "c.yml", tmp_path / "out", "-q") == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_hidden_layers"] == len(origins)
    assert config["layer_types"] == [TYPES[i] for i in origins]
    out = type(model).from_pretrained(tmp_path / "out").eval()  # refused before: the lengths differed
    # the same function as a model built here from the source's layers in that order (with their own types)
    config = type(model.config)(**{**model.config.to_dict(), "num_hidden_layers": len(origins),
                                   "layer_types": [TYPES[i] for i in origins]})
    built = type(model)(config).eval()
    source = model.state_dict()
    state = {}
    for k in built.state_dict():
        parts = k.split(".")
        if k.startswith("model.layers."):
            parts[2] = str(origins[int(parts[2])])
        state[k] = source[".".join(parts)]
    built.load_state_dict(state)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = built(ids, use_cache=False).logits, out(ids, use_cache=False).logits
    assert torch.equal(got, want)


def test_a_layer_range_written_as_text_is_read_as_numbers(tmp_path, capsys):
    """``layer_range: ["0", "2"]`` was refused; mergekit 0.1.5 reads the numbers (a text that is not a whole number
    is still one error)."""
    _model("qwen2", 0).save_pretrained(tmp_path / "m")
    for rng, code in (('["0", "2"]', 0), ('["0", "two"]', 2)):
        (tmp_path / "c.yml").write_text(f"slices:\n  - sources:\n      - model: {tmp_path / 'm'}\n        layer_range: "
                                        f"{rng}\nmerge_method: passthrough\n")
        out = tmp_path / f"out{code}"
        assert run_cli("run", tmp_path / "c.yml", out, "-q") == code
    assert json.loads((tmp_path / "out0" / "config.json").read_text())["num_hidden_layers"] == 2
    assert "'layer_range' is [a, b]" in capsys.readouterr().err and not (tmp_path / "out2").exists()
