"""Facts of particular families that the generic suite (test_groups.py) cannot state:

* the resolved specs name exactly the tensors of an independent table (encoders);
* GPT-2's fused ``c_attn`` and Conv1D layout, checked by hand;
* RoPE: the paper's general per-head rotation breaks it, so does the other pair layout; GQA's head
  mapping; SwiGLU's scale on the right projection; Phi's partial rotary; Qwen3's per-head norms lock
  pairs to sign flips;
* the residual stream: LayerNorm commutes with permutations but not rotations; RMSNorm needs the
  norms folded; a tied LM head blocks the fold of a non-uniform final norm; a base model has no
  residual group;
* specific broken transforms (scales on the wrong side, skipped DeBERTa relative projections).
"""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from conftest import add_noise, make_inputs, output_rel_diff, with_weights
from factories import DEC_HEADS, DEC_KV, HEADS, HIDDEN, LAYERS, make_model
from symmerge.core.apply import apply, canonicalize, random_elements
from symmerge.errors import SymmergeError
from symmerge.groups.base import haar
from symmerge.groups.head_orthogonal import HeadElement
from symmerge.groups.permutation import PermElement
from symmerge.groups.residual import StreamElement
from symmerge.pipeline.align import align, instances_for

pytestmark = pytest.mark.usefixtures("single_thread")

CONTROL_MIN = 1e-3


def of(model, *kinds, names=(), residual="largest"):
    _, instances = instances_for(model, residual=residual)
    return [i for i in instances if i.group.kind in kinds or i.group.name in names]


def breaks(model, sd) -> float:
    return output_rel_diff(model, with_weights(model, sd), make_inputs(model))


# ------------------------------------------------------------------ encoders: an independent table of the tensors

_QKV = ("{q}.weight", "{q}.bias", "{k}.weight", "{k}.bias", "{v}.weight", "{v}.bias", "{o}.weight")
_FFN = ("{fin}.weight", "{fin}.bias", "{fout}.weight")


def _names(layer, q, k, v, o, fin, fout, extra=()):
    fmt = dict(q=q, k=k, v=v, o=o, fin=fin, fout=fout)
    return tuple(f"{layer}.{t.format(**fmt)}" for t in _QKV + _FFN) + tuple(f"{layer}.{e}" for e in extra)


_BERT = _names("encoder.layer.{i}", "attention.self.query", "attention.self.key", "attention.self.value",
               "attention.output.dense", "intermediate.dense", "output.dense")
_DEBERTA = _names("encoder.layer.{i}", "attention.self.query_proj", "attention.self.key_proj",
                  "attention.self.value_proj", "attention.output.dense", "intermediate.dense", "output.dense")
EXPECTED = {
    "bert": _BERT, "roberta": _BERT, "electra": _BERT,
    "distilbert": _names("transformer.layer.{i}", "attention.q_lin", "attention.k_lin", "attention.v_lin",
                         "attention.out_lin", "ffn.lin1", "ffn.lin2"),
    "deberta-v2": _DEBERTA + tuple(f"encoder.layer.{{i}}.attention.self.{p}.{w}" for p in ("pos_key_proj", "pos_query_proj")
                                   for w in ("weight", "bias")),
    "deberta-v2-shared": _DEBERTA,
    "vit": _names("layers.{i}", "attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
                  "mlp.fc1", "mlp.fc2"),
}


@pytest.mark.parametrize("head", [False, True], ids=["base", "task"])
@pytest.mark.parametrize("family", list(EXPECTED))
def test_per_layer_groups_move_exactly_the_tensors_of_an_independent_table(family, head):
    model = make_model(family, head=head)
    sd = model.state_dict()
    prefix = "" if not head else model.base_model_prefix + "."
    expected = {prefix + t.format(i=i) for i in range(LAYERS) for t in EXPECTED[family]}
    assert not expected - sd.keys(), "test table names tensors the model lacks"
    local = of(model, "heads", "head_orthogonal", "permutation")
    assert {s.key for inst in local for s in inst.slots} == expected  # nothing skipped as optional, nothing extra
    new = apply(sd, local, random_elements(local, torch.Generator().manual_seed(5)))
    assert {k for k in sd if not torch.equal(sd[k], new[k])} == expected
    untouched = set(sd) - expected  # heads, pooler, embeddings, LayerNorms, output biases
    assert any("norm" in k.lower() for k in untouched) and any("embeddings" in k for k in untouched)


