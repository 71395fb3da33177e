"""Merging the weights of a sentence-transformers pipeline's modules beyond the transformer (``2_Dense/``)
with the merge's own method; :mod:`symmerge.io.sentence_transformers` checks and writes the pipeline."""

from __future__ import annotations

from ..io.sentence_transformers import module_tensors, read_pipeline
from .registry import get_method


def merge_module_weights(entry: dict, folders, method, weights=None, params=None, base=None,
                         allow_pickle: bool = False) -> dict:
    """The merged weights of every module with weights: ``{module folder: state dict}``. Methods that
    need statistics or the model have none for these modules: their tensors get ``entry``'s
    ``weighted_method`` (the average) instead."""
    out = {}
    m = get_method(entry.get("weighted_method", "average")) if method.needs or method.needs_model else method
    pipes = [read_pipeline(f) for f in folders]
    base_pipe = read_pipeline(base) if m.needs_base else None
    for module in entry["weighted_modules"]:
        sds = [module_tensors(p.weight_file(module), allow_pickle) for p in pipes]
        kw = dict(params or {}) if m is method else {}
        if m.needs_base:
            kw["base"] = module_tensors(base_pipe.weight_file(module), allow_pickle)
        out[module] = m.merge(sds, weights=weights, **kw)
    return out


def merge_pipeline_modules(entry: dict, report: dict) -> dict:
    """The module weights a merge ``report`` describes (the ``merge_modules`` hook of
    :func:`symmerge.io.model.save_model` / :func:`~symmerge.io.model.copy_side_files`). Pickle module
    weights were refused by ``check_pipelines`` unless ``--allow-pickle`` was given."""
    return merge_module_weights(entry, report["models"], get_method(report["method"]), report.get("weights"),
                                report.get("params"), report.get("base"), allow_pickle=True)
