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
    _, instances = instances_for(model)
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
    _, instances = instances_for(model)
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


def disguised(anchor, seed=1, noise=0.0):
    _, instances = instances_for(anchor)
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
