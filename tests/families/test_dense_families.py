"""Facts of the dense families of issue 22 that the generic suite (test_groups.py) cannot state:

* Gemma's ``(1 + w)`` RMSNorm folds as ``1 + w`` (folding ``w`` breaks the model); its tied LM head keeps
  the stream to signed permutations unless untied;
* norms on a block's output (Gemma 2/3 sandwich norms, OLMo 2 post-norms): a general rotation of the
  stream breaks the model even with every foldable norm folded; with those norms uniform the orthogonal
  group is exact again (so signed permutations are the largest group for generic weights);
* QK-norms: Gemma 3 per head (like Qwen3) and OLMo 2 over the whole projection lock RoPE pairs to sign
  flips where their weights differ; a per-head scale breaks OLMo 2;
* soft-capping (Gemma 2/3) is live in the test configs, so the suite's exactness covers it;
* GPT-NeoX's head-interleaved ``query_key_value`` and Phi-3's ``qkv_proj`` (parts sized by head counts)
  and ``gate_up_proj`` (halves): the elements move exactly the right rows; the wrong layout breaks the model.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import make_inputs, output_rel_diff, with_weights
from factories import make_model
from symmerge.core.apply import apply, canonicalize, random_elements
from symmerge.core.resolve import config_sizes, resolve
from symmerge.groups.base import haar
from symmerge.groups.residual import StreamElement
from symmerge.pipeline.align import instances_for

pytestmark = pytest.mark.usefixtures("single_thread")

CONTROL_MIN = 1e-3
SANDWICH = ("gemma2", "gemma3", "olmo2")


def of(model, *kinds):
    _, instances = instances_for(model)
    return [i for i in instances if i.group.kind in kinds]


def breaks(model, sd) -> float:
    return output_rel_diff(model, with_weights(model, sd), make_inputs(model))


# ------------------------------------------------------------------ Gemma: (1 + w) norms, tied head


def test_gemma_norms_fold_as_one_plus_w(fp64_rmsnorm):
    model = make_model("gemma", head=True)
    (res,) = of(model, "residual")
    assert res.info.variant == "orthogonal" and {f.offset for f in res.info.folds} == {1.0}
    sd = canonicalize(model.state_dict(), [res])
    for f in res.info.folds:  # folded: w = 0, i.e. the norm multiplies by 1
        assert torch.equal(sd[f.weight], torch.zeros_like(sd[f.weight]))
    assert breaks(model, sd) <= 1e-10
    wrong = dataclasses.replace(res, info=dataclasses.replace(
        res.info, folds=tuple(dataclasses.replace(f, offset=0.0) for f in res.info.folds)))
    assert breaks(model, canonicalize(model.state_dict(), [wrong])) > CONTROL_MIN  # folding w, not 1 + w


def test_gemma_tied_head_keeps_signed_permutations(fp64_rmsnorm):
    tied = make_model("gemma", head=True, tied=True)
    assert tied.config.tie_word_embeddings and tied.lm_head.weight is tied.model.embed_tokens.weight
    (res,) = of(tied, "residual")
    assert res.info.variant == "signed_permutation" and not res.info.folds
    _, instances = instances_for(tied)
    new = apply(tied.state_dict(), instances, random_elements(instances, torch.Generator().manual_seed(2)))
    assert breaks(tied, new) <= 1e-10
    with torch.no_grad():  # a uniform final norm is no obstacle: the full orthogonal group again
        tied.model.norm.weight.fill_(0.3)
    assert of(tied, "residual")[0].info.variant == "orthogonal"


def test_gemma_embedding_scale_is_live():
    """The √d embedding scale is applied in the forward pass (a scalar, which every stream map commutes with)."""
    model = make_model("gemma")
    ids = make_inputs(model)["input_ids"]
    emb = model.embed_tokens(ids)
    assert torch.allclose(emb, torch.nn.functional.embedding(ids, model.embed_tokens.weight) * model.config.hidden_size ** 0.5)


# ------------------------------------------------------------------ norms on the blocks' outputs


def _writer_norm_keys(res, layers=2):
    """The state-dict keys of the norms on the blocks' outputs (the task model's base is ``model.``)."""
    return {"model." + t.format(i=i) for t in res.group.param("fixed_norms", ()) for i in range(layers)}


@pytest.mark.parametrize("family", SANDWICH)
def test_writer_norms_allow_no_rotation_of_the_stream(family, fp64_rmsnorm):
    """Fold every foldable norm, rotate the stream by a general orthogonal Q, leave the output norms' weights
    (they cannot move as a diagonal): the model breaks. A signed permutation keeps it (the suite)."""
    model = make_model(family, head=True)
    (res,) = of(model, "residual")
    assert res.info.variant == "signed_permutation"
    prefix_norms = _writer_norm_keys(res)
    assert prefix_norms <= {s.key for s in res.slots}
    # the orthogonal variant with the folds the family allows (pre-norms and the final norm)
    spec, _ = instances_for(model)
    sizes = config_sizes(spec, model.config)
    uniform = {k: torch.ones_like(v) if k in prefix_norms else v for k, v in model.state_dict().items()}
    (dense,) = [i for i in resolve(spec, uniform, sizes.pop("num_layers"), sizes.pop("num_heads"), **sizes,
                                   architecture=type(model).__name__) if not i.kind.per_layer]
    assert dense.info.variant == "orthogonal" and dense.info.folds
    rotated = dataclasses.replace(dense, slots=tuple(s for s in dense.slots if s.key not in prefix_norms))
    sd = canonicalize(model.state_dict(), [rotated])
    assert breaks(model, sd) <= 1e-10
    Q = haar(1, dense.size, torch.Generator().manual_seed(0))[0]
    assert breaks(model, apply(sd, [rotated], {rotated.name: StreamElement(Q=Q)})) > CONTROL_MIN


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("family", SANDWICH)
def test_uniform_writer_norms_allow_every_rotation(family, dtype, request):
    if dtype == torch.float64:
        request.getfixturevalue("fp64_rmsnorm")
    model = make_model(family, head=True, dtype=dtype)
    (res,) = of(model, "residual")
    with torch.no_grad():
        for i, k in enumerate(sorted(_writer_norm_keys(res))):
            model.get_parameter(k).fill_(0.7 + 0.1 * i)
    _, instances = instances_for(model)
    (res,) = [i for i in instances if not i.kind.per_layer]
    assert res.info.variant == "orthogonal"
    sd = canonicalize(model.state_dict(), instances)
    new = apply(sd, instances, random_elements(instances, torch.Generator().manual_seed(1)))
    assert breaks(model, new) <= (1e-10 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("family", SANDWICH)
def test_writer_norms_refuse_a_stream_scale(family):
    from symmerge.errors import SymmergeError

    model = make_model(family, head=True)
    (res,) = of(model, "residual")
    with pytest.raises(SymmergeError, match="scale"):
        res.kind.check(res, StreamElement(scale=2.0))
    assert res.kind.learn_init(res, None, torch.float64, {"norm_eps": 0.0}) is None


# ------------------------------------------------------------------ QK norms


def _pair_norms(model):
    return [(layer.self_attn.q_norm, layer.self_attn.k_norm) for layer in model.model.layers]


def _tie_all_pairs(model):
    """q_norm / k_norm weights equal on every rotary pair (j, j + d/2) of every head: no pair locked."""
    d = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for norms in _pair_norms(model):
            for n in norms:
                w = n.weight.view(-1, d)
                w[:, d // 2:] = w[:, : d // 2]
    return model


@pytest.mark.parametrize("family", ["gemma3", "olmo2"])
def test_qk_norms_lock_pairs_unless_their_weights_agree(family, fp64_rmsnorm):
    model = make_model(family, head=True)
    d = model.config.hidden_size // model.config.num_attention_heads
    assert all(i.info.locked == tuple(range(d // 2)) for i in of(model, "rope_pairs"))
    _tie_all_pairs(model)
    qk = of(model, "rope_pairs")
    assert all(i.info.locked == () for i in qk)
    els = random_elements(qk, torch.Generator().manual_seed(0))
    assert all(torch.all(e.a == 1) and e.R[:, 0, 0].abs().max() < 1 for e in els.values())  # rotations, no scale
    assert breaks(model, apply(model.state_dict(), qk, els)) <= 1e-10
    if family == "olmo2":  # one head's weight differing on a pair locks that pair for every head
        with torch.no_grad():
            model.model.layers[0].self_attn.q_norm.weight[d + 1] += 0.1  # head 1, pair 1
        assert of(model, "rope_pairs")[0].info.locked == (1,)
    locked = make_model(family, head=True)  # the original weights: the free rotations break it
    assert breaks(locked, apply(locked.state_dict(), qk, els)) > CONTROL_MIN


def test_olmo2_whole_projection_norm_refuses_per_head_scales(fp64_rmsnorm):
    """The RMS runs over all heads: a scale of one head (with its inverse on the keys) changes the normaliser."""
    model = _tie_all_pairs(make_model("olmo2", head=True))
    qk = of(model, "rope_pairs")
    free = [dataclasses.replace(i, group=dataclasses.replace(i.group, params=())) for i in qk]
    els = random_elements(free, torch.Generator().manual_seed(3), scale=True)
    assert breaks(model, apply(model.state_dict(), free, els)) > CONTROL_MIN


def test_olmo2_head_permutation_moves_the_norm_weights():
    model = make_model("olmo2", head=True)
    (heads, *_) = of(model, "heads")
    keys = {s.key for s in heads.slots}
    assert {"model.layers.0.self_attn.q_norm.weight", "model.layers.0.self_attn.k_norm.weight"} <= keys


# ------------------------------------------------------------------ soft-capping is exercised


@pytest.mark.parametrize("family,caps", [("gemma2", ("attn_logit_softcapping", "final_logit_softcapping")),
                                         ("gemma3", ("final_logit_softcapping",))])
def test_soft_capping_is_live_in_the_test_configs(family, caps):
    """(transformers' Gemma 3 attention stores attn_logit_softcapping but does not apply it.)"""
    model = make_model(family, head=True)
    assert model.config.attn_logit_softcapping and model.config.final_logit_softcapping
    inputs = make_inputs(model)
    for attr in caps:
        other = make_model(family, head=True, **{attr: None})
        assert output_rel_diff(model, other, inputs) > CONTROL_MIN, attr


# ------------------------------------------------------------------ fused layouts


def _rows_changed(before, after, axis=0):
    diff = (before - after).abs()
    return diff.amax(dim=tuple(d for d in range(diff.dim()) if d != axis)) > 0


@pytest.mark.parametrize("family", ["gpt_neox", "gpt_neox-serial"])
def test_gpt_neox_elements_move_the_interleaved_blocks(family):
    model = make_model(family, head=True)
    H, dh = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    key = "gpt_neox.layers.0.attention.query_key_value.weight"
    which = torch.arange(3 * H * dh) % (3 * dh) // dh  # 0: q, 1: k, 2: v rows of each head
    sd = model.state_dict()
    for kind, moved in (("rope_pairs", (0, 1)), ("head_orthogonal", (2,))):
        inst = [i for i in of(model, kind) if i.layer == 0]
        new = apply(sd, inst, random_elements(inst, torch.Generator().manual_seed(0)))
        changed = _rows_changed(sd[key], new[key])
        assert torch.equal(changed, torch.isin(which, torch.tensor(moved))), kind
    (qk,) = [i for i in of(model, "rope_pairs") if i.layer == 0]
    assert qk.info.rotary == dh // 2  # rotary_pct 0.5


def test_gpt_neox_thirds_layout_breaks_the_model():
    """GPT-2's layout (Q, K, V as thirds) on GPT-NeoX's interleaved weight: the model breaks."""
    from symmerge.families import gpt_neox
    from symmerge.families.roles import Attention, MLP, Stream, build

    model = make_model("gpt_neox", head=True)
    spec = gpt_neox.SPEC
    wrong = build("gpt_neox", ("gpt_neox",), "layers.{i}", Attention(fused="attention.query_key_value",
                                                                     o="attention.dense", rope=True),
                  MLP(inputs=("mlp.dense_h_to_4h",), output="mlp.dense_4h_to_h"), None, partial_rotary=True)
    sizes = config_sizes(spec, model.config)
    for s, expect_ok in ((spec, True), (wrong, False)):
        sizes_ = dict(sizes)
        insts = [i for i in resolve(s, model.state_dict(), sizes_.pop("num_layers"), sizes_.pop("num_heads"), **sizes_)
                 if i.group.name == "attn.vo"]
        diff = breaks(model, apply(model.state_dict(), insts, random_elements(insts, torch.Generator().manual_seed(1))))
        assert (diff <= 1e-10) if expect_ok else (diff > CONTROL_MIN)


def test_phi3_fused_qkv_parts_follow_the_head_counts():
    model = make_model("phi3", head=True)
    H, KV, dh = 4, 2, model.config.hidden_size // 4
    key = "model.layers.0.self_attn.qkv_proj.weight"
    assert model.state_dict()[key].shape[0] == (H + 2 * KV) * dh
    rows = torch.arange((H + 2 * KV) * dh)
    sd = model.state_dict()
    for kind, lo, hi in (("rope_pairs", 0, (H + KV) * dh), ("head_orthogonal", (H + KV) * dh, (H + 2 * KV) * dh)):
        inst = [i for i in of(model, kind) if i.layer == 0]
        new = apply(sd, inst, random_elements(inst, torch.Generator().manual_seed(0)))
        assert torch.equal(_rows_changed(sd[key], new[key]), (rows >= lo) & (rows < hi)), kind


def test_phi3_unit_scale_sits_on_the_up_half(fp64_rmsnorm):
    model = make_model("phi3", head=True)
    (ffn, *_) = of(model, "permutation")
    key = "model.layers.0.mlp.gate_up_proj.weight"
    gate, up = [s for s in ffn.slots if s.key == key]
    assert (gate.power, gate.start, up.power, up.start) == (0, 0, 1, model.config.intermediate_size)
    els = random_elements([ffn], torch.Generator().manual_seed(2), scale=True)
    assert breaks(model, apply(model.state_dict(), [ffn], els)) <= 1e-10
    swapped = dataclasses.replace(ffn, slots=tuple(
        dataclasses.replace(s, power=1 - s.power) if s.key == key else s for s in ffn.slots))
    assert breaks(model, apply(model.state_dict(), [swapped], els)) > CONTROL_MIN  # the scale on the gate