@pytest.mark.parametrize("family", ["bert", "deberta-v2", "vit"])
def test_extreme_scales_still_exact(family):
    model = make_model(family)
    instances = of(model, "head_orthogonal")
    elements = random_elements(instances, torch.Generator().manual_seed(9))
    for k, inst in enumerate(instances):
        a = torch.full((inst.blocks,), 4.0 if k % 2 else 0.25, dtype=torch.float64)
        elements[inst.name] = HeadElement(elements[inst.name].R, a)
    assert breaks(model, apply(model.state_dict(), instances, elements)) <= 1e-10


@pytest.mark.parametrize("how", ["scale_q_and_k_same_way", "scale_v_without_o"])
@pytest.mark.parametrize("family", ["bert", "distilbert", "deberta-v2", "vit"])
def test_scales_on_the_wrong_side_break_the_model(family, how):
    model = make_model(family)
    group = "attn.qk" if how.startswith("scale_q") else "attn.vo"
    insts = of(model, names=(group,))
    elements = {i.name: HeadElement(HeadElement.identity(i.blocks, i.size).R,
                                    torch.full((i.blocks,), 1.7, dtype=torch.float64)) for i in insts}
    if how == "scale_q_and_k_same_way":  # a·Q with a·K (instead of K/a): the softmax temperature changes
        insts = [dataclasses.replace(i, slots=tuple(dataclasses.replace(s, power=1) for s in i.slots)) for i in insts]
    else:
        insts = [dataclasses.replace(i, slots=tuple(s for s in i.slots if s.power == 1)) for i in insts]
    assert breaks(model, apply(model.state_dict(), insts, elements)) > CONTROL_MIN


def test_deberta_relative_projections_are_needed():
    """With share_att_key=False, leaving pos_key_proj/pos_query_proj out of the QK group breaks c2p/p2c."""
    model = make_model("deberta-v2")
    qk = of(model, names=("attn.qk",))
    elements = random_elements(qk, torch.Generator().manual_seed(3), scale=False)
    assert breaks(model, apply(model.state_dict(), qk, elements)) <= 1e-10
    skipped = [dataclasses.replace(i, slots=tuple(s for s in i.slots if ".pos_" not in s.key)) for i in qk]
    assert breaks(model, apply(model.state_dict(), skipped, elements)) > CONTROL_MIN


# ------------------------------------------------------------------ GPT-2: fused c_attn, Conv1D

D = HIDDEN // HEADS


