"""mergekit's named modules (``modules: {encoder: ..., decoder: ..., shared: ...}``) on a real multi-module
``transformers`` architecture, T5ForConditionalGeneration (flan-T5's gated-GELU blocks, tiny random configs):
each module merged with its own models, slices and parameters, the same tensors as mergekit 0.1.5 within
1e-6 in float32 (its oracle runs in the venv that has mergekit); a config without ``modules:`` merges every
module with the document's models, as mergekit; the refusals are one line."""

from __future__ import annotations

import pytest
import torch

import mergekit_oracle as mo
from conftest import run_cli

needs_mergekit = pytest.mark.skipif(not mo.available(), reason="mergekit is not installed in this venv")


@pytest.fixture(scope="module")
def t5s(tmp_path_factory):
    """(base, A, B): a tiny T5 (2 encoder blocks, 3 decoder blocks, untied LM head) and two noisy copies."""
    from transformers import T5Config, T5ForConditionalGeneration

    root = tmp_path_factory.mktemp("t5")
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=3, num_heads=4,
                   feed_forward_proj="gated-gelu", tie_word_embeddings=False, decoder_start_token_id=0)
    model = T5ForConditionalGeneration(cfg)
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = []
    for i, name in enumerate(("base", "a", "b")):
        g = torch.Generator().manual_seed(i)
        model.load_state_dict({k: v + 0.02 * i * torch.randn(v.shape, generator=g) for k, v in sd.items()})
        model.save_pretrained(str(root / name))
        mo.save_tokenizer(root / name)
        out.append(root / name)
    return out


MODULES = """merge_method: linear
parameters:
  normalize: true
modules:
  encoder:
    models:
      - model: {a}
        parameters: {{weight: 0.3}}
      - model: {b}
        parameters: {{weight: 0.7}}
  decoder:
    slices:
      - sources:
          - model: {a}
            layer_range: [0, 2]
            parameters: {{weight: [1.0, 0.2]}}
          - model: {b}
            layer_range: [0, 2]
            parameters: {{weight: [0.0, 0.8]}}
      - sources:
          - model: {b}
            layer_range: [1, 3]
            parameters: {{weight: 1.0}}
          - model: {a}
            layer_range: [1, 3]
            parameters: {{weight: [0.5, 0.25]}}
  shared:
    models:
      - model: {a}
        parameters: {{weight: 0.9}}
      - model: {b}
        parameters: {{weight: 0.1}}
dtype: float32
"""
WHOLE = """merge_method: ties
base_model: {base}
models:
  - model: {a}
    parameters: {{weight: 0.6, density: 0.5}}
  - model: {b}
    parameters: {{weight: 0.4, density: 0.7}}
dtype: float32
"""


def _ours(text, t5s, tmp_path):
    base, a, b = t5s
    cfg = tmp_path / "merge.yml"
    cfg.write_text(text.format(base=base, a=a, b=b))
    out = tmp_path / "symmerge"
    assert run_cli("run", cfg, out, "--progress", "none") == 0
    return out, text.format(base=base, a=a, b=b)


@pytest.mark.parametrize("text", [MODULES, WHOLE], ids=["named-modules", "models-to-every-module"])
def test_t5_modules_merge_and_load(t5s, tmp_path, text):
    """Every module merged (the decoder's two overlapping slices make 4 decoder blocks), and the result is a
    T5 that transformers loads whole (no missing, no unexpected weights) and runs."""
    from transformers import T5ForConditionalGeneration

    out, _ = _ours(text, t5s, tmp_path)
    got = mo.tensors(out)
    decoder_blocks = {int(k.split(".")[2]) for k in got if k.startswith("decoder.block.")}
    assert decoder_blocks == set(range(4 if text is MODULES else 3))
    assert mo.config_of(out)["num_decoder_layers"] == len(decoder_blocks)
    assert set(got) >= {"shared.weight", "encoder.final_layer_norm.weight", "decoder.final_layer_norm.weight"}
    model, info = T5ForConditionalGeneration.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    ids = torch.tensor([[5, 6, 7, 1]])
    assert torch.isfinite(model(input_ids=ids, decoder_input_ids=ids).logits).all()


