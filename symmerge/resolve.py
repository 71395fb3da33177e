"""Resolve a spec against a concrete state dict: real tensor names, layers and head counts."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import SymmergeError
from .spec import HEAD_ORTHOGONAL, RESIDUAL, ROPE_PAIRS, Group, Member, Spec


@dataclass(frozen=True)
class Slot:
    """One member tensor of one group instance: state-dict key, axis and scale power.

    ``start``/``length``: the slice of the axis the group acts on (``length`` None: the whole axis);
    ``repeat``: member heads per group head (GQA: a query-head member of a KV-head group has
    ``H / H_kv``); ``diag``: a norm weight transformed as a diagonal matrix (residual group)."""

    key: str
    axis: int
    power: int
    start: int = 0
    length: int | None = None
    repeat: int = 1
    diag: bool = False


@dataclass(frozen=True)
class Instance:
    """A group in one layer, e.g. ``layer.3.attn.qk`` (or model-wide: ``residual``)."""

    name: str
    layer: int
    group: Group
    slots: tuple[Slot, ...]
    blocks: int  # number of group heads (head groups) or 1 (permutations, residual)
    size: int  # head dim, number of permuted units, or hidden size (residual)
    rotary: int = 0  # rope groups: rotary dims per head (pairs j, j + rotary/2); the rest are not rotated
    variant: str = ""  # residual: "orthogonal" (norms folded) or "signed_permutation" (tied, unfoldable norm)
    folds: tuple[tuple[str, tuple[str, ...]], ...] = ()  # residual: (norm key, reader keys) to fold first
    locked: tuple[int, ...] = ()  # rope groups with pair norms: pairs restricted to θ ∈ {0, π}


HEAD_KINDS = (HEAD_ORTHOGONAL, ROPE_PAIRS)


def find_prefix(spec: Spec, keys) -> str:
    """Prefix of the base model inside the state dict ('' for AutoModel, 'bert.' for task models)."""
    probe = spec.groups[0].members[0].name.format(i=0)
    hits = sorted(k[: -len(probe)] for k in keys if k.endswith(probe) and (k == probe or k[-len(probe) - 1] == "."))
    if len(hits) != 1:
        raise SymmergeError(
            f"cannot locate the {spec.family} layers in the checkpoint (looked for '*{probe}', found {len(hits)})"
        )
    return hits[0]


def _slot(state_dict, key: str, m: Member, heads: dict, blocks: int, head_kind: bool) -> Slot:
    t = state_dict[key]
    if not 0 <= m.axis < t.dim():
        raise SymmergeError(f"{key}: has no axis {m.axis}")
    k, n = m.chunk
    total = t.shape[m.axis]
    if total % n:
        raise SymmergeError(f"{key}: axis {m.axis} of size {total} does not split into {n} equal parts")
    repeat = 1
    if head_kind:
        if heads[m.heads] % blocks:
            raise SymmergeError(f"{key}: {heads[m.heads]} heads cannot share {blocks} group elements")
        repeat = heads[m.heads] // blocks
    length = total // n
    return Slot(key, m.axis, m.power, k * length, length if n > 1 else None, repeat, m.diag)


def _length(state_dict, s: Slot) -> int:
    return s.length if s.length is not None else state_dict[s.key].shape[s.axis]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Tied tensors: one storage under two names (as in ``model.state_dict()`` of a tied model)."""
    return a.shape == b.shape and a.data_ptr() == b.data_ptr() and a.stride() == b.stride()


def _uniform(t: torch.Tensor) -> bool:
    return bool((t == t.reshape(-1)[0]).all())


def _residual(spec: Spec, group: Group, state_dict, prefix: str, num_layers: int) -> Instance | None:
    """The model-wide residual instance (all layers), or None without a head reading the stream."""
    def keys(m: Member) -> list[str]:
        names = [m.name.format(i=i) for i in range(num_layers)] if "{i}" in m.name else [m.name]
        return [n if m.root else prefix + n for n in names]

    slots = []
    for m in group.members:
        for key in keys(m):
            if key in state_dict:
                slots.append(Slot(key, m.axis, 0, diag=m.diag))
            elif not m.optional:
                raise SymmergeError(f"checkpoint lacks tensor {key!r} expected by the {spec.family} spec")
    if not any(k in state_dict for m in group.members if m.root for k in keys(m)):
        return None  # a base model: rotating the stream would rotate its output hidden states
    d = _length(state_dict, slots[0])
    for s in slots:
        if _length(state_dict, s) != d:
            raise SymmergeError(f"{s.key}: axis {s.axis} has size {_length(state_dict, s)}, expected {d}")
    if spec.residual_kind == "permutation":  # LayerNorm: permutations only, nothing to fold
        return Instance("residual", -1, group, tuple(slots), 1, d, variant="permutation")
    streams = [s.key for s in slots if not s.diag]
    folds, blocked = [], []
    for f in spec.folds:
        for i in range(num_layers) if "{i}" in f.norm else [0]:
            readers = [(m.name if m.root else prefix + m.name.format(i=i), m.root) for m in f.readers]
            readers = [(k, root) for k, root in readers if k in state_dict]
            # a task head tied to another tensor of the stream (LM head = embeddings) cannot absorb a norm
            tied = any(_same(state_dict[k], state_dict[o]) for k, root in readers if root for o in streams if o != k)
            (blocked if tied else folds).append((prefix + f.norm.format(i=i), tuple(k for k, _ in readers)))
    if any(not _uniform(state_dict[n]) for n, _ in blocked):
        return Instance("residual", -1, group, tuple(slots), 1, d, variant="signed_permutation")
    return Instance("residual", -1, group, tuple(slots), 1, d, variant="orthogonal", folds=tuple(folds))


