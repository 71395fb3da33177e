"""The library entry that writes: ``symmerge.merge(models, out, options) -> report`` plans the merge
(:func:`~symmerge.merge.plan.plan_merge`: the mode and why), runs the wing the plan chose — in memory
(:func:`~symmerge.merge.fuse.merge_models`) or streamed (:func:`~symmerge.merge.stream.merge_streaming`) —
and writes the folder ``out`` atomically, exactly as ``symmerge merge`` does (the command parses its flags
into a :class:`~symmerge.merge.fuse.MergeOptions`, calls this, and prints)."""

from __future__ import annotations

from pathlib import Path

from ..errors import SymmergeError
from ..io.arguments import keeps_models, models_argument, output_argument
from ..io.checkpoint import parse_size
from ..io.model import check_room, ensure_output_dir, save_model
from ..io.output import writes_output
from ..progress import stage
from .fuse import MergeOptions, check_model_count, merge_models
from .registry import get_method
from .modules import merge_pipeline_modules
from .plan import base_among_models, plan_merge


@writes_output
@keeps_models
def merge_to_folder(models, out, options: MergeOptions | None = None, **keywords) -> dict:
    """Merge ``models`` (HF folders, or transformers models for an in-memory merge) into the folder ``out``
    (must not exist or be empty; written atomically) with ``options`` (a :class:`MergeOptions`, or its
    fields as keywords; ``options.mode``: ``auto``, ``memory`` or ``stream``; ``options.shard_size``: the
    output's largest shard, in both modes). Returns the report (also ``out/symmerge_report.json``), whose
    ``plan`` says which mode ran and why."""
    options = MergeOptions.of(options, keywords, "symmerge.merge()")
    out = Path(output_argument(out))
    models = models_argument(models)
    ensure_output_dir(out, inputs=models)  # fail before any expensive work
    models, options = _single_files(models, options)
    models, options = base_among_models(models, options)
    check_model_count(get_method(options.method), len(models), options.base is not None)
    plan = plan_merge(models, options, mode=options.mode)
    check_room(out, models)  # a full disk found now, not after the merge
    if plan.mode == "stream":
        from . import stream  # looked up at call time (tests bound the read-ahead budget through it)

        return stream.merge_streaming(models, out, options, shard_size=options.shard_size, plan=plan)
    model, report = merge_models(models, options=options, plan=plan)
    src = models[report["head"].get("from_index", 0) or 0]
    with stage(f"wrote {out}", enabled=options.progress):
        save_model(model, out, src=src if isinstance(src, (str, Path)) else None, report=report,
                   merge_modules=merge_pipeline_modules, shard_size=parse_size(options.shard_size))  # as streamed
    return report


def _single_files(models, options):
    """Single ``.safetensors`` files among the models and the base read as folders (:mod:`symmerge.io.single`:
    their config beside them, else the base model's)."""
    from dataclasses import replace

    from ..io.single import folders, is_single_file

    base = options.base
    if not any(is_single_file(m) for m in [*models, base]):
        return models, options
    config_from = base if base is not None and not is_single_file(base) else None
    if is_single_file(base):
        base = folders([base], next((m for m in models if not is_single_file(m)), None))[0]
    return folders(models, config_from or base), replace(options, base=base)

