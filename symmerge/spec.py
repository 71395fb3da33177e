"""Symmetry specs: which tensors and axes each symmetry group acts on, per architecture family.

A spec is data. Every group acts on a list of *members*; a member is one tensor and the axis that
carries the group's index (axis 0: output rows of a ``nn.Linear`` weight, or a bias; axis 1: input
columns of a weight). ``power`` is the exponent of the group's scalar rescale on that tensor.

Group kinds:

* ``head_orthogonal``: per head ``h`` an orthogonal ``R_h`` and a scale ``a_h > 0``. Each member's
  head block ``X_h`` (``d_h`` x rest, head index on the member's axis) becomes ``a_h**power R_hᵀ X_h``.
  QK: ``W_Q, b_Q`` (power +1) and ``W_K, b_K`` (power -1) — ``(aQR)(KR/a)ᵀ = QKᵀ``.
  VO: ``W_V, b_V`` (power +1) and the head's column block of ``W_O`` (power -1).
* ``permutation``: one permutation of the units on the member axis (FFN hidden units). With
  ``Group.unit_scale`` set, also a per-unit scale ``s`` applied as ``s**power`` (SwiGLU: ``up`` rows
  power +1, ``down`` columns power -1, ``gate`` power 0; ``"nonzero"``: any real ``s != 0``).
* ``rope_pairs``: the QK group of a rotary-embedding attention (``transformers``' ``rotate_half``
  layout). Per head and per frequency pair (dims ``j`` and ``j + r/2`` of the ``r`` rotary dims) a 2-D
  rotation by ``θ_j`` and a scale ``ρ_j > 0`` (Q rows ``ρ R(θ)ᵀ``, K rows ``R(θ)ᵀ / ρ``: a complex
  scalar per pair, the only transforms commuting with every position's rotation); the ``d - r``
  non-rotated dims keep the full orthogonal group + scale. With ``Group.pair_norms`` (Qwen3's
  ``q_norm``/``k_norm``: an RMSNorm with weight ``w`` over each head's dims between the projection and
  the rotary embedding) the element must also commute with ``diag(w)`` and keep each head's norm:
  no scale (``ρ = 1``), and a pair keeps its free rotation only where ``w_j = w_{j+r/2}`` for every such
  norm; elsewhere only ``θ ∈ {0, π}`` (a sign flip of the pair) remains.
* ``residual``: one orthogonal ``Q`` on the whole residual stream of a pre-RMSNorm decoder, applied
  to every member as ``X → Qᵀ X`` along its axis (embeddings and readers: columns, ``W → WQ``;
  writers: rows and biases, ``W → QᵀW``). Valid after the norm weights are folded into their readers
  (``Spec.folds``); ``diag`` members (norm weights) transform as ``γ → diag(Qᵀ diag(γ) Q)``.

Member options for fused and grouped layouts:

* ``chunk=(k, n)``: the member is the ``k``-th of ``n`` equal consecutive slices along its axis (GPT-2's
  ``c_attn`` holds Q, K, V as column blocks 0, 1, 2 of 3).
* ``heads="query"`` / ``"kv"``: which head count the member is split into. Groups act per *group
  head* (``Group.heads``): ``"kv"`` groups (GQA) share one element among the ``H / H_kv`` query heads
  of a KV head (query head ``h`` uses KV head ``h // (H / H_kv)``).
* ``root=True``: the name is a full state-dict key outside the base model (``lm_head.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD_ORTHOGONAL = "head_orthogonal"
PERMUTATION = "permutation"
ROPE_PAIRS = "rope_pairs"
RESIDUAL = "residual"


@dataclass(frozen=True)
class Member:
    """One tensor a group acts on; ``name`` is a template with ``{i}`` for the layer index."""

    name: str
    axis: int
    power: int = 1
    optional: bool = False  # biases may be absent (bias=False configs)
    chunk: tuple[int, int] = (0, 1)  # (k, n): k-th of n equal consecutive slices along the axis
    heads: str = "query"  # head count the member is split into: "query" or "kv"
    root: bool = False  # name is a full key outside the base model (task heads)
    diag: bool = False  # residual group: a norm weight, transformed as a diagonal matrix


@dataclass(frozen=True)
class Fold:
    """A norm whose weight folds into the tensors that read its output (weight columns)."""

    norm: str
    readers: tuple[Member, ...]


@dataclass(frozen=True)
class Group:
    """A symmetry group repeated in every layer; ``symmetry`` is the user-facing switch."""

    name: str
    kind: str
    symmetry: str
    members: tuple[Member, ...]
    heads: str = "query"  # head groups: one element per query head or per KV head (GQA)
    unit_scale: str | None = None  # permutation groups: None or "nonzero" (per-unit scale s**power)
    pair_norms: tuple[str, ...] = ()  # rope groups: per-head norms before the rotary embedding (Qwen3)


@dataclass(frozen=True)
class Spec:
    family: str
    model_types: tuple[str, ...]
    groups: tuple[Group, ...]
    input_kind: str = "text"  # "text" (input_ids) or "image" (pixel_values)
    folds: tuple[Fold, ...] = ()  # norms folded into their readers before the residual group acts
    partial_rotary: bool = False  # the model honours rope_parameters["partial_rotary_factor"]
    unsupported: tuple[tuple[str, str], ...] = ()  # (tensor template, reason): refuse checkpoints holding it
    residual_kind: str = "orthogonal"  # "orthogonal" (RMSNorm, after folding) or "permutation" (LayerNorm)


def linear_rows(module: str, power: int = 1) -> tuple[Member, ...]:
    """Output rows of a Linear layer: its weight rows and its (optional) bias."""
    return (Member(f"{module}.weight", 0, power), Member(f"{module}.bias", 0, power, optional=True))


def attention_groups(q: str, k: str, v: str, o: str, extra_q=(), extra_k=()) -> tuple[Group, Group]:
    """QK and VO head groups of one self-attention block (module name templates)."""
    qk = linear_rows(q, +1) + linear_rows(k, -1)
    for name in extra_q:
        qk += tuple(Member(m.name, m.axis, m.power, optional=True) for m in linear_rows(name, +1))
    for name in extra_k:
        qk += tuple(Member(m.name, m.axis, m.power, optional=True) for m in linear_rows(name, -1))
    vo = linear_rows(v, +1) + (Member(f"{o}.weight", 1, -1),)
    return (Group("attn.qk", HEAD_ORTHOGONAL, "attn", qk), Group("attn.vo", HEAD_ORTHOGONAL, "attn", vo))


def ffn_group(inputs: tuple[str, ...], output: str) -> Group:
    """Permutation of FFN hidden units: rows of every input Linear, columns of the output one."""
    members: tuple[Member, ...] = ()
    for name in inputs:
        members += linear_rows(name)
    return Group("ffn", PERMUTATION, "ffn", members + (Member(f"{output}.weight", 1),))


def _bert_like(family: str, model_types: tuple[str, ...], layer: str, q, k, v, o, ffn_in, ffn_out,
               extra_q=(), extra_k=(), input_kind="text", residual: Group | None = None) -> Spec:
    p = layer + "."
    attn = attention_groups(p + q, p + k, p + v, p + o, [p + n for n in extra_q], [p + n for n in extra_k])
    groups = attn + (ffn_group((p + ffn_in,), p + ffn_out),) + ((residual,) if residual else ())
    return Spec(family, model_types, groups, input_kind, residual_kind="permutation")


def layernorm_residual(stream: tuple[Member, ...], layer: str, readers, writers, norms, final_norms,
                       heads, conv1d: bool = False) -> Group:
    """The residual stream of a LayerNorm transformer: one permutation of the hidden dims everywhere
    (LayerNorm is permutation-equivariant: ``LN(Px) = P LN(x)`` with ``γ, β`` permuted; no sign flips,
    no rotations for generic ``γ``). ``stream``: tensors writing the stream outside the layers
    (embeddings), ``readers``/``writers``: layer modules reading (weight columns) or writing (weight rows
    and bias) it, ``norms``: the layers' LayerNorm modules (weight and bias move with the stream),
    ``final_norms``: LayerNorms outside the layers, ``heads``: full keys of task-head weights reading it.
    ``conv1d``: the layers are GPT-2 ``Conv1D`` (weight in × out: inputs on axis 0, outputs on axis 1)."""
    p = layer + "."
    w_in, w_out = (0, 1) if conv1d else (1, 0)
    members = stream + tuple(Member(p + r + ".weight", w_in, 0) for r in readers)
    for w in writers:
        members += (Member(p + w + ".weight", w_out, 0), Member(p + w + ".bias", 0, 0, optional=True))
    for n in [p + n for n in norms] + list(final_norms):
        members += (Member(n + ".weight", 0, 0, diag=True), Member(n + ".bias", 0, 0, optional=True, diag=True))
    members += tuple(Member(h, 1, 0, optional=True, root=True) for h in heads)
    return Group("residual", RESIDUAL, "residual", members)


def _rows(module: str, power: int, heads: str = "query") -> tuple[Member, ...]:
    return (Member(f"{module}.weight", 0, power, heads=heads), Member(f"{module}.bias", 0, power, optional=True, heads=heads))


def _gpt2() -> Spec:
    """GPT-2: Conv1D layers (weight in × out, so outputs are columns); ``c_attn`` fuses Q, K, V."""
    p = "h.{i}."

    def qkv(k: int, power: int) -> tuple[Member, ...]:
        return (Member(p + "attn.c_attn.weight", 1, power, chunk=(k, 3)),
                Member(p + "attn.c_attn.bias", 0, power, optional=True, chunk=(k, 3)))

    qk = Group("attn.qk", HEAD_ORTHOGONAL, "attn", qkv(0, +1) + qkv(1, -1))
    vo = Group("attn.vo", HEAD_ORTHOGONAL, "attn", qkv(2, +1) + (Member(p + "attn.c_proj.weight", 0, -1),))
    ffn = Group("ffn", PERMUTATION, "ffn", (Member(p + "mlp.c_fc.weight", 1), Member(p + "mlp.c_fc.bias", 0, optional=True),
                                            Member(p + "mlp.c_proj.weight", 0)))
    # LayerNorm stream: one permutation of the hidden dims (the LM head is tied to wte: both move alike)
    residual = layernorm_residual((Member("wte.weight", 1, 0), Member("wpe.weight", 1, 0)), "h.{i}",
                                  ("attn.c_attn", "mlp.c_fc"), ("attn.c_proj", "mlp.c_proj"), ("ln_1", "ln_2"),
                                  ("ln_f",), ("lm_head.weight", "score.weight"), conv1d=True)
    return Spec("gpt2", ("gpt2",), (qk, vo, ffn, residual), residual_kind="permutation")


def _rope_attention(a: str, o: str, pair_norms=()) -> tuple[Group, Group]:
    """RoPE QK pairs and VO rotations per KV head (GQA): q/o split into query heads, k/v into KV heads."""
    qk = Group("attn.qk", ROPE_PAIRS, "attn", _rows(a + "q_proj", +1) + _rows(a + "k_proj", -1, "kv"), heads="kv",
               pair_norms=tuple(a + n for n in pair_norms))
    vo = Group("attn.vo", HEAD_ORTHOGONAL, "attn", _rows(a + "v_proj", +1, "kv") + (Member(a + o, 1, -1),), heads="kv")
    return qk, vo


def _llama(family: str = "llama", model_types=("llama", "mistral", "qwen2"), pair_norms=()) -> Spec:
    """Llama / Mistral / Qwen2: RoPE + GQA attention, SwiGLU FFN, pre-RMSNorm residual stream.
    Qwen3: the same plus ``pair_norms`` (q_norm/k_norm), which restrict the QK group."""
    a, m = "layers.{i}.self_attn.", "layers.{i}.mlp."
    ffn = Group("ffn", PERMUTATION, "ffn", _rows(m + "gate_proj", 0) + _rows(m + "up_proj", +1)
                + (Member(m + "down_proj.weight", 1, -1),), unit_scale="nonzero")
    attn_in = tuple(Member(a + n + ".weight", 1, 0) for n in ("q_proj", "k_proj", "v_proj"))
    ffn_in = tuple(Member(m + n + ".weight", 1, 0) for n in ("gate_proj", "up_proj"))
    heads = tuple(Member(n, 1, 0, optional=True, root=True) for n in ("lm_head.weight", "score.weight"))
    writers = (Member(a + "o_proj.weight", 0, 0), Member(a + "o_proj.bias", 0, 0, optional=True),
               Member(m + "down_proj.weight", 0, 0), Member(m + "down_proj.bias", 0, 0, optional=True))
    norms = ("layers.{i}.input_layernorm.weight", "layers.{i}.post_attention_layernorm.weight", "norm.weight")
    residual = Group("residual", RESIDUAL, "residual", (Member("embed_tokens.weight", 1, 0),) + attn_in + ffn_in
                     + writers + tuple(Member(n, 0, 0, diag=True) for n in norms) + heads)
    folds = (Fold(norms[0], attn_in), Fold(norms[1], ffn_in), Fold(norms[2], heads))
    return Spec(family, tuple(model_types), _rope_attention(a, "o_proj.weight", pair_norms) + (ffn, residual),
                folds=folds)


def _phi() -> Spec:
    """Phi(-1/2): partial RoPE (``partial_rotary_factor``), parallel attention + GELU MLP, LayerNorm."""
    a, m = "layers.{i}.self_attn.", "layers.{i}.mlp."
    ffn = ffn_group((m + "fc1",), m + "fc2")
    return Spec("phi", ("phi",), _rope_attention(a, "dense.weight") + (ffn,), partial_rotary=True,
                unsupported=((a + "q_layernorm.weight", "qk_layernorm=True (a LayerNorm on each query/key head)"),))


SPECS: tuple[Spec, ...] = (
    _bert_like("bert", ("bert", "roberta", "xlm-roberta", "camembert"), "encoder.layer.{i}",
               "attention.self.query", "attention.self.key", "attention.self.value",
               "attention.output.dense", "intermediate.dense", "output.dense"),
    _bert_like("distilbert", ("distilbert",), "transformer.layer.{i}",
               "attention.q_lin", "attention.k_lin", "attention.v_lin", "attention.out_lin",
               "ffn.lin1", "ffn.lin2"),
    # DeBERTa-v2/v3: with share_att_key=False the relative-position projections live in the
    # query/key head space too: c2p uses Q·pos_keyᵀ (pos_key is K-like), p2c uses K·pos_queryᵀ.
    _bert_like("deberta-v2", ("deberta-v2",), "encoder.layer.{i}",
               "attention.self.query_proj", "attention.self.key_proj", "attention.self.value_proj",
               "attention.output.dense", "intermediate.dense", "output.dense",
               extra_q=("attention.self.pos_query_proj",), extra_k=("attention.self.pos_key_proj",)),
    _bert_like("vit", ("vit",), "layers.{i}",
               "attention.q_proj", "attention.k_proj", "attention.v_proj", "attention.o_proj",
               "mlp.fc1", "mlp.fc2", input_kind="image",
               residual=layernorm_residual(
                   (Member("embeddings.cls_token", 2, 0), Member("embeddings.position_embeddings", 2, 0),
                    Member("embeddings.patch_embeddings.projection.weight", 0, 0),
                    Member("embeddings.patch_embeddings.projection.bias", 0, 0, optional=True)),
                   "layers.{i}", ("attention.q_proj", "attention.k_proj", "attention.v_proj", "mlp.fc1"),
                   ("attention.o_proj", "mlp.fc2"), ("layernorm_before", "layernorm_after"), ("layernorm",),
                   ("classifier.weight",))),
    _gpt2(),
    _llama(),
    _llama("qwen3", ("qwen3",), pair_norms=("q_norm.weight", "k_norm.weight")),
    _phi(),
)

SYMMETRIES = ("attn", "ffn", "rescale", "residual")


def supported_model_types() -> list[str]:
    return sorted(t for s in SPECS for t in s.model_types)


def spec_for(model_type: str) -> Spec:
    for spec in SPECS:
        if model_type in spec.model_types:
            return spec
    from .errors import SymmergeError

    raise SymmergeError(
        f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}"
    )
