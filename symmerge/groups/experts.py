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

From activations (``--match activations``; ``activation_sites = "inputs"``): the router's input ``x`` on the
same tokens in both models gives each model's router logits and every expert's hidden units
``act(x W_gateᵀ) ⊙ (x W_upᵀ)`` (each expert on every token; :func:`expert_features`), accumulated as cross
moments (:class:`Moments`, (E·I)² per layer). ``S[e, f]`` = the correlation of the two router logits + the
mean unit correlation under the exact inner assignment of the pair (:func:`observed_scores`); one exact
E × E assignment on ``S`` is the joint optimum of that score, and the chosen pairs' inner assignments are
returned as the inner group's elements (its unit scales then come from the weights).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..core.parallel import layer_map
from ..core.slots import index_axis, stored, unit_matrix
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
    for s in inst.slots:  # the router's rows (and any other per-expert tensor outside the inner group), read as
        if s.key not in inner_keys:  # stored (no float32 copy of a half tensor): float64 either way, the same bits
            S += unit_matrix(stored(sd_a, s.key), s, torch.float64) @ unit_matrix(stored(sd_b, s.key), s,
                                                                                    torch.float64).T
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


@dataclass
class Moments:
    """Cross second moments of A's and B's features on the same tokens, with their sums and squares
    (enough for the correlation of every feature of A with every feature of B)."""

    cross: torch.Tensor
    sums: tuple
    squares: tuple
    count: int = 0

    @classmethod
    def of(cls, a: torch.Tensor, b: torch.Tensor) -> "Moments":
        m = cls(torch.zeros(a.shape[1], b.shape[1], dtype=torch.float64),
                (torch.zeros(a.shape[1], dtype=torch.float64), torch.zeros(b.shape[1], dtype=torch.float64)),
                (torch.zeros(a.shape[1], dtype=torch.float64), torch.zeros(b.shape[1], dtype=torch.float64)))
        return m.add(a, b)

    def add(self, a: torch.Tensor, b: torch.Tensor) -> "Moments":
        self.cross += (a.T @ b).double().cpu()
        for k, x in enumerate((a, b)):
            self.sums[k].add_(x.sum(0, dtype=torch.float64).cpu())
            self.squares[k].add_(x.double().square().sum(0).cpu())
        self.count += a.shape[0]
        return self

    def correlation(self) -> torch.Tensor:
        """corr(A's feature i, B's feature j) (a constant feature: correlation 0)."""
        n = max(self.count, 1)
        mean = [s / n for s in self.sums]
        std = [(q / n - m.square()).clamp_min(0).sqrt() for q, m in zip(self.squares, mean)]
        std = [torch.where(x > 1e-12 * x.max().clamp_min(1e-300), x, torch.full_like(x, math.inf)) for x in std]
        return (self.cross / n - torch.outer(mean[0], mean[1])) / std[0][:, None] / std[1][None, :]


def _module(key: str) -> str:
    return key.rsplit(".", 1)[0]


def _segments(inst):
    """(router slot, gate slot, up slot) of an experts instance, the gate and up segments of the fused
    ``gate_up`` tensor read from the inner FFN group's slots (power 0: the gate; the other: the up rows)."""
    router = [s for s in inst.slots if s.key not in {t.key for i in inst.info.inner for t in i.slots}]
    if len(router) != 1 or not inst.info.inner:
        raise SymmergeError(f"{inst.name}: activation matching of the experts needs the router's rows and the "
                            "FFN group inside each expert; use --match weights")
    flat = _flat(inst.info.inner[0])
    rows = [s for s in flat.slots if s.axis == 0]  # the gate and up rows (down: its columns, axis 1)
    gate = [s for s in rows if s.power == 0]
    up = [s for s in rows if s.power != 0]
    if len(gate) != 1 or len(up) != 1 or gate[0].key != up[0].key:
        raise SymmergeError(f"{inst.name}: activation matching of the experts reads gated experts (gate and up "
                            "rows of one fused tensor); use --match weights")
    return router[0], gate[0], up[0]


