"""Base models and fine-tunes with heads are one architecture.

A fine-tune saved with its task class (``BertForSequenceClassification``: tensors ``bert.*`` and
``classifier.*``; ``LlamaForCausalLM``: ``model.*`` and ``lm_head.*``) and its pretrained base saved as
the base class (``BertModel``, ``LlamaModel``: the body's tensors without the prefix) hold the same body
under different names. transformers loads one into the other by the task class's ``base_model_prefix``;
symmerge does the same, by one rule (:func:`plan`) decided once from the tensor names:

* the task class has a base-model prefix ``p``; the other checkpoint has no tensor under ``p.``; the task
  checkpoint's tensors under ``p.`` are, without it, all tensors of the other (its body): then the other
  is read under ``p.`` (:class:`Plan`). Tensors of the base class the task class has no place for (ViT's
  pooler, which ``ViTForImageClassification`` leaves out) are left out and listed.
* the tensors the base lacks (the head: ``classifier.*``, ``lm_head.weight``) are taken from a fine-tune
  (:attr:`Plan.added`) and never merged: a task vector needs the base's value, which does not exist, so the
  output keeps the fine-tune's (the output is of the fine-tunes' class). The report's ``base_adapted``
  entry says so (:func:`report_entry`).

Two forms of the same rule: :func:`adapt_model` for models in memory (a model of the task class holding
the base's body and the fine-tune's head) and :class:`KeyView` for :class:`~symmerge.io.checkpoint.
LazyCheckpoint` (the base's tensors under prefixed names, the head read from the fine-tune); both
wings call :func:`adapt_models` / :func:`adapt_checkpoints` once, after loading. Alignment of a base
model *to* a fine-tune uses the fine-tune's body (:func:`body_of`, :meth:`KeyView.body`): a base
model's output is the stream, so it keeps its own class.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from ..core.resolve import declared_ties
from .checkpoint import LazyCheckpoint


@dataclass
class Plan:
    """How the base-class checkpoint is read as the task class: its tensor ``k`` is the task class's
    ``prefix.k``; ``added``: the task class's tensors it lacks (taken from a fine-tune, never merged);
    ``left_out``: its tensors the task class has no place for."""

    prefix: str
    task_class: str
    base_class: str
    added: list = field(default_factory=list)
    left_out: list = field(default_factory=list)

    def outer(self, key: str) -> str:
        return f"{self.prefix}.{key}"

    def inner(self, key: str) -> str | None:
        p = self.prefix + "."
        return key[len(p):] if key.startswith(p) else None


def plan(task_class: str, prefix: str, task_keys, other_keys, other_class: str = "") -> Plan | None:
    """The renaming that reads the checkpoint of ``other_keys`` as the task class (of ``task_keys``, whose
    base-model prefix is ``prefix``), or None when the rule does not apply (no prefix; the other has tensors
    under it already; the bodies do not agree: the layout check then names the difference)."""
    if not prefix:
        return None
    p = prefix + "."
    other = list(other_keys)
    if not other or any(k.startswith(p) for k in other):
        return None
    body = [k[len(p):] for k in task_keys if k.startswith(p)]
    if not body:
        return None
    other_set = set(other)
    if not set(body) <= other_set:
        return None
    left_out = sorted(other_set - set(body))
    if len(left_out) * 4 > len(body):  # a few tensors the task class leaves out (a pooler), not another model
        return None
    added = [k for k in task_keys if not k.startswith(p)]
    return Plan(prefix, task_class, other_class, added, left_out)


def report_entry(name: str, pl: Plan, heads_from: str) -> dict:
    """The report's ``base_adapted`` entry of one input."""
    entry = {"model": name, "class": pl.base_class, "read_as": pl.task_class, "prefix_added": pl.prefix + ".",
             "tensors_only_in_fine_tunes": sorted(pl.added), "taken_from": heads_from,
             "note": (f"{name} is a {pl.base_class or 'base model'}: its tensors were read under "
                      f"'{pl.prefix}.' as the {pl.task_class}'s body; the tensors it lacks "
                      f"({', '.join(sorted(pl.added)[:3])}{' ...' if len(pl.added) > 3 else ''}) were kept from "
                      f"{heads_from}, not merged")}
    if pl.left_out:
        entry["left_out"] = pl.left_out
    return entry


def _anchor_entry(pl: Plan) -> dict:
    entry = report_entry("anchor", pl, "model")
    entry["note"] = (f"the anchor is a {pl.base_class}: its tensors were read under '{pl.prefix}.' as the "
                     f"model's class ({pl.task_class}); the tensors it lacks "
                     f"({', '.join(sorted(pl.added)[:3])}{' ...' if len(pl.added) > 3 else ''}) were taken from "
                     "the model itself (distance 0 there)")
    return entry


