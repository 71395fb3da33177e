"""Permutation of the experts of a mixture-of-experts layer (the user-facing symmetry ``experts``).

The router scores the experts with one row each (``logits = x Wᵀ``); softmax, top-k and the
renormalisation of the top-k weights (``norm_topk_prob``) are all equivariant under a permutation of
the experts, and the layer's output is a weighted sum over the chosen experts. So permuting the router's
rows (and bias) and the experts' weights (axis 0 of the fused ``gate_up_proj`` (E, 2I, d) and
``down_proj`` (E, d, I)) with one permutation preserves the function, ties in top-k aside.

Inside each expert its FFN units may be permuted too: the group named by the ``inner`` parameter (a
``permutation`` group of stacked members, one instance per expert; SwiGLU: with the unit scale).

Best element, jointly with the inner permutations: moving A closest (L2) to B over the experts and their
inner FFN permutations is maximising ``Σ_e S[π(e), e]`` with ``S[e, f]`` = the router rows' inner product
``⟨r_e^A, r_f^B⟩`` + the best inner-permuted inner product of expert ``e`` of A with expert ``f`` of B
(the optimum of the inner FFN assignment for that pair: one cost GEMM and exact assignment per pair,
E² of them). One exact E × E assignment on ``S`` then gives the joint optimum; the inner group, solved
next on the permuted model, finds the chosen pairs' inner permutations again (the same costs; unit
scales too with ``rescale``). Without the ``ffn`` symmetry the inner permutations stay the identity and
``S`` uses the unpermuted inner products. Cost: E² inner assignments per layer (64 for 8 experts, on
``Options.workers`` threads), against E for the inner group alone.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..core.parallel import layer_map
from ..core.slots import index_axis, unit_matrix
from ..core.solvers import match_permutation
from ..errors import SymmergeError
from .base import Kind, is_permutation


@dataclass(frozen=True)
class ExpertsInfo:
    inner: tuple = ()  # the inner FFN group's instances of this layer, one per expert (expert e: t[e])


@dataclass
class ExpertsElement:
    """``perm`` (E,): new expert j is old expert ``perm[j]``."""

    perm: torch.Tensor


def _flat(inst):
    """The instance of one expert with its slots addressed inside the sub-tensor ``t[e]``."""
    return replace(inst, slots=tuple(replace(s, index=None, axis=s.axis - 1) for s in inst.slots))


def expert_scores(inst, sd_a: dict, sd_b: dict, opts) -> torch.Tensor:
    """``S`` (E × E, float64): ``S[e, f]`` = the router rows' inner product of A's expert e with B's
    expert f, plus the best inner-permuted inner product of their FFNs (the identity's when the inner
    group is not active)."""
    from .permutation import KIND as PERMUTATION, permutation_cost

    E, inner = inst.size, inst.info.inner
    inner_keys = {s.key for i in inner for s in i.slots}
    S = torch.zeros(E, E, dtype=torch.float64)
    for s in inst.slots:  # the router's rows (and any other per-expert tensor outside the inner group)
        if s.key not in inner_keys:
            S += unit_matrix(sd_a[s.key], s, torch.float64) @ unit_matrix(sd_b[s.key], s, torch.float64).T
    if not inner:
        return S
    permute, _, signed = PERMUTATION.plan(inner[0], opts)
    flat = _flat(inner[0])
    keys = [s.key for s in flat.slots]

    def pair(ef):
        e, f = ef
        C = permutation_cost(flat, {k: sd_a[k][e] for k in keys}, {k: sd_b[k][f] for k in keys}, signed,
                             device=opts.device)
        if not permute:
            return C.diagonal().double().sum().item()
        perm = match_permutation(C.clone(), consume=True)
        return C[perm, torch.arange(len(perm))].double().sum().item()

    pairs = [(e, f) for e in range(E) for f in range(E)]
    for (e, f), value in zip(pairs, layer_map(pair, pairs, opts.workers)):
        S[e, f] += value
    return S


class ExpertsKind(Kind):
    name = "experts"
    activation_sites = "weights"  # the router and fused experts are no Linear modules: activation matching
    # solves the experts' permutation on the weights, exactly, given the groups before it
    description = ("permutation of a layer's experts, the router's rows with them (top-k and the routing "
                   "normalisation are permutation-equivariant); matched jointly with the FFN permutation "
                   "inside each expert")

    def bind(self, group, ctx, layer):
        inst = ctx.instance(group, layer, blocked=False)
        inner_group = ctx.spec.group(group.param("inner", ""))
        inner = tuple(ctx.stacked_instances(inner_group, layer)) if inner_group is not None else ()
        if inner and len(inner) != inst.size:
            raise SymmergeError(f"{inst.name}: {inst.size} router rows but {len(inner)} experts")
        return ctx.with_info(inst, ExpertsInfo(inner))

    def complete(self, insts, prepared, sd_a, sd_b, opts, ctx=None) -> dict:
        return {inst.name: ExpertsElement(match_permutation(expert_scores(inst, sd_a, sd_b, opts)))
                for inst in insts}

    def identity(self, inst) -> ExpertsElement:
        return ExpertsElement(torch.arange(inst.size))

    def random(self, inst, generator, scale: bool = True) -> ExpertsElement:
        return ExpertsElement(torch.randperm(inst.size, generator=generator))

    def check(self, inst, element, tol: float = 1e-6) -> None:
        if not is_permutation(element.perm, inst.size):
            raise SymmergeError(f"{inst.name}: solver returned a non-bijective permutation of the experts")

    def transform(self, t, slot, inst, element) -> torch.Tensor:
        return index_axis(t, slot, element.perm)

    def sides(self, inst) -> list[tuple]:
        """The router's rows, and the experts' weights."""
        inner_keys = {s.key for i in inst.info.inner for s in i.slots}
        return [tuple(s for s in inst.slots if s.key not in inner_keys),
                tuple(s for s in inst.slots if s.key in inner_keys)]


KIND = ExpertsKind()