def test_gpt2_elements_move_exactly_the_fused_blocks():
    """By hand, in Conv1D terms (``y = x W + b``, head k of Q = columns k·d … of block 0):
    Q_k → a·Q_k R, K_k → K_k R / a, V_k → a'·V_k R', rows of c_proj → R'ᵀ rows / a', FFN columns
    of c_fc and rows of mlp.c_proj permuted; nothing else changes."""
    model = make_model("gpt2", head=True)
    sd = model.state_dict()
    instances = of(model, "head_orthogonal", "permutation")
    elements = random_elements(instances, torch.Generator().manual_seed(3))
    new = apply(sd, instances, elements)
    touched = set()
    for i in range(LAYERS):
        p = f"transformer.h.{i}."
        qk, vo, ffn = (elements[f"layer.{i}.{n}"] for n in ("attn.qk", "attn.vo", "ffn"))
        W, b = sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"]
        Wn, bn = new[p + "attn.c_attn.weight"], new[p + "attn.c_attn.bias"]
        for k in range(HEADS):
            for block, el, power in ((0, qk, 1), (1, qk, -1), (2, vo, 1)):
                cols = slice(block * HIDDEN + k * D, block * HIDDEN + (k + 1) * D)
                a = el.a[k] ** power
                torch.testing.assert_close(Wn[:, cols], a * W[:, cols] @ el.R[k], rtol=0, atol=1e-12)
                torch.testing.assert_close(bn[cols], a * b[cols] @ el.R[k], rtol=0, atol=1e-12)
            rows = slice(k * D, (k + 1) * D)
            torch.testing.assert_close(new[p + "attn.c_proj.weight"][rows],
                                       vo.R[k].T @ sd[p + "attn.c_proj.weight"][rows] / vo.a[k], rtol=0, atol=1e-12)
        perm = ffn.perm
        assert torch.equal(new[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.weight"][:, perm])
        assert torch.equal(new[p + "mlp.c_fc.bias"], sd[p + "mlp.c_fc.bias"][perm])
        assert torch.equal(new[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.weight"][perm])
        touched |= {p + n for n in ("attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                                    "mlp.c_fc.weight", "mlp.c_fc.bias", "mlp.c_proj.weight")}
    for k in set(sd) - touched:  # embeddings, LayerNorms, output biases, LM head: bit-identical
        assert torch.equal(sd[k], new[k]), k


def test_gpt2_head_permutation_moves_whole_head_columns_by_hand():
    model = make_model("gpt2", head=True)
    sd = model.state_dict()
    (heads, *_) = of(model, "heads")
    perm = torch.tensor([2, 0, 1])
    from symmerge.groups.heads import HeadPerm

    new = apply(sd, [heads], {heads.name: HeadPerm(perm, perm)})
    p = "transformer.h.0.attn."
    for block in range(3):
        for j in range(HEADS):
            cols_new = slice(block * HIDDEN + j * D, block * HIDDEN + (j + 1) * D)
            cols_old = slice(block * HIDDEN + perm[j] * D, block * HIDDEN + (perm[j] + 1) * D)
            assert torch.equal(new[p + "c_attn.weight"][:, cols_new], sd[p + "c_attn.weight"][:, cols_old])
            assert torch.equal(new[p + "c_attn.bias"][cols_new], sd[p + "c_attn.bias"][cols_old])
    for j in range(HEADS):
        assert torch.equal(new[p + "c_proj.weight"][j * D:(j + 1) * D], sd[p + "c_proj.weight"][perm[j] * D:(perm[j] + 1) * D])
    assert breaks(model, new) <= 1e-10


def test_gpt2_qk_element_leaves_the_v_block_alone():
    model = make_model("gpt2")
    sd = model.state_dict()
    qk = of(model, names=("attn.qk",))
    new = apply(sd, qk, random_elements(qk, torch.Generator().manual_seed(0)))
    key = "h.0.attn.c_attn.weight"
    assert torch.equal(new[key][:, 2 * HIDDEN:], sd[key][:, 2 * HIDDEN:])
    assert not torch.allclose(new[key][:, :HIDDEN], sd[key][:, :HIDDEN])


@pytest.mark.parametrize("how", ["linear_axis", "wrong_block"])
def test_gpt2_misplaced_transforms_break_the_model(how):
    model = make_model("gpt2")
    qk = of(model, names=("attn.qk",))
    elements = random_elements(qk, torch.Generator().manual_seed(5), scale=False)

    def replace(fn):
        return [dataclasses.replace(i, slots=tuple(fn(s) for s in i.slots)) for i in qk]

    if how == "linear_axis":  # treat c_attn as nn.Linear (out × in): rotate rows instead of columns
        broken = replace(lambda s: dataclasses.replace(s, axis=0) if s.key.endswith("weight") else s)
    else:  # rotate Q with V's block instead of K's
        broken = replace(lambda s: dataclasses.replace(s, start=2 * HIDDEN) if s.power == -1 else s)
    assert breaks(model, apply(model.state_dict(), qk, elements)) <= 1e-10
    assert breaks(model, apply(model.state_dict(), broken, elements)) > CONTROL_MIN


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("cls", ["GPT2LMHeadModel", "GPT2ForSequenceClassification"])
def test_gpt2_residual_permutation_keeps_the_tie_and_the_score_head(cls, dtype):
    """One permutation of the hidden dims through wte, wpe, every c_attn/c_fc row (Conv1D inputs), every
    c_proj column and bias (outputs), every LayerNorm's γ and β, and the (tied) LM head or score head."""
    import transformers

    model = make_model("gpt2", head=True, dtype=dtype, tied=True)
    if cls != "GPT2LMHeadModel":
        torch.manual_seed(0)
        cfg = model.config
        cfg.num_labels, cfg.pad_token_id = 3, 0
        clf = getattr(transformers, cls)(cfg).to(dtype).eval()
        clf.transformer.load_state_dict(model.transformer.state_dict())
        model = clf
    (res,) = of(model, "residual", residual="permutation")
    assert res.info.variant == "permutation" and res.size == HIDDEN
    keys = {k for s in res.slots for k in (s.key, *s.aliases)}
    head = "lm_head.weight" if cls == "GPT2LMHeadModel" else "score.weight"
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.1.attn.c_attn.weight",
            "transformer.h.0.mlp.c_proj.bias", "transformer.h.1.ln_2.bias", "transformer.ln_f.weight", head} <= keys
    sd = model.state_dict()
    moved = with_weights(model, apply(sd, [res], random_elements([res], torch.Generator().manual_seed(0))))
    assert output_rel_diff(model, moved, make_inputs(model)) <= (1e-10 if dtype == torch.float64 else 1e-5)
    if cls == "GPT2LMHeadModel":  # the head stays tied to the (moved) embeddings
        assert moved.lm_head.weight.data_ptr() == moved.transformer.wte.weight.data_ptr()


def test_vit_residual_permutation_names_the_whole_stream():
    model = make_model("vit", head=True)
    (res,) = of(model, "residual", residual="permutation")
    assert res.info.variant == "permutation" and res.size == model.config.hidden_size
    keys = {s.key for s in res.slots}
    assert {"vit.embeddings.cls_token", "vit.embeddings.position_embeddings", "vit.layernorm.bias",
            "vit.embeddings.patch_embeddings.projection.weight", "vit.layers.1.layernorm_after.weight",
            "vit.layers.0.mlp.fc2.bias", "vit.layers.0.attention.q_proj.weight", "classifier.weight"} <= keys
    sd = model.state_dict()
    new = apply(sd, [res], random_elements([res], torch.Generator().manual_seed(0)))
    assert all(not torch.equal(new[k], sd[k]) for k in keys if sd[k].numel() > 1)


@pytest.mark.parametrize("family", ["gpt2", "vit", "phi"])
def test_layernorm_stream_rotations_must_fix_the_all_ones_direction(family):
    """After folding, an orthogonal Q with Q·1 = ±1 preserves a LayerNorm model (mean-centring and the
    RMS commute with it); a Haar-random Q (which moves 1) breaks it, and so does a permutation of the
    unfolded stream that leaves the LayerNorms' γ and β alone."""
    model = make_model(family, head=True)
    (res,) = of(model, "residual")
    assert res.info.variant == "centered" and res.info.folds
    folded = canonicalize(model.state_dict(), [res])
    assert breaks(model, folded) <= 1e-10
    good = random_elements([res], torch.Generator().manual_seed(0))
    ones = torch.ones(res.size, dtype=torch.float64)
    assert (good[res.name].Q @ ones).abs().sub(1).abs().max() < 1e-12
    assert breaks(model, apply(folded, [res], good)) <= 1e-10
    Q = haar(1, res.size, torch.Generator().manual_seed(0))[0]
    assert (Q @ ones - ones).abs().max() > 0.1 and (Q @ ones + ones).abs().max() > 0.1
    assert breaks(model, apply(folded, [res], {res.name: StreamElement(Q=Q)})) > 1e-2
    (perm,) = of(model, "residual", residual="permutation")
    no_norms = dataclasses.replace(perm, slots=tuple(s for s in perm.slots if ("norm" not in s.key.lower()
                                                                               and "ln_" not in s.key)))
    assert breaks(model, apply(model.state_dict(), [no_norms], random_elements([perm], torch.Generator()))) > CONTROL_MIN


def test_tied_gpt2_keeps_to_permutations_unless_untied():
    """ln_f cannot fold into an LM head tied to wte: the stream group stays permutations; untied, the
    final norm folds into the head and the O(d-1) group acts (exactly)."""
    from symmerge.pipeline.align import untied

    model = make_model("gpt2", head=True, tied=True)
    (res,) = of(model, "residual")
    assert res.info.variant == "permutation"
    free = untied(model)
    assert free.lm_head.weight is not free.transformer.wte.weight
    assert breaks(model, free.state_dict()) <= 1e-12
    (res,) = of(free, "residual")
    assert res.info.variant == "centered"
    assert any(f.weight == "transformer.ln_f.weight" and f.readers == (("lm_head.weight", 1),) for f in res.info.folds)
    new = apply(canonicalize(free.state_dict(), [res]), [res], random_elements([res], torch.Generator().manual_seed(1)))
    assert breaks(free, new) <= 1e-10
    aligned, report = align(disguised_ln(free), model, ("attn", "ffn", "rescale", "residual"), untie=True)
    assert report["untied"] and report["residual_variant"] == "centered"
    assert aligned.lm_head.weight is not aligned.transformer.wte.weight


def disguised_ln(model):
    from factories import disguised

    return disguised(model, ("attn", "ffn", "rescale", "residual"), seed=3)[0]


@pytest.mark.parametrize("family", ["gpt2", "vit", "llama", "qwen3"])
def test_a_base_model_has_no_residual_group(family, request):
    model = make_model(family)
    assert of(model, "residual") == []
    with pytest.raises(SymmergeError, match="residual"):
        align(model, make_model(family, seed=1), ("attn", "residual"))


# ------------------------------------------------------------------ RoPE, GQA, SwiGLU, RMSNorm


def _decoder_controls(model, how: str) -> dict:
    sd = model.state_dict()
    g = torch.Generator().manual_seed(7)
    qk, vo, ffn, res = (of(model, names=(n,)) for n in ("attn.qk", "attn.vo", "ffn", "residual"))
    if how in ("correct_rope", "general_rotation", "interleaved_pairs"):
        els = random_elements(qk, g, scale=False)
        if how == "general_rotation":  # the paper's per-head rotation: does not commute with RoPE
            els = {i.name: HeadElement(haar(i.blocks, i.size, g), torch.ones(i.blocks, dtype=torch.float64)) for i in qk}
        elif how == "interleaved_pairs":  # pairs (2j, 2j+1): the other RoPE layout
            order = torch.cat([torch.arange(0, 8, 2), torch.arange(1, 8, 2)])
            inv = torch.argsort(order)
            els = {k: HeadElement(e.R[:, inv][:, :, inv], e.a) for k, e in els.items()}
        return apply(sd, qk, els)
    if how in ("gqa_correct", "gqa_wrong_mapping"):
        # VO element per KV head, expanded to query heads by hand: h // rep is right, h % H_kv is not
        els, out = random_elements(vo, g, scale=False), sd
        rep = DEC_HEADS // DEC_KV
        heads = torch.arange(DEC_HEADS) // rep if how == "gqa_correct" else torch.arange(DEC_HEADS) % DEC_KV
        for inst in vo:
            v = dataclasses.replace(inst, slots=tuple(s for s in inst.slots if s.power == 1))
            o = dataclasses.replace(inst, blocks=DEC_HEADS, name=inst.name + ".o",
                                    slots=tuple(dataclasses.replace(s, repeat=1) for s in inst.slots if s.power == -1))
            e = els[inst.name]
            out = apply(out, [v, o], {v.name: e, o.name: HeadElement(e.R[heads], e.a[heads])})
        return out
    if how in ("scale_gate", "scale_up_only"):
        els = {i.name: PermElement(torch.arange(i.size), torch.full((i.size,), 1.5, dtype=torch.float64)) for i in ffn}
        power = {"scale_gate": {"gate_proj": 1, "up_proj": 0, "down_proj": -1},
                 "scale_up_only": {"gate_proj": 0, "up_proj": 1, "down_proj": 0}}[how]
        fixed = [dataclasses.replace(i, slots=tuple(dataclasses.replace(s, power=power[s.key.split(".")[-2]])
                                                    for s in i.slots)) for i in ffn]
        return apply(sd, fixed, els)
    if how == "residual_unfolded":  # rotate the stream but keep the norm weights (skip the fold)
        no_norms = [dataclasses.replace(i, slots=tuple(s for s in i.slots if not s.diag)) for i in res]
        return apply(sd, no_norms, {i.name: StreamElement(Q=haar(1, i.size, g)[0]) for i in res})
    if how == "tied_orthogonal":  # a tied model with a non-uniform final norm: orthogonal Q is no symmetry
        fake = [dataclasses.replace(i, info=dataclasses.replace(i.info, variant="orthogonal"),
                                    slots=tuple(s for s in i.slots if not s.diag)) for i in res]
        return apply(canonicalize(sd, res), fake, {i.name: StreamElement(Q=haar(1, i.size, g)[0]) for i in fake})
    raise AssertionError(how)


@pytest.mark.parametrize("how,tied", [("general_rotation", False), ("interleaved_pairs", False),
                                      ("gqa_wrong_mapping", False), ("scale_gate", False), ("scale_up_only", False),
                                      ("residual_unfolded", False), ("tied_orthogonal", True)])
def test_decoder_negative_controls(how, tied, fp64_rmsnorm):
    model = make_model("llama", head=True, tied=tied)
    for good in ("correct_rope", "gqa_correct"):
        assert breaks(model, _decoder_controls(model, good)) <= 1e-10
    diff = breaks(model, _decoder_controls(model, how))
    assert diff > CONTROL_MIN, f"{how} changed outputs by only {diff:.3g}"


def test_general_rotation_breaks_rope_with_a_head_permutation_too(fp64_rmsnorm):
    """Permuting whole heads is fine with RoPE (every head gets the same rotation)."""
    model = make_model("llama")
    heads = of(model, "heads")
    assert breaks(model, apply(model.state_dict(), heads, random_elements(heads, torch.Generator()))) <= 1e-10


def test_gqa_head_permutation_keeps_query_heads_in_their_group(fp64_rmsnorm):
    model = make_model("llama")
    (heads, *_) = of(model, "heads")
    el = random_elements([heads], torch.Generator().manual_seed(2))[heads.name]
    rep = DEC_HEADS // DEC_KV
    assert torch.equal(el.query // rep, el.kv.repeat_interleave(rep))
    from symmerge.groups.heads import HeadPerm

    for wrong in (HeadPerm(el.kv, torch.roll(el.query, 1)), HeadPerm(el.kv.flip(0), el.query)):
        with pytest.raises(SymmergeError, match="group"):
            heads.kind.check(heads, wrong)
        bad = apply(model.state_dict(), [heads], {heads.name: wrong})
        assert breaks(model, bad) > CONTROL_MIN


def test_residual_moves_every_stream_tensor():
    """Independent list: every weight and norm except the readers' own output biases (q/k/v,
    gate/up), which live in head/unit space, not on the stream."""
    model = make_model("llama-bias", head=True)
    sd = model.state_dict()
    res = of(model, "residual")
    folded = canonicalize(sd, res)
    new = apply(folded, res, random_elements(res, torch.Generator().manual_seed(0)))
    changed = {k for k in sd if not torch.equal(new[k], folded[k])}
    expected = {k for k in sd if not k.endswith("bias") or "o_proj" in k or "down_proj" in k} - {
        k for k in sd if "norm" in k}  # norms are 1 after folding and stay 1
    assert changed == expected
    assert all(torch.equal(new[k], torch.ones_like(new[k])) for k in sd if "norm" in k)


def test_tied_uniform_final_norm_keeps_the_orthogonal_group(fp64_rmsnorm):
    model = make_model("llama", head=True, tied=True)
    with torch.no_grad():
        model.model.norm.weight.fill_(1.3)
    (res,) = of(model, "residual")
    assert res.info.variant == "orthogonal"
    assert "model.norm.weight" not in {f.weight for f in res.info.folds}
    _, instances = instances_for(model)
    sd = canonicalize(model.state_dict(), instances)
    new = apply(sd, instances, random_elements(instances, torch.Generator().manual_seed(0)))
    assert torch.equal(new["model.norm.weight"], model.state_dict()["model.norm.weight"])
    assert breaks(model, new) <= 1e-10


def test_tied_model_rejects_an_orthogonal_stream_transform_on_its_unfoldable_norm():
    model = make_model("llama", head=True, tied=True)
    (res,) = of(model, "residual")
    assert res.info.variant == "signed_permutation" and not res.info.folds
    with pytest.raises(SymmergeError, match="fold"):
        apply(model.state_dict(), [res], {res.name: StreamElement(Q=haar(1, res.size, torch.Generator())[0])})


def test_partial_rotary_phi():
    """Phi rotates only the first half of each head (partial_rotary_factor 0.5): pairs (j, j + r/2)
    there, the full orthogonal group on the rest; its qk_layernorm variant is refused."""
    model = make_model("phi")
    (qk, *_) = of(model, "rope_pairs")
    assert (qk.size, qk.info.rotary) == (8, 4)
    el = random_elements([qk], torch.Generator().manual_seed(0))[qk.name]
    assert el.R[0, 4:, 4:].abs().min() > 0  # a dense rotation on the non-rotated dims
    _, instances = instances_for(model)
    for seed in (0, 1):
        assert breaks(model, apply(model.state_dict(), instances, random_elements(instances, torch.Generator().manual_seed(seed)))) <= 1e-10
    with pytest.raises(SymmergeError, match="qk_layernorm"):
        instances_for(make_model("phi", qk_layernorm=True))


def test_phi_partial_rotary_alignment_recovers_the_pass_through_dims():
    anchor = make_model("phi", head=True)
    instances = [i for i in instances_for(anchor)[1] if i.kind.per_layer]
    moved = with_weights(anchor, apply(anchor.state_dict(), instances,
                                       random_elements(instances, torch.Generator().manual_seed(4))))
    aligned, report = align(moved, anchor, ("heads", "attn", "ffn", "rescale"))
    assert report["distance_after"] <= 1e-9 * report["distance_before"]


# ------------------------------------------------------------------ Qwen3: per-head q_norm / k_norm


def _tie_pairs(model, pairs):
    """Make q_norm/k_norm weights equal on rotary pairs ``pairs`` (j and j + d/2) in every layer."""
    d = model.config.head_dim
    with torch.no_grad():
        for layer in getattr(model, "model", model).layers:
            for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                norm.weight[[j + d // 2 for j in pairs]] = norm.weight[list(pairs)]
    return model


def test_qwen3_locked_pairs_follow_the_norm_weights():
    model = make_model("qwen3")
    d = model.config.head_dim
    assert all(i.info.locked == tuple(range(d // 2)) for i in of(model, "rope_pairs"))  # generic: every pair locked
    _tie_pairs(model, [0, 2])
    assert all(i.info.locked == tuple(j for j in range(d // 2) if j not in (0, 2)) for i in of(model, "rope_pairs"))
    with torch.no_grad():  # a difference in k_norm alone locks the pair again
        model.layers[1].self_attn.k_norm.weight[d // 2] += 0.1
    assert [i.info.locked for i in of(model, "rope_pairs")][1] == tuple(j for j in range(d // 2) if j != 2)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_qwen3_free_rotation_on_tied_pairs_preserves_outputs(dtype, request):
    if dtype == torch.float64:
        request.getfixturevalue("fp64_rmsnorm")
    model = _tie_pairs(make_model("qwen3", head=True, dtype=dtype), [0, 1, 3])
    qk = of(model, "rope_pairs")
    els = random_elements(qk, torch.Generator().manual_seed(3))
    for inst in qk:
        R = els[inst.name].R
        assert R[:, 0, 0].abs().max() < 1 and torch.all(els[inst.name].a == 1)  # a real rotation, no scale
        assert torch.all(R[:, 2, 2].abs() == 1)  # locked pair 2: a sign flip only
    assert breaks(model, apply(model.state_dict(), qk, els)) <= (1e-10 if dtype == torch.float64 else 1e-5)


@pytest.mark.parametrize("how", ["rotate_locked_pair", "pair_scale", "llama_group"])
def test_qwen3_negative_controls(how, fp64_rmsnorm):
    """Breaking the restriction changes outputs: a rotation of a pair whose norm weights differ, a
    per-pair scale (the norm divides it out unevenly), or Llama's whole QK group (rotation + scale)."""
    from symmerge.core.solvers.rope import rope_element

    model = _tie_pairs(make_model("qwen3", head=True), [0, 1, 3])
    qk = of(model, "rope_pairs")
    free = [dataclasses.replace(i, info=dataclasses.replace(i.info, locked=()),
                                group=dataclasses.replace(i.group, params=())) for i in qk]
    els = random_elements(free, torch.Generator().manual_seed(4), scale=False)
    if how == "rotate_locked_pair":  # identity except pair 2 (locked), rotated by 1 rad
        for e in els.values():
            theta = torch.zeros(e.R.shape[0], e.R.shape[-1] // 2, dtype=torch.float64)
            theta[:, 2] = 1.0
            e.R, _ = rope_element(theta, torch.ones_like(theta), None, None, e.R.shape[-1])
    elif how == "pair_scale":  # a scale on the (tied, free) pair 0 only
        for e in els.values():
            e.R = HeadElement.identity(e.R.shape[0], e.R.shape[-1]).R
            e.a = torch.ones(e.R.shape[0], e.R.shape[-1], dtype=torch.float64)
            e.a[:, [0, e.R.shape[-1] // 2]] = 1.7
    else:
        els = random_elements(free, torch.Generator().manual_seed(4), scale=True)
    diff = breaks(model, apply(model.state_dict(), free, els))
    assert diff > CONTROL_MIN, f"{how} changed outputs by only {diff:.3g}"


def test_qwen3_sign_choice_equals_brute_force():
    """All pairs locked: per KV head the solver's flips equal the best of all 2^(d/2) patterns."""
    from symmerge.groups import Options
    from symmerge.pipeline.engine import solve_local

    anchor, model = make_model("qwen3", seed=0), make_model("qwen3", seed=5)
    (inst,) = [i for i in of(model, "rope_pairs") if i.layer == 0]
    sd_a, sd_b = model.state_dict(), anchor.state_dict()
    elements = solve_local([inst], sd_a, sd_b, Options(frozenset({"attn"}), "none"))
    R = elements[inst.name].R
    d = inst.size
    h = d // 2
    for head in range(inst.blocks):
        def dist(signs):
            el = HeadElement.identity(inst.blocks, d)
            el.R[head] = torch.diag(torch.tensor(list(signs) * 2, dtype=torch.float64))
            new = apply(sd_a, [inst], {inst.name: el})
            return sum((new[s.key] - sd_b[s.key]).square().sum().item() for s in inst.slots)
        best = min(itertools.product((1.0, -1.0), repeat=h), key=dist)
        assert torch.equal(torch.diagonal(R[head])[:h].sign(), torch.tensor(best, dtype=torch.float64))
        assert dist(torch.diagonal(R[head])[:h].tolist()) == pytest.approx(dist(best), rel=1e-12)


# ------------------------------------------------------------------ residual recovery beside the local groups


@pytest.mark.parametrize("family", ["vit", "gpt2"])
def test_layernorm_stream_alignment_undoes_a_hidden_permutation_that_local_groups_cannot(family):
    b = make_model(family, head=True, seed=0)
    instances = [i for i in instances_for(b, residual="permutation")[1] if i.group.kind != "heads"]
    el = random_elements(instances, torch.Generator().manual_seed(7))
    noisy, noise = add_noise(apply(b.state_dict(), instances, el), 0.01, seed=8)
    a = with_weights(b, noisy)
    aligned, rep = align(a, b, ("attn", "ffn", "rescale", "residual"), residual="permutation")
    assert rep["residual_variant"] == "permutation"
    assert rep["distance_after"] == pytest.approx(noise, rel=0.2)  # the hidden element is undone
    _, rep0 = align(a, b, ("attn", "ffn", "rescale"))
    assert rep0["distance_after"] > 5 * rep["distance_after"]
    assert output_rel_diff(a, aligned, make_inputs(a)) <= 1e-4


def test_independent_decoders_coordinate_descent_is_monotone(fp64_rmsnorm):
    a, b = make_model("llama", head=True, seed=0), make_model("llama", head=True, seed=9)
    inputs = make_inputs(a)
    aligned, report = align(a, b, ("attn", "ffn", "rescale", "residual"), inputs=inputs)
    sweeps = report["residual_sweeps_sq_distance"]
    assert len(sweeps) >= 2 and all(y <= x * (1 + 1e-12) for x, y in zip(sweeps, sweeps[1:-1]))
    assert report["distance_after"] ** 2 == pytest.approx(min(sweeps), rel=1e-9)  # the best sweep is returned
    assert report["distance_after"] < report["distance_before"]
    assert output_rel_diff(a, aligned, inputs) <= 1e-10
    _, local = align(a, b, ("attn", "ffn", "rescale"), inputs=inputs)
    assert local["distance_after"] < local["distance_before"]


def test_head_permutation_finds_a_hidden_one_that_index_pairing_cannot_undo():
    """B = a hidden head permutation of A followed by per-head rotations and FFN permutations. With
    ``heads`` the alignment returns B's weights; pairing heads by index (the paper's) cannot."""
    from symmerge.core.distance import distance, parameter_keys
    from symmerge.groups.heads import HeadPerm

    a = make_model("vit", head=True, num_attention_heads=4, hidden_size=32)
    _, instances = instances_for(a)
    hidden = torch.tensor([2, 0, 3, 1])
    heads = [i for i in instances if i.group.kind == "heads"]
    permuted = apply(a.state_dict(), heads, {i.name: HeadPerm(hidden, hidden) for i in heads})
    local = [i for i in instances if i.group.symmetry in ("attn", "ffn")]
    b = with_weights(a, apply(permuted, local, random_elements(local, torch.Generator().manual_seed(3), scale=False)))
    assert breaks(a, b.state_dict()) < 1e-10  # really a symmetry
    keys = parameter_keys(a)
    start = distance(a.state_dict(), b.state_dict(), keys)
    full, report = align(a, b, ("heads", "attn", "ffn", "rescale"))
    assert distance(full.state_dict(), b.state_dict(), keys) < 1e-9 * start
    by_index, _ = align(a, b, ("attn", "ffn", "rescale"))
    assert distance(by_index.state_dict(), b.state_dict(), keys) > 0.1 * start
