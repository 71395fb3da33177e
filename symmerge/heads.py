"""Task heads and body compatibility of models to be merged.

The *body* is everything under the transformers base model (``model.base_model_prefix``, e.g.
``bert.``, ``vit.``); the *head* is the rest (``classifier.*``, ``cls.*``). Bodies must agree in
tensor names and shapes; heads may differ (different label spaces) unless they are merged. A head
tensor tied to a body tensor (an LM decoder sharing the word embeddings) follows the body.
"""

from __future__ import annotations

from .errors import SymmergeError
from .verify import with_state_dict


def head_keys(model) -> list[str]:
    """State-dict keys outside the base model (task heads), e.g. ``classifier.weight``; a head tensor
    tied to a base-model one (an LM decoder sharing the word embeddings) follows the base model."""
    prefix = getattr(model, "base_model_prefix", "") + "."
    sd = model.state_dict(keep_vars=True)
    if prefix == "." or not any(k.startswith(prefix) for k in sd):
        return []
    body_ptrs = {t.data_ptr() for k, t in sd.items() if k.startswith(prefix)}
    return [k for k, t in sd.items() if not k.startswith(prefix) and t.data_ptr() not in body_ptrs]


def untied(model, keys) -> list[str]:
    """``keys`` without aliases: of state-dict keys sharing one tensor only the first is kept."""
    sd, seen, out = model.state_dict(keep_vars=True), set(), []
    for k in keys:
        if sd[k].data_ptr() not in seen:
            seen.add(sd[k].data_ptr())
            out.append(k)
    return out


def with_tied(model, merged: dict) -> dict:
    """The model's full state dict with ``merged`` written in, tied aliases of merged keys included."""
    sd = model.state_dict(keep_vars=True)
    by_ptr = {sd[k].data_ptr(): v for k, v in merged.items() if k in sd}
    return {k: merged.get(k, by_ptr.get(t.data_ptr(), t.detach())) for k, t in sd.items()}


def check_bodies(models, names) -> list[str]:
    """Same model type and same body tensors (names, shapes) everywhere; returns the body keys."""
    ref, ref_sd = models[0], models[0].state_dict()
    ref_heads = set(head_keys(ref))
    body = [k for k in ref_sd if k not in ref_heads]
    for m, name in zip(models[1:], names[1:]):
        if m.config.model_type != ref.config.model_type:
            raise SymmergeError(f"architectures differ: {names[0]} is {ref.config.model_type!r}, "
                                f"{name} is {m.config.model_type!r}")
        sd, heads = m.state_dict(), set(head_keys(m))
        mine = [k for k in sd if k not in heads]
        if set(mine) != set(body):
            only = sorted(set(mine) ^ set(body))[:3]
            raise SymmergeError(f"architectures differ between {names[0]} and {name}: tensors in only one, e.g. {only}")
        for k in body:
            if sd[k].shape != ref_sd[k].shape:
                raise SymmergeError(f"architectures differ: {k} is {tuple(ref_sd[k].shape)} in {names[0]}, "
                                    f"{tuple(sd[k].shape)} in {name}")
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
    """``model`` carrying the anchor's body weights: lets models with different heads be aligned."""
    sd = model.state_dict()
    asd = anchor.state_dict()
    return with_state_dict(model, {k: (asd[k] if k in body else v) for k, v in sd.items()})
