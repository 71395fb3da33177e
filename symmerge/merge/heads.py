"""Task heads and body compatibility of models to be merged.

The *body* is everything under the transformers base model (``model.base_model_prefix``, e.g.
``bert.``, ``vit.``); the *head* is the rest (``classifier.*``, ``cls.*``). Bodies must agree in
tensor names and shapes; heads may differ (different label spaces) unless they are merged. A head
tensor the model class declares tied to a body tensor (an LM decoder sharing the word embeddings)
follows the body.
"""

from __future__ import annotations

from ..core.layout import check_layouts
from ..io.layout import layout_of
from ..core.resolve import declared_ties
from ..errors import SymmergeError
from ..pipeline.verify import with_state_dict
from .steps import one_input_copies

HEAD_POLICIES = ("auto", "keep", "merge")
# classes whose head maps the stream to the vocabulary: rows indexed by tokens, which the tokenizer check
# finds the same in every model (or the user allowed the difference), so averaging it is as sound as
# averaging the embeddings (mergekit merges it too)
LANGUAGE_MODELS = ("ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForConditionalGeneration")


def head_policy(requested: str, cls) -> str:
    """The head policy a merge of ``cls`` models applies: ``requested`` itself, or for ``auto`` ``merge``
    for a language model's head (:data:`LANGUAGE_MODELS`) and ``keep`` for a task head, whose label space
    may differ between the models."""
    if requested not in HEAD_POLICIES:
        raise SymmergeError(f"unknown head policy {requested!r}; choose {', '.join(HEAD_POLICIES)}")
    if requested != "auto":
        return requested
    name = cls if isinstance(cls, str) else cls.__name__  # a class or its name
    return "merge" if name.endswith(LANGUAGE_MODELS) else "keep"


NO_HEAD_NOTE = "no head tensors of their own (a base model, or a head tied to the embeddings, merged with them)"
COPIED_NOTE = "every step copies its tensor from one model (a one-model passthrough): its head is copied too"


def no_head() -> dict:
    """The ``head`` entry of models with no head tensors of their own — base models, or a language model whose head
    is tied to the embeddings (GPT-2) and is merged with them (every entry's, a config's included)."""
    return {"policy": "none", "note": NO_HEAD_NOTE}


def passthrough_head(steps, names, heads, requested: str | None = None, keys=None) -> dict | None:
    """The ``head`` entry of a one-model passthrough — every step of ``steps`` copies from one input
    (:func:`~symmerge.merge.steps.one_input_copies`) — the one rule of ``symmerge merge`` (:func:`head_report`)
    and of a config (:func:`symmerge.config.run.config_head`): :func:`no_head` for a base model without a head
    (``heads``, the input's head keys, empty), else ``keep`` from that input, with
    :data:`COPIED_NOTE`; ``requested`` and ``keys`` (the policy asked for, the kept tensors: ``symmerge merge``'s
    entry; a config's has neither) where given. None when the steps are no one-model passthrough."""
    if not one_input_copies(steps or ()):
        return None
    if not heads:
        return no_head()
    source = steps[0].sources[0].model
    asked = {"requested": requested} if requested is not None else {}
    kept = {"keys": sorted(keys)} if keys is not None else {}
    return {"policy": "keep", **asked, "from_index": source, "from": names[source], **kept, "note": COPIED_NOTE}


def head_report(head_keys: list, policy: str, requested: str, head_from: int, names, kept_keys,
                steps=None) -> dict:
    """The report's ``head`` entry (in memory and streamed): ``none`` for base models, else the policy
    applied, the one requested, and the head's tensors (kept: whose, ``kept_keys`` being that model's).
    ``steps`` (the plan's :class:`~symmerge.merge.steps.TensorStep` list, None for a method with its own loop):
    what the steps do wins over the policy — a plan whose every step copies from one model (a one-model
    passthrough) is reported ``keep`` from that model with its note, whatever policy was asked
    (:func:`passthrough_head`)."""
    if not head_keys:
        return no_head()
    copied = passthrough_head(steps, names, head_keys, requested, kept_keys)
    if copied is not None:
        return copied
    if policy == "merge":
        return {"policy": "merge", "requested": requested, "keys": sorted(head_keys)}
    return {"policy": "keep", "requested": requested, "from_index": head_from, "from": names[head_from],
            "keys": sorted(kept_keys)}


def head_keys(model) -> list[str]:
    """State-dict keys outside the base model (task heads), e.g. ``classifier.weight``, without the
    ones declared tied to a base-model tensor."""
    prefix = getattr(model, "base_model_prefix", "") + "."
    sd = model.state_dict()
    if prefix == "." or not any(k.startswith(prefix) for k in sd):
        return []
    ties = declared_ties(model)
    return [k for k in sd if not k.startswith(prefix) and not ties.get(k, "").startswith(prefix)]


def untied(model, keys) -> list[str]:
    """``keys`` without declared aliases (each tied group is merged once, through its source)."""
    ties = declared_ties(model)
    return [k for k in keys if k not in ties]


def with_tied(model, merged: dict) -> dict:
    """The model's full state dict with ``merged`` written in, declared aliases of merged keys included."""
    ties = declared_ties(model)
    out = {}
    for k, t in model.state_dict().items():
        source = ties.get(k)
        out[k] = merged[k] if k in merged else merged[source] if source in merged else t.detach()
    return out


def check_bodies(models, names) -> list[str]:
    """Same model type, heads and body tensors (names, shapes) everywhere; returns the body keys."""
    ref = models[0]
    body = [k for k in ref.state_dict() if k not in set(head_keys(ref))]
    layouts = []
    for m, name in zip(models, names):
        heads = set(head_keys(m))
        layouts.append(layout_of(m, name, [k for k in m.state_dict() if k not in heads]))
    check_layouts(layouts)
    return body


def check_heads_mergeable(models, names, labels: bool = True, why: str = "use --heads keep") -> None:
    """Same head tensors (names and shapes) everywhere, and with ``labels`` the same label names."""
    keys = [sorted(head_keys(m)) for m in models]
    sds = [m.state_dict() for m in models]
    for i in range(1, len(models)):
        if keys[i] != keys[0] or any(sds[i][k].shape != sds[0][k].shape for k in keys[0]):
            raise SymmergeError(f"cannot merge task heads: {names[0]} and {names[i]} have different heads/label "
                                f"spaces ({why})")
        if not labels:
            continue
        l0, li = models[0].config.id2label, models[i].config.id2label
        if l0 != li:
            raise SymmergeError(f"cannot merge task heads: label names differ between {names[0]} ({l0}) and "
                                f"{names[i]} ({li}); use --heads keep")


def anchor_proxy(model, anchor, body):
    """``model`` carrying the anchor's body weights: lets models with different heads be aligned. In the anchor's
    dtype: a float32 base beside bfloat16 fine-tunes is aligned to and measured against as stored (the proxy had the
    model's dtype, so the base's body was rounded to bfloat16 in memory and not streamed)."""
    import copy

    sd = model.state_dict()
    asd = anchor.state_dict()
    dtype = next(anchor.parameters()).dtype
    holder = model if next(model.parameters()).dtype == dtype else copy.deepcopy(model).to(dtype)
    return with_state_dict(holder, {k: (asd[k] if k in body else v) for k, v in sd.items()})
