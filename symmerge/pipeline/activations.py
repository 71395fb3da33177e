"""Activation matching: the group elements fitted to both models' activations on unlabeled data.

One pass over the data runs both models (in the canonical form the groups act on) with forward hooks
and accumulates, per activation, the *joint Gram* ``G = Σ_t [a_t; b_t][a_t; b_t]ᵀ`` of model A's (``a``)
and the anchor B's (``b``) activations over the tokens ``t`` (padding excluded), their sums and count:

* the residual stream — the hidden states at every block boundary (the input of the first layer and
  the output of every layer, ``Spec.layer``), summed over boundaries;
* per-layer groups — a member slot on a ``Linear``'s output axis (weight axis 0; GPT-2's ``Conv1D``:
  axis 1, chunks = slices of the output) stands for that module's output, a slot on the input axis for
  its input (biases add nothing). So the QK group sees the per-head queries and keys (pre-RoPE), the VO
  group the values and the O projection's per-head inputs, the FFN group its units (the input of the
  output module: post-activation, SwiGLU's ``down_proj`` input).

**The kinds' own solvers on activations.** Every cost a kind minimises is a function of per-block
cross products ``Σ x₁ x₂ᵀ`` and norms ``‖x₁‖²``; for activations these are blocks of ``G``. Factoring
``G = L Lᵀ`` (eigendecomposition, ``L`` 2f × 2f; from :data:`PIVOTED_FROM` up a pivoted Cholesky, ``L`` 2f × the
Gram's rank) and taking ``L``'s first ``f`` rows as A's activation
matrix and the last ``f`` as B's gives matrices with exactly these products. They stand in for the weights
in a state dict of pseudo-tensors, one per activation, with one slot each (axis 0, the slot's chunk, its
GQA ``repeat``, and the power with which the activation moves: a module's output moves like the weight
rows (``a^p Rᵀ``), its input like the inverse of the weight columns (``a^{-p} Rᵀ``)). Head pairing
(``heads``, every pair valued by its per-head optimum), per-head Procrustes (``attn``), RoPE pairs and
GQA sharing then run unchanged through :func:`symmerge.pipeline.engine.solve_local`; memory is ``(2f)²``
per activation whatever the number of tokens. FFN units: the joint Gram is standardised first
(correlations, the usual choice for matching units), then the exact assignment.

**Residual stream.** Per-layer activations are invariant under the stream transform and the stream
under the per-layer groups, so the two are fitted independently (no coordinate descent). The stream's
states are compared as the norms' readers see them (``stream="normalized"``: per token centred for
LayerNorm, divided by the RMS; ``raw``: as they are, centred for LayerNorm), and ``Q`` maximises
``tr(Qᵀ C)`` in the family's group (:mod:`symmerge.core.solvers.residual`) with ``C`` from
``residual_fit``: ``procrustes`` — ``C = Σ H_A H_Bᵀ`` (orthogonal Procrustes); ``lstsq`` — the least-squares
map projected to the nearest orthogonal matrix (``C = Σ_A⁻¹ Σ H_A H_Bᵀ``); ``cca`` — the CCA map
(whitened Procrustes, ``C = Σ_A^{-1/2} U Vᵀ Σ_B^{1/2}``). LayerNorm (O(d−1) × {±1}): the fit lives in
the complement of the all-ones vector; the sign on it (invisible to every LayerNorm) is taken from the
weights. Permutation variants (post-LN, signed): assignment on the correlation matrix.

**Which groups come from activations** (``weights_for``; default None). With the residual stream among
the groups, the stream is fitted to activations and every per-layer group is then solved exactly on the
weights, given the stream element (the engine's per-layer solve, once: no coordinate descent); without
it, every per-layer group is fitted to activations (two models' weights live in different stream bases,
activations do not depend on them); docs/merge.md has the measurements behind this default. A tuple of
group names overrides it.
A kind whose ``activation_sites`` are its "inputs" (a mixture of experts' ``experts``: the router's
input) computes statistics of its own from that module's input on the same tokens in both models
(``Kind.observe``) and solves on them (``Kind.fit_observed``): the experts' permutation jointly with the
FFN inside each expert, whose elements it returns too. Groups no activation stands for — the FFN inside
each expert without the ``experts`` group (slices of fused 3-D tensors) and T5's self-attention head
permutation tied with the relative attention bias (an embedding's columns) — are always solved on the
weights, exactly, given the groups before them (:func:`reads_activations`); their elements still move the
activations of their ``Linear`` members (the tied heads' q, k, v, o) before the groups after them are fitted.

**Scales** (``rescale``; ``rescale_from``): ``weights`` (default) — rotations and permutations from the
activations, then per head (per RoPE pair) the scale closest in the weights for that rotation, on A's
weights moved by the stream transform and head pairing (a quartic); ``activations`` — the kinds' joint
solve on the activation statistics (QK: a two-sided fit of queries and keys; VO: only the + side moves
in activation space, where the solvers' convention leaves the scale at 1). SwiGLU unit scales always
come from the weights (the assignment ran on correlations, which carry no scale; under ``rescale`` a
unit's scale may be negative, so the assignment maximises ``|correlation|`` there).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import torch

from ..core.apply import apply
from ..core.instance import Slot
from ..core.solvers import (centered_residual, complement_basis, orthogonal_residual, permutation_residual,
                            signed_permutation_residual)
from ..errors import SymmergeError
from ..groups import Options
from ..groups.residual import StreamElement
from ..io.hf import linear_output_axis
from .bound import bind
from ..progress import bar
from .engine import SolveContext, by_group, solve_local

RESIDUAL_FITS = ("procrustes", "lstsq", "cca")
STREAM_MODES = ("normalized", "raw")
SCALE_SOURCES = ("weights", "activations")
STREAM = "<stream>"  # the key of the residual stream's statistics


# ---------------------------------------------------------------------------- statistics


@dataclass
class Joint:
    """Joint second moments of A's and B's activations ``[a; b]`` (2f): Gram, sums, token count."""

    gram: torch.Tensor
    sums: torch.Tensor
    count: int = 0

    @classmethod
    def empty(cls, f: int) -> "Joint":
        return cls(torch.zeros(2 * f, 2 * f, dtype=torch.float64), torch.zeros(2 * f, dtype=torch.float64))

    def add(self, a: torch.Tensor, b: torch.Tensor) -> None:
        z = torch.cat([a, b], dim=1)
        z = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32)
        n = z.shape[1]
        if n < PIVOTED_FROM:
            self.gram += (z.T @ z).double().cpu()
        else:  # in float64 (the products of float32 activations exact: the Gram keeps the tokens' rank to float64
            z = z.double()  # rounding, which the pivoted Cholesky finds; float32 sums leave it of full rank at
            for r in range(0, n, _ROWS):  # 1e-7), a block of rows at a time (no n × n temporary beside the Gram)
                self.gram[r:r + _ROWS] += (z[:, r:r + _ROWS].T @ z).cpu()
        self.sums += z.sum(0, dtype=torch.float64).cpu()
        self.count += z.shape[0]

    @property
    def f(self) -> int:
        return self.gram.shape[0] // 2

    def correlation(self, in_place: bool = False) -> torch.Tensor:
        """The joint Gram standardised: correlations of every pair of columns of ``[a; b]`` (2f × 2f); a
        constant column has correlation 0 with everything. ``in_place``: computed in the Gram's own memory (the
        Gram is lost: for a caller that discards the statistics; the same bits)."""
        n = max(self.count, 1)
        mean = self.sums / n
        if in_place:
            cov = self.gram
            cov /= n
        else:
            cov = self.gram / n  # then every step in place, by blocks of rows: the same bits as
        for r in range(0, len(mean), _ROWS):  # ``gram / n - outer(mean, mean)``, ``cov / std[:, None] / std[None, :]``
            cov[r:r + _ROWS] -= torch.outer(mean[r:r + _ROWS], mean)
        std = cov.diagonal().clamp_min(0).sqrt()
        std = torch.where(std > 1e-12 * std.max().clamp_min(1e-300), std, torch.full_like(std, math.inf))
        cov /= std[:, None]
        cov /= std[None, :]
        return cov


_ROWS = 1024  # rows per block of the in-place steps on a Gram
PIVOTED_FROM = 4096
"""The Gram size ``n`` (= 2f) from which :func:`factor` uses the pivoted Cholesky instead of ``eigh``. Below it
every published activation-matched result is untouched (the largest Gram they reach is n = 3072: SmolLM2-135M's FFN
site; ViTs, GPT-2 text, B7 Llamas, MiniLM ≤ 3072); from it up (Llama-3.2-1B's attention sites at 4096 and its FFN
site at 16384, SmolLM2-360M's FFN at 5120, GPT-2 small's c_attn at 4608 and FFN at 6144) the factor is n × rank in
O(n² rank): measured 13–66× faster than ``eigh`` at n = 512–4096 with 128 tokens, 17.5× at full rank (n = 4096),
5.9 s against ≈ 1 600 s (eigh's n³) at 16384 (docs/results/learned_scale.md, ``benchmarks/factor_cost.py``): the
threshold is set by the published figures, not by speed. The two factors differ by an orthogonal map on the right:
the same products to float64 rounding, so the solvers (which read only products: cross products, norms) see the
same statistics (:func:`factored` pads the pivoted factors to one width for the solvers' batching over layers)."""


def factor(gram: torch.Tensor, consume: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L_a, L_b)``, each f × r, with ``L_a L_bᵀ``, ``L_a L_aᵀ``, ``L_b L_bᵀ`` the blocks of the
    positive semi-definite ``gram`` (2f × 2f) to float64 rounding: r = 2f by ``eigh`` below
    :data:`PIVOTED_FROM`, r = the Gram's numerical rank (≤ the tokens it was gathered from) by the pivoted
    Cholesky (:func:`pivoted_cholesky`) from it up. ``gram`` is not modified, unless ``consume`` (a contiguous
    float64 CPU Gram the caller drops: from the threshold up it is symmetrised and factored in place, no
    n × n tensor beside it)."""
    f = gram.shape[0] // 2
    big = gram.shape[0] >= PIVOTED_FROM
    if big and consume and gram.dtype == torch.float64 and gram.is_contiguous() and gram.device.type == "cpu":
        return pivoted_cholesky(_symmetrised_in_place(gram), f)
    sym = gram + gram.T
    sym /= 2  # (gram + gram.T) / 2 bit for bit, one n × n temporary fewer
    if big:
        return pivoted_cholesky(sym, f)
    lam, V = torch.linalg.eigh(sym)
    L = V * lam.clamp_min(0).sqrt()
    return L[:f].contiguous(), L[f:].contiguous()


def _symmetrised_in_place(g: torch.Tensor) -> torch.Tensor:
    """``g`` overwritten by ``(g + gᵀ) / 2`` (the same bits), a block pair at a time."""
    n = g.shape[0]
    for i in range(0, n, _ROWS):
        for j in range(i, n, _ROWS):
            s = g[i:i + _ROWS, j:j + _ROWS] + g[j:j + _ROWS, i:i + _ROWS].T
            s /= 2
            g[i:i + _ROWS, j:j + _ROWS] = s
            g[j:j + _ROWS, i:i + _ROWS] = s.T
    return g


def pivoted_cholesky(sym: torch.Tensor, f: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[:f]`` and ``[f:]`` of ``L`` (n × r) with ``L Lᵀ`` = the symmetric positive semi-definite ``sym``
    (n × n, overwritten) to float64 rounding, by LAPACK's pivoted Cholesky (``dpstrf``, through scipy):
    ``Pᵀ sym P = C Cᵀ`` with ``C`` lower trapezoidal n × r, r the numerical rank (pivots stop when the largest
    remaining diagonal entry is ≤ n·ε·max diag, LAPACK's default: what is dropped is a Schur complement whose
    entries are all below that, so rounding that leaves the Gram slightly indefinite stops the factor there);
    ``L = P C`` (the permutation undone). A zero Gram gives one zero column."""
    from scipy.linalg import lapack

    n = sym.shape[0]
    work = sym.detach().to(device="cpu", dtype=torch.float64)
    if not bool(torch.isfinite(work.diagonal()).all()):  # a non-finite activation makes its own diagonal entry so
        raise SymmergeError("activation statistics are not finite (the models produced inf or nan on the data)")
    # symmetric and C-contiguous: its transpose is the same matrix in Fortran order, factored in place
    c, piv, rank, info = lapack.dpstrf(work.numpy().T, lower=1, tol=-1.0, overwrite_a=1)
    if info < 0:
        raise SymmergeError(f"the pivoted Cholesky refused its input (LAPACK dpstrf info {info})")
    del work, sym
    rank = int(rank)
    # n × r; the strict upper part of c still holds the Gram, its trailing block the dropped Schur complement
    C = torch.from_numpy(c)[:, :rank].tril() if rank else torch.zeros(n, 1, dtype=torch.float64)
    del c
    rows = torch.empty(n, dtype=torch.long)
    rows[torch.as_tensor(piv, dtype=torch.long) - 1] = torch.arange(n)  # row i of L is row rows[i] of C
    return C[rows[:f]], C[rows[f:]]


def factored(stats: dict, corr_keys, keep=()) -> tuple[dict, dict]:
    """A's and B's pseudo-tensors ``({key: L_a}, {key: L_b})`` of every :class:`Joint` in ``stats`` but ``keep``
    (:func:`factor` of its Gram, or of its correlations for the keys in ``corr_keys``), each popped from ``stats``
    and freed once factored (one Gram at a time beside the factors). The pivoted factors (Grams of
    :data:`PIVOTED_FROM` or more) are padded with zero columns to one width, their largest rank: the solvers batch
    one site's matrices over the layers (``torch.stack``/``cat`` along the blocks), which needs equal widths, and
    zero columns add nothing to any product. ``eigh``'s factors (2f columns) are left as they are."""
    act_a, act_b = {}, {}
    for key in [k for k in stats if k not in keep]:
        joint = stats.pop(key)
        gram = joint.correlation(in_place=True) if key in corr_keys else joint.gram  # one n × n tensor
        del joint
        act_a[key], act_b[key] = factor(gram, consume=True)
        del gram
    pivoted = [k for k in act_a if 2 * act_a[k].shape[0] >= PIVOTED_FROM]
    width = max((act_a[k].shape[1] for k in pivoted), default=0)
    for k in pivoted:
        short = width - act_a[k].shape[1]
        if short:
            act_a[k], act_b[k] = (torch.nn.functional.pad(x, (0, short)) for x in (act_a[k], act_b[k]))
    return act_a, act_b


def _tokens(x: torch.Tensor, mask) -> torch.Tensor:
    """Activations (..., f) → (tokens, f), padding tokens dropped where the batch mask fits."""
    if mask is not None and x.dim() == mask.dim() + 1 and x.shape[:-1] == mask.shape:
        return x[mask]
    if mask is not None and x.dim() == 2 and x.shape[0] == mask.numel():  # tokens flattened (a MoE router's input)
        return x[mask.reshape(-1)]
    return x.reshape(-1, x.shape[-1])


def _first(x):
    return x[0] if isinstance(x, (tuple, list)) else x


@dataclass(frozen=True)
class Site:
    """Where an activation is read: a module's output (``out``) or input (``in``)."""

    module: str
    side: str

    @property
    def key(self) -> str:
        return f"{self.module}@{self.side}"


def _out_axis(module, name: str) -> int:
    """The weight axis of a module's outputs: 0 for ``nn.Linear``, 1 for GPT-2's ``Conv1D``."""
    axis = linear_output_axis(module)
    if axis is None:
        raise SymmergeError(f"{name}: activation matching reads Linear (or Conv1D) modules, "
                            f"got {type(module).__name__}")
    return axis


def activation_slot(model, slot: Slot) -> tuple[Site, Slot] | None:
    """The activation a weight slot stands for, and the slot on it (axis 0 of a features × tokens
    matrix, with the power the activation moves with); None for biases and norm weights."""
    if slot.diag or not slot.key.endswith(".weight"):
        return None
    name = slot.key[: -len(".weight")]
    out = slot.axis == _out_axis(model.get_submodule(name), name)
    site = Site(name, "out" if out else "in")
    return site, Slot(site.key, 0, slot.power if out else -slot.power, slot.start, slot.length, slot.repeat,
                      period=slot.period)


def boundaries(model, bound=None) -> list[str]:
    """Module paths of the layers (their outputs are the stream at every block boundary): ``bound``'s
    (:class:`~symmerge.pipeline.bound.BoundModel`), or ``model``'s bound here."""
    bound = bound if bound is not None else bind(model)
    if not bound.spec.layer and not bound.spec.stacks:
        raise SymmergeError(f"the {bound.spec.family} spec names no layer module: activation matching needs it")
    return bound.layer_paths()


def _stream_view(h: torch.Tensor, variant: str, stream: str) -> torch.Tensor:
    """The stream's tokens (n, d) as compared: centred per token for LayerNorm, and (``normalized``)
    divided by their RMS; post-LN and signed permutations are compared by correlation (as they are)."""
    h = h.double() if h.dtype == torch.float64 else h.float()
    if variant == "centered":
        h = h - h.mean(-1, keepdim=True)
    if stream == "normalized" and variant in ("centered", "orthogonal"):
        h = h / h.square().mean(-1, keepdim=True).add(1e-12).sqrt()
    return h


def batches_on(model, data, desc: str, progress: bool):
    """The data's batches moved to the model's device, behind a progress bar (hook passes)."""
    device = next(model.parameters()).device
    for batch in bar(data, desc=desc, total=len(data), unit="batch", disable=None if progress else True):
        yield batch.to(device)


class _Stop(Exception):
    """Raised by the last block boundary's hook: the rest of the forward feeds no statistic."""


def gather(model_a, model_b, data, sites, stream_variant: str | None, stream: str = "normalized",
           progress: bool = True, bound=None, observers=()) -> dict:
    """One pass over ``data``: ``{site key: Joint}`` for every :class:`Site` and, with a
    ``stream_variant``, the stream's boundaries summed under :data:`STREAM`. ``observers``: instances of
    kinds whose ``activation_sites`` are their "inputs": each one's statistics (:meth:`Kind.observe` on
    the input of its :meth:`Kind.activation_input`, batch by batch) under its instance name."""
    observed = {i.name: Site(i.kind.activation_input(i), "in") for i in observers}
    given = set(sites)
    sites = list({s.key: s for s in list(sites) + list(observed.values())}.values())
    cur: list[dict] = [{}, {}]
    # the forward stops after the last block boundary when, on the first batch, nothing hooked ran after it
    # (what follows — the final norm, the LM head — feeds no statistic): ``stop_after`` boundary calls
    state = {"mask": None, "first": True, "last": None, "calls": 0, "stop_after": None}
    handles = []

    def keep(k, key):
        def store(x):
            cur[k].setdefault(key, []).append(_tokens(x.detach(), state["mask"]))
            state["last"] = key
            if key == STREAM:
                state["calls"] += 1
                if state["calls"] == state["stop_after"]:
                    raise _Stop
        return store

    def out_hook(store):
        return lambda module, args, output: store(_first(output))

    def in_hook(store):
        return lambda module, args, kwargs: store(args[0] if args else kwargs["hidden_states"])

    layers = boundaries(model_a, bound) if stream_variant is not None else []
    for k, model in enumerate((model_a, model_b)):
        for site in sites:
            mod = model.get_submodule(site.module)
            store = keep(k, site.key)
            handles.append(mod.register_forward_hook(out_hook(store)) if site.side == "out" else
                           mod.register_forward_pre_hook(in_hook(store), with_kwargs=True))
        for i, name in enumerate(layers):
            mod = model.get_submodule(name)
            if i == 0:
                handles.append(mod.register_forward_pre_hook(in_hook(keep(k, STREAM)), with_kwargs=True))
            handles.append(mod.register_forward_hook(out_hook(keep(k, STREAM))))
    stats: dict = {}
    wanted = {s.key for s in given} | {STREAM}  # Joint statistics of these; the observed sites feed their kinds
    try:
        with torch.no_grad():
            for batch in batches_on(model_a, data, "activation statistics", progress):
                state["mask"] = batch.mask
                for k, model in enumerate((model_a, model_b)):
                    cur[k] = {}
                    state["calls"], state["last"] = 0, None
                    try:
                        model.eval()(**batch.inputs)
                    except _Stop:
                        pass
                    if state["first"] and k == 1:
                        state["first"] = False
                        state["stop_after"] = state["calls"] if state["last"] == STREAM and state["calls"] else None
                for inst in observers:
                    key = observed[inst.name].key
                    xa, xb = torch.cat(cur[0][key]), torch.cat(cur[1][key])
                    if len(xa):
                        stats[inst.name] = inst.kind.observe(inst, stats.get(inst.name), xa, xb, model_a, model_b)
                for key, parts_a in cur[0].items():
                    if key not in wanted:
                        continue
                    parts_b = cur[1][key]
                    if key == STREAM:
                        parts_a = [_stream_view(x, stream_variant, stream) for x in parts_a]
                        parts_b = [_stream_view(x, stream_variant, stream) for x in parts_b]
                    a, b = torch.cat(parts_a), torch.cat(parts_b)
                    if key not in stats:
                        stats[key] = Joint.empty(a.shape[1])
                    stats[key].add(a, b)
                cur = [{}, {}]
    finally:
        for h in handles:
            h.remove()
    return stats


# ---------------------------------------------------------------------------- residual stream


def _inv_sqrt(S: torch.Tensor, power: float) -> torch.Tensor:
    """``S^power`` of a symmetric PSD matrix, with a small ridge (1e-8 of the mean eigenvalue)."""
    lam, V = torch.linalg.eigh((S + S.T) / 2)
    lam = lam.clamp_min(0) + 1e-8 * lam.clamp_min(0).mean().clamp_min(1e-300)
    return (V * lam.pow(power)) @ V.T


def residual_cost(joint: Joint, fit: str, basis: torch.Tensor | None = None) -> torch.Tensor:
    """The d × d matrix whose orthogonal Procrustes is the fitted stream map (see the module text);
    ``basis``: an orthonormal basis of the subspace the fit lives in (LayerNorm: the complement of 1)."""
    if fit not in RESIDUAL_FITS:
        raise SymmergeError(f"unknown residual fit {fit!r}; choose one of {', '.join(RESIDUAL_FITS)}")
    d = joint.f
    B = torch.eye(d, dtype=torch.float64) if basis is None else basis
    G = joint.gram
    C, Sa, Sb = (B.T @ X @ B for X in (G[:d, d:], G[:d, :d], G[d:, d:]))
    if fit == "lstsq":
        C = _inv_sqrt(Sa, -1.0) @ C
    elif fit == "cca":
        Sa_h, Sb_h = _inv_sqrt(Sa, -0.5), _inv_sqrt(Sb, -0.5)
        U, _, Vh = torch.linalg.svd(Sa_h @ C @ Sb_h)
        C = Sa_h @ U @ Vh @ _inv_sqrt(Sb, 0.5)
    return B @ C @ B.T


def residual_element(inst, joint: Joint, fit: str, sd_a: dict, sd_b: dict) -> StreamElement:
    """The stream element in the instance's variant from the boundary statistics."""
    variant = inst.info.variant
    d = joint.f
    if variant in ("permutation", "signed_permutation"):
        corr = joint.correlation()[:d, d:]
        if variant == "permutation":
            return StreamElement(perm=permutation_residual(corr))
        perm, signs = signed_permutation_residual(corr)
        return StreamElement(perm=perm, signs=signs)
    if variant == "orthogonal":
        return StreamElement(Q=orthogonal_residual(residual_cost(joint, fit)))
    B = complement_basis(d)
    C = residual_cost(joint, fit, B)
    u = torch.full((d, 1), 1 / math.sqrt(d), dtype=torch.float64)
    weights_cost, _ = inst.kind.cost(inst, sd_a, sd_b)  # the sign on the all-ones direction: from the weights
    C = C + (u.T @ weights_cost @ u) * (u @ u.T)
    return StreamElement(Q=centered_residual(C))


# ---------------------------------------------------------------------------- the matching


def _pseudo(model, inst):
    """The instance on activation slots (one per weight slot that stands for an activation; a kind whose
    ``activation_sites`` are the "units": only the input of the module consuming them), and the sites it
    reads."""
    if inst.kind.activation_sites not in ("slots", "units"):
        raise SymmergeError(f"{inst.name}: the {inst.kind.name!r} group kind declares no per-layer activation "
                            "sites, so --match activations cannot align it; use --match weights")
    units_only = inst.kind.activation_sites == "units"
    slots, sites = [], []
    for s in inst.slots:
        found = activation_slot(model, s)
        if found is None:
            continue
        site, slot = found
        if units_only and site.side != "in":
            continue
        slots.append(slot)
        sites.append(site)
    if not slots:
        raise SymmergeError(f"{inst.name}: no activation stands for this group's tensors")
    return replace(inst, slots=tuple(slots)), sites


def _linear(model, slot) -> bool:
    """Whether the slot is a whole ``Linear`` (or ``Conv1D``) module's weight (not a router's or one expert's
    slice of fused experts, nor an embedding)."""
    if slot.index is not None:
        return False
    module = model.get_submodule(slot.key[: -len(".weight")])
    return isinstance(module, torch.nn.Linear) or hasattr(module, "nf")


def _weight(slot) -> bool:
    return not slot.diag and slot.key.endswith(".weight")


def reads_activations(model, inst) -> bool:
    """Whether activations stand for the group's tensors: each weight is a ``Linear`` (or ``Conv1D``)
    module's, not a router's or one expert's slice of fused experts (a mixture of experts' ``experts``
    group and the FFN inside each expert, which :func:`match_activations` solves on the weights) nor an
    embedding's (T5's relative attention bias, whose tied head permutation is solved on the weights)."""
    return all(_linear(model, s) for s in inst.slots if s.index is not None or _weight(s))


def _movable(model, inst):
    """The instance on the activation slots of its members that are whole ``Linear`` (or ``Conv1D``) weights
    (the others stand for no activation: an embedding's columns, one expert's slice of fused experts)."""
    return replace(inst, slots=tuple(activation_slot(model, s)[1] for s in inst.slots
                                     if _weight(s) and _linear(model, s)))


def _present(inst, tensors: dict):
    """The instance restricted to the slots whose tensors exist (activations gathered)."""
    return replace(inst, slots=tuple(s for s in inst.slots if s.key in tensors))


def _plan(instances, model_a, opts, weights_for):
    """What activation matching gathers and solves: ``(active, local, wide, observing, weights_for, pseudo,
    sites)`` — the active instances, the per-layer and model-wide ones, those fitted to their kinds' own
    statistics, the groups solved on the weights, every per-layer instance on its activation slots and the
    sites to gather (``model_a``: module types only, a weightless model will do)."""
    active = [i for i in instances if i.kind.active(i, opts)]
    local = [i for i in active if i.kind.per_layer]
    wide = [i for i in active if not i.kind.per_layer]
    if weights_for is None:
        weights_for = tuple({i.group.name for i in local}) if wide else ()
    for inst in wide:
        if inst.kind.activation_sites != "stream":
            raise SymmergeError(f"{inst.name}: activation matching fits a model-wide group from the hidden states at "
                                f"the block boundaries; the {inst.kind.name!r} group kind does not declare them")
    # groups solved on the weights, exactly, given the groups before them: kinds that declare so (experts),
    # and instances no activation stands for (one expert's slice of fused experts)
    observing = [i for i in local if i.kind.activation_sites == "inputs" and i.group.name not in weights_for]
    no_sites = {i.group.name for i in local if i.kind.activation_sites in ("weights", "inputs")
                or not reads_activations(model_a, i)}
    weights_for = tuple(weights_for) + tuple(sorted(no_sites - set(weights_for) - {i.group.name for i in observing}))
    pseudo, sites = {}, {}
    for inst in local:
        if inst.group.name in no_sites:  # solved on the weights; it still moves the activations that stand for
            pseudo[inst.name] = _movable(model_a, inst)  # its Linear members (a tied head permutation's q, k, v, o)
            continue
        pseudo[inst.name], found = _pseudo(model_a, inst)
        if inst.group.name not in weights_for:
            sites.update({s.key: s for s in found})
    return active, local, wide, observing, weights_for, pseudo, sites


def match_activations(instances, model_a, model_b, data, opts: Options, progress=None, residual_fit: str = "procrustes",
                      stream: str = "normalized", rescale_from: str = "weights", weights_for: tuple | None = None,
                      timings: dict | None = None, bound=None, by_layer: bool | None = None) -> dict:
    """``{instance name: element}`` for the instances active under ``opts``, fitted to the activations of
    ``model_a`` (moved) and ``model_b`` (anchor) — both in the canonical form the groups act on — on the
    unlabeled ``data``; see the module text for ``residual_fit``, ``stream`` and ``rescale_from``.
    ``weights_for``: names of per-layer groups solved on the weights instead (exactly, given the stream
    element and the groups before them); None: all of them when the residual stream is among the
    groups, none otherwise (see the module text). ``timings``: seconds of the statistics pass and of the
    solve are added to it. ``bound``: ``model_a``'s :class:`~symmerge.pipeline.bound.BoundModel` (bound
    here when None). ``by_layer``: gather and solve one layer at a time (:class:`LayerReplay`), the same
    elements in the memory of one layer's statistics; None: whenever no model-wide group nor a kind's own
    statistics need the whole pass and the layers feed each other (else the whole pass); True: or an error."""
    for value, allowed, what in ((residual_fit, RESIDUAL_FITS, "residual fit"), (stream, STREAM_MODES, "stream mode"),
                                 (rescale_from, SCALE_SOURCES, "scale source")):
        if value not in allowed:
            raise SymmergeError(f"unknown {what} {value!r}; choose one of {', '.join(allowed)}")
    t0 = time.perf_counter()
    active, local, wide, observing, weights_for, pseudo, sites = _plan(instances, model_a, opts, weights_for)
    variant = wide[0].info.variant if wide else None
    if by_layer is not False and not wide and not observing:
        paths = boundaries(model_a, bound)
        layered = _sites_by_layer(local, pseudo, sites, paths)
        if layered is not None:
            replay = LayerReplay.of_models(model_a, model_b, paths, data, progress is not None)
            if replay is not None:
                sd_a, sd_b = model_a.state_dict(), model_b.state_dict()
                return _match_by_layer(local, _Solving(pseudo, weights_for, opts, rescale_from), layered, replay,
                                       lambda path: (sd_a, sd_b), progress, timings, t0, paths)
    if by_layer:
        raise SymmergeError("activation matching by layer needs per-layer groups only, whose activations lie inside "
                            "one layer each, and layers that feed each other")
    stats = gather(model_a, model_b, data, list(sites.values()), variant, stream, progress=progress is not None,
                   bound=bound, observers=observing)
    observed = {i.name: stats.pop(i.name) for i in observing if i.name in stats}
    if wide and STREAM not in stats:
        raise SymmergeError("no hidden states reached the layers: check the data")
    t1 = time.perf_counter()
    if progress is not None:
        progress("activation statistics")

    sd_a, sd_b = model_a.state_dict(), model_b.state_dict()
    elements = {inst.name: residual_element(inst, stats[STREAM], residual_fit, sd_a, sd_b) for inst in wide}
    # pseudo-tensors: A's and B's factors of every joint Gram (of the correlations, for the kinds whose
    # solver sees those: FFN units)
    corr_keys = {s.key for i in local if i.kind.activation_statistic == "correlation" for s in pseudo[i.name].slots}
    act_a, act_b = factored(stats, corr_keys, keep=(STREAM,))
    _fit_local(local, _Solving(pseudo, weights_for, opts, rescale_from), (act_a, act_b), observed,
               apply(sd_a, wide, elements), (sd_a, sd_b), elements, progress,
               first=[i for i in active if not i.kind.per_layer or i.kind.moves_before_scales])
    if timings is not None:
        timings["statistics"] = timings.get("statistics", 0.0) + t1 - t0
        timings["solve"] = timings.get("solve", 0.0) + time.perf_counter() - t1
    return elements


@dataclass(frozen=True)
class _Solving:
    """What solving the per-layer groups reads in every layer: ``pseudo`` (the instances on the activation
    factors), ``weights_for`` (the groups solved on the weights), the solver options and the scales' source."""

    pseudo: dict
    weights_for: object
    opts: Options
    rescale_from: str


def _fit_local(local, solving: _Solving, acts: tuple, observed, moved_w, sds: tuple, elements, progress, first):
    """The per-layer groups ``local`` solved in the spec's order, their elements added to ``elements``: from
    the activation factors ``acts`` = (A's, B's) (``solving.pseudo``: the instances on them), the kinds'
    ``observed`` statistics, or the weights (``solving.weights_for``; ``moved_w``: A's weights moved by the
    model-wide groups; ``sds``: A's and B's state dicts); then, with ``opts.rescale``, the scales from the weights
    on A moved by the ``first`` instances."""
    act_a, act_b = acts
    sd_a, sd_b = sds
    pseudo, weights_for, opts, rescale_from = solving.pseudo, solving.weights_for, solving.opts, solving.rescale_from
    rotations = opts if rescale_from == "activations" else replace(opts, rescale="none")
    moved_act = act_a
    by_weights = SolveContext(local)
    by_acts = SolveContext([pseudo[i.name] for i in local])
    fitted = []  # instances fitted to activations (their scales follow)
    joint: dict = {}  # elements of groups solved jointly with an earlier one (the FFN inside each expert)
    for name, insts in by_group(local).items():  # in the spec's order: head pairing first
        kind = insts[0].kind
        if all(i.name in joint for i in insts):  # solved with an earlier group, from the activations
            found = {i.name: joint.pop(i.name) for i in insts}
            fitted += insts
        elif kind.activation_sites == "inputs" and name not in weights_for:  # the kind's own statistics
            if not all(i.name in observed for i in insts):
                raise SymmergeError(f"{insts[0].name}: no tokens reached {kind.activation_input(insts[0])}: "
                                    "check the data")
            found = kind.fit_observed(insts, observed, opts)
            joint.update({k: v for k, v in found.items() if k not in {i.name for i in insts}})
            found = {i.name: found[i.name] for i in insts}
            fitted += insts
        elif name in weights_for:  # the exact optimum in the weights, given the stream and the groups before
            found = solve_local(insts, moved_w, sd_b, opts, ctx=by_weights)
        else:  # the kind's own activation solver, else its weight solver on the pseudo-tensors
            on_acts = [pseudo[i.name] for i in insts]
            found = kind.fit_activations(on_acts, moved_act, act_b, opts)
            if found is None:
                found = solve_local(on_acts, moved_act, act_b, rotations, ctx=by_acts)
            fitted += insts
        for inst in insts:  # inactive without scales (rescale only): scales alone below
            found.setdefault(inst.name, kind.identity(inst))
        elements.update(found)
        moved_w = apply(moved_w, insts, found)
        moved_act = apply(moved_act, [_present(pseudo[i.name], moved_act) for i in insts], found)
        if progress is not None:
            progress(name)

    if opts.rescale != "none":  # scales from the weights, on A moved by the stream and head pairing
        moved = apply(sd_a, first, elements)
        for insts in by_group(fitted).values():
            insts[0].kind.weight_scales(insts, elements, moved, sd_b, opts,
                                        scales_fitted=rescale_from == "activations")


# ---------------------------------------------------------------------------- layer by layer


_CACHES = ("cache", "past_key_value", "past_key_values", "layer_past")  # a layer's cache arguments: none replayed


def _no_cache(name: str, value) -> bool:
    """Whether a layer's keyword argument is a cache (by its name, or a transformers ``Cache``)."""
    if name in _CACHES:
        return True
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover
        return False
    return isinstance(value, Cache)


class LayerReplay:
    """Both models' layers run one at a time over every batch: the inputs of the first layer are captured
    once per batch from each model's own forward (its position embeddings, attention mask and other
    arguments kept, any cache dropped), then layer ``i`` of each model is called on the outputs of layer
    ``i − 1``: the same hidden states as the whole forward (the same calls), held for one layer boundary
    only (batches × tokens × width per model). ``layers[k](i)``: model ``k``'s layer ``i`` as a callable."""

    def __init__(self, layers, inputs, masks, modules):
        self.layers, self.inputs, self.masks, self.modules = layers, inputs, masks, modules
        self.current = 0  # the model whose layer runs

    @classmethod
    def of_models(cls, model_a, model_b, paths, data, progress: bool = False) -> "LayerReplay | None":
        """The replay of two models in memory; None when their layers do not feed each other (a layer's
        replayed output differs from the next layer's input in the model's own forward)."""
        layers = [lambda i, m=m: m.get_submodule(paths[i]) for m in (model_a, model_b)]
        return cls.of_forwards([model_a, model_b], layers, paths, data, progress)

    @classmethod
    def of_forwards(cls, models, layers, paths, data, progress: bool = False) -> "LayerReplay | None":
        """``models[k](**inputs)`` runs model ``k`` (a module, or a callable that sets up one); its layer
        modules are ``models[k]``'s at ``paths`` (the first two are hooked to capture their inputs)."""
        inputs, masks = [[] for _ in models], []
        first = True
        for batch in bar(data, desc="first layer's inputs", total=len(data), unit="batch",
                         disable=None if progress else True):
            masks.append(batch.mask)
            for k, run in enumerate(models):
                module = run if isinstance(run, torch.nn.Module) else run.module
                captured = _capture(module, run, paths[:2] if first else paths[:1], batch)
                if captured is None:
                    return None
                if first and len(paths) > 1:  # the chain checked once, on the first batch: layer 0 replayed
                    h, args, kwargs = captured[0]
                    with torch.no_grad():
                        out = _first(layers[k](0)(h, *args, **kwargs))
                    if not torch.equal(out, captured[1][0]):
                        return None
                inputs[k].append(captured[0])
            first = False
        return cls(layers, inputs, masks, [(m if isinstance(m, torch.nn.Module) else m.module).get_submodule
                                            for m in models])

    def run(self, i: int):
        """Every model's layer ``i`` over every batch, its outputs becoming the next layer's inputs; the hooks
        registered on its modules fire per call (model 0 first, then model 1, batch by batch: ``on_batch(b)``
        between batches)."""
        with torch.no_grad():
            for b in range(len(self.masks)):
                for k, layer_of in enumerate(self.layers):
                    self.current = k
                    h, args, kwargs = self.inputs[k][b]
                    self.inputs[k][b] = (_first(layer_of(i)(h, *args, **kwargs)), args, kwargs)
                yield b


def _capture(module, run, paths, batch):
    """``[(hidden, args, kwargs)]`` of the first calls of the layers at ``paths`` in ``run``'s forward on
    ``batch`` (stopped after the last); None if one of them is not called with hidden states first."""
    got: dict = {}

    def hook_of(path):
        def hook(_module, args, kwargs):
            if path in got:  # a layer run through functional_call inside its own call: seen once
                return
            hidden = args[0] if args else kwargs.get("hidden_states")
            if not torch.is_tensor(hidden):
                raise _Stop
            rest = {k: (None if _no_cache(k, v) else v) for k, v in kwargs.items() if k != "hidden_states"}
            if "use_cache" in rest:
                rest["use_cache"] = False
            got[path] = (hidden.detach(), tuple(None if _no_cache("", v) else v for v in args[1:]), rest)
            if len(got) == len(paths):
                raise _Stop
        return hook

    handles = [module.get_submodule(p).register_forward_pre_hook(hook_of(p), with_kwargs=True) for p in paths]
    try:
        with torch.no_grad():
            (run.eval() if isinstance(run, torch.nn.Module) else run)(**batch.inputs)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
    return [got[p] for p in paths] if len(got) == len(paths) else None


def _sites_by_layer(local, pseudo, sites: dict, paths) -> dict | None:
    """``{layer index: (its instances, its sites)}`` when every instance and every site it reads lie in one
    layer (a module under that layer's path); None otherwise."""
    def layer_of(module: str):
        hits = [i for i, p in enumerate(paths) if module.startswith(p + ".")]
        return hits[0] if len(hits) == 1 else None

    out: dict = {}
    for inst in local:
        where = {layer_of(s.key.rsplit("@", 1)[0]) for s in pseudo[inst.name].slots}
        if not where and isinstance(inst.layer, int) and 0 <= inst.layer < len(paths):
            where = {inst.layer}  # solved on the weights, moving no activation (a mixture's experts): its own layer
        if len(where) != 1 or None in where:
            return None
        out.setdefault(where.pop(), ([], {}))[0].append(inst)
    for key, site in sites.items():
        i = layer_of(site.module)
        if i is None or i not in out:
            return None
        out[i][1][key] = site
    return dict(sorted(out.items()))


def layer_statistics(replay: "LayerReplay", i: int, sites: dict) -> dict:
    """``{site key: Joint}`` of layer ``i``'s ``sites`` while the replay runs it (``replay.modules[k](path)``:
    model ``k``'s module at a path; both models may share the modules: the hooks store under the model running)."""
    cur: list[dict] = [{}, {}]
    state = {"mask": None}
    handles, hooked = [], set()

    def store(key, x):
        cur[replay.current].setdefault(key, []).append(_tokens(x.detach(), state["mask"]))

    for k in range(2):
        for key, site in sites.items():
            mod = replay.modules[k](site.module)
            if (id(mod), key) in hooked:
                continue
            hooked.add((id(mod), key))
            handles.append(mod.register_forward_hook(lambda m, a, o, key=key: store(key, _first(o)))
                           if site.side == "out" else
                           mod.register_forward_pre_hook(lambda m, a, kw, key=key:
                                                         store(key, a[0] if a else kw["hidden_states"]),
                                                         with_kwargs=True))
    stats: dict = {}
    try:
        state["mask"] = replay.masks[0] if replay.masks else None
        for b in replay.run(i):
            for key in cur[0]:
                a, bb = torch.cat(cur[0][key]), torch.cat(cur[1][key])
                if key not in stats:
                    stats[key] = Joint.empty(a.shape[1])
                stats[key].add(a, bb)
            cur[0], cur[1] = {}, {}
            state["mask"] = replay.masks[b + 1] if b + 1 < len(replay.masks) else None
    finally:
        for h in handles:
            h.remove()
    return stats


def _match_by_layer(local, solving: _Solving, layered, replay, weights_of, progress, timings, t0, paths) -> dict:
    """:func:`match_activations` one layer at a time: layer ``i``'s statistics gathered while the replay runs
    it, factored and solved, then freed before layer ``i + 1``: memory one layer's Grams. ``weights_of(path)``:
    ``(A's, B's)`` tensors of the layer at ``path`` (at least), for the groups solved on the weights and the
    scales."""
    elements: dict = {}
    spent = {"statistics": 0.0, "solve": 0.0}
    pseudo = solving.pseudo
    corr = {s.key for i in local if i.kind.activation_statistic == "correlation" for s in pseudo[i.name].slots}
    done = -1
    for i, (insts, sites) in layered.items():
        t1 = time.perf_counter()
        for j in range(done + 1, i):  # layers with nothing to gather: run through
            for _ in replay.run(j):
                pass
        stats = layer_statistics(replay, i, sites)
        done = i
        t2 = time.perf_counter()
        act_a, act_b = factored(stats, corr)
        sd_a, sd_b = weights_of(paths[i])
        _fit_local(insts, solving, (act_a, act_b), {}, sd_a, (sd_a, sd_b), elements, None,
                   first=[x for x in insts if x.kind.moves_before_scales])
        del sd_a, sd_b
        del act_a, act_b
        spent["statistics"] += t2 - t1
        spent["solve"] += time.perf_counter() - t2
        if progress is not None:
            progress(f"layer {i}")
    if timings is not None:
        timings["statistics"] = timings.get("statistics", 0.0) + spent["statistics"] + (time.perf_counter() - t0
                                                                                        - sum(spent.values()))
        timings["solve"] = timings.get("solve", 0.0) + spent["solve"]
    return elements


def match_replayed(instances, model, replay: LayerReplay, paths, weights_of, opts: Options, progress=None,
                   rescale_from: str = "weights", timings: dict | None = None) -> dict:
    """:func:`match_activations` by layer on a given :class:`LayerReplay` (models whose layers are run by
    other means: read layer by layer from their checkpoints); ``model``: the module types (weightless will
    do); ``weights_of(path)``: ``(A's, B's)`` tensors of that layer. Per-layer groups only; those fitted to their
    kinds' own statistics of a whole pass (a mixture's experts, on the router's inputs) are solved on the weights,
    exactly, given the groups before them (as every group is beside the residual stream)."""
    if rescale_from not in SCALE_SOURCES:
        raise SymmergeError(f"unknown scale source {rescale_from!r}; choose one of {', '.join(SCALE_SOURCES)}")
    t0 = time.perf_counter()
    _, local, wide, observing, weights_for, pseudo, sites = _plan(instances, model, opts, None)
    if observing and not wide:
        on_weights = tuple(sorted({i.group.name for i in observing}))
        _, local, wide, observing, weights_for, pseudo, sites = _plan(instances, model, opts, on_weights)
    layered = _sites_by_layer(local, pseudo, sites, paths) if not wide and not observing else None
    if layered is None:
        raise SymmergeError("activation matching by layer needs per-layer groups only, whose activations lie inside "
                            "one layer each, and layers that feed each other")
    return _match_by_layer(local, _Solving(pseudo, weights_for, opts, rescale_from), layered, replay, weights_of,
                           progress, timings, t0, paths)
