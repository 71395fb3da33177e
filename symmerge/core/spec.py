"""Symmetry specs as data: which tensors and axes each symmetry group acts on.

A spec is generated from a family's *roles* (:mod:`symmerge.families`); nothing here knows a model.
Every group acts on a list of *members*; a member is one tensor and the axis that carries the
group's index (axis 0: output rows of a ``nn.Linear`` weight, or a bias; axis 1: input columns of a
weight). ``power`` is the exponent of the group's scalar rescale on that tensor. What a group *does*
to its members is its kind's business (:mod:`symmerge.groups`, one module per kind).

Member options for fused and grouped layouts:

* ``chunk=(k, n)``: the member is the ``k``-th of ``n`` equal consecutive slices along its axis (GPT-2's
  ``c_attn`` holds Q, K, V as column blocks 0, 1, 2 of 3).
* ``parts=("query", "kv", "kv")``: with ``chunk=(k, n)``, the ``n`` consecutive slices are not equal but
  sized by these head counts (Phi-3's ``qkv_proj`` holds H query heads, then H_kv key and H_kv value heads).
* ``interleaved=True``: with ``chunk=(k, n)``, the slice is the ``k``-th of ``n`` equal parts *of every head*
  (GPT-NeoX's ``query_key_value`` holds ``[q_h, k_h, v_h]`` head after head).
* ``heads="query"`` / ``"kv"``: which head count the member is split into. Head groups act per *group
  head* (``Group.heads``): ``"kv"`` groups (GQA) share one element among the ``H / H_kv`` query heads
  of a KV head (query head ``h`` uses KV head ``h // (H / H_kv)``).
* ``root=True``: the name is a full state-dict key outside the base model (``lm_head.weight``).
* ``diag=True``: a norm weight, transformed by the residual stream's group as a diagonal matrix (other
  groups move it like any member; it is never an activation site).
* ``classes=(...)``: a role that depends on the task head (``classifier.weight`` reads the stream in a
  ``...ForTokenClassification`` model but the pooler's output in a ``...ForSequenceClassification``).
* ``unless="..."``: a role that depends on another tensor's presence (ELECTRA's embeddings write the
  stream only when there is no ``embeddings_project``).
* ``stacked=True``: the tensor stacks one copy of the role per index of its axis 0 (the fused experts of
  a mixture of experts, ``(E, 2I, d)``): a group of such members binds one instance per index, each
  acting on its own sub-tensor ``t[e]``; ``axis`` still counts the whole tensor's axes (≥ 1).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Member:
    """One tensor a group acts on; ``name`` is a template with ``{i}`` for the layer index."""

    name: str
    axis: int
    power: int = 1
    optional: bool = False  # biases may be absent (bias=False configs), task heads may be absent
    chunk: tuple[int, int] = (0, 1)  # (k, n): k-th of n equal consecutive slices along the axis
    heads: str = "query"  # head count the member is split into: "query" or "kv"
    root: bool = False  # name is a full key outside the base model (task heads)
    diag: bool = False  # a norm weight (residual group): transformed as a diagonal matrix
    classes: tuple[str, ...] = ()  # only in models whose class name ends with one of these (head-specific roles)
    unless: str = ""  # not a member when this tensor (a template of the same kind) is present
    parts: tuple[str, ...] = ()  # chunk slices sized by these head counts ("query"/"kv") instead of equal
    interleaved: bool = False  # chunk k of n inside each head's block (head-interleaved fused layouts)
    stacked: bool = False  # one copy of the role per index of axis 0: one instance per index (fused experts)


@dataclass(frozen=True)
class Fold:
    """A norm whose weight (``γ``) and bias (``β``, LayerNorm) fold into the tensors that read its
    output: ``W ← W diag(γ)`` on the reader's input axis, ``b ← b + W β`` where the reader has a bias."""

    weight: str
    readers: tuple[Member, ...]
    bias: str | None = None  # LayerNorm's β (None: RMSNorm)
    offset: float = 0.0  # the norm multiplies by offset + weight (Gemma's RMSNorm: 1 + w)
    group: str = ""  # the residual group whose stream the norm reads ('' : the family's only one)


