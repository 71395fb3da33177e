"""Families as data: a family states the *roles* of its tensors once; its symmetry groups follow.

Roles (module names relative to one layer, ``{i}`` filled in later):

* :class:`Attention` — the query/key/value inputs and the output (or GPT-2's fused ``c_attn``),
  rotary embeddings, grouped key/value heads, per-head q/k norms, DeBERTa's relative-position
  projections;
* :class:`MLP` — the modules producing the hidden units (``up``/``fc1``, SwiGLU's ``gate``) and the one
  consuming them;
* :class:`Stream` — the residual stream: its norm (LayerNorm / RMSNorm, pre / post), the layer norms and
  which block each feeds, the embeddings writing the stream, the final norm and the task heads and
  other tensors reading it.

:func:`build` turns them into a :class:`~symmerge.core.spec.Spec`: head permutation (``heads``), the
QK and VO groups (``attn``; RoPE pairs where there are rotary embeddings), the FFN permutation
(``ffn``; with a unit scale for SwiGLU) and the residual stream (``residual``), plus the norm folds.
Tied weights are not stated here: they are what the model class declares (``all_tied_weights_keys``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.spec import Fold, Group, Member, Spec

# The names the role builders give their groups (inside a stack, scoped: T5's ``decoder.cross.attn.vo``). They
# are the family's data: code that needs a layer's parts (REPAIR's channels, OT fusion's unit sets) reads a
# group's role (:func:`role`), never a symmetry's name.
HEADS, QK, VO, FFN = "heads", "attn.qk", "attn.vo", "ffn"
# the blocks a layer norm may feed (``Stream.norms``): (its output reaches the attention, the MLP)
FEEDS = {"attn": (True, False), "mlp": (False, True), "both": (True, True)}


def role(group_name: str) -> str:
    """A group's role: its name without its stack's scope (T5's ``decoder.cross.attn.vo`` is an ``attn.vo``)."""
    for name in (FFN, VO, QK):
        if group_name == name or group_name.endswith("." + name):
            return name
    return group_name


@dataclass(frozen=True)
class Attention:
    q: str = ""
    k: str = ""
    v: str = ""
    o: str = ""
    fused: str = ""  # one module holding Q, K, V as thirds of its output (GPT-2's Conv1D c_attn)
    fused_parts: tuple[str, ...] = ()  # ... as parts sized by head counts instead (Phi-3: ("query", "kv", "kv"))
    fused_interleaved: bool = False  # ... as [q_h, k_h, v_h] head after head instead (GPT-NeoX)
    extra_q: tuple[str, ...] = ()  # optional modules in the query head space (DeBERTa pos_query_proj)
    extra_k: tuple[str, ...] = ()  # ... and in the key head space (pos_key_proj)
    rope: bool = False  # rotary position embeddings (rotate_half layout)
    grouped: bool = False  # k, v split into key/value heads (GQA): one element per KV head
    pair_norms: tuple[str, ...] = ()  # per-head norms between the projection and RoPE (Qwen3 q_norm/k_norm)
    pair_norms_span_heads: bool = False  # the pair norms normalise the whole projection (OLMo 2): one weight
    # per dim of every head, so they also move with the head permutation
    # (q norm, k norm) over the whole q and k, all heads together (OLMoE): permuted with the heads; they
    # leave no QK group (a rotation inside a head does not commute with their elementwise weight, and
    # the norm removes a QK scale, so its inverse on K would change the scores)
    whole_norms: tuple[str, ...] = ()


@dataclass(frozen=True)
class MLP:
    inputs: tuple[str, ...]  # modules producing the hidden units from the stream (fc1 / up)
    output: str  # the module consuming them (fc2 / down)
    gate: str = ""  # SwiGLU's gate: permuted with the units, no scale; 'inputs' get a unit scale s ≠ 0
    fused: str = ""  # one module holding the gate then the up projection as halves of its output (Phi-3)


@dataclass(frozen=True)
class Stream:
    norm: str  # "layernorm" or "rmsnorm"
    placement: str  # "pre" (norm before each block, a final norm) or "post" (norm after each residual add)
    embeddings: tuple[Member, ...]  # tensors writing the stream outside the layers (axis: the hidden one)
    norms: tuple[tuple[str, str], ...]  # per layer: (norm module, the block it feeds: "attn", "mlp", "both")
    final: str = ""  # final norm module (pre-LN), read by the heads
    heads: tuple[Member, ...] = ()  # tensors outside the layers reading the stream (root: task heads)
    others: tuple[Member, ...] = ()  # further stream members outside the layers (e.g. embedding norms)
    extra_readers: tuple[str, ...] = ()  # optional layer modules reading stream-space inputs (DeBERTa's rel. pos.)
    writer_norms: tuple[str, ...] = ()  # per layer: norms on a block's output before the residual add (Gemma 2/3
    # sandwich norms, OLMo 2): they cannot fold, so the stream keeps to signed permutations unless they are uniform
    offset: float = 0.0  # the norms multiply by offset + weight (Gemma's RMSNorm: 1 + w)
    # norms between the embeddings and the first layer (CLIP's vision ``pre_layrnorm``): the stream is their
    # output, so like writer_norms they cannot fold (permutations of the stream unless they are uniform)
    input_norms: tuple[str, ...] = ()


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts block as transformers 5 holds it in memory: the ``router`` module (a weight of
    one row per expert), the experts' SwiGLU FFNs fused in 3-D tensors ``gate_up`` ((E, 2I, d): each
    expert's gate rows, then its up rows) and ``down`` ((E, d, I)), and other modules of the block reading
    the stream (``readers``: Qwen2-MoE's shared-expert gate). A shared expert is the family's ``MLP``."""

    router: str
    gate_up: str
    down: str
    readers: tuple[str, ...] = ()


# task heads of decoders reading the final norm's output: LM, sequence / token classification, QA
DECODER_HEADS = ("lm_head.weight", "score.weight", "classifier.weight", "qa_outputs.weight")


@dataclass(frozen=True)
class Layout:
    conv1d: bool = False  # GPT-2's Conv1D: weight is in × out (outputs on axis 1, inputs on axis 0)

    @property
    def out_axis(self) -> int:
        return 1 if self.conv1d else 0

    @property
    def in_axis(self) -> int:
        return 0 if self.conv1d else 1


def rows(module: str, power: int = 1, heads: str = "query", layout: Layout = Layout(), chunk=(0, 1),
         optional: bool = False, **fused) -> tuple[Member, ...]:
    """A Linear's outputs: its weight on the output axis and its (optional) bias; ``fused``: the
    member options of fused layouts (``parts``, ``interleaved``)."""
    return (Member(f"{module}.weight", layout.out_axis, power, optional=optional, chunk=chunk, heads=heads, **fused),
            Member(f"{module}.bias", 0, power, optional=True, chunk=chunk, heads=heads, **fused))


def columns(module: str, power: int = 1, heads: str = "query", layout: Layout = Layout()) -> tuple[Member, ...]:
    """A Linear's inputs: its weight on the input axis."""
    return (Member(f"{module}.weight", layout.in_axis, power, heads=heads),)


def _attention_groups(p: str, att: Attention, layout: Layout) -> tuple[Group, ...]:
    """The head permutation, then the QK group (where the attention has one) and the VO group."""
    kv = "kv" if att.grouped else "query"
    if att.fused:
        q, k, v = (rows(p + att.fused, power, h, layout, (c, 3),
                        parts=att.fused_parts, interleaved=att.fused_interleaved)
                   for c, power, h in ((0, 1, "query"), (1, -1, kv), (2, 1, kv)))
    else:
        q, k, v = rows(p + att.q, 1), rows(p + att.k, -1, kv), rows(p + att.v, 1, kv)
    for name in att.extra_q:
        q += rows(p + name, 1, optional=True)
    for name in att.extra_k:
        k += rows(p + name, -1, optional=True)
    o = columns(p + att.o, -1, layout=layout)
    qk_kind = "rope_pairs" if att.rope else "head_orthogonal"
    params = (("pair_norms", tuple(p + n for n in att.pair_norms)),) if att.pair_norms else ()
    qk = Group(QK, qk_kind, "attn", q + k, heads=kv, params=params)
    vo = Group(VO, "head_orthogonal", "attn", v + o, heads=kv)
    norms = tuple(Member(p + n, 0, 0, heads=h, diag=True) for n, h in zip(att.pair_norms, ("query", kv))) \
        if att.pair_norms_span_heads else ()
    if att.whole_norms:
        qn, kn = att.whole_norms
        norms = (Member(f"{p}{qn}.weight", 0, 0), Member(f"{p}{kn}.weight", 0, 0, heads=kv))
        return Group(HEADS, "heads", "heads", q + k + v + o + norms, heads=kv, params=(("couples", (VO,)),)), vo
    heads = Group(HEADS, "heads", "heads", q + k + v + o + norms, heads=kv, params=(("couples", (QK, VO)),))
    return heads, qk, vo


def _expert_groups(p: str, moe: Experts) -> tuple[Group, ...]:
    """The permutation of the experts (router rows and the fused tensors' axis 0 together), then the FFN
    permutation inside each expert (one instance per expert, SwiGLU: the up rows with a unit scale)."""
    gate_up, down = p + moe.gate_up, p + moe.down
    inner = Group("expert_ffn", "permutation", "ffn",
                  (Member(gate_up, 1, 0, chunk=(0, 2), stacked=True), Member(gate_up, 1, 1, chunk=(1, 2), stacked=True),
                   Member(down, 2, -1, stacked=True)), params=(("unit_scale", "nonzero"),))
    experts = Group("experts", "experts", "experts",
                    (Member(f"{p}{moe.router}.weight", 0, 0), Member(gate_up, 0, 0), Member(down, 0, 0)),
                    params=(("inner", inner.name),))
    return experts, inner


def _mlp_group(p: str, mlp: MLP, layout: Layout) -> Group:
    members: tuple[Member, ...] = rows(p + mlp.gate, 0, layout=layout) if mlp.gate else ()
    if mlp.fused:
        members += rows(p + mlp.fused, 0, layout=layout, chunk=(0, 2)) \
            + rows(p + mlp.fused, 1, layout=layout, chunk=(1, 2))
    for name in mlp.inputs:
        members += rows(p + name, 1, layout=layout)
    members += columns(p + mlp.output, -1, layout=layout)
    gated = bool(mlp.gate or mlp.fused)
    return Group(FFN, "permutation", "ffn", members, params=(("unit_scale", "nonzero"),) if gated else ())


def _readers(p: str, att: Attention, mlp: MLP | None, block: str, layout: Layout,
             moe: Experts | None = None) -> tuple[Member, ...]:
    """The weights reading the output of a norm that feeds ``block`` ("attn", "mlp" or "both"), at
    their input axis (power 0: a scale of the stream does not reach them through the norm)."""
    attn = (att.fused,) if att.fused else (att.q, att.k, att.v)
    ffn = ((mlp.gate,) * bool(mlp.gate) + (mlp.fused,) * bool(mlp.fused) + mlp.inputs if mlp else ()) + \
        ((moe.router,) + moe.readers if moe else ())
    to_attn, to_mlp = FEEDS[block]
    mods = (attn if to_attn else ()) + (ffn if to_mlp else ())
    experts = (Member(p + moe.gate_up, 2, 0),) if moe and to_mlp else ()
    return tuple(m for name in mods for m in columns(p + name, 0, layout=layout)) + experts


def mlm_transform(dense: str, norm: str, decoder: str, unless: str = "", reader: bool = True) -> tuple[Member, ...]:
    """A masked-LM head ``dense → norm → decoder`` whose decoder is (usually) tied to the word
    embeddings: the transform's output and norm then live in the stream's basis too, so ``dense``
    moves on both axes and the decoder on its input axis (a tied decoder follows the embeddings).
    ``reader``: name ``dense``'s input axis too (False when another role already does)."""
    out = (Member(f"{dense}.weight", 1, 0, optional=True, root=True),) if reader else ()
    return out + (Member(f"{dense}.weight", 0, 1, optional=True, root=True, unless=unless),
                  Member(f"{dense}.bias", 0, 1, optional=True, root=True, unless=unless),
                  Member(f"{norm}.weight", 0, 0, optional=True, root=True, diag=True, unless=unless),
                  Member(f"{norm}.bias", 0, 0, optional=True, root=True, unless=unless),
                  Member(f"{decoder}.weight", 1, 0, optional=True, root=True, unless=unless))


def _stream_group(p: str, att: Attention, mlp: MLP | None, stream: Stream, layout: Layout,
                  moe: Experts | None = None) -> tuple[Group, tuple[Fold, ...]]:
    members = tuple(stream.embeddings)
    members += _readers(p, att, mlp, "both", layout, moe)
    members += tuple(Member(f"{p}{n}.weight", layout.in_axis, 0, optional=True) for n in stream.extra_readers)
    # writers: output rows and bias (power +1: they carry a scale of the stream)
    for w in (att.o,) + ((mlp.output,) if mlp else ()):
        members += rows(p + w, 1, layout=layout)
    members += (Member(p + moe.down, 1, 1),) if moe else ()  # each expert's output rows
    norms = [p + n for n, _ in stream.norms] + ([stream.final] if stream.final else [])
    fixed = tuple(p + n + ".weight" for n in stream.writer_norms) + tuple(n + ".weight" for n in stream.input_norms)
    for n in norms + [p + n for n in stream.writer_norms] + list(stream.input_norms):
        members += (Member(n + ".weight", 0, 0, diag=True),)
        if stream.norm == "layernorm":
            members += (Member(n + ".bias", 0, 0, optional=True),)
    members += tuple(stream.heads) + tuple(stream.others)
    params = (("norm", stream.norm), ("placement", stream.placement)) + ((("fixed_norms", fixed),) if fixed else ()) \
        + ((("norm_offset", stream.offset),) if stream.offset else ())
    folds: tuple[Fold, ...] = ()
    if stream.placement == "pre":
        bias = (lambda n: n + ".bias") if stream.norm == "layernorm" else (lambda n: None)
        folds = tuple(Fold(p + n + ".weight", _readers(p, att, mlp, block, layout, moe), bias(p + n), stream.offset)
                      for n, block in stream.norms)
        if stream.final:
            folds += (Fold(stream.final + ".weight", tuple(stream.heads), bias(stream.final), stream.offset),)
    return Group("residual", "residual", "residual", members, params=params), folds


def build(family: str, model_types: tuple[str, ...], layer: str, attention: Attention, mlp: MLP | None,
          stream: Stream | None = None, inputs: str = "text", conv1d: bool = False,
          partial_rotary: bool = False, unsupported: tuple[tuple[str, str], ...] = (),
          moe: Experts | None = None, in_memory_only: str = "",
          unsupported_settings: tuple[tuple[str, tuple, str], ...] = ()) -> Spec:
    """The spec of a family from its roles; ``layer`` is the template of one layer's module path; ``mlp``
    may be None with ``moe`` (a mixture of experts; ``mlp`` is then its shared expert, if any)."""
    layout = Layout(conv1d)
    p = layer + "."
    groups = _attention_groups(p, attention, layout) + (_expert_groups(p, moe) if moe else ())
    groups += (_mlp_group(p, mlp, layout),) if mlp else ()
    folds: tuple[Fold, ...] = ()
    if stream is not None:
        residual, folds = _stream_group(p, attention, mlp, stream, layout, moe)
        groups += (residual,)
    probe = f"{p}{attention.fused or attention.q}.weight"
    return Spec(family, tuple(model_types), groups, inputs, folds, partial_rotary,
                tuple((p + t if not t.startswith("/") else t[1:], r) for t, r in unsupported), probe, layer,
                in_memory_only, unsupported_settings=unsupported_settings)


# ------------------------------------------------------------------ families with several layer stacks


def scoped(scope: str, groups) -> tuple[Group, ...]:
    """The groups of one stack (or block) of a family with several, named ``{scope}.{name}``, with their
    references to each other (a head permutation's ``couples``, the experts' ``inner``) renamed alike."""
    def name(n: str) -> str:
        return f"{scope}.{n}"

    def param(key, value):
        return tuple(map(name, value)) if key == "couples" else name(value) if key == "inner" else value

    return tuple(replace(g, name=name(g.name), params=tuple((k, param(k, v)) for k, v in g.params)) for g in groups)


def attention_groups(layer: str, att: Attention, heads: bool = True,
                     tied: tuple[Member, ...] = ()) -> tuple[Group, ...]:
    """The head groups of one attention block of a layer template; ``heads=False`` leaves out the head
    permutation; ``tied``: the head permutation is one for every layer of the stack and also moves these
    members, one block per head (T5's self-attention: its relative position bias, one column per head in
    layer 0, is added to the scores of every layer of the stack)."""
    permutation, *others = _attention_groups(layer + ".", att, Layout())  # the head permutation comes first
    if tied:
        what = ("one permutation of the attention heads of every layer of the stack at once, and of the per-head "
                "columns of the tensors listed without a layer index")
        permutation = replace(permutation, members=permutation.members + tuple(tied),
                              params=permutation.params + (("tied", "stack"), ("description", what)))
    return ((permutation,) if heads else ()) + tuple(others)
