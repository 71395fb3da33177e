"""The reports (``symmerge_report.json``, ``barrier.json``): one builder, :func:`build_report`, makes every
command's report from its plan (the decisions, :mod:`symmerge.merge.plan`, :mod:`symmerge.pipeline.align_plan`,
:mod:`symmerge.merge.barrier`) and what was measured; the alignment's measured part has one schema for in-memory
and streamed alignment.

Distances come from per-tensor squared distances before and after, collected as the work goes
(streaming: part by part), then summed: the whole model, each group instance (``per_module``) and
each layer (``per_layer``: the union of its instances' tensors).
"""

from __future__ import annotations

import math


def build_report(plan, measured: dict) -> dict:
    """The one report builder of every command (merge, align, barrier, each merge of ``run``): the fields the
    plan decides (``plan.fields()``: what was asked for and what it resolved to), the facts measured (``measured``:
    distances, verification, timings...; they cannot overwrite a decision), and the plan itself as its report
    entry (``plan``: ``plan.describe()``)."""
    decided = plan.fields()
    report = dict(decided)
    report.update((k, v) for k, v in measured.items() if k not in decided)
    report["plan"] = plan.describe()
    return report


class Distances:
    """Per-tensor squared distances to the anchor, before and after alignment."""

    def __init__(self):
        self.before: dict[str, float] = {}
        self.after: dict[str, float] = {}

    def add(self, key: str, before: float, after: float) -> None:
        self.before[key], self.after[key] = before, after

    def total(self, keys=None) -> tuple[float, float]:
        """(before, after) over ``keys`` (default: every tensor seen), each summed exactly (``math.fsum``): the same
        whatever order the tensors came in (in memory the model's, streamed the parts')."""
        keys = self.before.keys() if keys is None else keys
        return (math.sqrt(math.fsum(self.before.get(k, 0.0) for k in keys)),
                math.sqrt(math.fsum(self.after.get(k, 0.0) for k in keys)))

    def tables(self, instances) -> dict:
        per_module, layer_keys = {}, {}
        for inst in instances:
            keys = inst.keys()
            b, a = self.total(keys)
            per_module[inst.name] = {"before": b, "after": a}
            if inst.layer >= 0:
                layer_keys.setdefault(inst.layer, set()).update(keys)
        per_layer = {}
        for layer, keys in sorted(layer_keys.items()):
            b, a = self.total(keys)
            per_layer[str(layer)] = {"before": b, "after": a}
        return {"per_module": per_module, "per_layer": per_layer}


def alignment_report(spec, model_type: str, opts, instances, distances: Distances, keys=None, **fields) -> dict:
    """The report's common fields; ``fields`` adds the mode-specific ones (verification, timings,
    shards...). ``keys``: the tensors the whole-model distance runs over (default: every tensor seen)."""
    before, after = distances.total(keys)
    report = {
        "family": spec.family,
        "model_type": model_type,
        "symmetries": list(opts.symmetries),
        "rescale": opts.effective_rescale,
        "layers": list(opts.layers) if opts.layers is not None else "all",
        "distance_before": before,
        "distance_after": after,
        **distances.tables(instances),
        "match": opts.match,  # both modes (a streamed alignment is data-free: its matcher streams)
    }
    report.update(fields)
    return report


MATCH_FIELDS = ("align_samples_used", "align_data", "learned", "residual_group", "sweeps", "solver")


def match_fields(report: dict) -> dict:
    """How an alignment was found, from its report: ``match`` and, where they apply, the unlabeled
    samples used, the learned alignment's record, the residual group and the sweeps (the per-model
    entries of a merge report and the curves of a barrier study carry them)."""
    return {"match": report.get("match", "weights"), **{k: report[k] for k in MATCH_FIELDS if k in report}}


def solver_summary(record: dict) -> str:
    """One line on the data-free search (the report's ``solver`` entry): the start kept and every start's objective."""
    starts = ", ".join(f"{r['start']} {r['objective']:.6g}" for r in record["starts"])
    weights = [f"{name} {record[key]:g}" for key, name in (("ends_weight", "ends weight"),
                                                           ("depth_decay", "depth decay"))
               if record.get(key, 1.0) != 1.0]
    weighted = f", objective with {' and '.join(weights)}" if weights else ""
    return (f"data-free solver: kept {record['winner']} (objective {record['objective']:.6g}{weighted}) of "
            f"{len(record['starts'])} start(s) in {record['seconds']:.2f} s: {starts}")
