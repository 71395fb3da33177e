"""Mixtures of experts (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): the ``experts`` group on the real classes.

The parametrized suite (test_groups.py) covers every MoE family's kinds (fp64/fp32 equivalence, exact
tensors moved, negative controls, recovery). Here: the routing normalisation both ways, the negative
control of the experts group by name (experts without the router's rows), the joint expert + inner FFN
matching against brute force, the fused-in-memory / per-expert-on-disk layout through the CLI and
activation matching through ``align`` (the streamed path: test_moe_stream.py; activation matching:
test_moe_activations.py).
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from conftest import make_inputs, output_rel_diff, run_cli, with_weights
from factories import disguised, make_model
from symmerge.core.apply import apply, random_elements
from symmerge.core.distance import sq_distance
from symmerge.groups import Options
from symmerge.pipeline.align import align, instances_for
from symmerge.pipeline.engine import solve_local

pytestmark = pytest.mark.usefixtures("single_thread")

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def _experts(model):
    _, instances = instances_for(model)
    return [i for i in instances if i.group.kind == "experts"]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("norm_topk", [True, False], ids=["renormalised", "raw-topk"])
@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "olmoe"])
def test_expert_permutation_preserves_outputs_under_either_routing_normalisation(family, norm_topk, dtype, request):
    if dtype == torch.float64:
        request.getfixturevalue("fp64_rmsnorm")
    model = make_model(family, head=True, dtype=dtype, norm_topk_prob=norm_topk)
    insts = _experts(model)
    inputs = make_inputs(model, length=16)
    sd = model.state_dict()
    elements = random_elements(insts, torch.Generator().manual_seed(4))
    assert all(not torch.equal(e.perm, torch.arange(len(e.perm))) for e in elements.values())
    moved = apply(sd, insts, elements)
    assert output_rel_diff(model, with_weights(model, moved), inputs) <= TOL[dtype]
    # negative controls: the experts without the router's rows, the router's rows without the experts
    for side in (0, 1):
        partial = [i.__class__(**{**i.__dict__, "slots": i.kind.sides(i)[side]}) for i in insts]
        broken = apply(sd, partial, elements)
        assert output_rel_diff(model, with_weights(model, broken), inputs) > 1e-3


def test_top_k_routing_really_selects_different_experts():
    """The check above is not vacuous: tokens pick different experts, and the permuted model picks the
    permuted ones (the router's logits move with the experts)."""
    model = make_model("mixtral", head=True, dtype=torch.float32)
    inputs = make_inputs(model, length=16)
    insts = _experts(model)
    elements = random_elements(insts, torch.Generator().manual_seed(4))
    moved = with_weights(model, apply(model.state_dict(), insts, elements))
    with torch.no_grad():
        a = model(**inputs, output_router_logits=True).router_logits
        b = moved(**inputs, output_router_logits=True).router_logits
    for layer, (la, lb) in enumerate(zip(a, b)):
        chosen = la.topk(2, dim=-1).indices
        assert len({tuple(sorted(r.tolist())) for r in chosen}) > 1
        perm = elements[f"layer.{layer}.experts"].perm
        torch.testing.assert_close(lb, la[:, perm])


# ------------------------------------------------------------------ joint matching against brute force


def _tiny_mixtral(seed: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=16, hidden_size=4, intermediate_size=3, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=2)
    torch.manual_seed(seed)
    return MixtralForCausalLM(cfg).double().eval()


@pytest.mark.parametrize("with_ffn", [True, False], ids=["experts+ffn", "experts"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_joint_expert_matching_equals_brute_force(seed, with_ffn):
    """Over every permutation of the 3 experts and (with ``ffn``) every permutation of the 3 units inside
    each of them (6 × 6³ elements), no element brings A closer to B than the solver's."""
    a, b = _tiny_mixtral(seed), _tiny_mixtral(seed + 10)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    _, instances = instances_for(a)
    insts = [i for i in instances if i.group.name in ("experts", "expert_ffn")]
    experts = next(i for i in insts if i.group.kind == "experts")
    inner = [i for i in insts if i.group.name == "expert_ffn"]
    keys = sorted({s.key for i in insts for s in i.slots})
    symmetries = frozenset({"experts", "ffn"} if with_ffn else {"experts"})
    found = solve_local(insts, sd_a, sd_b, Options(symmetries=symmetries, workers=1))
    solved = sq_distance(apply(sd_a, [experts] + inner * with_ffn, found), sd_b, keys)

    from symmerge.groups.experts import ExpertsElement
    from symmerge.groups.permutation import PermElement

    best = float("inf")
    unit_perms = list(itertools.permutations(range(3))) if with_ffn else [(0, 1, 2)]
    for perm in itertools.permutations(range(3)):
        moved = apply(sd_a, [experts], {experts.name: ExpertsElement(torch.tensor(perm))})
        for inner_perms in itertools.product(unit_perms, repeat=3):
            elements = {i.name: PermElement(torch.tensor(p)) for i, p in zip(inner, inner_perms)}
            best = min(best, sq_distance(apply(moved, inner, elements), sd_b, keys))
    assert solved <= best * (1 + 1e-12)
    assert solved <= sq_distance(sd_a, sd_b, keys)


def test_expert_scores_count_the_router_rows():
    """With identical experts, only the router's rows tell them apart: the matching follows them."""
    from symmerge.groups.experts import expert_scores

    b = _tiny_mixtral(0)
    sd_b = b.state_dict()
    key = "model.layers.0.mlp.experts.gate_up_proj"
    sd_b[key] = sd_b[key][:1].expand_as(sd_b[key]).clone()
    down = "model.layers.0.mlp.experts.down_proj"
    sd_b[down] = sd_b[down][:1].expand_as(sd_b[down]).clone()
    experts = _experts(b)[0]
    sd_a = apply(sd_b, [experts], {experts.name: type(experts.kind.identity(experts))(torch.tensor([2, 0, 1]))})
    S = expert_scores(experts, sd_a, sd_b, Options(symmetries=frozenset({"experts", "ffn"}), workers=1))
    found = experts.kind.complete([experts], None, sd_a, sd_b, Options(symmetries=frozenset({"experts"})))
    perm = found[experts.name].perm
    assert torch.equal(apply(sd_a, [experts], found)["model.layers.0.mlp.gate.weight"], sd_b["model.layers.0.mlp.gate.weight"])
    assert S.shape == (3, 3) and perm.tolist() == [1, 2, 0]


# ------------------------------------------------------------------ layouts, CLI, streaming, activations


def test_fused_experts_round_trip_through_the_cli(tmp_path, fp64_rmsnorm):
    """Saved per expert on disk, fused in memory: ``symmerge align`` (recommended: experts included)
    undoes a hidden element and writes a folder transformers loads, with per-expert tensors again."""
    from safetensors import safe_open
    from transformers import MixtralForCausalLM

    anchor = make_model("mixtral", head=True, dtype=torch.float32)
    model, _, _ = disguised(anchor, ("heads", "attn", "ffn", "experts"), seed=3)
    anchor.save_pretrained(tmp_path / "anchor")
    model.save_pretrained(tmp_path / "model")
    with safe_open(str(tmp_path / "model" / "model.safetensors"), "pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in f.keys()
    assert run_cli("align", tmp_path / "model", tmp_path / "anchor", "-o", tmp_path / "out") == 0
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    assert "experts" in report["symmetries"]
    assert report["distance_after"] <= 1e-4 * report["distance_before"]
    aligned = MixtralForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert output_rel_diff(model, aligned, make_inputs(model)) <= 1e-4
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        assert "model.layers.1.block_sparse_moe.experts.0.w1.weight" in f.keys()


def test_activation_matching_undoes_a_hidden_element_through_align(fp64_rmsnorm):
    """``--match activations`` through ``align``: the experts and the FFN inside each expert from the
    router's logits and the experts' units (test_moe_activations.py); a hidden element is undone exactly."""
    anchor = make_model("mixtral", head=True)
    symmetries = ("heads", "attn", "ffn", "experts")
    model, _, _ = disguised(anchor, symmetries, seed=5)
    from test_activations import unlabeled

    aligned, report = align(model, anchor, symmetries, rescale="none", match="activations",
                            align_data=unlabeled(anchor), align_samples=16)
    assert report["match"] == "activations"
    assert report["distance_after"] <= 1e-8 * report["distance_before"]
