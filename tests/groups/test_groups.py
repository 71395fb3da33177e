"""Every group kind on every family (the real transformers classes), from one parametrized suite:

* a random element of the kind preserves the function exactly (fp64 and fp32; base and task models);
* it changes exactly the tensors its group names, and nothing else;
* applying it to only some *sides* of the group (Q without K, the units' inputs without their
  output, the stream's writers without its readers...) breaks the function: the negative control;
* the identity element is bit-exact and the kind's validity check accepts its random elements;
* alignment brings a model disguised by hidden elements of every kind at once back to the anchor
  (to the noise level with noise).

Family-specific facts (RoPE layouts, GQA mapping, Qwen3's locked pairs, GPT-2's fused blocks,
LayerNorm vs rotations...) are in test_family_specifics.py; solvers against brute force in
test_solvers.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from conftest import make_inputs, output_rel_diff, sq_dist, with_weights
from factories import DEC_HEADS, DECODERS, FAMILIES, PRE_LAYERNORM, RMSNORM, WITH_RESIDUAL, disguised, make_model
from symmerge.core.apply import apply, canonicalize, check_elements, identity_elements, random_elements
from symmerge.groups import KINDS
from symmerge.pipeline.align import align, instances_for

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
CONTROL_MIN = 1e-3  # a broken transform must change outputs by at least this (relative)
ALL = ("heads", "attn", "ffn", "rescale", "residual", "experts")


def all_of(spec, instances) -> tuple:
    """The symmetries of ``ALL`` that the model's family declares (align_pair refuses the others), the residual
    stream only where the model binds it (a base model's output is the stream)."""
    declared = {g.symmetry for g in spec.groups} | {"rescale"}
    return tuple(s for s in ALL if s in declared and (s != "residual" or any(not i.kind.per_layer for i in instances)))


@functools.cache
def kinds_of(family: str) -> tuple[str, ...]:
    _, instances = instances_for(make_model(family, head=True))
    return tuple(dict.fromkeys(i.group.kind for i in instances))


# (family, kind, residual group choice): LayerNorm streams in both groups
CASES = [(f, k, "largest") for f in FAMILIES for k in kinds_of(f)] + [(f, "residual", "permutation") for f in PRE_LAYERNORM]


def test_every_kind_is_exercised():
    assert {k for _, k, _ in CASES} == set(KINDS)


def _setup(family, kind, residual="largest", dtype=torch.float64, tied=False, request=None):
    if dtype == torch.float64 and family in RMSNORM and request is not None:
        request.getfixturevalue("fp64_rmsnorm")
    model = make_model(family, head=True, dtype=dtype, tied=tied if family in DECODERS else None)
    _, instances = instances_for(model, residual=residual)
    chosen = [i for i in instances if i.group.kind == kind]
    assert chosen, f"{family} has no {kind} group"
    sd = canonicalize(model.state_dict(), [i for i in chosen if not i.kind.per_layer])
    return model, chosen, sd


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("family,kind,residual", CASES)
def test_random_element_preserves_outputs(family, kind, residual, dtype, request):
    model, chosen, sd = _setup(family, kind, residual, dtype, request=request)
    inputs = make_inputs(model)
    assert output_rel_diff(model, with_weights(model, sd), inputs) <= TOL[dtype]  # the canonical form
    for seed in (0, 1):
        elements = random_elements(chosen, torch.Generator().manual_seed(seed))
        check_elements(chosen, elements)
        new = apply(sd, chosen, elements)
        assert any(not torch.equal(new[k], sd[k]) for k in sd)
        assert output_rel_diff(model, with_weights(model, new), inputs) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("head", [False, True], ids=["base", "task"])
@pytest.mark.parametrize("family", FAMILIES)
def test_all_kinds_at_once(family, head, dtype, request):
    if dtype == torch.float64 and family in RMSNORM:
        request.getfixturevalue("fp64_rmsnorm")
    for tied in ((False, True) if head and family in DECODERS else (False,)):
        model = make_model(family, head=head, dtype=dtype, tied=tied)
        _, instances = instances_for(model)
        assert any(not i.kind.per_layer for i in instances) == (head and family in WITH_RESIDUAL)
        sd = canonicalize(model.state_dict(), instances)
        new = apply(sd, instances, random_elements(instances, torch.Generator().manual_seed(3)))
        assert output_rel_diff(model, with_weights(model, new), make_inputs(model)) <= TOL[dtype]


@pytest.mark.parametrize("family,kind,residual", CASES)
def test_element_moves_exactly_its_group_tensors(family, kind, residual):
    model, chosen, sd = _setup(family, kind, residual)
    new = apply(sd, chosen, random_elements(chosen, torch.Generator().manual_seed(5)))
    members = {k for i in chosen for s in i.slots for k in (s.key, *s.aliases)}
    changed = {k for k in sd if not torch.equal(sd[k], new[k])}
    assert changed <= members
    moved = [i for i in chosen if any(not torch.equal(new[s.key], sd[s.key]) for s in i.slots)]
    assert moved
    # every member materially (folded norms stay uniform, folded norm biases zero), in every instance whose
    # random element is not the identity (a permutation of 3 heads is, one time in 6)
    for i in moved:
        for s in i.slots:
            t = sd[s.key]
            if not ((s.diag and bool((t == t.reshape(-1)[0]).all())) or not bool(t.any())):
                assert (new[s.key] - sd[s.key]).norm() > 1e-3 * sd[s.key].norm(), s.key
    for k in set(sd) - members:
        assert torch.equal(sd[k], new[k]), k


@pytest.mark.parametrize("family,kind,residual", CASES)
def test_applying_an_element_to_part_of_the_group_breaks_the_model(family, kind, residual, request):
    """The negative control, generic: every side of the group is needed."""
    import dataclasses

    model, chosen, sd = _setup(family, kind, residual, request=request)
    inputs = make_inputs(model)
    elements = random_elements(chosen, torch.Generator().manual_seed(7))
    full = apply(sd, chosen, elements)
    tested = 0
    for side in range(len(chosen[0].kind.sides(chosen[0]))):
        partial = []
        for inst in chosen:
            sides = inst.kind.sides(inst)
            dropped = set(sides[side]) if side < len(sides) else set()
            partial.append(dataclasses.replace(inst, slots=tuple(s for s in inst.slots if s not in dropped)))
        broken = apply(sd, partial, elements)
        if all(torch.equal(broken[k], full[k]) for k in sd):
            continue  # this side's transform is the identity here (e.g. folded norm weights)
        diff = output_rel_diff(model, with_weights(model, broken), inputs)
        assert diff > CONTROL_MIN, f"leaving out side {side} of {kind} changed outputs by only {diff:.3g}"
        tested += 1
    assert tested >= 1


@pytest.mark.parametrize("family", FAMILIES)
def test_identity_elements_are_bit_exact(family):
    model = make_model(family, head=True, dtype=torch.float32)
    _, instances = instances_for(model)
    sd = canonicalize(model.state_dict(), instances)
    new = apply(sd, instances, identity_elements(instances))
    for k, v in sd.items():
        assert torch.equal(v, new[k]), k


def test_apply_does_not_mutate_its_input():
    model = make_model("llama", head=True)
    _, instances = instances_for(model)
    sd = model.state_dict()
    before = {k: v.clone() for k, v in sd.items()}
    apply(canonicalize(sd, instances), instances, random_elements(instances, torch.Generator().manual_seed(0)))
    for k in before:
        assert torch.equal(before[k], sd[k]), k


# ------------------------------------------------------------------ recovery by alignment


def _params(model) -> list[str]:
    return [n for n, _ in model.named_parameters()]


RECOVERY = [(f, False) for f in FAMILIES] + [(f, True) for f in ("gpt2", "llama", "qwen3", "gemma", "gemma3", "gpt_neox")]


@pytest.mark.parametrize("family,tied", RECOVERY)
def test_alignment_recovers_a_hidden_element_of_every_kind(family, tied, request):
    if family in RMSNORM:
        request.getfixturevalue("fp64_rmsnorm")
    anchor = make_model(family, head=True, tied=tied if family in DECODERS else None)
    spec, instances = instances_for(anchor)
    symmetries = all_of(spec, instances)
    model, _, canonical = disguised(anchor, symmetries)
    inputs = make_inputs(anchor)
    assert output_rel_diff(anchor, model, inputs) <= 1e-10
    aligned, report = align(model, anchor, symmetries, inputs=inputs)
    assert type(aligned) is type(anchor)
    assert report["distance_before"] > 10
    # independent of the report: the aligned weights equal the (canonical) anchor's
    assert sq_dist(aligned.state_dict(), canonical, _params(anchor)) ** 0.5 <= 1e-9 * report["distance_before"]
    assert report["distance_after"] <= 1e-9 * report["distance_before"]
    assert output_rel_diff(anchor, aligned, inputs) <= 1e-10
    for name, d in report["per_module"].items():
        assert d["after"] <= 1e-9 * max(d["before"], 1.0), name
    if tied:  # the LM head is still the embedding matrix
        assert aligned.get_output_embeddings().weight is aligned.get_input_embeddings().weight
    if "residual" in symmetries:
        sweeps = report["residual_sweeps_sq_distance"]
        assert sweeps[-1] <= 1e-18 * report["distance_before"] ** 2 + 1e-24
        if report["residual_variant"] == "orthogonal":  # RMSNorm weights folded into their readers
            neutral = 1.0 - spec.folds[0].offset  # the weight of a norm multiplying by 1 (Gemma's 1 + w: w = 0)
            for k, v in aligned.state_dict().items():
                if "norm" in k and not k.endswith(("q_norm.weight", "k_norm.weight")):
                    assert torch.equal(v, torch.full_like(v, neutral)), k


@pytest.mark.parametrize("kv", [DEC_HEADS, 1], ids=["mha", "one-kv-head"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_decoders_without_gqa_and_with_one_kv_head(family, kv, fp64_rmsnorm):
    anchor = make_model(family, head=True, num_key_value_heads=kv)
    model, _, canonical = disguised(anchor)
    assert output_rel_diff(anchor, model, make_inputs(anchor)) <= 1e-10
    aligned, report = align(model, anchor, all_of(*instances_for(anchor)))
    assert report["distance_after"] <= 1e-9 * report["distance_before"]


NOISY = [("bert", False), ("vit", False), ("gpt2", True), ("qwen2", False), ("qwen2", True), ("deberta-v2", False),
         ("gemma2", True), ("gpt_neox", False), ("phi3", False), ("olmo2", False), ("t5", False)]


@pytest.mark.parametrize("family,tied", NOISY)
def test_noisy_copy_aligns_to_the_noise_level_fp32(family, tied):
    anchor = make_model(family, head=True, dtype=torch.float32, tied=tied if family in DECODERS else None)
    spec, instances = instances_for(anchor)
    symmetries = all_of(spec, instances)
    model, noise, _ = disguised(anchor, symmetries, seed=2, noise=0.02)
    aligned, report = align(model, anchor, symmetries)
    assert report["distance_before"] > 20 * noise
    assert 0.8 * noise <= report["distance_after"] <= noise * (1 + 1e-4)
    assert report["verify_max_rel_diff"] <= 1e-5


def test_validity_checks_reject_invalid_elements():
    from symmerge.errors import SymmergeError
    from symmerge.groups.head_orthogonal import HeadElement
    from symmerge.groups.heads import HeadPerm
    from symmerge.groups.permutation import PermElement
    from symmerge.groups.residual import StreamElement

    model = make_model("vit", head=True)
    _, instances = instances_for(model, residual="largest")
    by_kind = {i.group.kind: i for i in instances}
    qk, ffn, heads, res = (by_kind[k] for k in ("head_orthogonal", "permutation", "heads", "residual"))
    d, H = qk.size, qk.blocks
    eye = torch.eye(d, dtype=torch.float64).expand(H, d, d)
    qk.kind.check(qk, HeadElement(eye.clone(), torch.ones(H, dtype=torch.float64)))
    bad = [(qk, HeadElement(2 * eye, torch.ones(H, dtype=torch.float64)), "invalid element"),
           (qk, HeadElement(eye.clone(), -torch.ones(H, dtype=torch.float64)), "invalid element"),
           (ffn, PermElement(torch.zeros(ffn.size, dtype=torch.long)), "bijective"),
           (ffn, PermElement(torch.arange(ffn.size), torch.zeros(ffn.size, dtype=torch.float64)), "unit scale"),
           (heads, HeadPerm(torch.tensor([0, 0, 1]), torch.tensor([0, 0, 1])), "bijective"),
           (res, StreamElement(Q=2 * torch.eye(res.size, dtype=torch.float64)), "invalid element")]
    for inst, element, message in bad:
        with pytest.raises(SymmergeError, match=message):
            inst.kind.check(inst, element)
