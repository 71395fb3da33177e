"""The residual stream: one transform of the hidden dims, model-wide.

Every stream member moves as ``X → Qᵀ X`` along its hidden axis: embeddings and the readers' input
columns (``W → W Q``), the writers' output rows and biases (``W → Qᵀ W``), LayerNorm biases, and the
task heads reading the stream. Which ``Q`` preserve the function depends on the norm (the family's
group parameters ``norm`` and ``placement``), so the kind binds one of four *variants*:

* ``orthogonal`` — RMSNorm, its weights folded into their readers (``W ← W diag(γ)``, ``γ ← 1``): any
  orthogonal ``Q`` (RMSNorm commutes with it);
* ``centered`` — pre-LN LayerNorm, ``γ`` folded into the readers and ``β`` into their biases
  (``b ← b + W β``; kept as the norm's bias, a stream vector, where a reader has no bias): any
  orthogonal ``Q`` with ``Q·1 = ±1`` (it commutes with mean-centring and the RMS), the group O(d−1) × {±1};
* ``permutation`` — LayerNorm left as it is (post-LN, or ``--residual permutation``): permutations
  only, ``γ`` and ``β`` permuted with the stream;
* ``signed_permutation`` — RMSNorm left as it is (``--residual permutation``, or a norm that cannot be
  folded: a final norm before an LM head tied to the embeddings, not uniform): signed permutations,
  ``γ`` permuted (RMSNorm commutes with sign flips, LayerNorm's mean-centring does not).

Norms on a block's *output* before the residual add (group parameter ``fixed_norms``: Gemma 2/3's
sandwich norms, OLMo 2's post-norms) cannot be folded either: the block writes ``γ ⊙ RMS(y)`` to the
stream, which must become ``Qᵀ (γ ⊙ RMS(y))``. The writer's output may move by any ``M``, but ``RMS(M y)``
is a function of ``RMS(y)`` for every ``y`` only for ``M = cR`` (``R`` orthogonal), where it is ``±R RMS(y)``;
so some ``γ'`` must give ``diag(γ') R = Qᵀ diag(γ)``, i.e. ``R = diag(γ')⁻¹ Qᵀ diag(γ)`` orthogonal, i.e.
``Qᵀ diag(γ²) Q`` diagonal. Where the ``|γ_i|`` are distinct (trained weights) that makes ``Q`` a signed
permutation (``R = Qᵀ``, ``γ' = Pγ``), the variant bound here; the orthogonal variant is kept when every
such norm is uniform (then any ``Q``, with ``R = Qᵀ``). Rotations inside sets of equal ``|γ_i|`` (in every
such norm at once) are not used. A family whose norms multiply by
``offset + γ`` (Gemma: ``1 + w``) folds ``offset + γ`` and leaves ``γ = 1 − offset``.

A model whose output *is* the stream (a base model without a task head) has no residual group.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..core.slots import fast_dtype, index_axis, segment, stored, unit_matrix, with_segment, working_dtype
from ..core.solvers import (centered_residual, orthogonal_residual, permutation_residual,
                            signed_permutation_residual)
from ..errors import SymmergeError
from .base import Kind, haar, is_permutation, orthogonality_error, segment_update, small_rotation, swap_blocks

VARIANTS = ("orthogonal", "centered", "permutation", "signed_permutation")
EXACT_EPS = 1e-9  # a stream scale is learned only where the norms' ε is this small (exact to double precision)
DENSE = ("orthogonal", "centered")


@dataclass(frozen=True)
class FoldBinding:
    weight: str  # the norm's γ
    bias: str | None  # the norm's β (LayerNorm)
    readers: tuple[tuple[str, int], ...]  # (key, input axis) of the tensors reading the norm's output
    offset: float = 0.0  # the norm multiplies by offset + γ


@dataclass(frozen=True)
class StreamInfo:
    variant: str
    folds: tuple[FoldBinding, ...] = ()


@dataclass
class StreamElement:
    """A dense orthogonal ``Q`` (d × d), or a permutation ``perm`` (new dim j = old dim perm[j]) with
    optional ``signs``; optionally a scale ``c > 0`` of the whole stream (every writer times ``c``: exact
    for a pre-LN stream up to the norms' ε, as ``LN(c·x) = LN(x)``; learned alignment uses it)."""

    Q: torch.Tensor | None = None
    perm: torch.Tensor | None = None
    signs: torch.Tensor | None = None
    scale: float | None = None


def _uniform(t: torch.Tensor) -> bool:
    return bool((t == t.reshape(-1)[0]).all())


class Residual(Kind):
    name = "residual"
    per_layer = False
    moves_heads_input = True
    moves_output_frame = True
    activation_sites = "stream"  # activation matching: the hidden states at every block boundary
    description = ("one transform of the residual stream through every layer, norm and task head, in the largest "
                   "group the family allows: orthogonal maps fixing the all-ones direction (pre-LN LayerNorm, norms "
                   "folded), orthogonal maps (RMSNorm, norms folded), permutations (post-LN LayerNorm, or with "
                   "--residual permutation), signed permutations (a tied LM head keeps the final norm from folding)")

    def bind(self, group, ctx, layer=None):
        if not ctx.task_model:
            return None  # a base model: moving the stream would move its output hidden states
        inst = ctx.model_instance(group)
        norm, placement = group.param("norm", "rmsnorm"), group.param("placement", "pre")
        if ctx.residual == "permutation" or (norm == "layernorm" and placement == "post"):
            # the norms stay as they are: LayerNorm commutes with permutations, RMSNorm with signed ones
            return ctx.with_info(inst, StreamInfo("signed_permutation" if norm == "rmsnorm" else "permutation"))
        folds, blocked = [], []
        for f in ctx.spec.folds:
            if f.group and f.group != group.name:
                continue  # a norm of another stream (CLIP's other tower)
            for i in ctx.layers_of(f.weight):
                # a norm outside the layers may feed readers in every layer (T5's encoder output: the
                # decoder's cross-attention keys and values)
                readers = [(ctx.key_of(m.name, j, m.root), m.axis) for m in f.readers
                           for j in ([i] if i is not None else ctx.layers_of(m.name))]
                readers = [(k, a) for k, a in readers if k in ctx.state_dict]
                binding = FoldBinding(ctx.key_of(f.weight, i), ctx.key_of(f.bias, i) if f.bias else None,
                                      tuple(readers), f.offset)
                # a reader tied to another tensor (an LM head sharing the embeddings) cannot absorb the norm
                (blocked if any(ctx.alias_source(k) for k, _ in readers) else folds).append(binding)
        fixed = [ctx.key_of(n, i) for n in group.param("fixed_norms", ()) for i in ctx.layers_of(n)]
        for key in fixed:  # members of the group: present (binding the instance checked it)
            if ctx.state_dict[key].is_meta:
                raise SymmergeError(f"{ctx.disk(key)}: the residual group depends on this norm's values; resolve "
                                    "against real weights")
        if any(not _uniform(ctx.state_dict[k]) for k in [b.weight for b in blocked] + fixed):
            return ctx.with_info(inst, StreamInfo("signed_permutation" if norm == "rmsnorm" else "permutation"))
        return ctx.with_info(inst, StreamInfo("orthogonal" if norm == "rmsnorm" else "centered", tuple(folds)))

    # ------------------------------------------------------------------ canonical form
    def canonicalize(self, state_dict: dict, inst) -> dict:
        """Fold each norm into its readers (same function; the parameterisation on which the dense
        variants act). A no-op for the permutation variants."""
        out = dict(state_dict)
        for f in inst.info.folds:
            gamma = out[f.weight].detach().to(torch.float64) + f.offset
            if f.bias is not None and f.bias in out:
                beta = out[f.bias].detach().to(torch.float64)
                biases = [_bias_key(k) for k, _ in f.readers]
                if all(b in out for b in biases):  # b ← b + W β, the norm's bias ← 0
                    for (k, axis), b in zip(f.readers, biases):
                        w = out[k].detach().to(torch.float64)
                        out[b] = (out[b].detach().to(torch.float64)
                                  + torch.tensordot(w, beta, dims=([axis], [0]))).to(out[b].dtype)
                    out[f.bias] = torch.zeros_like(out[f.bias])
                else:  # a reader without a bias: β/γ stays in the norm, where the stream transform moves it
                    if bool((gamma == 0).any()):
                        raise SymmergeError(f"{f.weight}: a zero norm weight cannot be folded into its readers")
                    out[f.bias] = (beta / gamma).to(out[f.bias].dtype)
            for k, axis in f.readers:
                shape = [1] * out[k].dim()
                shape[axis] = -1
                out[k] = (out[k].detach().to(torch.float64) * gamma.reshape(shape)).to(out[k].dtype)
            out[f.weight] = torch.full_like(out[f.weight], 1.0 - f.offset)
        return out

    def canonical_changes(self, inst, keys) -> dict:
        """Each norm folded into its readers: the readers (scaled), their biases (``b + Wβ``, when every reader has
        one) and the norm's own weight and bias, each with the norm folded."""
        keys, out = set(keys), {}
        for f in inst.info.folds:
            readers = [k for k, _ in f.readers]
            changed = readers + [f.weight]
            if f.bias is not None and f.bias in keys:
                biases = [_bias_key(k) for k in readers]
                changed += [f.bias] + (biases if all(b in keys for b in biases) else [])
            for k in changed:
                if k in keys:
                    out.setdefault(k, []).append(f"{f.weight} folded")
        return out

    # ------------------------------------------------------------------ solving
    def cost(self, inst, sd_a: dict, sd_b: dict, keys=None):
        """``C = Σ X₁ X₂ᵀ`` (d × d) over the stream members (optionally only ``keys``) and
        ``D = Σ γ₁ γ₂ᵀ`` over the norm weights; float32 for non-float64 models."""
        dtype = fast_dtype(*(working_dtype(sd_a, s.key) for s in inst.slots))
        C = torch.zeros(inst.size, inst.size, dtype=dtype)
        D = torch.zeros(inst.size, inst.size, dtype=torch.float64)
        for s in inst.slots:
            if keys is not None and s.key not in keys:
                continue
            # converted from the tensors as stored: a half tensor's float32 copy would give the same values
            x1, x2 = unit_matrix(stored(sd_a, s.key), s, dtype), unit_matrix(stored(sd_b, s.key), s, dtype)
            if s.diag:
                D += x1.double() @ x2.double().T
            else:
                C += x1 @ x2.T
        return C.double(), D

    def complete(self, insts, prepared, sd_a, sd_b, opts, ctx=None) -> dict:
        out = {}
        for inst in insts:
            C, D = self.cost(inst, sd_a, sd_b, getattr(ctx, "only_keys", None))
            variant = inst.info.variant
            if variant == "orthogonal":
                out[inst.name] = StreamElement(Q=orthogonal_residual(C))
            elif variant == "centered":
                out[inst.name] = StreamElement(Q=centered_residual(C))
            elif variant == "signed_permutation":
                perm, signs = signed_permutation_residual(C, D)
                out[inst.name] = StreamElement(perm=perm, signs=signs)
            else:
                out[inst.name] = StreamElement(perm=permutation_residual(C, D))
        return out

    # ------------------------------------------------------------------ the multi-start search
    KICK = 0.3  # the strength of a random rotation kick (radians, roughly, per direction)

    def perturb(self, inst, element, generator):
        """A small random rotation after the dense ``Q`` (on the complement of the all-ones direction for
        LayerNorm: ``Q·1 = ±1`` is kept), or two blocks of ``d/16`` stream dims swapped (signs with them)."""
        d, variant = inst.size, inst.info.variant
        if element.Q is None and element.perm is None:
            return None
        if variant in DENSE:
            if variant == "centered":
                from ..core.solvers import complement_basis

                B = complement_basis(d)
                u = torch.full((d, 1), 1 / math.sqrt(d), dtype=torch.float64)
                K = u @ u.T + B @ small_rotation(d - 1, self.KICK, generator) @ B.T
            else:
                K = small_rotation(d, self.KICK, generator)
            return StreamElement(Q=element.Q.double() @ K, scale=element.scale)
        index = swap_blocks(d, max(1, d // 16), generator)
        signs = None if element.signs is None else element.signs[index]
        return StreamElement(perm=element.perm[index], signs=signs, scale=element.scale)

    def spectral_start(self, inst, sd_a, sd_b, keys=None):
        """Each model's stream in its own canonical frame: the principal axes of ``Σ X Xᵀ`` over the members
        (in the complement of the all-ones direction for LayerNorm), matched in the order of their
        eigenvalues, each axis's sign chosen by the cross term ``C``; for the permutation variants the stream
        dims ordered by their squared norm over the members (signs from ``C``)."""
        d, variant = inst.size, inst.info.variant
        C, _ = self.cost(inst, sd_a, sd_b, keys)
        grams = []
        for sd in (sd_a, sd_b):
            G = torch.zeros(d, d, dtype=torch.float64)
            for s in inst.slots:
                if (keys is None or s.key in keys) and not s.diag:
                    x = unit_matrix(stored(sd, s.key), s, torch.float64)
                    G += x @ x.T
            grams.append(G)
        if variant not in DENSE:
            norm_a, norm_b = (torch.diagonal(G) for G in grams)
            perm = torch.empty(d, dtype=torch.long)
            perm[torch.argsort(norm_b, stable=True)] = torch.argsort(norm_a, stable=True)
            if variant == "permutation":
                return StreamElement(perm=perm)
            signs = torch.where(C[perm, torch.arange(d)] < 0, -1.0, 1.0).to(torch.float64)
            return StreamElement(perm=perm, signs=signs)
        if variant == "centered":
            from ..core.solvers import complement_basis

            B = complement_basis(d)
            grams, C_in = [B.T @ G @ B for G in grams], B.T @ C @ B
        else:
            C_in = C
        (_, U_a), (_, U_b) = (torch.linalg.eigh(G) for G in grams)
        signs = torch.where(torch.diagonal(U_a.T @ C_in @ U_b) < 0, -1.0, 1.0).to(torch.float64)
        R = U_a @ torch.diag(signs) @ U_b.T
        if variant == "centered":
            u = torch.full((d, 1), 1 / math.sqrt(d), dtype=torch.float64)
            sign = 1.0 if (u.T @ C @ u).item() >= 0 else -1.0
            R = sign * (u @ u.T) + B @ R @ B.T
        return StreamElement(Q=R)

    def discrete(self, inst) -> bool:  # the (signed) permutation variants; the dense ones are rotations
        return inst.info.variant not in DENSE

    # ------------------------------------------------------------------ learned alignment
    # an orthogonal map exp(S − Sᵀ) (on the complement of the all-ones direction for LayerNorm) and, for a
    # pre-norm stream whose norms' ε is negligible (≤ EXACT_EPS), a scale c = e^γ of every writer: the
    # norm removes it exactly only up to ε (LN(c·x) is LN(x) with ε/c² in place of ε)
    def learn_init(self, inst, opts, dtype, model_facts):
        if inst.info.variant not in DENSE:
            return None
        k = inst.size - (1 if inst.info.variant == "centered" else 0)
        values = {"skew": torch.zeros(k, k, dtype=dtype)}
        if inst.group.param("placement") == "pre" and not inst.group.param("fixed_norms") \
                and model_facts.get("norm_eps", 1.0) <= EXACT_EPS:  # a norm on a writer's output removes c
            values["logc"] = torch.zeros((), dtype=dtype)
        return values

    def learn_prepare(self, inst, values):
        S = values["skew"]
        R = torch.linalg.matrix_exp(S - S.mT)
        if inst.info.variant == "centered":
            from ..core.solvers import complement_basis

            d = inst.size
            B = complement_basis(d).to(R)
            u = torch.full((d, 1), 1 / math.sqrt(d), dtype=R.dtype, device=R.device)
            R = u @ u.T + B @ R @ B.T
        return R, values["logc"].exp() if "logc" in values else None

    def learn_apply(self, t, slot, inst, prepared):
        if slot.diag:
            return t
        Q, c = prepared
        new = segment_update(t, slot, lambda x: (Q.mT.to(x) @ x.reshape(x.shape[0], -1)).reshape(x.shape))
        return new * c.to(new) if c is not None and slot.power > 0 else new

    def learn_element(self, inst, values) -> StreamElement:
        Q, c = self.learn_prepare(inst, {k: v.detach().double() for k, v in values.items()})
        return StreamElement(Q=Q, scale=None if c is None else float(c))

    # ------------------------------------------------------------------ elements
    def identity(self, inst) -> StreamElement:
        if inst.info.variant in DENSE:
            return StreamElement(Q=torch.eye(inst.size, dtype=torch.float64))
        return StreamElement(perm=torch.arange(inst.size))

    def random(self, inst, generator, scale: bool = True) -> StreamElement:
        d, variant = inst.size, inst.info.variant
        if variant == "orthogonal":
            return StreamElement(Q=haar(1, d, generator)[0])
        if variant == "centered":
            from ..core.solvers import complement_basis

            B = complement_basis(d)
            u = torch.full((d, 1), 1 / math.sqrt(d), dtype=torch.float64)
            s = 1.0 if torch.rand(1, generator=generator).item() < 0.5 else -1.0
            return StreamElement(Q=s * (u @ u.T) + B @ haar(1, d - 1, generator)[0] @ B.T)
        perm = torch.randperm(d, generator=generator)
        if variant == "signed_permutation":
            signs = torch.randint(0, 2, (d,), generator=generator).to(torch.float64) * 2 - 1
            return StreamElement(perm=perm, signs=signs)
        return StreamElement(perm=perm)

    def check(self, inst, element, tol: float = 1e-6) -> None:
        variant = inst.info.variant
        if element.scale is not None and not (math.isfinite(float(element.scale)) and float(element.scale) > 0):
            raise SymmergeError(f"{inst.name}: the stream scale must be finite and positive")
        if element.scale is not None and (inst.group.param("placement") == "post" or inst.group.param("fixed_norms")):
            raise SymmergeError(f"{inst.name}: a post-LN stream has no scale symmetry")
        if element.Q is None and element.perm is None:
            return  # a scale only
        if variant in DENSE:
            Q = element.Q
            err = orthogonality_error(Q[None]) if Q is not None else math.inf
            if not (math.isfinite(err) and err <= tol):
                raise SymmergeError(f"{inst.name}: solver returned an invalid element (orthogonality error {err:.2e})")
            if variant == "centered":
                ones = torch.ones(inst.size, dtype=torch.float64)
                q1 = Q.double() @ ones
                if min((q1 - ones).abs().max().item(), (q1 + ones).abs().max().item()) > tol * math.sqrt(inst.size):
                    raise SymmergeError(f"{inst.name}: the stream transform does not map the all-ones vector to ±1")
        else:
            if element.perm is None or not is_permutation(element.perm, inst.size):
                raise SymmergeError(f"{inst.name}: solver returned a non-bijective permutation")
            if element.signs is not None and not bool((element.signs.abs() == 1).all()):
                raise SymmergeError(f"{inst.name}: signs of a signed permutation must be ±1")
            if variant == "permutation" and element.signs is not None and bool((element.signs < 0).any()):
                raise SymmergeError(f"{inst.name}: LayerNorm commutes with permutations only, not sign flips")

    def transform(self, t, slot, inst, element) -> torch.Tensor:
        out = self._rotate(t, slot, element)
        if element.scale is not None and slot.power > 0 and not slot.diag:  # a writer of the stream
            out = (out.to(torch.float64) * float(element.scale)).to(t.dtype)
        return out

    def _rotate(self, t, slot, element) -> torch.Tensor:
        if element.Q is None and element.perm is None:
            return t
        if element.Q is None:  # exact, by indexing; a norm weight moves with the stream, its signs drop out
            signs = None if slot.diag else element.signs
            return index_axis(t, slot, element.perm, signs)
        if slot.diag:  # diag(Qᵀ diag(γ) Q) is diagonal only for uniform γ
            if not _uniform(t):
                raise SymmergeError(f"{slot.key}: an orthogonal residual transform needs the norm weights folded "
                                    "first (canonicalize)")
            return t.detach().clone()
        x = segment(t, slot)
        work = fast_dtype(t)
        y = element.Q.to(device=x.device, dtype=work).mT @ x.to(work).reshape(x.shape[0], -1)
        return with_segment(t, slot, y.reshape(x.shape))


def _bias_key(weight_key: str) -> str:
    return weight_key[: -len("weight")] + "bias" if weight_key.endswith("weight") else weight_key + ".bias"


KIND = Residual()