def merge_anchor_entry(entry: dict, name: str) -> dict:
    """The report's ``base_adapted`` entry of a base-class ``--anchor`` of a merge, one form in memory and streamed
    (made from either wing's entry): the anchor is not merged, so nothing is kept from another model in its place
    (``taken_from`` None): each model is aligned to its body, with its own head."""
    kept = {k: entry[k] for k in ("class", "read_as", "prefix_added", "tensors_only_in_fine_tunes", "left_out")
            if k in entry}
    return {"model": name, **kept, "taken_from": None,
            "note": (f"the anchor {name} is a {entry.get('class') or 'base model'}: its tensors were read under "
                     f"'{entry['prefix_added']}' as the {entry['read_as']}'s body, and the models aligned to it "
                     "(each with its own head)")}


def print_notes(report: dict) -> None:
    """One ``note:`` line on stderr per adapted input (the commands' summaries)."""
    import sys

    for entry in report.get("base_adapted") or []:
        print(f"note: {entry['note']}", file=sys.stderr)


def borrowed(ckpts) -> set:
    """The tensors the adapted checkpoints among ``ckpts`` (:class:`KeyView`) read from another checkpoint (a
    base model's missing head): kept, never merged."""
    return {k for c in ckpts if c is not None for k in getattr(c, "borrowed", ())}


def not_merged(adapted: list) -> set:
    """The tensors no adapted input had (kept from the fine-tunes, never merged)."""
    return {k for entry in adapted for k in entry["tensors_only_in_fine_tunes"]}


# ------------------------------------------------------------------ in memory


def _own_keys(model) -> list[str]:
    ties = declared_ties(model)
    return [k for k in model.state_dict() if k not in ties]


def _is_task(model) -> bool:
    prefix = getattr(model, "base_model_prefix", "") or ""
    return bool(prefix) and any(k.startswith(prefix + ".") for k in model.state_dict())


def model_plan(task_model, other) -> Plan | None:
    """:func:`plan` for two models in memory."""
    return plan(type(task_model).__name__, getattr(task_model, "base_model_prefix", "") or "", _own_keys(task_model),
                _own_keys(other), type(other).__name__)


def adapt_model(base_model, task_model, pl: Plan):
    """A model of ``task_model``'s class holding ``base_model``'s body (under the prefix) and
    ``task_model``'s other tensors (the head), its config the task model's; ``base_model`` and
    ``task_model`` are left untouched."""
    ties = declared_ties(task_model)
    bsd = base_model.state_dict()
    sd = {}
    for k, v in task_model.state_dict().items():
        inner = pl.inner(k)
        sd[k] = bsd[inner] if inner is not None and inner in bsd else v
    for alias, source in ties.items():  # a tied alias follows its source (the body's embeddings)
        if alias in sd and source in sd:
            sd[alias] = sd[source]
    clone = copy.deepcopy(task_model)
    clone.load_state_dict(sd)
    clone.config._name_or_path = getattr(base_model.config, "_name_or_path", "")
    return clone.eval()


def body_of(task_model):
    """The task model's base model (``model.bert``, ``model.model``): its body as the base class."""
    return getattr(task_model, task_model.base_model_prefix)


def _adapt_all(items: list, names: list, head_from: int, is_task, plan_of, adapt):
    """Every base-class entry of ``items`` (``None`` entries allowed) that a task-class entry's body matches
    (``plan_of(task, other)``) replaced by ``adapt(other, task, plan)``, the head from ``items[head_from]``
    when that is a task entry, else from the first one. Returns (items, the report's ``base_adapted`` entries)."""
    tasks = [i for i, x in enumerate(items) if x is not None and is_task(x)]
    if not tasks or len(tasks) == len([x for x in items if x is not None]):
        return list(items), []
    ref = head_from if head_from in tasks else tasks[0]
    out, entries = list(items), []
    for i, x in enumerate(items):
        if x is None or i in tasks:
            continue
        pl = plan_of(items[ref], x)
        if pl is None:
            continue
        out[i] = adapt(x, items[ref], pl)
        entries.append(report_entry(names[i], pl, names[ref]))
    return out, entries


def adapt_models(models: list, names: list, head_from: int = 0):
    """Every base-class model of ``models`` that a task-class model's body matches (:func:`plan`) replaced
    by :func:`adapt_model` (the head from ``models[head_from]`` when that is a task model, else from the
    first task model). Returns (models, the report's ``base_adapted`` entries)."""
    return _adapt_all(models, names, head_from, _is_task, model_plan, adapt_model)


def _adapt_pair(model, anchor, is_task, plan_of, adapt, strip):
    """The rule of :func:`adapt_pair`, for models or checkpoints (``is_task``, ``plan_of``, and ``adapt`` /
    ``strip``: read a base-class one as the task class, or a task-class one as its base class)."""
    if is_task(model) and not is_task(anchor):
        pl = plan_of(model, anchor)
        if pl is not None:
            return model, adapt(anchor, model, pl), [_anchor_entry(pl)]
    if is_task(anchor) and not is_task(model):
        pl = plan_of(anchor, model)
        if pl is not None and not pl.left_out:
            entry = report_entry("model", pl, "anchor")
            entry["note"] = (f"the model is a {pl.base_class}: aligned to the anchor's body (its tensors under "
                             f"'{pl.prefix}.'); the anchor's head was not used")
            return model, strip(anchor, model, pl), [entry]
    return model, anchor, []


