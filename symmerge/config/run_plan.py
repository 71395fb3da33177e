"""The plan of each document of a ``symmerge run`` config, resolved from the config and the inputs' headers before
any weight is read, printed by ``symmerge run CONFIG --print-plan`` and read by the report of the final merge.

A mergekit document is one :class:`DocumentPlan`: the merge's plan (:class:`~symmerge.merge.plan.MergePlan`: the
method, the inputs as the report names them, the parameters as written, every output tensor's step — copy, or merge
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
            out["alignment"] = {"requested": a.requested, "symmetries": list(a.align.symmetries), "note": a.note,
                                **a.describe()}
        return out

    def printed(self) -> dict:
        from ..merge.steps import describe_step

        return {**self.describe(), "steps": [describe_step(s) for s in self.job.steps]}


def _plain(value):
    """A config value as JSON holds it (the report)."""
    return json.loads(json.dumps(value, default=str)) if value is not None else {}


def document_of(desc, job):
    """The config document ``job`` was planned from."""
    docs = desc.docs
    return next((d for d in docs if d.data.get("name") == job.name), docs[-1]) if job.name else \
        next((d for d in docs if d.data.get("name") is None), docs[-1])


def merged_names(job, labels=None) -> tuple[list, bool]:
    """(the merged inputs as the report names them, whether every merged step reads the same inputs in the same
    order — then the pairwise and result distances are per input)."""
    labels = labels or [i.label for i in job.inputs]
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
    params = _plain(document_of(desc, job).data.get("parameters"))
    frame = {"align": AlignOptions(symmetries=()), "requested": "none", "note": None, "frame": "none",
             "anchor_index": None, "anchor_rule": None}
    if alignment is not None:
        frame = {"align": alignment.align, "requested": alignment.requested, "note": alignment.note,
                 "frame": alignment.frame, "anchor_index": alignment.anchor_index, "anchor_rule": alignment.anchor_rule}
    merge = MergePlan(method=method, names=names, model_type=model_type, mode="stream", why=MODE_WHY, params=params,
                      weights=None, steps=list(job.steps), **frame)
    where = str(desc.output) if job.final else f"<intermediate {job.name}>"
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
