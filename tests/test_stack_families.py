"""Families with several layer stacks (the generic kind suite of test_groups.py covers their groups):

* T5: why self-attention keeps its heads (the relative position bias of layer 0 serves every layer of a
  stack), the one residual group of both streams (the shared embedding), the encoder's final norm folded
  into every decoder layer's cross-attention, the layer numbering through the stacks, the function
  verified on the logits, and merge / barrier end to end on saved checkpoints.
"""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_inputs, output_rel_diff, run_cli, with_weights, write_tokenizer
from factories import disguised, make_model
from symmerge.core.apply import apply, canonicalize, random_elements
from symmerge.pipeline.align import align, instances_for

pytestmark = pytest.mark.usefixtures("single_thread")

ATTN = "encoder.block.{i}.layer.0.SelfAttention"


def _permute_heads(sd: dict, module: str, perm: torch.Tensor, d_head: int, bias: bool) -> dict:
    """Whole heads of ``module``'s q, k, v rows and o columns moved by ``perm`` (and, with ``bias``, the
    relative attention bias's columns)."""
    out = dict(sd)
    rows = (perm[:, None] * d_head + torch.arange(d_head)).reshape(-1)
    for x in "qkv":
        out[f"{module}.{x}.weight"] = sd[f"{module}.{x}.weight"][rows]
    out[f"{module}.o.weight"] = sd[f"{module}.o.weight"][:, rows]
    key = f"{module}.relative_attention_bias.weight"
    if bias and key in sd:
        out[key] = sd[key][:, perm]
    return out


@pytest.mark.parametrize("family", ["t5", "t5-relu"])
def test_t5_self_attention_heads_move_only_together_through_a_stack(family, fp64_rmsnorm):
    """Permuting the heads of every encoder layer and the bias columns by one permutation preserves the
    function; the same permutation in one layer only does not (the bias of layer 0 is added in every
    layer): hence no per-layer head group for self-attention. The bias is live in the test config."""
    model = make_model(family, head=True)
    cfg, sd, inputs = model.config, model.state_dict(), make_inputs(model)
    perm = torch.tensor([2, 0, 1])
    together = sd
    for i in range(cfg.num_layers):
        together = _permute_heads(together, ATTN.format(i=i), perm, cfg.d_kv, bias=True)
    assert output_rel_diff(model, with_weights(model, together), inputs) <= 1e-10
    for layer in range(cfg.num_layers):  # one layer (with the bias where it lives): broken
        one = _permute_heads(sd, ATTN.format(i=layer), perm, cfg.d_kv, bias=True)
        assert output_rel_diff(model, with_weights(model, one), inputs) > 1e-3
    key = ATTN.format(i=0) + ".relative_attention_bias.weight"
    assert output_rel_diff(model, with_weights(model, {**sd, key: torch.zeros_like(sd[key])}), inputs) > 1e-3
    _, instances = instances_for(model)
    heads = [i for i in instances if i.group.symmetry == "heads"]
    assert heads and all(".cross." in i.name for i in heads)  # cross-attention only


def test_t5_cross_attention_heads_are_permuted_per_layer(fp64_rmsnorm):
    """Cross-attention has no position bias: a different head permutation in each decoder layer
    preserves the function; Q and K moved without V and O (half a head move) break it."""
    model = make_model("t5", head=True)
    cfg, sd, inputs = model.config, model.state_dict(), make_inputs(model)
    cross = "decoder.block.{i}.layer.1.EncDecAttention"
    new = sd
    for i, perm in enumerate(([1, 2, 0], [2, 1, 0], [0, 2, 1])):
        new = _permute_heads(new, cross.format(i=i), torch.tensor(perm), cfg.d_kv, bias=False)
    assert output_rel_diff(model, with_weights(model, new), inputs) <= 1e-10
    half = dict(new)
    for x in ("v", "o"):
        key = f"{cross.format(i=0)}.{x}.weight"
        half[key] = sd[key]
    assert output_rel_diff(model, with_weights(model, half), inputs) > 1e-3


