"""Streamed merges: checkpoints merged tensor by tensor from their safetensors files, never loaded whole.

``symmerge merge --mode stream`` (or ``auto``, see :func:`symmerge.merge.plan.choose_mode`) runs every per-tensor method
(average, task arithmetic, TIES, DARE, DARE-TIES) this way, for any number of models and any model type
transformers knows (no symmetry spec needed):

* the inputs' headers give every tensor's name, shape and dtype; bodies must agree (names, shapes), the
  task head is kept from ``head_from`` (or merged, with ``heads="merge"``), as in memory;
* the merge is planned as :class:`~symmerge.merge.steps.TensorStep` s (:func:`plain_steps`) and run by the
  streamed executor (:func:`symmerge.merge.executor.execute_steps`: a method's model-wide quantities first,
  then a reader thread ahead into a ring buffer, :func:`~symmerge.merge.base.merge_tensor` — the very
  function the in-memory loop runs, so both give the same bits —, a writer thread behind);
* an aligned merge first aligns every model to the anchor with ``align --stream``'s engine
  (:func:`symmerge.pipeline.stream.align_streaming`; with ``--match learned``, the learned alignment from the
  files, :func:`symmerge.pipeline.learn_layerwise_write.align_learned_streaming`, one layer at a time, the anchor
  carrying the model's own heads as in memory) into temporary folders, then merges those.

Peak memory ≈ interpreter + N × the largest tensor × a small factor, whatever the model size. The
output is written atomically (a temporary folder renamed at the end: an interrupted merge leaves none).
Methods that need statistics (Fisher, RegMean: activations of the models run on data), the architecture
(OT fusion), REPAIR and evaluation need the models in memory: ``--mode memory``.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from ..core.layout import Layout, check_layouts
from ..errors import SymmergeError
from ..io.checkpoint import LazyCheckpoint
from ..io.card import write_card
from ..io.model import write_json
from ..io.output import temp_prefix
from ..io.prefix import adapt_checkpoints, borrowed, merge_anchor_entry
from ..io.sentence_transformers import check_pipelines
from ..io.tokenizers import check_tokenizers
from ..progress import stage
from .executor import (DEFAULT_SHARD, OutputFolder, _Budget, config_text, default_budget,  # noqa: F401 (re-exported)
                       execute_steps)
from .heads import head_policy, head_report
from .plan import (MEMORY_FRACTION, MODES, MergePlan, average_keys, checkpoint_bytes, choose_mode,  # noqa: F401
                   closest, closest_to_average, has_spec, merge_report, plain_fallback, plan_merge, stream_entry,
                   stream_refusal)
from .registry import get_method
from .steps import file_order, measured_steps, plain_merge_steps


def head_keys_of(ckpt: LazyCheckpoint) -> list[str]:
    """Tensors outside the base model (``base_model_prefix``), as :func:`symmerge.merge.heads.head_keys`
    finds them in memory (tied aliases are already folded into their sources)."""
    prefix = ckpt.base_model_prefix + "."
    keys = ckpt.keys()
    if prefix == "." or not any(k.startswith(prefix) for k in keys):
        return []
    return [k for k in keys if not k.startswith(prefix)]


def _model_row(path: Path, rep: dict) -> dict:
    """A streamed aligned model's ``alignment.models`` entry, as the in-memory merge writes it: the distances to the
    anchor proxy (the anchor's body carrying the model's heads, as in memory: a head's distance is 0.0, so the whole
    model's distance is the body's, each tensor's value summed once, :class:`symmerge.pipeline.report.Distances`),
    ``match`` and the ``distances`` tables."""
    from ..pipeline.report import match_fields

    body = {side: rep[f"distance_{side}"] for side in ("before", "after")}
    return {"model": str(path), "anchor": False, "distance_before": body["before"], "distance_after": body["after"],
            "verify_max_rel_diff": rep.get("verify_max_rel_diff"), "seconds": rep.get("seconds"), **match_fields(rep),
            "distances": {side: {"whole": body[side],
                                 "per_layer": {k: v[side] for k, v in rep.get("per_layer", {}).items()},
                                 "per_module": {k: v[side] for k, v in rep.get("per_module", {}).items()}}
                          for side in ("before", "after")}}


def _body_layout(ckpt: LazyCheckpoint, name: str, heads) -> Layout:
    heads = set(heads)
    return Layout(name, ckpt.config["model_type"], ckpt.heads,
                  {k: ckpt.shape[k] for k in ckpt.keys() if k not in heads}, ckpt.disk_name, ckpt.class_name)


def merge_streaming(models, out, options, shard_size=DEFAULT_SHARD, budget=None, write_hook=None,
                    plan: MergePlan | None = None) -> dict:
    """Merge the safetensors folders ``models`` tensor by tensor into the folder ``out`` (atomically)
    with a per-tensor method of ``options`` (a :class:`~symmerge.merge.fuse.MergeOptions`); returns the
    report (also written as ``out/symmerge_report.json``). ``plan``: the merge's plan
    (:func:`~symmerge.merge.plan.plan_merge`, made here when not given). ``budget``: bytes the reader may
    hold ahead, the size of its ring buffer (default: :func:`default_budget`). ``write_hook(tmp, report)``,
    if given, runs on the finished temporary folder before it is renamed (extra files)."""
    t0 = time.perf_counter()
    plan = plan if plan is not None else plan_merge(models, options, mode="stream")
    if plan.mode != "stream":
        raise SymmergeError(f"streamed merge: the plan loads the models ({plan.why}); use --mode memory")
    options = plan.options or options  # the options the plan validated
    names = [str(x) for x in models]
    # the same checks as in memory, before anything is read: tokenizers, sentence-transformers pipelines
    tokenizer = check_tokenizers([(n, x) for n, x in zip(names, models)] +
                                 [(str(x), x) for x in (options.base, options.anchor) if isinstance(x, (str, Path))],
                                 options.allow_tokenizer_mismatch)
    embedding = check_pipelines(list(zip(names, models)), plan.method, options.base, options.allow_pickle)
    timings = {"load": 0.0, "align": 0.0, "statistics": 0.0, "merge": 0.0, "evaluate": 0.0}
    checked = _Checked(plan, names, tokenizer, embedding, timings, t0, shard_size, budget, write_hook)
    if plan.aligns:
        return _aligned_streaming(models, out, options, checked)
    return _plain_streaming(models, options.base, out, options, checked, alignment=plan.alignment(), aligned=False)


@dataclass(frozen=True)
class _Checked:
    """What a streamed merge hands from its checks (:func:`merge_streaming`) to the merge: the plan, the inputs'
    names, the tokenizer and pipeline facts, the timings so far and the clock's start, how it writes."""

    plan: MergePlan
    names: list
    tokenizer: object
    embedding: object
    timings: dict  # filled in as the stages run
    t0: float
    shard_size: object
    budget: object
    write_hook: object


def label_names(config: dict) -> dict:
    """config.json's ``id2label`` as transformers reads it: the default names (``LABEL_0`` …, ``num_labels`` of them,
    2 without it) where it has none — transformers 4 wrote them into every config.json, transformers 5 leaves them
    out, and the two mean the same labels."""
    found = config.get("id2label")
    if isinstance(found, dict):
        return {str(k): v for k, v in found.items()}
    n = config.get("num_labels")
    return {str(i): f"LABEL_{i}" for i in range(n if isinstance(n, int) else 2)}


def plain_steps(ckpts, base, options, names) -> tuple[list, list, list]:
    """(steps, the head keys of every model, the head policy) of a plain merge of the checkpoints ``ckpts``
    (base model ``base`` or None, the last input when given): the bodies checked to agree, every body tensor
    merged under its own name, the task head kept from ``head_from`` (copied) or merged (``heads="merge"``),
    in the order of the head's model."""
    policy = head_policy(options.heads, ckpts[0].class_name)  # 'auto': by class
    heads = [head_keys_of(c) for c in ckpts]
    everything = ckpts + ([base] if base is not None else [])
    labels = names + (["base"] if base is not None else [])
    check_layouts([_body_layout(c, n, head_keys_of(c)) for c, n in zip(everything, labels)])
    holder = ckpts[options.head_from]
    body = [k for k in ckpts[0].keys() if k not in set(heads[0])]
    merged_keys = list(body)
    if policy == "merge":
        for i in range(1, len(ckpts)):
            if sorted(heads[i]) != sorted(heads[0]) or any(ckpts[i].shape[k] != ckpts[0].shape[k] for k in heads[0]):
                raise SymmergeError(f"cannot merge task heads: {names[0]} and {names[i]} have different heads/label "
                                    "spaces (use --heads keep)")
            if label_names(ckpts[i].config) != label_names(ckpts[0].config):
                raise SymmergeError(f"cannot merge task heads: label names differ between {names[0]} and "
                                    f"{names[i]}; use --heads keep")
        merged_keys += heads[0]
        if base is not None:
            missing = [k for k in heads[0] if k not in base.shape]
            if missing:
                raise SymmergeError(f"base model lacks tensor {base.disk_name.get(missing[0], missing[0])!r}")
    merged_keys = [k for k in merged_keys if k not in borrowed(everything)]  # a base model's missing head: kept
    merged_set = set(merged_keys)
    kept = set(heads[options.head_from])
    # safetensors' own layout, not the files' order: the same output from single-file or sharded inputs
    order = file_order([k for k in holder.keys() if k in merged_set or k in kept], holder.dtype.__getitem__,
                       holder.save_name)
    steps = plain_merge_steps(order, merged_set, len(ckpts), base=len(ckpts) if base is not None else None,
                              weights=options.weights, params=options.params, head_from=options.head_from,
                              method=get_method(options.method))
    return steps, heads, policy


def header_steps(models, options, plan: MergePlan) -> list | None:
    """The steps of ``plan`` from the inputs' headers alone (no weights read): the plain merge's
    (:func:`plain_steps`, the very steps both wings run — an alignment moves tensors, never renames them);
    None for a method with its own loop (statistics, the architecture)."""
    if plan.method.needs or plan.method.needs_model:
        return None
    ckpts = [LazyCheckpoint(x, spec=False) for x in models]
    base = LazyCheckpoint(options.base, spec=False) if options.base is not None else None
    names = [str(x) for x in models]
    (*ckpts, base), _ = adapt_checkpoints(ckpts + [base], names + [str(options.base)], options.head_from)
    return plain_steps(ckpts, base, options, names)[0]


def _plain_streaming(folders, base_folder, out, options, checked: _Checked, *, alignment, aligned) -> dict:
    """The folders merged tensor by tensor (no alignment left to do: ``aligned`` when they are the aligned
    copies of the inputs ``checked.names``); the report written into ``out``."""
    plan, names, tokenizer, embedding, timings = (checked.plan, checked.names, checked.tokenizer, checked.embedding,
                                                  checked.timings)
    with stage("read the checkpoint headers", enabled=options.progress):
        ckpts = [LazyCheckpoint(x, spec=False) for x in folders]
        base = LazyCheckpoint(base_folder, spec=False) if base_folder is not None else None
    (*ckpts, base), adapted = adapt_checkpoints(ckpts + [base], list(names) + [str(base_folder)], options.head_from)
    steps, heads, policy = plain_steps(ckpts, base, options, names)
    plan.steps = steps
    holder = ckpts[options.head_from]
    base_name = str(options.base) if options.base is not None else None
    report = None

    def finish(tmp, facts):
        nonlocal report
        timings["prepare"] = facts["seconds"]["prepare"]
        timings["merge"] = facts["seconds"]["merge"]
        pairs = {f"{names[i]} | {names[j]}": math.sqrt(v) for (i, j), v in sorted(facts["pairwise_sq"].items())}
        report = merge_report(
            plan, base=base_name, alignment=alignment,
            head=head_report(heads[0], policy, options.heads, options.head_from, names, heads[options.head_from],
                             steps),
            # aligned: the distances before alignment are each model's to the anchor (alignment.models)
            distances_between_inputs={"before_alignment": None if aligned else pairs, "after_alignment": dict(pairs)},
            distance_result_to_inputs={nm: math.sqrt(facts["result_sq"].get(i, 0.0)) for i, nm in enumerate(names)},
            stream=stream_entry(facts),
            tokenizer=tokenizer, embedding=embedding, side_files=facts["side_files"], names=names,
            result_warnings=facts["result_warnings"])
        timings["total"] = time.perf_counter() - checked.t0
        report["timings"] = timings
        anchor_adapted = [alignment["anchor"]["base_adapted"]] if "base_adapted" in (alignment or {}).get(
            "anchor", {}) else []  # reported, not merged: as in memory
        if adapted or anchor_adapted:
            report["base_adapted"] = adapted + anchor_adapted
        if checked.write_hook is not None:
            checked.write_hook(tmp, report)
        write_card(tmp, report)  # README.md, the output's own model card
        write_json(tmp / "symmerge_report.json", report)

    # a sentence-transformers pipeline's module weights: merged by the same method from the folders merged
    side = {"method": plan.method.name, "params": plan.params, "weights": plan.weights,
            "models": [str(x) for x in folders], "base": str(base_folder) if base_folder is not None else None,
            **({"sentence_transformers": embedding} if embedding else {})}
    execute_steps(ckpts + ([base] if base is not None else []), steps, plan.method, out,
                  # the side files of the input itself, not of its aligned temporary copy (its report, its card)
                  OutputFolder(config=config_text(holder), side_files_from=names[options.head_from] if aligned
                               else holder.folder, side_report=side,
                               naming=options.head_from, shard_size=checked.shard_size, finish=finish),
                  budget=checked.budget, progress=options.progress,
                  distances=measured_steps(steps, heads[0]))  # the body, as in memory
    return report


def _aligned_streaming(models, out, options, checked: _Checked) -> dict:
    """Each model aligned to the anchor (:func:`aligned_folders`), then the aligned folders merged tensor by
    tensor; the temporary folders are removed whatever happens."""
    header_steps(models, options, checked.plan)  # the inputs' layouts checked before any is aligned, as in memory
    t = time.perf_counter()
    with aligned_folders(models, out, options, checked.plan, checked.names) as (aligned, base_path, alignment):
        checked.timings["align"] = time.perf_counter() - t
        return _plain_streaming(aligned, base_path, out, options, checked, alignment=alignment, aligned=True)


@contextlib.contextmanager
def aligned_folders(models, out, options, plan, names):
    """Each model (and ``options.base``) aligned to the plan's anchor with
    :func:`symmerge.pipeline.stream.align_streaming` (one part of a layer at a time; a learned matcher:
    :func:`~symmerge.pipeline.learn_layerwise_write.align_learned_streaming`) into temporary folders
    beside ``out``; yields (the models' folders, aligned or the anchor's own, the base's folder, the report's
    ``alignment`` entry). The temporary folders are removed on leaving, whatever happens."""
    from ..pipeline.learn_layerwise_write import align_learned_streaming
    from ..pipeline.stream import align_streaming

    learns = plan.align.matcher.learns  # learned from the files, layer by layer (pipeline/learn_layerwise_write.py)
    align_one = align_learned_streaming if learns else align_streaming
    idx, info = plan.anchor_index, {"rule": plan.anchor_rule}
    if plan.anchor_rule == "closest to the average":
        with stage("chose the anchor (closest to the average)", enabled=options.progress):
            ckpts = [LazyCheckpoint(x, spec=False) for x in models]
            keys = average_keys(ckpts[0].keys(), head_keys_of(ckpts[0]), ckpts[0].dtype.__getitem__)
            idx, dists = closest_to_average(lambda k: [c.read_direct(k) for c in ckpts], keys)
        info = {**info, "distances_to_average": dists}
    anchor_path = Path(models[idx]) if idx is not None else Path(options.anchor if options.anchor is not None
                                                                 else options.base)
    info = {"index": idx, "name": str(anchor_path), **info}
    targets = [(i, Path(x)) for i, x in enumerate(models) if i != idx]
    if options.base is not None and Path(options.base) != anchor_path:
        targets.append(("base", Path(options.base)))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=temp_prefix(out, "aligned"), dir=out.parent))  # a later run knows it
    try:
        aligned, base_path, rows, resolved = list(models), options.base, [], None
        for i, path in targets:
            with stage(f"aligned {path} to the anchor (streamed)", enabled=options.progress):
                # the anchor carries the model's own heads, as the in-memory merge's anchor proxy
                rep = align_one(path, anchor_path, work / f"model-{i}", plan.align, progress=options.progress,
                                allow_tokenizer_mismatch=options.allow_tokenizer_mismatch,
                                model_heads=head_keys_of(LazyCheckpoint(path, spec=False)))
            # the copy holds the model's files, as the in-memory alignment's copy does: its report is read (rep)
            (work / f"model-{i}" / "symmerge_report.json").unlink(missing_ok=True)
            resolved = rep.get("symmetries", resolved)
            for entry in rep.get("base_adapted") or []:  # a base-class anchor, read as the model's class
                if entry["model"] == "anchor" and "base_adapted" not in info:
                    info["base_adapted"] = merge_anchor_entry(entry, str(anchor_path))
            if i == "base":
                base_path = work / f"model-{i}"
            else:
                aligned[i] = work / f"model-{i}"
            rows.append(_model_row(path, rep))
        if idx is not None:
            rows.insert(idx, {"model": names[idx], "anchor": True})
        elif options.base is not None and Path(options.base) == anchor_path:  # the base is the anchor: its row last,
            rows.append({"model": str(options.base), "anchor": True})  # as in memory
        alignment = {"symmetries": list(resolved or []), "requested": plan.requested,
                     "rescale": plan.align.effective_rescale, "anchor": info, "models": rows, "streamed": True}
        notes = []
        if options.use_joint(len(models)):  # auto: more than two models, no anchor
            notes.append("streamed: every model was aligned to one anchor (the star); joint alignment into one frame "
                         "needs the models in memory (--mode memory)")
        if plan.why.startswith("auto:"):  # chosen by the memory free now: another run may load them
            notes.append("--mode auto streamed this aligned merge because the models exceed half the memory "
                         "available now; loaded (--mode memory) it aligns every group, residual included, and gives "
                         "another model: give --mode stream or --mode memory for one result whatever memory is free")
        if notes:
            alignment["note"] = "; ".join(notes)
        yield aligned, base_path, alignment
    finally:
        shutil.rmtree(work, ignore_errors=True)