def _locked_pairs(state_dict, norm_keys: list[str], size: int, rotary: int) -> tuple[int, ...]:
    """Rotary pairs ``(j, j + r/2)`` whose per-head norm weights differ in some norm: only a sign flip
    (θ = π) commutes with ``diag(w)`` there."""
    if not norm_keys:
        return ()
    if rotary != size:
        raise SymmergeError("per-head query/key norms with partial rotary embeddings are not supported")
    h = rotary // 2
    locked = torch.zeros(h, dtype=torch.bool)
    for key in norm_keys:
        w = state_dict.get(key)
        if w is None:
            raise SymmergeError(f"checkpoint lacks tensor {key!r} (a per-head query/key norm)")
        if w.is_meta:
            raise SymmergeError(f"{key}: the QK group depends on this norm's values; resolve against real weights")
        if tuple(w.shape) != (size,):
            raise SymmergeError(f"{key}: shape {tuple(w.shape)}, expected ({size},) (one weight per head dim)")
        locked |= w[:h] != w[h:rotary]
    return tuple(int(j) for j in torch.nonzero(locked).flatten())


def value_keys(spec: Spec, keys, num_layers: int) -> list[str]:
    """Tensors whose values (not only shapes) ``resolve`` reads: the per-head QK norms (Qwen3)."""
    norms = [n for g in spec.groups for n in g.pair_norms]
    if not norms:
        return []
    keys = set(keys)
    prefix = find_prefix(spec, keys)
    return [k for i in range(num_layers) for n in norms if (k := prefix + n.format(i=i)) in keys]


def config_sizes(spec: Spec, config) -> dict:
    """Layer and head counts (and rotary dims) from a transformers config, as ``resolve`` keywords."""
    heads = config.num_attention_heads
    sizes = dict(num_layers=config.num_hidden_layers, num_heads=heads,
                 num_kv_heads=getattr(config, "num_key_value_heads", None) or heads)
    if spec.partial_rotary:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        sizes["rotary_dim"] = int(head_dim * factor)
    return sizes


def resolve(spec: Spec, state_dict, num_layers: int, num_heads: int, layers=None, *, num_kv_heads: int | None = None,
            rotary_dim: int | None = None, residual: bool = True) -> list[Instance]:
    """All group instances of ``spec`` in ``state_dict`` (optionally only the given ``layers``; the
    model-wide residual group always spans every layer). ``num_kv_heads``: KV heads (GQA; default
    ``num_heads``); ``rotary_dim``: rotary dims per head of rope groups (default: the head dim);
    ``residual=False``: leave out the model-wide residual group (it reads norm values, so it needs
    real tensors, not shape-only ones)."""
    prefix = find_prefix(spec, state_dict.keys())
    for template, reason in spec.unsupported:
        if any(prefix + template.format(i=i) in state_dict for i in range(num_layers)):
            raise SymmergeError(f"{spec.family} models with {reason} are not supported")
    heads = {"query": num_heads, "kv": num_kv_heads or num_heads}
    if heads["query"] % heads["kv"]:
        raise SymmergeError(f"{num_heads} attention heads do not split into {heads['kv']} key/value heads")
    chosen = range(num_layers) if layers is None else layers
    out = []
    for i in chosen:
        if not 0 <= i < num_layers:
            raise SymmergeError(f"layer {i} out of range: the model has {num_layers} layers")
        for group in spec.groups:
            if group.kind == RESIDUAL:
                continue
            blocks = heads[group.heads] if group.kind in HEAD_KINDS else 1
            slots = []
            for m in group.members:
                key = (m.name if m.root else prefix + m.name).format(i=i)
                if key not in state_dict:
                    if m.optional:
                        continue
                    raise SymmergeError(f"checkpoint lacks tensor {key!r} expected by the {spec.family} spec")
                slots.append(_slot(state_dict, key, m, heads, blocks, group.kind in HEAD_KINDS))
            sizes = []
            for s in slots:
                member_heads = blocks * s.repeat
                n = _length(state_dict, s)
                if n % member_heads:
                    raise SymmergeError(f"{s.key}: {n} rows do not split into {member_heads} heads")
                sizes.append(n // member_heads)
            if len(set(sizes)) != 1:
                bad = next(s for s, z in zip(slots, sizes) if z != sizes[0])
                raise SymmergeError(f"{bad.key}: axis {bad.axis} does not match {slots[0].key} ({sizes})")
            size = sizes[0]
            rotary, locked = 0, ()
            if group.kind == ROPE_PAIRS:
                rotary = size if rotary_dim is None else rotary_dim
                if rotary % 2 or not 0 < rotary <= size:
                    raise SymmergeError(f"rotary dims {rotary} do not fit head dim {size} in pairs")
                locked = _locked_pairs(state_dict, [prefix + n.format(i=i) for n in group.pair_norms], size, rotary)
            out.append(Instance(f"layer.{i}.{group.name}", i, group, tuple(slots), blocks, size, rotary,
                                locked=locked))
    for group in spec.groups:
        if group.kind == RESIDUAL and residual:
            inst = _residual(spec, group, state_dict, prefix, num_layers)
            if inst is not None:
                out.append(inst)
    return out
