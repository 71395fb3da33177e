"""Families with several layer stacks (the generic kind suite of test_groups.py covers their groups):

* T5: why self-attention's heads move by one permutation per stack (the relative position bias of layer 0
  serves every layer of a stack; the tied group itself: test_t5_tied_heads.py), the one residual group of both streams (the shared embedding), the encoder's final norm folded
  into every decoder layer's cross-attention, the layer numbering through the stacks, the function
  verified on the logits, and merge / barrier end to end on saved checkpoints;
* CLIP: the shared embedding space (both projections rotated together keep the logits, one alone does
  not), the two towers as two stacks with their own sizes, the vision stream behind ``pre_layrnorm``,
  and align on saved checkpoints verified on the logits.
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
    layer): hence one head group per stack for self-attention. The bias is live in the test config."""
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
    heads = [i for i in instances if i.group.symmetry == "heads" and ".cross." not in i.name]
    assert [i.name for i in heads] == ["encoder.heads", "decoder.heads"]  # one per stack (test_t5_tied_heads.py)


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
    assert {i.layer for i in instances} == {-1, 0, 1} and all(i.kind.per_layer for i in instances)
    assert [i.name for i in instances if i.layer < 0] == ["encoder.heads"]  # tied across the stack


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


# ------------------------------------------------------------------ CLIP


def _rotate_rows(sd: dict, keys, Q: torch.Tensor) -> dict:
    return {**sd, **{k: (Q.T.to(sd[k]) @ sd[k]) for k in keys}}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_clip_shared_space_rotates_both_projections_together(dtype):
    """One orthogonal map on the outputs of text_projection and visual_projection keeps logits_per_image
    and logits_per_text (cosine similarities times the untouched logit_scale) while the embeddings
    move; the same map on one projection only changes the logits."""
    from symmerge.groups.base import haar

    model = make_model("clip", head=True, dtype=dtype)
    sd, inputs = model.state_dict(), make_inputs(model)
    Q = haar(1, model.config.projection_dim, torch.Generator().manual_seed(0))[0]
    both = _rotate_rows(sd, ("text_projection.weight", "visual_projection.weight"), Q)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert output_rel_diff(model, with_weights(model, both), inputs) <= tol
    with torch.no_grad():
        a, b = model(**inputs), with_weights(model, both)(**inputs)
    assert (a.text_embeds - b.text_embeds).abs().max() > 1e-2  # the embeddings moved; their similarities did not
    torch.testing.assert_close(b.text_embeds, a.text_embeds @ Q.to(dtype), rtol=0, atol=tol * 10)
    for one in ("text_projection.weight", "visual_projection.weight"):
        assert output_rel_diff(model, with_weights(model, _rotate_rows(sd, (one,), Q)), inputs) > 1e-3
    _, instances = instances_for(model)
    (proj,) = [i for i in instances if i.name == "projection"]
    assert {(s.key, s.axis) for s in proj.slots} == {("text_projection.weight", 0), ("visual_projection.weight", 0)}
    assert proj.info.variant == "orthogonal" and "logit_scale" not in {s.key for s in proj.slots}


