"""A random group element must leave every architecture's outputs unchanged, touch exactly the
tensors its spec names, and nothing else; broken variants of the transform must be caught."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import ARCHS, make_inputs, make_model, output_rel_diff, with_weights
from symmerge.align import instances_for
from symmerge.apply import HeadElement, PermElement, apply, random_elements

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
CONTROL_MIN = 1e-3  # a broken transform must change outputs by at least this (relative)

# Independent ground truth: the tensors (per layer, relative to the base model) a group element moves.
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
    "bert": _BERT,
    "roberta": _BERT,
    "distilbert": _names("transformer.layer.{i}", "attention.q_lin", "attention.k_lin", "attention.v_lin",
                         "attention.out_lin", "ffn.lin1", "ffn.lin2"),
    "deberta-v2": _DEBERTA + tuple(f"encoder.layer.{{i}}.attention.self.{p}.{w}" for p in ("pos_key_proj", "pos_query_proj")
                                   for w in ("weight", "bias")),
    "deberta-v2-shared": _DEBERTA,
    "vit": _names("layers.{i}", "attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
                  "mlp.fc1", "mlp.fc2"),
}


def expected_keys(model, arch) -> set[str]:
    sd = model.state_dict()
    prefix = "" if "embeddings.word_embeddings.weight" in sd or "embeddings.cls_token" in sd else model.base_model_prefix + "."
    keys = {prefix + t.format(i=i) for i in range(model.config.num_hidden_layers) for t in EXPECTED[arch]}
    missing = keys - sd.keys()
    assert not missing, f"test table names tensors the model lacks: {sorted(missing)[:3]}"
    return keys


def transformed(model, seed=0, scale=True):
    """The per-layer groups (the residual stream's group is tested in test_vit_residual / test_llama_family)."""
    _, instances = instances_for(model)
    instances = [i for i in instances if i.group.kind != "residual"]
    elements = random_elements(instances, torch.Generator().manual_seed(seed), scale=scale)
    return instances, elements, apply(model.state_dict(), instances, elements)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("head", [False, True], ids=["base", "head"])
@pytest.mark.parametrize("arch", ARCHS)
def test_random_element_preserves_outputs(arch, head, dtype):
    model = make_model(arch, head=head, dtype=dtype)
    inputs = make_inputs(model)
    for seed in (0, 1):
        _, _, sd = transformed(model, seed)
        moved = with_weights(model, sd)
        assert output_rel_diff(model, moved, inputs) <= TOL[dtype]


@pytest.mark.parametrize("head", [False, True], ids=["base", "head"])
@pytest.mark.parametrize("arch", ARCHS)
def test_element_moves_exactly_the_spec_tensors(arch, head):
    model = make_model(arch, head=head)
    sd = model.state_dict()
    instances, _, new = transformed(model, seed=5)
    expected = expected_keys(model, arch)
    # the resolved spec names exactly these tensors (nothing skipped as 'optional', nothing extra)
    assert {s.key for inst in instances for s in inst.slots} == expected
    changed = {k for k in sd if not torch.equal(sd[k], new[k])}
    assert changed == expected
    for k in expected:  # and each one materially (not by rounding)
        assert (new[k] - sd[k]).norm() > 0.05 * sd[k].norm(), k
    # heads, pooler, embeddings, LayerNorms, output biases: bit-identical
    untouched = set(sd) - expected
    assert any("LayerNorm" in k or "layernorm" in k or "layer_norm" in k for k in untouched)
    assert any("embeddings" in k for k in untouched)
    if head:
        assert any("classifier" in k for k in untouched)
    for k in untouched:
        assert torch.equal(sd[k], new[k]), k


@pytest.mark.parametrize("arch", ["bert", "deberta-v2", "vit"])
def test_extreme_scales_still_exact(arch):
    model = make_model(arch)
    _, instances = instances_for(model)
    elements = random_elements(instances, torch.Generator().manual_seed(9))
    for k, inst in enumerate(instances):
        if isinstance(elements[inst.name], HeadElement):
            a = torch.full((inst.blocks,), 4.0 if k % 2 else 0.25, dtype=torch.float64)
            elements[inst.name] = HeadElement(elements[inst.name].R, a)
    moved = with_weights(model, apply(model.state_dict(), instances, elements))
    assert output_rel_diff(model, moved, make_inputs(model)) <= 1e-10


def test_identity_element_is_bit_exact():
    model = make_model("bert", dtype=torch.float32)
    _, instances = instances_for(model)
    elements = {i.name: (HeadElement.identity(i.blocks, i.size) if i.group.kind == "head_orthogonal"
                         else PermElement(torch.arange(i.size))) for i in instances}
    new = apply(model.state_dict(), instances, elements)
    for k, v in model.state_dict().items():
        assert torch.equal(v, new[k]), k


def test_apply_does_not_mutate_input():
    model = make_model("bert")
    sd = model.state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    transformed(model)
    for k in before:
        assert torch.equal(before[k], sd[k])


# ------------------------------------------------------------------ negative controls


def _only(inst, keep):
    return dataclasses.replace(inst, slots=tuple(s for s in inst.slots if keep(s)))


def _broken(model, how: str, seed=3):
    """State dict after a deliberately wrong 'symmetry' (the check above must notice these)."""
    _, instances = instances_for(model)
    g = torch.Generator().manual_seed(seed)
    elements = random_elements(instances, g, scale=False)  # rotations / permutations only
    chosen = []
    for inst in instances:
        group = inst.group.name
        if how == "rotate_q_not_k" and group == "attn.qk":
            chosen.append(_only(inst, lambda s: s.power == 1))
        elif how == "rotate_v_not_o" and group == "attn.vo":
            chosen.append(_only(inst, lambda s: s.power == 1))
        elif how == "scale_q_and_k_same_way" and group == "attn.qk":
            # a·Q with a·K (instead of K/a): softmax temperature changes
            elements[inst.name] = HeadElement(HeadElement.identity(inst.blocks, inst.size).R,
                                              torch.full((inst.blocks,), 1.7, dtype=torch.float64))
            chosen.append(dataclasses.replace(inst, slots=tuple(dataclasses.replace(s, power=1) for s in inst.slots)))
        elif how == "scale_v_without_o" and group == "attn.vo":
            elements[inst.name] = HeadElement(HeadElement.identity(inst.blocks, inst.size).R,
                                              torch.full((inst.blocks,), 1.7, dtype=torch.float64))
            chosen.append(_only(inst, lambda s: s.power == 1))
        elif how == "different_ffn_perms" and group == "ffn":
            chosen.append(_only(inst, lambda s: s.axis == 0))  # W_in rows, b_in with one permutation
            other = dataclasses.replace(_only(inst, lambda s: s.axis == 1), name=inst.name + ".out")
            elements[other.name] = PermElement(torch.randperm(inst.size, generator=g))  # W_out another
            chosen.append(other)
        elif how == "skip_relative_position_projections" and group == "attn.qk":
            chosen.append(_only(inst, lambda s: ".pos_" not in s.key))
        elif how == "correct":
            chosen.append(inst)
    assert chosen
    return apply(model.state_dict(), chosen, elements)


CONTROLS = ["rotate_q_not_k", "rotate_v_not_o", "scale_q_and_k_same_way", "scale_v_without_o", "different_ffn_perms"]


@pytest.mark.parametrize("how", CONTROLS)
@pytest.mark.parametrize("arch", ARCHS)
def test_negative_controls_change_outputs(arch, how):
    model = make_model(arch)
    inputs = make_inputs(model)
    assert output_rel_diff(model, with_weights(model, _broken(model, "correct")), inputs) <= 1e-10
    diff = output_rel_diff(model, with_weights(model, _broken(model, how)), inputs)
    assert diff > CONTROL_MIN, f"{how} changed outputs by only {diff:.3g}"


def test_deberta_relative_projections_are_needed():
    """With share_att_key=False, leaving pos_key_proj/pos_query_proj out of the QK group breaks c2p/p2c."""
    model = make_model("deberta-v2")
    diff = output_rel_diff(model, with_weights(model, _broken(model, "skip_relative_position_projections")),
                           make_inputs(model))
    assert diff > CONTROL_MIN
