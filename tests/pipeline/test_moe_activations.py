"""Activation matching of mixtures of experts (``--match activations`` with ``experts``).

The ``experts`` kind reads the router's input (its ``activation_sites`` are its "inputs") and scores each
pair of experts by the correlation of their router logits plus the mean correlation of their hidden
units under the best inner assignment (every expert evaluated on every token); one exact E × E
assignment, and the FFN permutation inside each matched pair from the same correlations. Here: recovery
of a hidden expert permutation with the inner permutations (and SwiGLU unit scales) from activations
alone, the weights never asked (their solvers raise), the joint optimum against enumeration of every
element of a 3-expert model, and the aligned model computing the same function."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import make_inputs, output_rel_diff
from factories import disguised, make_model
from symmerge.errors import SymmergeError
from symmerge.groups.experts import ExpertsKind
from symmerge.groups.permutation import Permutation
from symmerge.pipeline.activations import match_activations
from symmerge.pipeline.align import align, instances_for
from test_activations import canonical_pair, max_error, unlabeled

pytestmark = pytest.mark.usefixtures("single_thread", "fp64_rmsnorm")


def _weights_refused(monkeypatch):
    """The experts' and the inner FFN's weight solvers raise: every element must come from activations."""
    def refuse(*args, **kwargs):
        raise AssertionError("solved on the weights")

    monkeypatch.setattr(ExpertsKind, "complete", refuse)
    monkeypatch.setattr(Permutation, "prepare", refuse)


@pytest.mark.parametrize("symmetries", [("experts", "ffn"), ("experts", "ffn", "rescale"), ("heads", "attn", "experts", "ffn")],
                         ids=["experts+ffn", "with-unit-scales", "with-attention"])
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "olmoe"])
def test_activations_recover_a_hidden_expert_permutation(family, symmetries, monkeypatch):
    anchor = make_model(family, head=True)
    moved, _, _ = disguised(anchor, symmetries, seed=3)
    instances, opts, ca, cb, ma, mb = canonical_pair(moved, anchor, symmetries)
    experts = [i for i in instances if i.group.name == "experts"]
    _weights_refused(monkeypatch)
    elements = match_activations(instances, ma, mb, unlabeled(anchor), opts)
    assert all(not torch.equal(elements[i.name].perm, torch.arange(i.size)) for i in experts)  # really permuted
    assert max_error(instances, elements, ca, cb) < 1e-6


def test_qwen2_moe_with_its_shared_expert(monkeypatch):
    """The shared expert's FFN (a Linear FFN: its units' correlations) beside the routed experts."""
    anchor = make_model("qwen2_moe", head=True)
    moved, _, _ = disguised(anchor, ("experts", "ffn"), seed=4)
    instances, opts, ca, cb, ma, mb = canonical_pair(moved, anchor, ("experts", "ffn"))
    monkeypatch.setattr(ExpertsKind, "complete", lambda *a, **k: (_ for _ in ()).throw(AssertionError("weights")))
    elements = match_activations(instances, ma, mb, unlabeled(anchor), opts)
    assert max_error(instances, elements, ca, cb) < 1e-6


def test_aligned_model_from_activations_computes_the_same_function():
    """Through ``align`` (the CLI's path): another model, not a disguised copy; the result is verified."""
    model, anchor = make_model("mixtral", head=True, seed=1), make_model("mixtral", head=True, seed=0)
    syms = ("heads", "attn", "ffn", "experts", "rescale")
    aligned, report = align(model, anchor, syms, match="activations", align_data=unlabeled(anchor), align_samples=16)
    assert report["match"] == "activations" and "experts" in report["symmetries"]
    assert output_rel_diff(model, aligned, make_inputs(model)) < 1e-9
    assert report["distance_after"] < report["distance_before"]


# ------------------------------------------------------------------ the joint optimum against enumeration


def _tiny(seed: int):
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(vocab_size=16, hidden_size=4, intermediate_size=3, num_hidden_layers=1, num_attention_heads=2,
                        num_key_value_heads=1, num_local_experts=3, num_experts_per_tok=2)
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    return MixtralForCausalLM(cfg).double().eval()


def _features(model, data):
    """The router's inputs on the data's tokens (an independent hook), then per token the router logits
    (n, E) and every expert's hidden units silu(x W_gateᵀ) ⊙ (x W_upᵀ) (n, E, I)."""
    xs = []
    router = model.model.layers[0].mlp.gate
    handle = router.register_forward_pre_hook(lambda m, args: xs.append(args[0].reshape(-1, args[0].shape[-1])))
    with torch.no_grad():
        for batch in data:
            model(**batch.inputs)
            xs[-1] = xs[-1][batch.mask.reshape(-1)]
    handle.remove()
    x = torch.cat(xs)
    W = model.model.layers[0].mlp.experts.gate_up_proj.detach()
    n = W.shape[1] // 2
    h = torch.nn.functional.silu(torch.einsum("td,eid->tei", x, W[:, :n])) * torch.einsum("td,eid->tei", x, W[:, n:])
    return x @ router.weight.detach().T, h


def _corr(a, b):
    return torch.corrcoef(torch.cat([a, b], 1).T)[: a.shape[1], a.shape[1]:]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_joint_activation_matching_equals_enumeration(seed):
    """Over every permutation of the 3 experts and of the 3 units inside each (6 × 6³ elements), none
    scores higher than the solver's: Σ_j corr(router logit of A's π(j), B's j) + mean_u corr(unit σ_j(u)
    of A's π(j), unit u of B's j); and the optimum is not the identity's (a real choice)."""
    a, b = _tiny(seed), _tiny(seed + 10)
    data = unlabeled(b, batches=3)
    instances, opts, _, _, ma, mb = canonical_pair(a, b, ("experts", "ffn"))
    insts = [i for i in instances if i.group.name in ("experts", "expert_ffn")]
    elements = match_activations(insts, ma, mb, data, opts)
    (la, ha), (lb, hb) = _features(a, data), _features(b, data)
    R = _corr(la, lb)
    U = [[_corr(ha[:, e], hb[:, f]) for f in range(3)] for e in range(3)]

    def score(perm, inner):
        return sum(R[perm[j], j] + sum(U[perm[j]][j][inner[j][u], u] for u in range(3)) / 3 for j in range(3)).item()

    experts = next(i for i in insts if i.group.name == "experts")
    inner_names = [i.name for i in experts.info.inner]
    found = score(elements[experts.name].perm.tolist(), [elements[n].perm.tolist() for n in inner_names])
    best = max(score(p, inner) for p in itertools.permutations(range(3))
               for inner in itertools.product(itertools.permutations(range(3)), repeat=3))
    identity = score([0, 1, 2], [[0, 1, 2]] * 3)
    assert found == pytest.approx(best, abs=1e-9)
    assert identity < best - 1e-6


def test_activation_matching_of_experts_refuses_empty_data():
    anchor = make_model("mixtral", head=True)
    instances, opts, _, _, ma, mb = canonical_pair(anchor, anchor, ("experts", "ffn"))
    empty = unlabeled(anchor, batches=1)
    empty.batches[0].mask[:] = False  # every token padding
    with pytest.raises(SymmergeError, match="no tokens reached"):
        match_activations(instances, ma, mb, empty, opts)


def test_statistics_too_large_for_memory_are_refused_before_any_forward(monkeypatch):
    """(E·I)² float64 cross moments per layer: refused by name when over half the available memory."""
    from symmerge.groups import experts as experts_module

    anchor = make_model("mixtral", head=True)
    instances, opts, ca, cb, ma, mb = canonical_pair(anchor, anchor, ("experts", "ffn"))
    inst = next(i for i in instances if i.group.name == "experts")
    units = inst.size * inst.info.inner[0].size
    need = units * units * 8
    experts_module.check_statistics_memory(inst, available=2 * need)  # fits: no error
    with pytest.raises(SymmergeError, match="statistics per layer"):
        experts_module.check_statistics_memory(inst, available=2 * need - 1)
    monkeypatch.setattr("symmerge.core.memory.available_memory", lambda: need)  # what match_activations asks
    with pytest.raises(SymmergeError, match="use --match weights"):
        match_activations(instances, ma, mb, unlabeled(anchor), opts)
