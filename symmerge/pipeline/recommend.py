"""What an alignment's symmetries resolve to for the models at hand: every rule that narrows 'recommended' (or
refuses an explicit list) is here, in :func:`recommended`. The callers — the merge plan, the in-memory merge,
``align`` in memory and streamed — supply facts about their models, never a symmetry's name; the rules read
the kinds' declared capabilities (:attr:`~symmerge.groups.base.Kind.moves_heads_input`,
:attr:`~symmerge.groups.base.Kind.moves_output_frame`, :attr:`~symmerge.groups.base.Kind.per_layer`) through
:func:`symmerge.families.symmetries_whose`.

=========================== ============================================ ===========================================
fact (keyword)              'recommended'                                an explicit list
=========================== ============================================ ===========================================
``model_type`` has no spec  nothing aligned, with a note                 one error naming the supported types
``base_given``              nothing aligned, with a note (fine-tunes of  kept
                            one base share its frame)
``available`` groups        the recommended symmetries among them        kept
``heads_check`` fails       the symmetries moving the heads' input left  the heads' error
                            out, with a note
``output_reader`` given     the symmetries moving the output frame left  one error
                            out, with a note
``streamed``                the symmetries of a model-wide kind left out one error
``spec`` (with available)   —                                            a group the family declares and the model
                                                                         does not bind: one error
=========================== ============================================ ===========================================

The rules run in the order of the table; the notes are joined with ``"; "``.
"""

from __future__ import annotations

from typing import Callable

from ..core.spec import setting
from ..errors import SymmergeError
from ..families import SCALES, spec_for, supported_model_types, symmetries_whose
from .options import AlignOptions

BASE_NOTE = ("'recommended' aligns nothing when a --base is given: models fine-tuned from one base share its "
             "parameterisation (matching changed no accuracy there, docs/results.md); name symmetries to align "
             "anyway")


def has_spec(model_type: str) -> bool:
    try:
        spec_for(model_type)
        return True
    except SymmergeError:
        return False


def plain_fallback(align: AlignOptions, model_type: str, config=None):
    """(alignment options, note) for a model type without a symmetry spec: 'recommended' falls back to no
    alignment with a note; an explicit list is refused naming the supported types; 'none' stays. With ``config``
    (the model's config.json as a dict, or its config), a family whose groups its settings leave inexact
    (:meth:`~symmerge.core.spec.Spec.refusal`: Qwen2/3-MoE with dense layers among the sparse ones, Phi's
    qk_layernorm) does the same: 'recommended' merges without alignment, with a note; an explicit list is
    refused when the model is bound."""
    if align.symmetries and config is not None and has_spec(model_type) and align.recommended:
        spec = spec_for(model_type)
        why = spec.refusal(config)
        if why is not None:
            return align.with_(symmetries=()), (f"'recommended' aligns nothing: the {spec.family} family's "
                                                f"symmetries do not hold for models with {why}; merged without "
                                                "alignment")
    if not align.symmetries or has_spec(model_type):
        return align, None
    if align.recommended:
        return align.with_(symmetries=()), (f"no symmetry spec for model_type {model_type!r}: merged without "
                                            f"alignment (symmetry alignment supports: "
                                            f"{', '.join(supported_model_types())})")
    spec_for(model_type)  # raises the one clear error naming the supported types
    return align, None


def moving(options: AlignOptions, capability: Callable) -> list[str]:
    """The symmetries of ``options`` whose kind satisfies ``capability`` (a predicate on the kind, e.g.
    ``lambda kind: kind.moves_heads_input``)."""
    having = symmetries_whose(capability)
    return [s for s in options.symmetries if s in having]


def moves_heads_input(kind) -> bool:
    return kind.moves_heads_input


def moves_output_frame(kind) -> bool:
    return kind.moves_output_frame


def model_wide(kind) -> bool:
    return not kind.per_layer


CROSS_ATTENTION = ("its cross-attention layers (add_cross_attention=True) read and write the residual stream, and no "
                   "group of its family transforms them: a residual transform would change what they compute")


CLIP_QKV = ("its queries, keys and values are clipped elementwise (clip_qkv), and a clip does not commute with the "
            "per-head rotations and scales: the attn and rescale symmetries would change what the attention computes")


def held_symmetries(config) -> dict:
    """``{symmetry: why}``: the symmetries a model's own settings keep from being function-preserving (OLMo/OLMoE's
    ``clip_qkv``: attn and rescale), read by :func:`recommended` (left out of 'recommended' with a note; named
    explicitly, one error). They were aligned, and a streamed alignment (no forward check) wrote a model that
    computed another function."""
    return {"attn": CLIP_QKV, "rescale": CLIP_QKV} if setting(config, "clip_qkv") is not None else {}


def model_facts(embedding: dict | None, config) -> dict:
    """The keywords of :func:`recommended` a model's own settings give: ``output_reader`` and ``held``."""
    return {"output_reader": frame_readers(embedding, config), "held": held_symmetries(config)}