def test_clip_towers_are_two_stacks_with_their_own_sizes():
    """Text layers first, then vision layers (different widths and head counts); a residual group per
    tower and the shared space; a single tower has no model-wide group, with its projection one."""
    model = make_model("clip", head=True)
    _, instances = instances_for(model)
    by_layer = {}
    for i in instances:
        by_layer.setdefault(i.layer, set()).add(i.name.split(".layer.")[0] if i.layer >= 0 else i.name)
    assert by_layer == {0: {"text"}, 1: {"text"}, 2: {"vision"}, 3: {"vision"}, 4: {"vision"},
                        -1: {"text.residual", "vision.residual", "projection"}}
    heads = {i.name.split(".")[0]: i.blocks for i in instances if i.name.endswith(".heads")}
    assert heads == {"text": 3, "vision": 4}
    sizes = {i.name: i.size for i in instances if i.layer < 0}
    assert sizes == {"text.residual": 24, "vision.residual": 20, "projection": 12}
    for family in ("clip_text", "clip_vision"):
        assert all(i.kind.per_layer for i in instances_for(make_model(family))[1])
        wide = [i for i in instances_for(make_model(family, head=True))[1] if not i.kind.per_layer]
        assert [i.name for i in wide] == ["residual"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_clip_vision_pre_layernorm_restricts_its_stream_unless_uniform(dtype):
    """pre_layrnorm's output is the vision stream: a non-uniform γ leaves permutations (the suite's
    random models), a uniform one the O(d-1) group, whose random element keeps the logits."""
    model = make_model("clip", head=True, dtype=dtype)
    variants = {i.name: i.info.variant for i in instances_for(model)[1] if i.layer < 0}
    assert variants == {"text.residual": "centered", "vision.residual": "permutation", "projection": "orthogonal"}
    with torch.no_grad():
        model.vision_model.pre_layrnorm.weight.fill_(1.3)
    _, instances = instances_for(model)
    (vision,) = [i for i in instances if i.name == "vision.residual"]
    assert vision.info.variant == "centered"
    sd = canonicalize(model.state_dict(), [vision])
    new = apply(sd, [vision], random_elements([vision], torch.Generator().manual_seed(2)))
    assert not torch.equal(new["vision_model.embeddings.class_embedding"], sd["vision_model.embeddings.class_embedding"])
    tol = 1e-10 if dtype == torch.float64 else 1e-5
    assert output_rel_diff(model, with_weights(model, new), make_inputs(model)) <= tol
    with torch.no_grad():  # the control: a non-uniform pre_layrnorm does not commute with the rotation
        changed = with_weights(model, new)
        changed.vision_model.pre_layrnorm.weight.copy_(torch.linspace(0.5, 1.5, 20, dtype=dtype))
        model.vision_model.pre_layrnorm.weight.copy_(torch.linspace(0.5, 1.5, 20, dtype=dtype))
    assert output_rel_diff(model, changed, make_inputs(model)) > 1e-3


def test_clip_align_cli_verifies_the_logits(tmp_path):
    """align on saved CLIPModel folders: every group, the report's verification on the logits."""
    anchor = make_model("clip", head=True, dtype=torch.float32)
    model, _, _ = disguised(anchor, ("heads", "attn", "ffn", "residual"), seed=3)
    a, m = tmp_path / "anchor", tmp_path / "model"
    anchor.save_pretrained(str(a))
    model.save_pretrained(str(m))
    out = tmp_path / "out"
    assert run_cli("align", m, a, "--symmetries", "heads,attn,ffn,rescale,residual", "--progress", "none",
                   "-o", out) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["distance_after"] <= 1e-4 * report["distance_before"]
    assert report["verify_max_rel_diff"] <= 1e-5 and "projection" in report["per_module"]


# ------------------------------------------------------------------ matchers


def test_t5_activation_matcher_solves_every_group(fp64_rmsnorm):
    """--match activations on T5: every kind solved (the stream's boundaries run through both stacks),
    the function kept (learned alignment on T5: test_stack_matchers.py)."""
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions
    from test_matchers import unlabeled

    a, b = make_model("t5", head=True, seed=0), make_model("t5", head=True, seed=5)
    result = align_pair(a, b, AlignOptions(symmetries="recommended", match="activations", align_data=unlabeled(a)),
                        inputs=make_inputs(a))
    assert output_rel_diff(a, result.model, make_inputs(a)) <= 1e-9
    assert {i.name for i in result.instances} <= set(result.elements)
    assert result.report["distance_after"] < result.report["distance_before"]


def test_clip_data_is_refused_by_name(tmp_path):
    from symmerge.errors import SymmergeError
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions

    lines = tmp_path / "lines.txt"
    lines.write_text("the cat sat\n")
    a, b = make_model("clip", head=True, seed=0), make_model("clip", head=True, seed=5)
    with pytest.raises(SymmergeError, match="takes text and images together"):
        align_pair(a, b, AlignOptions(symmetries="recommended", match="activations", align_data=str(lines)))


def test_t5_classification_model_keeps_its_stream(fp64_rmsnorm):
    """T5ForSequenceClassification (under a ``transformer.`` prefix) reads the decoder's stream with a head
    the spec does not name: it gets the per-layer groups only, which keep its function."""
    import transformers

    from factories import _configs

    config = _configs()["t5"][0]()
    config.num_labels = 3
    torch.manual_seed(0)
    model = transformers.T5ForSequenceClassification(config).double().eval()
    _, instances = instances_for(model)
    assert instances and all(i.kind.per_layer for i in instances)
    inputs = make_inputs(model)
    ids = inputs["input_ids"]
    ids[:, -1] = config.eos_token_id  # the head reads the last eos token
    inputs = {"input_ids": ids, "decoder_input_ids": ids}  # (it needs every row to end in one)
    sd = model.state_dict()
    new = apply(sd, instances, random_elements(instances, torch.Generator().manual_seed(0)))
    assert output_rel_diff(model, with_weights(model, new), inputs) <= 1e-10


def test_clip_models_with_other_head_counts_are_refused(tmp_path, capsys):
    """CLIPConfig has no num_attention_heads of its own: the layout check compares each tower's. Same
    shapes, other head counts: the head blocks would not correspond, so merge (in memory and streamed)
    and align refuse with one error, and write nothing."""
    from transformers import CLIPConfig, CLIPModel

    from symmerge.cli import main as cli_main

    folders = []
    for i, heads in enumerate((2, 4)):
        torch.manual_seed(i)
        config = CLIPConfig(text_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=heads, vocab_size=40, max_position_embeddings=16,
                                             bos_token_id=0, eos_token_id=1, pad_token_id=1),
                            vision_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                               num_attention_heads=2, image_size=8, patch_size=4),
                            projection_dim=8)
        CLIPModel(config).save_pretrained(str(tmp_path / f"c{i}"))
        folders.append(str(tmp_path / f"c{i}"))
    for extra in (["--mode", "memory"], ["--mode", "stream"]):
        out = tmp_path / f"out{extra[-1]}"
        assert cli_main(["merge", *folders, "--method", "average", "--align", "none", *extra, "--progress", "none",
                         "-o", str(out)]) == 2
        err = capsys.readouterr().err
        assert "attention heads" in err and "text_config 4" in err and not out.exists()
    assert cli_main(["align", *folders, "-o", str(tmp_path / "aligned"), "--progress", "none"]) == 2
    err = capsys.readouterr().err
    assert "attention heads" in err and "text_config 4" in err and not (tmp_path / "aligned").exists()
