"""GPT-2: Conv1D layers (weight in × out) and the fused ``c_attn`` (Q, K, V = column blocks 0, 1, 2).

Per-head QK/VO rotations + rescale and the FFN permutation must leave GPT2Model / GPT2LMHeadModel
unchanged, act on exactly the right column blocks (checked against a hand computation in Conv1D
terms), and misplaced variants (wrong block, nn.Linear axis convention, Q without K) must break it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import add_noise, make_inputs, output_rel_diff, sq_dist, with_weights
from symmerge.align import align, instances_for
from symmerge.apply import HeadElement, PermElement, apply, random_elements

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
HIDDEN, HEADS, LAYERS, D = 24, 3, 2, 8


def gpt2(head: bool = True, dtype=torch.float64, seed: int = 0):
    """A tiny random GPT-2 with non-zero biases and LayerNorms."""
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=60, n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=32,
                     initializer_range=0.3, bos_token_id=0, eos_token_id=0)
    model = (GPT2LMHeadModel if head else GPT2Model)(cfg)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model.to(dtype).eval()


def local_instances(model):
    """The per-layer instances (QK, VO, FFN); the opt-in residual group is tested on its own below."""
    return [i for i in instances_for(model)[1] if i.group.kind != "residual"]


def elements_for(instances, symmetry: str, seed: int = 0) -> dict:
    """A random element of one symmetry only: ``attn`` (rotations), ``rescale`` (scales), ``ffn``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for inst in instances:
        el = random_elements([inst], g)[inst.name]
        if isinstance(el, HeadElement):
            if symmetry == "attn":
                out[inst.name] = HeadElement(el.R, torch.ones_like(el.a))
            elif symmetry == "rescale":
                out[inst.name] = HeadElement(HeadElement.identity(inst.blocks, inst.size).R, el.a)
        elif symmetry == "ffn":
            out[inst.name] = el
    assert out
    return out


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("head", [False, True], ids=["GPT2Model", "GPT2LMHeadModel"])
@pytest.mark.parametrize("symmetry", ["attn", "rescale", "ffn", "all"])
def test_random_element_preserves_outputs(symmetry, head, dtype):
    model = gpt2(head, dtype)
    inputs = make_inputs(model)
    instances = local_instances(model)
    assert len(instances) == 3 * LAYERS
    for seed in (0, 1):
        if symmetry == "all":
            elements = random_elements(instances, torch.Generator().manual_seed(seed))
        else:
            elements = elements_for(instances, symmetry, seed)
        moved = with_weights(model, apply(model.state_dict(), instances, elements))
        assert output_rel_diff(model, moved, inputs) <= TOL[dtype]


def test_element_moves_exactly_the_fused_blocks():
    """By hand, in Conv1D terms (``y = x W + b``, head k of Q = columns k·d … of block 0):
    Q_k → a·Q_k R, K_k → K_k R / a, V_k → a'·V_k R', rows of c_proj → R'ᵀ rows / a', FFN columns
    of c_fc and rows of mlp.c_proj permuted; nothing else changes."""
    model = gpt2(head=True)
    sd = model.state_dict()
    instances = local_instances(model)
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


def test_qk_element_leaves_the_v_block_alone():
    model = gpt2()
    sd = model.state_dict()
    _, instances = instances_for(model)
    qk = [i for i in instances if i.group.name == "attn.qk"]
    new = apply(sd, qk, random_elements(qk, torch.Generator().manual_seed(0)))
    key = "transformer.h.0.attn.c_attn.weight"
    assert torch.equal(new[key][:, 2 * HIDDEN:], sd[key][:, 2 * HIDDEN:])
    assert not torch.allclose(new[key][:, :HIDDEN], sd[key][:, :HIDDEN])


def _replace_slots(inst, fn):
    return dataclasses.replace(inst, slots=tuple(fn(s) for s in inst.slots))


@pytest.mark.parametrize("how", ["linear_axis", "wrong_block", "q_without_k"])
def test_misplaced_transforms_break_the_model(how):
    model = gpt2()
    inputs = make_inputs(model)
    _, instances = instances_for(model)
    qk = [i for i in instances if i.group.name == "attn.qk"]
    elements = random_elements(qk, torch.Generator().manual_seed(5), scale=False)
    if how == "linear_axis":  # treat c_attn as nn.Linear (out × in): rotate rows instead of columns
        broken = [_replace_slots(i, lambda s: dataclasses.replace(s, axis=0) if s.key.endswith("weight") else s)
                  for i in qk]
    elif how == "wrong_block":  # rotate Q with V's block instead of K's
        broken = [_replace_slots(i, lambda s: dataclasses.replace(s, start=2 * HIDDEN) if s.power == -1 else s)
                  for i in qk]
    else:
        broken = [dataclasses.replace(i, slots=tuple(s for s in i.slots if s.power == 1)) for i in qk]
    correct = with_weights(model, apply(model.state_dict(), qk, elements))
    assert output_rel_diff(model, correct, inputs) <= 1e-10
    wrong = with_weights(model, apply(model.state_dict(), broken, elements))
    assert output_rel_diff(model, wrong, inputs) > 1e-3


def disguised(anchor, seed=1, noise=0.0, residual=False):
    instances = instances_for(anchor)[1] if residual else local_instances(anchor)
    sd, noise_norm = anchor.state_dict(), 0.0
    if noise:
        sd, noise_norm = add_noise(sd, noise, seed + 100, sorted({s.key for i in instances for s in i.slots}))
    elements = random_elements(instances, torch.Generator().manual_seed(seed))
    return with_weights(anchor, apply(sd, instances, elements)), noise_norm


