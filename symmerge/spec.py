"""Symmetry specs: which tensors and axes each symmetry group acts on, per architecture family.

A spec is data. Every group acts on a list of *members*; a member is one tensor and the axis that
carries the group's index (axis 0: output rows of a ``nn.Linear`` weight, or a bias; axis 1: input
columns of a weight). ``power`` is the exponent of the group's scalar rescale on that tensor.

Group kinds:

* ``head_orthogonal``: per head ``h`` an orthogonal ``R_h`` and a scale ``a_h > 0``. Each member's
  head block ``X_h`` (``d_h`` x rest, head index on the member's axis) becomes ``a_h**power R_hᵀ X_h``.
  QK: ``W_Q, b_Q`` (power +1) and ``W_K, b_K`` (power -1) — ``(aQR)(KR/a)ᵀ = QKᵀ``.
  VO: ``W_V, b_V`` (power +1) and the head's column block of ``W_O`` (power -1).
* ``permutation``: one permutation of the units on the member axis (FFN hidden units).
"""

from __future__ import annotations

from dataclasses import dataclass

HEAD_ORTHOGONAL = "head_orthogonal"
PERMUTATION = "permutation"


@dataclass(frozen=True)
class Member:
    """One tensor a group acts on; ``name`` is a template with ``{i}`` for the layer index."""

    name: str
    axis: int
    power: int = 1
    optional: bool = False  # biases may be absent (bias=False configs)


@dataclass(frozen=True)
class Group:
    """A symmetry group repeated in every layer; ``symmetry`` is the user-facing switch."""

    name: str
    kind: str
    symmetry: str
    members: tuple[Member, ...]


@dataclass(frozen=True)
class Spec:
    family: str
    model_types: tuple[str, ...]
    groups: tuple[Group, ...]
    input_kind: str = "text"  # "text" (input_ids) or "image" (pixel_values)


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
               extra_q=(), extra_k=(), input_kind="text") -> Spec:
    p = layer + "."
    attn = attention_groups(p + q, p + k, p + v, p + o, [p + n for n in extra_q], [p + n for n in extra_k])
    return Spec(family, model_types, attn + (ffn_group((p + ffn_in,), p + ffn_out),), input_kind)


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
               "mlp.fc1", "mlp.fc2", input_kind="image"),
)

SYMMETRIES = ("attn", "ffn", "rescale")


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