def frame_readers(embedding: dict | None, config) -> str | None:
    """Why the residual stream's frame must stay (the ``output_reader`` :func:`recommended` reads), or None: a
    sentence-transformers pipeline reading the output (:func:`symmerge.io.sentence_transformers.output_reader`),
    or a decoder's cross-attention (GPT-2, BERT with ``add_cross_attention``), whose tensors no family declares
    (they were copied unchanged while the stream moved, and the verification's inputs have no encoder states)."""
    from ..io.sentence_transformers import output_reader

    cross = bool(setting(config, "add_cross_attention", False)) and not setting(config, "is_encoder_decoder", False)
    return "; ".join(r for r in (output_reader(embedding), CROSS_ATTENTION if cross else None) if r) or None


def recommended(align: AlignOptions, *, model_type: str | None = None, base_given: bool = False, available=None,
                spec=None, heads_check: Callable[[str], None] | None = None, output_reader: str | None = None,
                streamed: bool = False, held: dict | None = None, config=None) -> tuple[AlignOptions, str | None]:
    """``(options, note)``: what ``align`` resolves to given the facts the caller knows (see the module's
    table; a fact left at its default is not checked), with a note when 'recommended' was narrowed.

    ``model_type``: the inputs' model type; ``base_given``: a base model is given (a merge);
    ``available``: the symmetries whose groups the model (the anchor, for a merge) binds; ``spec``: its
    family's :class:`~symmerge.core.spec.Spec` (an explicitly named group it lacks is then an error);
    ``heads_check(why)``: raises :class:`SymmergeError` (carrying ``why``) when the heads of the models differ;
    ``output_reader``: why the model's output frame must stay (what reads it), or None; ``streamed``: aligned
    one layer at a time; ``held``: ``{symmetry: why}`` the model's settings keep from being exact
    (:func:`held_symmetries`); ``config``: the model's config, read with ``model_type`` (:func:`plain_fallback`)."""
    asked = align.recommended
    notes = []
    if model_type is not None:
        align, note = plain_fallback(align, model_type, config)
        if align.symmetries and base_given and asked:
            return align.with_(symmetries=()), BASE_NOTE
        notes.append(note)
    if available is not None:
        available = tuple(available)
        align = align.resolved(available)
    if heads_check is not None and (names := moving(align, moves_heads_input)):
        try:  # the head reads the stream: it is matched too, so heads must agree
            heads_check(f"the {names[0]} symmetry moves the heads' input; leave it out")
        except SymmergeError as e:
            if not asked:
                raise
            align, note = _left_out(align, names, str(e))
            notes.append(note)
    if output_reader is not None and (names := moving(align, moves_output_frame)):
        if not asked:
            raise SymmergeError(f"the {names[0]} symmetry cannot be aligned here: {output_reader}; leave {names[0]} "
                                "out")
        align, note = _left_out(align, names, output_reader)
        notes.append(note)
    if held and (names := [n for n in align.symmetries if n in held]):
        if not asked:
            raise SymmergeError(f"the {names[0]} symmetry cannot be aligned here: {held[names[0]]}; leave "
                                f"{', '.join(names)} out")
        align, note = _left_out(align, names, held[names[0]])
        notes.append(note)
    if streamed and (names := moving(align, model_wide)):
        if not asked:
            raise SymmergeError(f"the {names[0]} symmetry couples every layer (one transform of the whole stream) "
                                "and cannot be streamed; align it in memory (align without --stream, merge "
                                "--mode memory) or leave it out")
        align = align.with_(symmetries=tuple(s for s in align.symmetries if s not in names))
    if spec is not None and available is not None:
        _require_groups(spec, available, align.symmetries)
    return align, "; ".join(n for n in notes if n) or None


def _left_out(align: AlignOptions, names, why: str) -> tuple[AlignOptions, str]:
    return (align.with_(symmetries=tuple(s for s in align.symmetries if s not in names)),
            f"{', '.join(names)} left out of 'recommended': {why}")


def _require_groups(spec, available, symmetries) -> None:
    """A requested symmetry whose groups this model does not have is an error, not a silent no-op."""
    for name in symmetries:
        if spec.group(name) is None and not any(g.symmetry == name for g in spec.groups):
            continue  # not a group of its own (rescale)
        if name not in available:
            if name in symmetries_whose(moves_heads_input):
                raise SymmergeError(
                    f"the {name} symmetry needs a model with a task head reading the residual stream (e.g. "
                    "LlamaForCausalLM, ViTForImageClassification, GPT2LMHeadModel) of a family with a residual "
                    f"spec; this {spec.family} model has no residual group (a base model's output is the stream)")
            raise SymmergeError(f"this {spec.family} model has no {name!r} group")


def require_declared(spec, align: AlignOptions) -> None:
    """An explicit symmetry list naming a symmetry the model's family does not declare (``experts`` of a dense
    model) is one error naming the family's symmetries. Checked where a command plans an alignment (``align``,
    ``barrier``: :func:`~symmerge.pipeline.align_plan.plan_align`; ``merge``: its plan) and by the Python API's
    :func:`~symmerge.pipeline.align.align_pair` on the loaded model."""
    declared = list(dict.fromkeys(g.symmetry for g in spec.groups))
    unknown = [s for s in align.symmetries if s != SCALES and s not in declared]
    if unknown and not align.recommended:
        raise SymmergeError(f"the {spec.family} family has no {unknown[0]!r} symmetry; its symmetries: "
                            f"{', '.join([*declared, SCALES])}")