@dataclass(frozen=True)
class Group:
    """A symmetry group (per layer, or model-wide for the residual stream).

    ``kind`` names the group kind (:mod:`symmerge.groups`); ``symmetry`` is the user-facing switch
    (``--symmetries``) that turns it on; ``params`` holds kind-specific options as (name, value)
    pairs (e.g. ``unit_scale``, ``pair_norms``, ``couples``; ``description``: the group in words for ``symmerge
    specs`` where the kind's own description would mislead, as for CLIP's shared space)."""

    name: str
    kind: str
    symmetry: str
    members: tuple[Member, ...]
    heads: str = "query"  # head groups: one element per query head or per KV head (GQA)
    params: tuple[tuple[str, object], ...] = ()

    def param(self, key: str, default=None):
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class Stack:
    """One layer stack of a family with several (T5's encoder and decoder, CLIP's text and vision towers).

    ``layer``: the module path template of one of its layers; a member template under it (``{layer}.…``)
    counts this stack's layers with ``{i}``. ``probe``: a tensor template of its layer 0 (the stack is
    present where the checkpoint holds it: T5EncoderModel has no decoder, CLIPTextModel no vision tower).
    Its sizes are the config attributes ``layers`` and ``heads`` of the sub-config ``config`` (CLIP's
    ``text_config``), or of the model's config where it has no such sub-config (CLIPTextModel's config
    is the text config itself)."""

    name: str
    layer: str
    probe: str
    config: str = ""
    layers: str = "num_hidden_layers"
    heads: str = "num_attention_heads"


def setting(config, key: str, default=None):
    """``key`` of a model's config: config.json read as a dict, or a transformers config object."""
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


@dataclass(frozen=True)
class Spec:
    family: str
    model_types: tuple[str, ...]
    groups: tuple[Group, ...]
    inputs: str = "text"  # "text" (input_ids) or "image" (pixel_values)
    folds: tuple[Fold, ...] = ()  # norms folded into their readers before an orthogonal stream transform
    partial_rotary: bool = False  # the model honours rope_parameters["partial_rotary_factor"]
    unsupported: tuple[tuple[str, str], ...] = ()  # (tensor template, reason): refuse checkpoints holding it
    probe: str = ""  # a tensor template every checkpoint of the family holds (locates the base model)
    layer: str = ""  # module path template of one layer (``encoder.layer.{i}``): its output is the stream
    # why streamed alignment refuses the family ('' : it streams; MoE experts fused in memory but stored per
    # expert stream as virtual tensors, see symmerge.io.fused)
    in_memory_only: str = ""
    # several layer stacks (T5, CLIP): each per-layer group belongs to the stack whose ``layer`` template
    # prefixes its members; instances are numbered through the stacks in this order (``layer`` of an instance)
    stacks: tuple[Stack, ...] = ()
    # class-name endings of the models whose output is read through a head although they have no base-model
    # prefix (T5ForConditionalGeneration, CLIPModel): they, and only they, get the model-wide groups
    task_classes: tuple[str, ...] = ()
    # the outputs that are the model's function where others are internal states a model-wide group moves
    # (T5's encoder_last_hidden_state, CLIP's text_embeds): verification compares these ('' : every output)
    outputs: tuple[str, ...] = ()
    # (config key, the values that leave the spec exact, reason): the same refusals read from config.json, before
    # any tensor (a key absent from the config is at an exact value)
    unsupported_settings: tuple[tuple[str, tuple, str], ...] = ()

    def refusal(self, config) -> str | None:
        """Why the family's groups do not hold for a model with ``config`` (a dict or a transformers config), from
        :attr:`unsupported_settings`, or None."""
        for key, exact, reason in self.unsupported_settings:
            value = setting(config, key)
            if value is not None and value not in exact:
                return reason
        return None

    def group(self, name: str) -> Group | None:
        return next((g for g in self.groups if g.name == name), None)
