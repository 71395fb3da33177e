"""Bind a spec to a concrete state dict: real tensor names, layers, head counts — for every kind.

:func:`resolve` loops over layers and groups and asks each group's kind to bind it
(:meth:`symmerge.groups.base.Kind.bind`); kinds use the generic helpers of :class:`Binding` (slots of
one layer, slots of the whole model, key templates, declared ties). Nothing here knows a kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..errors import SymmergeError
from .instance import Instance, Slot
from .kinds import get_kind
from .spec import Group, Member, Spec


def find_prefix(spec: Spec, keys, disk_names=None) -> str:
    """Prefix of the base model inside the state dict ('' for AutoModel, 'bert.' for task models)."""
    return _locate(spec, keys, disk_names)[0]


def _probe_hits(probe: str, keys) -> list[str]:
    return sorted(k[: -len(probe)] for k in keys if k.endswith(probe) and (k == probe or k[-len(probe) - 1] == "."))


def _locate(spec: Spec, keys, disk_names=None) -> tuple[str, tuple]:
    """(prefix, the stacks present): a family with several stacks needs one of them (its others may be
    absent: T5EncoderModel, CLIPTextModel), all under one prefix."""
    keys = list(keys)
    if spec.stacks:
        found = {s.name: _probe_hits(s.probe.format(i=0), keys) for s in spec.stacks}
        present = tuple(s for s in spec.stacks if found[s.name])
        prefixes = {p for s in present for p in found[s.name]}
        if len(prefixes) == 1 and all(len(found[s.name]) == 1 for s in present):
            return prefixes.pop(), present
        probed = ", ".join(p + s.probe.format(i=0) for s in spec.stacks for p in found[s.name])
        raise SymmergeError(f"cannot locate the {spec.family} layers in the checkpoint (looked for layer 0 of its "
                            f"{', '.join(s.name for s in spec.stacks)} stacks, found {probed or 'none'})")
    probe = spec.probe.format(i=0)
    hits = _probe_hits(probe, keys)
    if len(hits) != 1:
        found = f": {', '.join((disk_names or {}).get(h + probe, h + probe) for h in hits)}" if hits else ""
        raise SymmergeError(
            f"cannot locate the {spec.family} layers in the checkpoint (looked for its layer 0's attention "
            f"query weight, found {len(hits)}{found})"
        )
    return hits[0], ()


def stack_of(spec: Spec, template: str):
    """The stack whose layers a template's ``{i}`` counts (None: a single-stack family)."""
    return next((s for s in spec.stacks if template.startswith(s.layer + ".")), None)