def test_named_module_parameters_are_the_modules_own(t5s, tmp_path):
    """Brute force: each module's tensors are its own weighted average (normalized), the gradient's weights at
    each layer's place in its slice; the relative attention bias only where its input block has one."""
    base, a, b = t5s
    out, _ = _ours(MODULES, t5s, tmp_path)
    got, ta, tb = mo.tensors(out), mo.tensors(a), mo.tensors(b)

    def avg(name_a, wa, name_b, wb):
        return (wa * ta[name_a] + wb * tb[name_b]) / (wa + wb)

    k = "encoder.block.1.layer.1.DenseReluDense.wi_0.weight"
    torch.testing.assert_close(got[k], avg(k, 0.3, k, 0.7), rtol=0, atol=1e-6)
    torch.testing.assert_close(got["shared.weight"], avg("shared.weight", 0.9, "shared.weight", 0.1), rtol=0,
                               atol=1e-6)
    q = "decoder.block.{}.layer.0.SelfAttention.q.weight"
    # slice 1 (A, B blocks 0..1): t = 0, 1; slice 2 (B, A blocks 1..2): t = 0, 1
    torch.testing.assert_close(got[q.format(0)], avg(q.format(0), 1.0, q.format(0), 0.0), rtol=0, atol=1e-6)
    torch.testing.assert_close(got[q.format(1)], avg(q.format(1), 0.2, q.format(1), 0.8), rtol=0, atol=1e-6)
    torch.testing.assert_close(got[q.format(2)], avg(q.format(1), 0.5, q.format(1), 1.0), rtol=0, atol=1e-6)
    torch.testing.assert_close(got[q.format(3)], avg(q.format(2), 0.25, q.format(2), 1.0), rtol=0, atol=1e-6)
    bias = "decoder.block.{}.layer.0.SelfAttention.relative_attention_bias.weight"
    assert bias.format(0) in got and not any(bias.format(i) in got for i in (1, 2, 3))


@needs_mergekit
@pytest.mark.parametrize("text", [MODULES, WHOLE], ids=["named-modules", "models-to-every-module"])
def test_t5_modules_equal_mergekit(t5s, tmp_path, text):
    out, resolved = _ours(text, t5s, tmp_path)
    ours = mo.tensors(out)
    theirs = mo.tensors(mo.run_mergekit(resolved, tmp_path / "mergekit"))
    assert sorted(ours) == sorted(theirs)
    worst = max(float((ours[k].double() - theirs[k].double()).abs().max()) for k in theirs)
    assert worst <= 1e-6, worst
    assert mo.config_of(out)["num_decoder_layers"] == mo.config_of(tmp_path / "mergekit")["num_decoder_layers"]


BAD = [
    ("merge_method: linear\nparameters: {{weight: 1}}\nmodules:\n  encoder: {{models: [{a}, {b}]}}\n"
     "  decoder: {{models: [{a}, {b}]}}\n", "line 3: 'modules' gives no 'shared': T5ForConditionalGeneration has "
     "the modules encoder, decoder, shared"),
    ("merge_method: linear\nparameters: {{weight: 1}}\nmodules:\n  default: {{models: [{a}, {b}]}}\n"
     "  encoder: {{models: [{a}, {b}]}}\n", "T5ForConditionalGeneration has no module 'default' (its modules: "
     "encoder, decoder, shared)"),
    ("merge_method: linear\nparameters: {{weight: 1}}\nslices:\n  - sources:\n      - {{model: {a}, layer_range: [0, 1]}}\n"
     "      - {{model: {b}, layer_range: [0, 1]}}\n", "line 3: T5ForConditionalGeneration is a model of several modules "
     "(encoder, decoder, shared): its slices go under 'modules: NAME: slices:'"),
]


@pytest.mark.parametrize("text,message", BAD, ids=["a-module-left-out", "default-on-t5", "slices-without-modules"])
def test_bad_named_modules_one_line(t5s, tmp_path, capsys, text, message):
    base, a, b = t5s
    cfg = tmp_path / "bad.yml"
    cfg.write_text(text.format(a=a, b=b))
    assert run_cli("run", cfg, tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("symmerge: error:") == 1 and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()