def adapt_pair(model, anchor):
    """(model, anchor, entries) for aligning ``model`` to ``anchor`` when one is a base model and the
    other a fine-tune of its task class: a base-class anchor is read as the fine-tune's class (the
    fine-tune's own head: distance 0 there); a base-class model is aligned to the fine-tune's body
    (:func:`body_of`) and keeps its class. Otherwise both unchanged."""
    return _adapt_pair(model, anchor, _is_task, model_plan, adapt_model, lambda task, base, pl: body_of(task))


# ------------------------------------------------------------------ streamed (LazyCheckpoint)


class KeyView(LazyCheckpoint):
    """A :class:`~symmerge.io.checkpoint.LazyCheckpoint` read under other tensor names: ``names`` maps each
    outer name to (checkpoint, its name there). It answers what the streamed merge and the streamed
    alignment ask of a checkpoint (shapes, dtypes, reads; a subclass so that code taking a checkpoint takes
    it, but built from others: the parent's ``__init__`` never runs); ``folder``, ``config`` and the class
    are those of ``like``, the checkpoint whose class it is read as."""

    def __init__(self, names: dict, like, borrowed=()):
        self._names = names
        self.like = like
        self.borrowed = list(borrowed)  # tensors read from a checkpoint other than the adapted one
        self.folder, self.config = like.folder, like.config
        self.class_name, self.base_model_prefix, self.heads = like.class_name, like.base_model_prefix, like.heads
        self.ties, self.virtual = {}, {}
        self.files = sorted({c.file_of[k] for c, k in names.values()})
        self.shape = {o: c.shape[k] for o, (c, k) in names.items()}
        self.dtype = {o: c.dtype[k] for o, (c, k) in names.items()}
        self.file_of = {o: c.file_of[k] for o, (c, k) in names.items()}
        self.disk_name = {o: c.disk_name.get(k, k) for o, (c, k) in names.items()}

    @property
    def hf_config(self):
        return self.like.hf_config

    def keys(self) -> list[str]:
        return list(self._names)

    def _at(self, key):
        return self._names[key]

    def save_name(self, key: str) -> str:
        return self.like.save_name(key) if key in self.like.shape else key

    def nbytes(self, key: str) -> int:
        c, k = self._at(key)
        return c.nbytes(k)

    def room(self, key: str) -> int:
        c, k = self._at(key)
        return c.room(k)

    def read(self, keys, _stored: bool = False) -> dict:
        out = {}
        for key in keys:
            c, k = self._at(key)
            out[key] = c.read([k])[k]
        return out

    def read_direct(self, key: str, check: bool = True, buffer=None):
        c, k = self._at(key)
        return c.read_direct(k, check, buffer)

    def map_direct(self, key: str, check: bool = True):
        c, k = self._at(key)
        return c.map_direct(k, check)

    def read_blocks(self, key: str, first: int, stride: int, width: int):
        c, k = self._at(key)
        return c.read_blocks(k, first, stride, width)

    def meta(self) -> dict:
        import torch

        return {k: torch.empty(self.shape[k], dtype=self.dtype[k], device="meta") for k in self._names}

    def to_disk(self, key: str, tensor) -> list:
        return [(self.save_name(key), tensor)]

    def layout(self, name: str):
        from ..core.layout import Layout

        return Layout(name, self.config["model_type"], self.heads, dict(self.shape), self.disk_name, self.class_name)


def lazy_is_task(ckpt) -> bool:
    prefix = ckpt.base_model_prefix or ""
    return bool(prefix) and any(k.startswith(prefix + ".") for k in ckpt.keys())


def lazy_plan(task, other) -> Plan | None:
    """:func:`plan` for two :class:`~symmerge.io.checkpoint.LazyCheckpoint` (tied aliases already folded)."""
    return plan(task.class_name, task.base_model_prefix or "", task.keys(), other.keys(), other.class_name)


def prefixed(base, task, pl: Plan) -> KeyView:
    """``base`` read as ``task``'s class: its body under the prefix, the tensors it lacks from ``task``."""
    names = {}
    for k in task.keys():
        inner = pl.inner(k)
        names[k] = (base, inner) if inner is not None else (task, k)
    return KeyView(names, task, borrowed=pl.added)


def stripped(task, base, pl: Plan) -> KeyView:
    """``task``'s body read as the base class of ``base`` (its tensors without the prefix, no head)."""
    names = {inner: (task, k) for k in task.keys() if (inner := pl.inner(k)) is not None}
    return KeyView(names, base)


def adapt_checkpoints(ckpts: list, names: list, head_from: int = 0):
    """:func:`adapt_models` for checkpoints (``None`` entries allowed, e.g. no base): every base-class
    checkpoint a task checkpoint's body matches is read as the task class (:func:`prefixed`). Returns
    (checkpoints, the report's ``base_adapted`` entries)."""
    return _adapt_all(ckpts, names, head_from, lazy_is_task, lazy_plan, prefixed)


def adapt_checkpoint_pair(model, anchor):
    """:func:`adapt_pair` for checkpoints (``align --stream``)."""
    return _adapt_pair(model, anchor, lazy_is_task, lazy_plan, prefixed, stripped)
