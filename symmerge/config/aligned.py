"""A mergekit config with alignment (``align:`` in the config, or ``symmerge run --align``): every model of the
merge is brought into one frame first, then the config runs exactly as it would without ``align`` on the
aligned models — its gradients, filters, per-model parameters, slices, ``dtype``, tokenizer and chat template.

* **The frame** is the one ``symmerge merge`` aligns into, by the same rules
  (:mod:`symmerge.merge.plan`): the base model's when the method uses one (``recommended`` then aligns
  nothing: fine-tunes of one base share its frame; name the symmetries to align anyway), else the second of
  two models, else jointly into one frame (more than two models, in memory) or the star on the model closest
  to the average; ``anchor``, ``star``, ``joint_rounds``, ``rescale``, ``match``, ``align_data`` ... are the
  merge command's options by their long names. In memory when the models fit in half the available memory
  (every group, the residual stream included), else each model streamed by ``align --stream``'s engine
  (``mode: stream`` / ``memory`` force either).
* **The merge** is the config re-planned on the aligned copies (written into a temporary folder beside the
  output, removed at the end): the same :class:`~symmerge.merge.steps.TensorStep` s as the config without
  ``align`` run on folders that ``symmerge align`` would have written, so the result is, tensor for tensor,
  aligning first and running the plain config on the aligned folders.
* **Slices** (frankenmerges) are aligned as whole models before slicing: well defined when every model of
  the config has one architecture (the same tensors and shapes); models of different shapes are one error
  naming them, before anything is read.

The output gets ``symmerge_report.json`` with the ``alignment`` entry of a merge report.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import SymmergeError
from ..option_ranges import model_index
from ..options.declared import ALIGNMENT, OPTIONS
from .schema import merge_options

# an aligned config's alignment keys (beside a mergekit config's own): these of merge's, and every option of merge's
# alignment part as the options
# schema declares it (a new alignment option is a key here too) — except learn_frame: the dual frame moves the
# anchor too, and a config's frame is its base model's or a joint one
ALIGN_KEYS = tuple(dict.fromkeys(
    ("align", "anchor", "star", "joint_rounds", "joint_refine", "no_verify", "mode", "device", "progress")
    + tuple(o.name for o in OPTIONS if o.part == ALIGNMENT and "merge" in o.commands and o.name != "learn_frame")))


def wants_alignment(doc, align) -> bool:
    """Whether alignment is asked for: ``align`` on the command line or in the document, other than none."""
    value = align if align is not None else doc.data.get("align")
    if value is None or value is False:
        return False
    return not (isinstance(value, str) and value.strip().lower() == "none")


def applies(doc, align) -> bool:
    """An aligned mergekit config: alignment asked for, and every key a mergekit key or an alignment option
    (a config with other symmerge keys, e.g. ``eval_data``, runs the ``symmerge merge`` it stands for)."""
    from .command import is_option
    from .mergekit import KEYS, OUTPUT_KEYS

    return wants_alignment(doc, align) and all(k in KEYS or k in OUTPUT_KEYS or k in ALIGN_KEYS
                                               or not (k == "command" or is_option("merge", k)) for k in doc.data)


def without_alignment_keys(doc):
    """``doc`` as the mergekit config it aligns (its alignment keys left out; the lines kept for errors)."""
    return replace(doc, data={k: v for k, v in doc.data.items() if k not in ALIGN_KEYS})


@dataclass
class Alignment:
    """How an aligned config aligns: the merge options of its alignment keys, and where they were written."""

    options: object  # a symmerge.merge.fuse.MergeOptions (method and base set per job at run time)
    doc: object
    keys: tuple = ()
    report: dict = field(default_factory=dict)


def alignment_of(doc, align=None) -> Alignment:
    """The :class:`Alignment` of the document's alignment keys (``align``: ``--align`` from the command line),
    each value checked as ``symmerge merge`` checks its flag (:mod:`symmerge.config.schema`); a bad one is one
    error naming its key and line."""
    refuse_misspelt_keys(doc)
    keys = {k: v for k, v in doc.data.items() if k in ALIGN_KEYS}
    if align is not None:
        keys["align"] = align
    options, given = merge_options(doc, keys)
    options = replace(options, progress=given.progress != "none", evaluate=False)
    return Alignment(options, doc, tuple(keys))


def refuse_misspelt_keys(doc) -> None:
    """An unknown key of an aligned config that is closest to one of symmerge's own (``anchro``: ``anchor``) is one
    error naming it and its line: the alignment keys are symmerge's, and a misspelt one left out would align
    otherwise than asked. One closest to a mergekit key (``tokenzer_source``), or to none, is left to the mergekit
    reading, which ignores it with a warning as mergekit does."""
    from ..errors import closest, did_you_mean
    from .command import option_names
    from .mergekit import KEYS, OUTPUT_KEYS

    mergekit = KEYS + OUTPUT_KEYS
    ours = tuple(k for k in dict.fromkeys(ALIGN_KEYS + option_names("merge")) if k not in mergekit)
    for k in doc.data:
        if k in mergekit or k in ALIGN_KEYS:
            continue
        if closest(k, mergekit + ours) in ours:
            raise doc.error(f"unknown key {k!r}{did_you_mean(k, mergekit + ours)}: the alignment options of an aligned "
                            "config (align, anchor, match, rescale, ...: the merge command's, by their long names) are "
                            "symmerge's own, and a misspelt one is an error, not ignored", k)


def check_one_architecture(doc, planner, job) -> None:
    """Every input of ``job`` has the same tensors and shapes (an adapted base-class base: its tensors a part of
    the fine-tunes'), or one error: models are aligned into one frame as wholes, before any slice is taken."""
    lays = [(inp, planner.layout(doc, inp, ("models",))) for inp in job.inputs]
    ref_inp, ref = next(((i, lay) for i, lay in lays if i.adapt is None), lays[0])
    for inp, lay in lays:
        if inp is ref_inp:
            continue
        names = set(lay.shapes)
        missing = sorted(set(ref.shapes) - names) if inp.adapt is None else []
        extra = sorted(names - set(ref.shapes))
        odd = [k for k in sorted(names & set(ref.shapes)) if lay.shapes[k] != ref.shapes[k]]
        if missing or extra or odd:
            what = (f"{odd[0]} has shape {tuple(lay.shapes[odd[0]])} in {inp.label} and {tuple(ref.shapes[odd[0]])} in "
                    f"{ref_inp.label}" if odd else
                    f"{(missing or extra)[0]} is only in {ref_inp.label if missing else inp.label}")
            raise doc.error(f"'align' brings whole models into one frame before they are merged or sliced, which "
                            f"needs one architecture (the same tensors and shapes): {what} ({inp.label}: {lay.layers} "
                            f"layers, {ref_inp.label}: {ref.layers}); drop 'align' to run the config as mergekit "
                            "does", "align")


def plan_alignment(job, spec: Alignment):
    """(models, base, options, plan or None) of aligning ``job``'s inputs into one frame: the merge plan's
    rules (:func:`symmerge.merge.plan.recommended`, :func:`~symmerge.merge.plan.anchor_rule`,
    :func:`~symmerge.merge.plan.choose_mode`) for its models and base; None: nothing to align (one model, or
    'recommended' with a base model: ``spec.report`` holds the note)."""
    from ..merge.plan import MergePlan, anchor_rule, choose_mode, config_or_none, model_type_of, recommended
    from ..merge.registry import get_method

    folders = [inp.folder for inp in job.inputs]
    models = [f for i, f in enumerate(folders) if i != job.base]
    base = folders[job.base] if job.base is not None else None
    options = replace(spec.options, base=base, method="average", weights=None, params={})
    if isinstance(options.anchor, int):  # the one rule of an index (symmerge.option_ranges.model_index)
        try:
            model_index(options.anchor, len(models), among=f"the {len(models)} merged model(s) ("
                        f"{', '.join(i.label for j, i in enumerate(job.inputs) if j != job.base)})")
        except SymmergeError as e:
            raise spec.doc.error(str(e), "anchor") from None
    model_type = model_type_of(models[0])
    align, note = recommended(options.align, model_type=model_type, base_given=base is not None,
                              config=config_or_none(models[0]))
    spec.report = {"symmetries": [], "requested": options.align.requested, "rescale": "none",
                   "anchor": {"index": None, "name": None, "rule": None}, "models": []}
    if note:
        spec.report["note"] = note
    if not align.symmetries or len(models) + (base is not None) < 2:
        if align.symmetries:
            spec.report["note"] = "one model: nothing to align"
        return models, base, options, None
    method = get_method("average")
    try:
        mode, why = choose_mode(options.mode, method, options, models, True)
        index, rule = anchor_rule(len(models), options.anchor, base is not None)
    except SymmergeError as e:
        raise spec.doc.error(str(e), "mode" if "--mode" in str(e) else "align") from None
    if options.anchor is None and base is not None:
        frame = "base"
    elif mode == "memory" and options.use_joint(len(models)):
        frame = "joint"
    else:
        frame = "star"
    plan = MergePlan(method=method, names=[str(m) for m in models], model_type=model_type, mode=mode, why=why,
                     align=align, requested=options.align.requested, note=note, frame=frame, anchor_index=index,
                     anchor_rule=rule)
    return models, base, options, plan


def align_job(job, spec: Alignment, out: Path, work: Path, stack) -> tuple[dict, object]:
    """The job's inputs aligned into one frame, their aligned copies written under ``work`` (a streamed
    alignment's into its own temporary folder beside ``out``, removed when ``stack`` closes); returns
    ({input label: aligned folder} (inputs left as they are are not in it), the alignment's plan — the
    :class:`~symmerge.merge.plan.MergePlan` of :func:`plan_alignment`, made once here; None: nothing aligned)
    and sets ``spec.report``."""
    from ..io.model import save_model

    models, base, options, plan = plan_alignment(job, spec)
    if plan is None:
        return {}, None
    t = time.perf_counter()
    label = {inp.folder: inp.label for inp in job.inputs}
    moved: dict = {}
    if plan.mode == "stream":
        from ..merge.stream import aligned_folders

        aligned, base_path, alignment = stack.enter_context(
            aligned_folders(models, out, options, plan, [str(m) for m in models]))
        for src, dst in zip(models, aligned):
            if Path(dst) != Path(src):
                moved[label[src]] = str(dst)
        if base is not None and Path(base_path) != Path(base):
            moved[label[base]] = str(base_path)
    else:
        from ..merge.fuse import align_models

        aligned = align_models(models, options, plan)  # a symmerge.merge.fuse.Aligned record
        alignment = aligned.alignment
        pairs = list(zip(models, aligned.aligned)) + ([(base, aligned.aligned_base)] if base is not None else [])
        loaded = list(aligned.loaded.models) + ([aligned.loaded.base_model] if base is not None else [])
        for i, (src, model) in enumerate(pairs):
            if model is loaded[i]:  # nothing moved it (the anchor): read from its folder, as streamed
                continue
            dst = work / f"model-{i}"
            save_model(model, dst, src=src)
            moved[label[src]] = str(dst)
    alignment["mode"] = plan.mode
    alignment["seconds"] = time.perf_counter() - t
    spec.report = alignment
    return moved, plan


def describe_line(spec: Alignment) -> str:
    """What ``--print-command`` says of the alignment."""
    from ..pipeline.matchers import DEFAULT_MATCHER

    a = spec.options.align
    what = ",".join(a.symmetries) if not a.recommended else "recommended"
    shown = (("anchor", spec.options.anchor), ("match", a.match))
    extra = [f"{k}={v}" for k, v in shown if v not in (None, DEFAULT_MATCHER)]
    return f"align {what}{' (' + ', '.join(extra) + ')' if extra else ''}: every model into one frame, then"
