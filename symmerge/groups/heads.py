"""Head permutation: whole attention heads reordered (the user-facing symmetry ``heads``).

Attention is a sum over heads, so permuting the heads — the rows of ``W_Q``, ``W_K``, ``W_V`` (and their
biases) and the column blocks of ``W_O``, all with one permutation — preserves the function. With GQA
the key/value heads are permuted as whole groups (with their query heads), and the query heads
within a group among themselves.

Best element, combined with the per-head groups it couples (group parameter ``couples``: the layer's
QK and VO groups, e.g. rotations and scales): pairing A's head ``i`` with B's head ``j`` costs the
squared distance left after the *best* per-head element for that pair (each coupled kind's
``block_values``), so one exact linear assignment on those ``H × H`` costs solves head pairing and
per-head elements jointly (without GQA). With GQA the query heads within each candidate pair of KV
groups are first paired by an assignment on the rotation-invariant similarity of their blocks (the
nuclear norm of their cross products, ``‖X_A X_Bᵀ‖_*``), then the KV groups by the exact group costs.
The coupled groups are solved afterwards on the permuted model.

**Tied across a stack** (group parameter ``tied="stack"``; T5's self-attention, whose relative position
bias ``relative_attention_bias`` — one column per head, in layer 0 — is added to the scores of *every*
layer of the stack): one permutation of every layer's heads at once and of the members without a layer
index (the bias's columns, one block per head). The group binds one instance per stack (layer -1: it
lies in no one layer; bound only where every layer of its stack is), and its best element is one exact
assignment on the sum over the stack's layers of the per-layer pairing values above (each layer's coupled
per-head elements solved per pair) plus, for the members no coupled group covers, the squared distance
between A's block i and B's block j. Plain multi-head attention only (no GQA).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..core.slots import (block_index, index_axis, precise_dtype, segment, slot_blocks, slot_length, stored,
                          working_dtype)
from ..core.solvers import match_permutation
from ..errors import SymmergeError
from .base import Kind, is_permutation, swap_blocks
from .head_orthogonal import blocks


@dataclass
class HeadPerm:
    """``kv`` (H_kv,): new KV head j is old KV head ``kv[j]``; ``query`` (H,): new query head j is old
    query head ``query[j]`` (for plain multi-head attention ``kv`` and ``query`` are the same)."""

    kv: torch.Tensor
    query: torch.Tensor


@dataclass(frozen=True)
class Tied:
    """The binding of a head permutation tied across a stack: the (global) layers its instance spans."""

    layers: tuple[int, ...]


PAIR_BUDGET = 1 << 25  # elements of head blocks materialised at once when pairing heads


class Heads(Kind):
    name = "heads"
    moves_before_scales = True  # after an activation fit, the per-head scales are those of the paired heads
    description = "permutation of the attention heads (GQA: of the key/value heads with their query heads)"
    blocked = True
    lazy = True  # valuing every pairing is most of a sweep; the pairing rarely changes once the stream settles

    def discrete(self, inst) -> bool:
        return True

    def bind(self, group, ctx, layer):
        if group.param("tied") != "stack":
            return super().bind(group, ctx, layer)
        # one instance per stack, bound with its layer 0 where every layer of the stack is being bound
        layers = tuple(range(ctx.offset, ctx.offset + ctx.num_layers))
        if layer != 0 or (ctx.selected is not None and not ctx.selected.issuperset(layers)):
            return None
        per_layer = replace(group, members=tuple(m for m in group.members if "{i}" in m.name))
        once = replace(group, members=tuple(m for m in group.members if "{i}" not in m.name))
        insts = [ctx.instance(per_layer, i, blocked=True) for i in range(ctx.num_layers)]
        slots = tuple(s for i in insts for s in i.slots)
        if once.members:  # e.g. the relative attention bias: one column per head
            slots += ctx.instance(once, 0, blocked=True).slots
        if any(s.repeat > 1 for s in slots):
            raise SymmergeError(f"{group.name}: a head permutation tied across a stack needs plain multi-head "
                                "attention (no grouped key/value heads)")
        return ctx.with_info(replace(insts[0], name=group.name, layer=-1, slots=slots), Tied(layers))

    def siblings(self, inst, ctx) -> list:
        names = set(inst.group.param("couples", ()))
        layers = inst.info.layers if isinstance(inst.info, Tied) else (inst.layer,)
        return [i for i in ctx.instances if i.layer in layers and i.group.name in names]

    def complete(self, insts, prepared, sd_a, sd_b, opts, ctx=None) -> dict:
        out = {}
        # without GQA (and every tied group): one assignment per instance on its pairing values
        plain = [i for i in insts if isinstance(i.info, Tied) or max(s.repeat for s in i.slots) == 1]
        for inst, cost in zip(plain, self._pair_costs(plain, sd_a, sd_b, opts, ctx)):
            kv = match_permutation(-cost)
            out[inst.name] = HeadPerm(kv, kv.clone())
        for inst in insts:
            if inst.name not in out:
                out[inst.name] = self._solve(inst, self.siblings(inst, ctx), sd_a, sd_b, opts)
        return out

    def _pair_costs(self, insts, sd_a, sd_b, opts, ctx) -> list:
        """(H, H) per instance: the squared distance over its members when A's head i is paired with B's head
        j — the coupled groups' best (every pair of every layer valued in one batched solve per coupled
        group; a tied instance sums its stack's layers), and the plain distance of the members no coupled
        group given here covers (a tied group's bias columns; q, k, v, o where the coupled groups are not
        among the instances, as under the activation matcher without them)."""
        sibs = [self.siblings(i, ctx) for i in insts]
        cost = [torch.zeros(i.blocks, i.blocks, dtype=torch.float64) for i in insts]
        pairs = [(k, s) for k, found in enumerate(sibs) for s in found]
        for name in dict.fromkeys(s.group.name for _, s in pairs):
            same = [(k, s) for k, s in pairs if s.group.name == name]
            kind = same[0][1].kind
            if hasattr(kind, "pair_value_matrices"):
                values = kind.pair_value_matrices([s for _, s in same], sd_a, sd_b, opts)
            else:
                values = [self._cost(s, sd_a, sd_b, opts) for _, s in same]
            for (k, _), v in zip(same, values):
                cost[k] += v
        for k, inst in enumerate(insts):
            covered = {slot.key for sib in sibs[k] for slot in sib.slots}
            cost[k] += _block_distances(inst, [s for s in inst.slots if s.key not in covered], sd_a, sd_b)
        return cost

    def _cost(self, sib, sd_a, sd_b, opts, sub=None) -> torch.Tensor:
        """(G, G): the coupled group's best squared distance for each pairing of A's group head i with
        B's group head j (with GQA, A's query heads in the order ``sub[i, j]``)."""
        G = sib.blocks
        rep = sub.shape[-1] if sub is not None else 1
        cost = torch.zeros(G, G, dtype=torch.float64)
        xb = blocks(sib, sd_b)
        xa_all = blocks(sib, sd_a)
        width = sum(x.shape[1] * x.shape[2] for x in xa_all.values())
        step = max(1, PAIR_BUDGET // max(G * width, 1))
        for i0 in range(0, G, step):
            ia = torch.arange(i0, min(G, i0 + step))
            if sub is None:
                xa = {p: x[ia].repeat_interleave(G, 0) for p, x in xa_all.items()}
            else:  # A's group i with its query heads ordered for B's group j
                xa = self._reordered(sib, sd_a, ia, G, sub[ia].reshape(-1, rep))
            xbb = {p: x.repeat(len(ia), 1, 1) for p, x in xb.items()}
            cost[ia] += sib.kind.block_values(sib, xa, xbb, opts).reshape(len(ia), G)
        return cost

    def _solve(self, inst, siblings, sd_a, sd_b, opts) -> HeadPerm:
        G = inst.blocks
        rep = max(s.repeat for s in inst.slots)
        if not siblings:  # GQA heads with no coupled group bound beside them (heads without attn, streamed): the
            # plain distance over the members, each group's query heads kept in their order (summing no cost
            # gave 0, and the assignment failed on it)
            kv = match_permutation(-_block_distances(inst, inst.slots, sd_a, sd_b))
            return HeadPerm(kv, torch.cat([kv[j] * rep + torch.arange(rep) for j in range(G)]))
        sub = None
        if rep > 1:  # GQA: pair the query heads inside every candidate pair of KV groups
            sub = self._query_pairing(inst, siblings, sd_a, sd_b, opts, rep)  # (G, G, rep)
        cost = sum(self._cost(sib, sd_a, sd_b, opts, sub) for sib in siblings)
        kv = match_permutation(-cost)  # new group j = old group kv[j]
        if sub is None:
            return HeadPerm(kv, kv.clone())
        query = torch.cat([kv[j] * rep + sub[kv[j], j] for j in range(G)])
        return HeadPerm(kv, query)

    @staticmethod
    def _reordered(sib, sd_a, ia, G, order) -> dict:
        """A's blocks of groups ``ia`` (each repeated for every B group) with their query heads in
        ``order`` ((len(ia)·G, rep): for the pair (i, j), the order of i's query heads)."""
        idx = ia.repeat_interleave(G)
        dtype = precise_dtype(*(working_dtype(sd_a, s.key) for s in sib.slots))
        out = {}
        for p in sorted({s.power for s in sib.slots}, reverse=True):
            parts = []
            for s in [s for s in sib.slots if s.power == p]:
                x = slot_blocks(stored(sd_a, s.key), s, sib.blocks, dtype)[idx]  # as stored: the same values
                if s.repeat > 1:
                    P, d = x.shape[0], x.shape[1]
                    x = x.reshape(P, d, s.repeat, -1)
                    x = x[torch.arange(P)[:, None], :, order].permute(0, 2, 1, 3).reshape(P, d, -1)
                parts.append(x)
            out[p] = torch.cat(parts, dim=2)
        return out

    @staticmethod
    def _query_pairing(inst, siblings, sd_a, sd_b, opts, rep) -> torch.Tensor:
        """``sub[i, j]`` (rep,): for A's KV group i paired with B's group j, which of i's query heads
        goes to each of j's positions (assignment on Σ ‖X_A X_Bᵀ‖_* over the query members; plain
        inner products when rotations are off)."""
        G = inst.blocks
        H = G * rep
        sim = torch.zeros(H, H, dtype=torch.float64)
        for sib in siblings:
            for s in sib.slots:
                if s.repeat == 1:
                    continue
                dtype = precise_dtype(working_dtype(sd_a, s.key))
                xa = _query_blocks(stored(sd_a, s.key), s, H, dtype)  # as stored: the same values
                xb = _query_blocks(stored(sd_b, s.key), s, H, dtype)
                cross = torch.einsum("adn,ben->abde", xa, xb).double()
                sim += torch.linalg.matrix_norm(cross, ord="nuc") if opts.rotate else \
                    torch.diagonal(cross, dim1=-2, dim2=-1).sum(-1)
        sub = torch.empty(G, G, rep, dtype=torch.long)
        for i in range(G):
            for j in range(G):
                block = sim[i * rep:(i + 1) * rep, j * rep:(j + 1) * rep]
                sub[i, j] = match_permutation(block)
        return sub

    def perturb(self, inst, element, generator) -> HeadPerm:
        """Two heads (KV groups with their query heads) of the pairing exchanged: the search's head swap."""
        if inst.blocks < 2:
            return None
        index = swap_blocks(inst.blocks, 1, generator)
        rep = len(element.query) // inst.blocks
        return HeadPerm(element.kv[index], element.query.reshape(inst.blocks, rep)[index].reshape(-1))

    # elements
    def identity(self, inst) -> HeadPerm:
        rep = max(s.repeat for s in inst.slots)
        return HeadPerm(torch.arange(inst.blocks), torch.arange(inst.blocks * rep))

    def random(self, inst, generator, scale: bool = True) -> HeadPerm:
        rep = max(s.repeat for s in inst.slots)
        kv = torch.randperm(inst.blocks, generator=generator)
        query = torch.cat([kv[j] * rep + torch.randperm(rep, generator=generator) for j in range(inst.blocks)])
        return HeadPerm(kv, query)

    def check(self, inst, element, tol: float = 1e-6) -> None:
        rep = max(s.repeat for s in inst.slots)
        G = inst.blocks
        if not (is_permutation(element.kv, G) and is_permutation(element.query, G * rep)):
            raise SymmergeError(f"{inst.name}: solver returned a non-bijective head permutation")
        if not torch.equal(element.query // rep, element.kv.repeat_interleave(rep)):
            raise SymmergeError(f"{inst.name}: query heads were moved out of their key/value group")

    def transform(self, t, slot, inst, element) -> torch.Tensor:
        perm = element.query if slot.repeat > 1 else element.kv
        heads = inst.blocks * slot.repeat
        return index_axis(t, slot, block_index(perm, slot_length(t, slot) // heads))


def _block_distances(inst, slots, sd_a, sd_b) -> torch.Tensor:
    """(H, H): the squared distance between A's head block i and B's head block j over ``slots``."""
    H = inst.blocks
    cost = torch.zeros(H, H, dtype=torch.float64)
    for s in slots:
        xa = slot_blocks(stored(sd_a, s.key), s, H).reshape(H, -1)  # float64 from the tensor as stored
        xb = slot_blocks(stored(sd_b, s.key), s, H).reshape(H, -1)
        cost += xa.square().sum(1)[:, None] + xb.square().sum(1)[None, :] - 2 * xa @ xb.T
    return cost


def _query_blocks(t, slot, heads: int, dtype) -> torch.Tensor:
    """A member's query heads as (H, d, rest)."""
    x = segment(t, slot).to(dtype)
    return x.reshape(heads, x.shape[0] // heads, -1)


KIND = Heads()