@pytest.mark.parametrize("rescale", ["joint", "sequential"])
@pytest.mark.parametrize("head", [False, True], ids=["GPT2Model", "GPT2LMHeadModel"])
def test_recovers_transformed_copy(head, rescale):
    anchor = gpt2(head)
    model, _ = disguised(anchor)
    inputs = make_inputs(anchor)
    aligned, report = align(model, anchor, rescale=rescale, inputs=inputs)
    keys = [n for n, _ in anchor.named_parameters()]
    assert report["distance_before"] > 10
    assert sq_dist(aligned.state_dict(), anchor.state_dict(), keys) ** 0.5 <= 1e-9 * report["distance_before"]
    assert output_rel_diff(model, aligned, inputs) <= 1e-10


def test_noisy_copy_aligns_to_noise_level():
    anchor = gpt2(dtype=torch.float32)
    model, noise = disguised(anchor, seed=2, noise=0.02)
    _, report = align(model, anchor)
    assert report["distance_before"] > 20 * noise
    assert 0.9 * noise <= report["distance_after"] <= noise * (1 + 1e-5)
    assert report["verify_max_rel_diff"] <= 1e-5


# ------------------------------------------------------------------ residual stream (LayerNorm: permutations)


def residual_of(model):
    _, instances = instances_for(model)
    return [i for i in instances if i.group.kind == "residual"], instances


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("cls", ["GPT2LMHeadModel", "GPT2ForSequenceClassification"])
def test_residual_permutation_preserves_outputs(cls, dtype):
    """One permutation of the hidden dims through wte, wpe, every c_attn/c_fc row (Conv1D inputs), every
    c_proj column and bias (outputs), every LayerNorm's γ and β, and the (tied) LM head or score head."""
    import transformers

    model = gpt2(head=True, dtype=dtype)
    if cls != "GPT2LMHeadModel":
        torch.manual_seed(0)
        cfg = model.config
        cfg.num_labels, cfg.pad_token_id = 3, 0
        clf = getattr(transformers, cls)(cfg).to(dtype).eval()
        clf.transformer.load_state_dict(model.transformer.state_dict())
        model = clf
    (res,), instances = residual_of(model)
    assert res.variant == "permutation" and res.size == HIDDEN
    head = "lm_head.weight" if cls == "GPT2LMHeadModel" else "score.weight"
    keys = {s.key for s in res.slots}
    assert {"transformer.wte.weight", "transformer.wpe.weight", "transformer.h.1.attn.c_attn.weight",
            "transformer.h.0.mlp.c_proj.bias", "transformer.h.1.ln_2.bias", "transformer.ln_f.weight", head} <= keys
    x = make_inputs(model)
    sd = model.state_dict()
    for seed in (0, 1):
        for which in ([res], instances):  # the residual alone, then every group at once
            el = random_elements(which, torch.Generator().manual_seed(seed))
            new = apply(sd, which, el)
            assert not torch.equal(new["transformer.h.0.attn.c_attn.weight"], sd["transformer.h.0.attn.c_attn.weight"])
            moved = with_weights(model, new)
            assert output_rel_diff(model, moved, x) <= TOL[dtype]
            if cls == "GPT2LMHeadModel":  # the head stays tied to the (moved) embeddings
                assert moved.lm_head.weight.data_ptr() == moved.transformer.wte.weight.data_ptr()
                assert torch.equal(moved.lm_head.weight, new["transformer.wte.weight"])


@pytest.mark.parametrize("how", ["rotation", "norms_left_alone"])
def test_misplaced_residual_transforms_break_gpt2(how):
    """Negative controls: a rotation of the stream (LayerNorm centring does not commute with it), and a
    permutation of every stream tensor except the LayerNorms' γ and β."""
    from symmerge.apply import haar

    model = gpt2(head=True)
    (res,), _ = residual_of(model)
    dense = dataclasses.replace(res, slots=tuple(s for s in res.slots if not s.diag))
    if how == "rotation":
        Q = haar(1, res.size, torch.Generator().manual_seed(0))
        element = HeadElement(Q, torch.ones(1, dtype=torch.float64))
        new = apply(model.state_dict(), [dataclasses.replace(dense, variant="orthogonal")], {res.name: element})
    else:
        new = apply(model.state_dict(), [dense], random_elements([res], torch.Generator().manual_seed(0)))
    assert output_rel_diff(model, with_weights(model, new), make_inputs(model)) > 1e-3


def test_gpt2_base_model_has_no_residual_group():
    assert residual_of(gpt2(head=False))[0] == []


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_alignment_recovers_a_hidden_residual_permutation(dtype):
    anchor = gpt2(head=True, dtype=dtype)
    model, noise = disguised(anchor, seed=4, noise=0.01, residual=True)
    aligned, rep = align(model, anchor, ("attn", "ffn", "rescale", "residual"))
    assert rep["residual_variant"] == "permutation"
    assert rep["distance_after"] == pytest.approx(noise, rel=0.2)  # the hidden element is undone
    _, rep0 = align(model, anchor, ("attn", "ffn", "rescale"))
    assert rep0["distance_after"] > 5 * rep["distance_after"]
    assert output_rel_diff(model, aligned, make_inputs(model)) <= TOL[dtype] * 10
    assert aligned.lm_head.weight.data_ptr() == aligned.transformer.wte.weight.data_ptr()
