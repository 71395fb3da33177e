"""The plan of each document of a ``symmerge run`` config, resolved from the config and the inputs' headers before
any weight is read, printed by ``symmerge run CONFIG --print-plan`` and read by the report of the final merge.

A mergekit document is one :class:`DocumentPlan`: the merge's plan (:class:`~symmerge.merge.plan.MergePlan`: the
method, the inputs as the report names them, the parameters after defaults and the weights as ``symmerge merge``
reports them (:func:`resolved_params`, :func:`resolved_weights`; the document's own ``parameters`` as written are
:attr:`DocumentPlan.parameters`), every output tensor's step — copy, or merge
with which inputs and arguments —, mode ``stream``: the config runs through the one executor tensor by tensor) plus
the document's own facts (its name, inputs, base, output or intermediate, dtypes, layers); an aligned config adds
the alignment's plan (:func:`symmerge.config.aligned.plan_alignment`: symmetries resolved, frame, anchor rule, mode).
A config of symmerge's own keys stands for one ``symmerge merge | align | barrier`` command, whose plan is that
command's ``--print-plan``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MODE_WHY = "a mergekit config: its per-tensor steps, read and written tensor by tensor"


@dataclass(frozen=True)
class DocumentPlan:
    """One document (one merge) of a config."""

    job: object  # the symmerge.config.mergekit.Job
    merge: object  # its symmerge.merge.plan.MergePlan (steps: the job's)
    parameters: dict
    output: str
    alignment: object = None  # an aligned config's alignment plan (a MergePlan), or None

    def describe(self) -> dict:
        """The document as ``--print-plan`` shows it, without its steps."""
        job = self.job
        out = {"name": job.name, "method": job.method, "models": list(self.merge.names),
               "inputs": [i.label for i in job.inputs],
               "base": job.inputs[job.base].label if job.base is not None else None, "parameters": self.parameters,
               "output": self.output, "final": job.final, "dtype": job.dtype, "out_dtype": job.out_dtype,
               "layers": job.layers, "tensors": len(job.steps), "plan": self.merge.describe()}
        if self.alignment is not None:
            a = self.alignment
            out["alignment"] = {"requested": a.requested, "symmetries": a.symmetries, "note": a.note,
                                **a.describe()}
        return out

    def printed(self) -> dict:
        from ..merge.steps import describe_step

        return {**self.describe(), "steps": [describe_step(s) for s in self.job.steps]}


def _plain(value):
    """A config value as JSON holds it (the report)."""
    return json.loads(json.dumps(value, default=str)) if value is not None else {}


def _plain_value(v) -> bool:
    return isinstance(v, (bool, int, float, str))


def _written_keys(value, out: set) -> set:
    """Every key of every ``parameters`` mapping in ``value`` (a document's slices, sources, modules)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "parameters" and isinstance(v, dict):
                out |= set(v)
            else:
                _written_keys(v, out)
    elif isinstance(value, list):
        for v in value:
            _written_keys(v, out)
    return out


def _top_and_merged(data: dict) -> tuple[dict, list]:
    """A mergekit document's top-level ``parameters`` (``{}`` when not a mapping) and its ``models`` entries merged
    (the base model's left out), as :func:`resolved_params` and :func:`resolved_weights` read them."""
    top = data.get("parameters") if isinstance(data.get("parameters"), dict) else {}
    base = data.get("base_model")
    return top, [m for m in data.get("models") or [] if isinstance(m, dict) and m.get("model") != base]


def resolved_params(method, data: dict) -> dict:
    """The report's ``params`` of a mergekit document, as ``symmerge merge`` reports the same merge's (after
    defaults): every parameter of ``method`` at its default unless the document sets it; a plain value of the top
    level checked and under its parameter's name (an alias translated: ``lambda`` is ``scale``, DARE's ``density``
    is ``drop``); a per-model parameter every model of ``models`` sets to a plain value, the list in model order (as
    ``symmerge.merge(..., params={"density": [0.7, 0.4]})`` reports it); a gradient or filters as written; a
    parameter set only in slices or modules left out (it is not one value for the merge)."""
    from ..merge.base import REQUIRED

    from . import lenient
    from .mergekit import parameter_names

    kinds = parameter_names(method)

    def named(k, v):
        """(the parameter's name, ``v`` read as the config reads it — ``normalize: 1.0`` is true —, checked and
        translated) for a plain ``v`` (or a list of them)."""
        target, translate = method.aliases.get(k, (k, None))
        values = [lenient.coerce_setting(x, kinds.value_kind(k)) for x in (v if isinstance(v, list) else [v])]
        check = method.checks.get(k)
        values = [check(method.name, k, x) if check is not None else x for x in values]
        if translate is not None:
            values = [translate(x) for x in values]
        return target, values if isinstance(v, list) else values[0]

    out = {k: v for k, v in method.params.items() if v is not REQUIRED}
    top, models = _top_and_merged(data)
    known = set(method.params) | set(method.aliases)
    per = set(method.per_model) | {a for a, (t, _) in method.aliases.items() if t in method.per_model}
    elsewhere = _written_keys({k: v for k, v in data.items() if k not in ("parameters", "models")}, set())
    for k in sorted(known & elsewhere - set(top)):
        out.pop(method.aliases.get(k, (k,))[0], None)
    for k, v in top.items():
        if k not in known:
            continue
        if _plain_value(v):
            name, value = named(k, v)
        else:
            name, value = method.aliases.get(k, (k,))[0], _plain(v)
            if method.aliases.get(k, (k, None))[1] is not None:  # a translated alias kept as written: its own name
                out.pop(name, None)
                name = k
        out[name] = value
    for k in sorted(known & per):
        values = [(m.get("parameters") or {}).get(k) if isinstance(m.get("parameters"), dict) else None
                  for m in models]
        if not models or all(v is None for v in values):
            continue
        target = method.aliases.get(k, (k,))[0]
        if all(_plain_value(v) for v in values):
            name, value = named(k, values)
            out[name] = value
        else:
            out.pop(target, None)  # per model, not all plain: the steps hold them
    return out


def resolved_weights(data: dict) -> list | None:
    """The report's ``weights`` of a mergekit document, as ``symmerge merge --weights`` reports them: one number per
    merged model of ``models`` (its own ``weight``, else the top level's), or None where a weight is not one number
    (a gradient, filters, none given, slices)."""
    top, models = _top_and_merged(data)
    values = [(m.get("parameters") or {}).get("weight", top.get("weight")) if isinstance(m.get("parameters"), dict)
              else top.get("weight") for m in models]
    if not values or not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        return None
    return [float(v) for v in values]


def document_of(desc, job):
    """The config document ``job`` was planned from."""
    docs = desc.docs
    return next((d for d in docs if d.data.get("name") == job.name), docs[-1]) if job.name else \
        next((d for d in docs if d.data.get("name") is None), docs[-1])


def merged_names(job, labels=None) -> tuple[list, bool]:
    """(the merged inputs as the report names them, whether every merged step reads the same inputs in the same
    order — then the pairwise and result distances are per input; a job whose every step copies from one input, a
    one-model passthrough, is that input's, as ``symmerge merge`` reports it)."""
    from ..merge.steps import one_input_copies

    labels = labels or [i.label for i in job.inputs]
    if one_input_copies(job.steps):
        return [labels[job.steps[0].sources[0].model]], True
    merged = [st for st in job.steps if st.merge]
    order = [s.model for s in merged[0].sources] if merged else []
    uniform = bool(merged) and all([s.model for s in st.sources] == order for st in merged)
    return ([labels[i] for i in order] if uniform else [lb for i, lb in enumerate(labels) if i != job.base]), uniform


def plan_document(desc, job, method, model_type: str, labels=None, alignment=None) -> DocumentPlan:
    """The :class:`DocumentPlan` of ``job`` (``method``: the Method it runs, ``model_type``: its output's;
    ``alignment``: an aligned config's alignment plan, whose frame, anchor rule and symmetries the merge's plan
    records — the merge itself runs on the aligned copies, streamed)."""
    from ..merge.plan import MergePlan
    from ..pipeline.options import AlignOptions

    names, _ = merged_names(job, labels)
    data = document_of(desc, job).data
    params = _plain(data.get("parameters"))
    frame = {"align": AlignOptions(symmetries=()), "requested": "none", "note": None, "frame": "none",
             "anchor_index": None, "anchor_rule": None}
    if alignment is not None:
        frame = {"align": alignment.align, "requested": alignment.requested, "note": alignment.note,
                 "frame": alignment.frame, "anchor_index": alignment.anchor_index, "anchor_rule": alignment.anchor_rule}
    merge = MergePlan(method=method, names=names, model_type=model_type, mode="stream", why=MODE_WHY,
                      params=resolved_params(method, data), weights=resolved_weights(data), steps=list(job.steps),
                      **frame)
    where = (None if desc.output is None else str(desc.output)) if job.final else f"<intermediate {job.name}>"
    return DocumentPlan(job, merge, params, where, alignment)


def plan_run(desc) -> list[DocumentPlan]:
    """Every document's plan (a mergekit config: in dependency order, the final one last)."""
    from ..merge import METHODS

    out = []
    for job in desc.jobs:
        config = job.inputs[job.config_from].folder if job.inputs[job.config_from].folder is not None else None
        model_type = model_type_at(config) if config is not None else ""
        alignment = None
        if desc.alignment is not None and job.final:
            from .aligned import plan_alignment

            alignment = plan_alignment(job, desc.alignment)[3]
        out.append(plan_document(desc, job, METHODS[job.method], model_type, alignment=alignment))
    return out


def model_type_at(folder) -> str:
    try:
        return json.loads((Path(folder) / "config.json").read_text()).get("model_type", "")
    except (OSError, ValueError):
        return ""


def printed(desc) -> dict:
    """What ``symmerge run CONFIG --print-plan`` prints for a mergekit config."""
    return {"config": str(desc.path), "output": str(desc.output) if desc.output is not None else None,
            "warnings": list(desc.warnings), "documents": [p.printed() for p in plan_run(desc)]}