def test_t5_one_residual_group_spans_both_streams_and_the_tied_embeddings(fp64_rmsnorm):
    """One model-wide instance; the shared embedding is its member, its tied copies (encoder and decoder
    embed_tokens, the LM head) follow it; an aligned model keeps them one tensor."""
    anchor = make_model("t5", head=True)
    _, instances = instances_for(anchor)
    (res,) = [i for i in instances if not i.kind.per_layer]
    keys = {s.key for s in res.slots}
    assert "shared.weight" in keys and not keys & {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
                                                   "lm_head.weight"}
    shared = next(s for s in res.slots if s.key == "shared.weight")
    assert set(shared.aliases) == {"encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}
    assert any(k.startswith("encoder.block.") for k in keys) and any(k.startswith("decoder.block.") for k in keys)
    model, _, _ = disguised(anchor, ("residual",))
    aligned, report = align(model, anchor, ("residual",), inputs=make_inputs(anchor))
    assert report["distance_after"] <= 1e-9 * report["distance_before"]
    assert aligned.lm_head.weight is aligned.shared.weight is aligned.encoder.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_t5_uniform_decoder_final_norm_allows_every_rotation(dtype, request):
    """The decoder's final norm cannot fold into the tied head: with its weights uniform the stream is
    orthogonal (every other norm folded; the encoder's into all decoder layers' cross-attention k and v);
    a random rotation preserves the logits and alignment recovers it."""
    if dtype == torch.float64:
        request.getfixturevalue("fp64_rmsnorm")
    anchor = make_model("t5", head=True, dtype=dtype)
    with torch.no_grad():
        anchor.decoder.final_layer_norm.weight.fill_(0.7)
    _, instances = instances_for(anchor)
    (res,) = [i for i in instances if not i.kind.per_layer]
    assert res.info.variant == "orthogonal"
    encoder_fold = next(f for f in res.info.folds if f.weight == "encoder.final_layer_norm.weight")
    assert sorted(k for k, _ in encoder_fold.readers) == sorted(
        f"decoder.block.{i}.layer.1.EncDecAttention.{x}.weight" for i in range(3) for x in "kv")
    sd = canonicalize(anchor.state_dict(), [res])
    assert torch.equal(sd["encoder.final_layer_norm.weight"], torch.ones_like(sd["encoder.final_layer_norm.weight"]))
    inputs = make_inputs(anchor)
    new = apply(sd, [res], random_elements([res], torch.Generator().manual_seed(0)))
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert output_rel_diff(anchor, with_weights(anchor, new), inputs) <= tol
    # the encoder's output (an internal state here) is rotated: the logits are the function
    with torch.no_grad():
        a = anchor(**inputs).encoder_last_hidden_state
        b = with_weights(anchor, new)(**inputs).encoder_last_hidden_state
    assert (a - b).abs().max() > 1e-2
    if dtype == torch.float64:
        model, _, canonical = disguised(anchor, ("attn", "ffn", "heads", "residual"))
        aligned, report = align(model, anchor, ("heads", "attn", "ffn", "residual"), inputs=inputs)
        assert report["residual_variant"] == "orthogonal"
        assert report["distance_after"] <= 1e-9 * report["distance_before"]


def test_t5_layers_are_numbered_through_the_stacks():
    """2 encoder layers then 3 decoder layers: 5 layer numbers; --layers picks decoder layers by them."""
    model = make_model("t5", head=True)
    _, instances = instances_for(model)
    layers = {i.name.split(".layer.")[0] + str(i.layer) for i in instances if i.layer >= 0}
    assert layers == {"encoder0", "encoder1", "decoder2", "decoder3", "decoder4"}
    _, some = instances_for(model, layers=[3])
    assert {i.name for i in some if i.layer >= 0} == {f"decoder.layer.1.{g}" for g in (
        "attn.qk", "attn.vo", "cross.heads", "cross.attn.qk", "cross.attn.vo", "ffn")}
    encoder_only = make_model("t5")  # T5EncoderModel: its stream is its output, no residual group
    _, instances = instances_for(encoder_only)
    assert {i.layer for i in instances} == {0, 1} and all(i.kind.per_layer for i in instances)


def test_t5_verification_compares_the_logits_and_refuses_a_broken_model(fp64_rmsnorm):
    from symmerge.errors import SymmergeError
    from symmerge.families import spec_for
    from symmerge.pipeline.verify import verify_forward

    anchor = make_model("t5", head=True)
    spec = spec_for("t5")
    model, _, _ = disguised(anchor, ("residual", "attn"))
    assert verify_forward(anchor, model, spec)["verify_max_rel_diff"] <= 1e-10
    broken = dict(model.state_dict())
    broken["decoder.block.1.layer.1.EncDecAttention.k.weight"] = broken["decoder.block.1.layer.1.EncDecAttention.k.weight"] * 1.1
    with pytest.raises(SymmergeError, match="not equivalent"):
        verify_forward(anchor, with_weights(model, broken), spec)


def test_t5_merge_and_barrier_end_to_end(tmp_path):
    """Two T5 checkpoints saved with save_pretrained: merge --align recommended aligns every group and
    writes a loadable folder; barrier scores the reconstruction loss of .txt lines."""
    folders = []
    for seed in (0, 1):
        folder = tmp_path / f"t5_{seed}"
        make_model("t5", head=True, dtype=torch.float32, seed=seed).save_pretrained(str(folder))
        write_tokenizer(folder)
        folders.append(folder)
    lines = tmp_path / "lines.txt"
    lines.write_text("the cat sat on the mat\na dog ran fast\nthe mat\n")
    out = tmp_path / "merged"
    assert run_cli("merge", *folders, "--method", "average", "--align", "recommended", "--data", lines,
                   "--progress", "none", "-o", out) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["alignment"]["symmetries"] == ["heads", "attn", "ffn", "rescale", "residual"]
    (moved,) = [m for m in report["alignment"]["models"] if not m["anchor"]]
    assert moved["distance_after"] < moved["distance_before"] and moved["verify_max_rel_diff"] <= 1e-5
    assert set(moved["distances"]["before"]["per_layer"]) == {"0", "1", "2", "3", "4"}
    from transformers import T5ForConditionalGeneration

    merged = T5ForConditionalGeneration.from_pretrained(str(out))
    assert merged.lm_head.weight is merged.shared.weight
    bar = tmp_path / "barrier"
    assert run_cli("barrier", *folders, "--data", lines, "--points", "3", "--progress", "none", "-o", bar) == 0
    result = json.loads((bar / "barrier.json").read_text())
    curves = result["curves"]
    assert set(curves) == {"none", "heads,attn,ffn,rescale,residual"}
    for curve in curves.values():
        assert len(curve["loss"]) == 3 and all(torch.isfinite(torch.tensor(curve["loss"])))