@dataclass
class Binding:
    """What a kind needs to bind a group: the state dict (real or shape-only ``meta`` tensors), the
    base-model prefix, layer and head counts, rotary dims, declared ties ``{alias: source}``, and the
    residual-group choice (``largest`` or ``permutation``)."""

    spec: Spec
    state_dict: dict
    prefix: str
    num_layers: int
    heads: dict
    rotary_dim: int | None = None
    ties: dict = field(default_factory=dict)
    residual: str = "largest"
    disk_names: object = field(default_factory=dict)  # a mapping: in-memory -> on-disk names (messages)
    architecture: str = ""  # the model's class name (task-head-specific roles)
    # several stacks (T5, CLIP): per-layer binding of one stack names its instances ``{scope}.layer.{i}.…``
    # and numbers them from ``offset``; ``stack_layers`` (layer template -> count, 0 for an absent stack)
    # says how many layers a model-wide member's ``{i}`` runs over
    scope: str = ""
    offset: int = 0
    stack_layers: dict = field(default_factory=dict)
    # the global layer indices being bound (``layers`` of :func:`resolve`; None: all): a group tied across
    # a stack binds only where every layer of its stack is among them
    selected: frozenset | None = None

    # ---------------------------------------------------------------- names
    def key_of(self, template: str, layer=None, root: bool = False) -> str:
        name = template if root else self.prefix + template
        return name.format(i=layer) if "{i}" in name else name

    def disk(self, key: str) -> str:
        """The name a tensor has in the checkpoint files (for messages)."""
        return self.disk_names.get(key, key)

    def layers_of(self, template: str) -> list:
        if "{i}" not in template:
            return [None]
        if self.spec.stacks:
            stack = stack_of(self.spec, template)
            if stack is None:
                raise SymmergeError(f"{template}: a {self.spec.family} template with a layer index lies in no stack")
            return list(range(self.stack_layers.get(stack.layer, 0)))
        return list(range(self.num_layers))

    def alias_source(self, key: str) -> str | None:
        return self.ties.get(key)

    def aliases_of(self, key: str) -> tuple[str, ...]:
        return tuple(a for a, s in self.ties.items() if s == key and a in self.state_dict)

    @property
    def task_model(self) -> bool:
        """A model with a task head around its base model: its output is not the residual stream."""
        if self.spec.task_classes:  # named where a prefix does not tell (T5ForSequenceClassification has one, but
            return self.architecture.endswith(self.spec.task_classes)  # its head reads no stream the spec names)
        return self.prefix != ""

    def applies(self, m: Member, layer=None) -> bool:
        """Whether the member's role holds in this model (its head class, the tensors present)."""
        if m.classes and not self.architecture.endswith(m.classes):
            return False
        return not (m.unless and self.key_of(m.unless, layer) in self.state_dict)

    def with_info(self, inst: Instance, info) -> Instance:
        return replace(inst, info=info)

    # ---------------------------------------------------------------- slots
    def _length(self, s: Slot) -> int:
        total = self.state_dict[s.key].shape[s.axis]
        if s.length is None:
            return total
        return s.length * (total // s.period if s.period is not None else 1)

    def _slot(self, key: str, m: Member, blocks: int | None) -> Slot:
        t = self.state_dict[key]
        if not 0 <= m.axis < t.dim() or (m.stacked and m.axis == 0):
            raise SymmergeError(f"{self.disk(key)}: has no axis {m.axis}" + " below its stacking axis" * m.stacked)
        k, n = m.chunk
        total = t.shape[m.axis]
        if total % n and not m.parts:
            raise SymmergeError(f"{self.disk(key)}: axis {m.axis} of size {total} does not split into {n} equal parts")
        repeat = 1
        if blocks is not None:
            if self.heads[m.heads] % blocks:
                raise SymmergeError(f"{self.disk(key)}: {self.heads[m.heads]} heads cannot share {blocks} group "
                                    "elements")
            repeat = self.heads[m.heads] // blocks
        length, start, period = total // n, k * (total // n), None
        if m.parts:  # consecutive slices sized by head counts (fused GQA projections)
            counts = [self.heads[p] for p in m.parts]
            unit, rem = divmod(total, sum(counts))
            if rem or len(counts) != n:
                raise SymmergeError(f"{self.disk(key)}: axis {m.axis} of size {total} does not split into parts of "
                                    f"{'/'.join(map(str, counts))} heads")
            start, length = unit * sum(counts[:k]), unit * counts[k]
        elif m.interleaved:  # the k-th of n parts of every head's block
            period, rem = divmod(total, self.heads[m.heads])
            if rem or period % n:
                raise SymmergeError(f"{self.disk(key)}: axis {m.axis} of size {total} does not split into "
                                    f"{self.heads[m.heads]} heads of {n} equal parts")
            length = period // n
            start = k * length
        return Slot(key, m.axis, m.power, start, length if n > 1 else None, repeat, m.diag,
                    self.aliases_of(key), period)

    def _missing(self, key: str) -> SymmergeError:
        return SymmergeError(f"checkpoint lacks tensor {self.disk(key)!r} expected by the {self.spec.family} spec")

    def instance(self, group: Group, layer: int, blocked: bool) -> Instance:
        """The instance of a per-layer group: its slots in ``layer``, split into head blocks when
        ``blocked`` (all members must agree on the block size)."""
        blocks = self.heads[group.heads] if blocked else 1
        slots = []
        for m in group.members:
            if not self.applies(m, layer):
                continue
            key = self.key_of(m.name, layer, m.root)
            if key not in self.state_dict:
                if m.optional:
                    continue
                raise self._missing(key)
            slots.append(self._slot(key, m, blocks if blocked else None))
        sizes = []
        for s in slots:
            member_heads = blocks * s.repeat
            n = self._length(s)
            if n % member_heads:
                raise SymmergeError(f"{self.disk(s.key)}: {n} rows do not split into {member_heads} heads")
            sizes.append(n // member_heads)
        if len(set(sizes)) != 1:
            bad = next(s for s, z in zip(slots, sizes) if z != sizes[0])
            raise SymmergeError(f"{self.disk(bad.key)}: axis {bad.axis} does not match {self.disk(slots[0].key)} "
                                f"({sizes})")
        name = f"{self.scope}.layer.{layer}.{group.name.removeprefix(self.scope + '.')}" if self.scope \
            else f"layer.{layer}.{group.name}"
        return Instance(name, self.offset + layer, group, tuple(slots), blocks, sizes[0])

    def stacked_instances(self, group: Group, layer: int) -> list[Instance]:
        """One instance per index ``e`` of axis 0 of the group's stacked members (fused experts
        ``(E, ...)``: the FFN inside each expert), named ``layer.{i}.{group}.{e}``, whose slots lie in the
        sub-tensors ``t[e]``. Every member must be stacked, and all on the same number of experts."""
        base = self.instance(group, layer, blocked=False)
        counts = {self.state_dict[s.key].shape[0] for s in base.slots}
        if not all(m.stacked for m in group.members) or len(counts) != 1:
            raise SymmergeError(f"{group.name}: its stacked tensors do not hold one common number of experts "
                                f"({', '.join(self.disk(s.key) for s in base.slots)})")
        return [replace(base, name=f"{base.name}.{e}", slots=tuple(replace(s, index=e) for s in base.slots))
                for e in range(counts.pop())]

    def model_instance(self, group: Group) -> Instance:
        """The model-wide instance of a group whose members span every layer and the tensors outside
        them; declared aliases (tied copies) are not slots of their own but follow their source."""
        slots = []
        for m in group.members:
            for i in self.layers_of(m.name):
                if not self.applies(m, i):
                    continue
                key = self.key_of(m.name, i, m.root)
                if key in self.state_dict:
                    if self.alias_source(key) is None:
                        slots.append(self._slot(key, m, None))
                elif not m.optional:
                    raise self._missing(key)
        d = self._length(slots[0])
        for s in slots:
            if self._length(s) != d:
                raise SymmergeError(f"{self.disk(s.key)}: axis {s.axis} has size {self._length(s)}, expected {d}")
        return Instance(group.name, -1, group, tuple(slots), 1, d)


def declared_ties(model) -> dict:
    """``{alias: source}`` of the weights the model class declares tied under its config
    (transformers' ``all_tied_weights_keys``: e.g. ``lm_head.weight`` → ``model.embed_tokens.weight``
    when ``tie_word_embeddings`` is set)."""
    ties = getattr(model, "all_tied_weights_keys", None) or {}
    return {str(a): str(s) for a, s in dict(ties).items()}


def config_sizes(spec: Spec, config) -> dict:
    """Layer and head counts (and rotary dims) from a transformers config, as ``resolve`` keywords. A
    family with several stacks adds ``stacks`` (per stack: its layer and head counts); its
    ``num_layers`` counts the layers of every stack."""
    if spec.stacks:
        stacks = {}
        for s in spec.stacks:
            c = (getattr(config, s.config, None) if s.config else None) or config
            heads = getattr(c, s.heads)
            stacks[s.name] = dict(num_layers=getattr(c, s.layers), num_heads=heads,
                                  num_kv_heads=getattr(c, "num_key_value_heads", None) or heads)
        first = stacks[spec.stacks[0].name]
        return dict(num_layers=sum(v["num_layers"] for v in stacks.values()), num_heads=first["num_heads"],
                    stacks=stacks)
    heads = config.num_attention_heads
    sizes = dict(num_layers=config.num_hidden_layers, num_heads=heads,
                 num_kv_heads=getattr(config, "num_key_value_heads", None) or heads)
    if spec.partial_rotary:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        factor = (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0)
        sizes["rotary_dim"] = int(head_dim * factor)
    return sizes


def layer_paths(spec: Spec, keys, sizes: dict) -> list[str]:
    """Module paths of every layer of the stacks present, in the order instances number them."""
    prefix, present = _locate(spec, keys)
    if not spec.stacks:
        return [(prefix + spec.layer.format(i=i)).rstrip(".") for i in range(sizes["num_layers"])]
    return [prefix + s.layer.format(i=i) for s in present for i in range(sizes["stacks"][s.name]["num_layers"])]


def value_keys(spec: Spec, keys, num_layers: int) -> list[str]:
    """Tensors whose values (not only shapes) binding reads: per-head QK norms (Qwen3)."""
    norms = [n for g in spec.groups for n in g.param("pair_norms", ())]
    if not norms:
        return []
    keys = set(keys)
    prefix = find_prefix(spec, keys)
    return [k for i in range(num_layers) for n in norms if (k := prefix + n.format(i=i)) in keys]


def _bind_all(out: list, group: Group, ctx: Binding, layer) -> None:
    inst = get_kind(group.kind).bind(group, ctx, layer)
    if isinstance(inst, list):  # one instance per expert (stacked members)
        out += inst
    elif inst is not None:
        out.append(inst)


def resolve(spec: Spec, state_dict, num_layers: int, num_heads: int, layers=None, *, num_kv_heads: int | None = None,
            rotary_dim: int | None = None, model_wide: bool = True, ties: dict | None = None,
            residual: str = "largest", disk_names: dict | None = None,
            architecture: str = "", stacks: dict | None = None) -> list[Instance]:
    """All group instances of ``spec`` in ``state_dict``, per-layer groups first (in the spec's order)
    and model-wide groups last. ``layers``: only these layer indices (model-wide groups always span
    every layer); ``num_kv_heads``: KV heads (GQA; default ``num_heads``); ``rotary_dim``: rotary dims
    per head (default: the head dim); ``model_wide=False``: leave the model-wide groups out (they read
    norm values, so they need real tensors); ``ties``: declared ``{alias: source}``;
    ``architecture``: the model's class name;
    ``residual``: ``permutation`` or ``largest`` (the residual stream's group for LayerNorm models);
    ``stacks``: a family with several stacks, per stack name its ``num_layers``/``num_heads``/``num_kv_heads``
    (:func:`config_sizes`): the layers of the stacks present are numbered one after another (T5: the
    encoder's, then the decoder's), ``layers`` and the instances' ``layer`` count in that numbering."""
    prefix, present = _locate(spec, state_dict.keys(), disk_names)
    heads = {"query": num_heads, "kv": num_kv_heads or num_heads}
    ctx = Binding(spec, state_dict, prefix, num_layers, heads, rotary_dim, dict(ties or {}), residual,
                  disk_names if disk_names is not None else {}, architecture,
                  selected=frozenset(layers) if layers is not None else None)
    # (binding, its first global layer index, its layer count, its per-layer groups) of every stack
    parts = [(ctx, 0, num_layers, [g for g in spec.groups if get_kind(g.kind).per_layer])]
    if spec.stacks:
        if stacks is None:
            raise SymmergeError(f"{spec.family}: resolve needs the sizes of each stack (config_sizes)")
        parts, offset = [], 0
        for s in present:
            n, h = stacks[s.name]["num_layers"], stacks[s.name]["num_heads"]
            kv = stacks[s.name].get("num_kv_heads") or h
            own = [g for g in spec.groups if get_kind(g.kind).per_layer and stack_of(spec, g.members[0].name) is s]
            parts.append((replace(ctx, num_layers=n, heads={"query": h, "kv": kv}, scope=s.name, offset=offset),
                          offset, n, own))
            offset += n
        ctx = replace(ctx, num_layers=offset, stack_layers={s.layer: stacks[s.name]["num_layers"] if s in present else 0
                                                            for s in spec.stacks})
        num_layers = offset
    for template, reason in spec.unsupported:
        if any(ctx.key_of(template, i) in state_dict for i in range(num_layers)):
            raise SymmergeError(f"{spec.family} models with {reason} are not supported")
    for part, _, _, _ in parts:
        if part.heads["query"] % part.heads["kv"]:
            raise SymmergeError(f"{part.heads['query']} attention heads do not split into {part.heads['kv']} "
                                "key/value heads")
    for i in (layers or ()):
        if not 0 <= i < num_layers:
            raise SymmergeError(f"layer {i} out of range: the model has {num_layers} layers")
    where = {offset + i: (part, i, groups) for part, offset, n, groups in parts for i in range(n)}
    out = []
    for g in range(num_layers) if layers is None else layers:
        part, i, groups = where[g]
        for group in groups:
            _bind_all(out, group, part, i)
    if model_wide:
        for group in spec.groups:
            if not get_kind(group.kind).per_layer:
                _bind_all(out, group, ctx, None)
    return out