def expert_features(inst, x: torch.Tensor, model) -> tuple[torch.Tensor, torch.Tensor]:
    """``(router logits (n, E), every expert's hidden units (n, E·I))`` of ``model`` on the tokens ``x``
    (n × d, the router's input): each expert evaluated on every token, ``act(x W_gateᵀ) ⊙ (x W_upᵀ)``
    with the activation of the experts' module."""
    router, gate, up = _segments(inst)
    W = model.get_parameter(gate.key).detach()
    x = x.to(W.dtype)
    logits = x @ model.get_parameter(router.key).detach().T
    act = model.get_submodule(_module(gate.key)).act_fn
    g = torch.einsum("nd,eid->nei", x, W[:, gate.start: gate.start + gate.length])
    u = torch.einsum("nd,eid->nei", x, W[:, up.start: up.start + up.length])
    return logits, (act(g) * u).flatten(1)


def observed_scores(inst, stats: dict, opts) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(S, inner)`` from the activation statistics: ``S[e, f]`` (E × E) = the correlation of A's router
    logit for expert e with B's for expert f, plus the mean correlation of their hidden units paired by
    the best inner assignment (the identity's without the ``ffn`` symmetry; ``|correlation|`` where unit
    scales may flip signs); ``inner[e, f]`` (E × E × I) that assignment (None without ``ffn``)."""
    from .permutation import KIND as PERMUTATION

    E = inst.size
    permute, _, signed = PERMUTATION.plan(inst.info.inner[0], opts)
    S = stats["router"].correlation().clone()
    U = stats["units"].correlation()
    n = U.shape[0] // E
    U = U.view(E, n, E, n)
    inner = torch.empty(E, E, n, dtype=torch.long) if permute else None
    for e in range(E):
        for f in range(E):
            C = U[e, :, f, :].abs() if signed else U[e, :, f, :].clone()
            if permute:
                inner[e, f] = match_permutation(C.clone())
                S[e, f] += C[inner[e, f], torch.arange(n)].sum() / n
            else:
                S[e, f] += C.diagonal().sum() / n
    return S, inner


def check_statistics_memory(inst, available: int | None = None) -> None:
    """Refuse, before any statistic is gathered, an experts layer whose unit cross moments (float64,
    (E·I)² numbers: every hidden unit of every expert of A against every one of B) would take more than
    half the available memory (Mixtral-8x7B: 105 GB a layer)."""
    from ..core.memory import available_memory

    units = inst.size * (inst.info.inner[0].size if inst.info.inner else 0)
    need = units * units * 8
    free = available_memory() if available is None else available
    if free is not None and need > free // 2:
        raise SymmergeError(f"{inst.name}: activation matching of the experts needs {need / 2 ** 30:.1f} GiB of "
                            f"statistics per layer ({inst.size} experts x {units // max(inst.size, 1)} units, "
                            f"squared, float64) and {free / 2 ** 30:.1f} GiB is available; use --match weights for "
                            "the experts")


class ExpertsKind(Kind):
    name = "experts"
    # activation matching: the router's input (the tokens as the layer's experts see them); per pair of
    # experts the correlation of their router logits and of their hidden units (every expert on every
    # token), one exact E × E assignment jointly with the inner FFN assignment of each pair
    activation_sites = "inputs"
    moves_before_scales = True  # the unit scales inside each expert are fitted on the matched experts
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

    def activation_input(self, inst) -> str:
        return _module(_segments(inst)[0].key)

    def observe(self, inst, stats, x_a, x_b, model_a, model_b):
        if stats is None:
            check_statistics_memory(inst)
        with torch.no_grad():
            (la, ha), (lb, hb) = expert_features(inst, x_a, model_a), expert_features(inst, x_b, model_b)
        if stats is None:
            return {"router": Moments.of(la, lb), "units": Moments.of(ha, hb)}
        stats["router"].add(la, lb)
        stats["units"].add(ha, hb)
        return stats

    def fit_observed(self, insts, stats, opts) -> dict:
        from .permutation import PermElement

        out = {}
        for inst in insts:
            S, inner = observed_scores(inst, stats[inst.name], opts)
            perm = match_permutation(S)
            out[inst.name] = ExpertsElement(perm)
            if inner is not None:  # expert j of the moved model is A's expert perm[j], paired with B's j
                out.update({unit.name: PermElement(inner[perm[j], j]) for j, unit in enumerate(inst.info.inner)})
        return out

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
