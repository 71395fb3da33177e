"""Align a model to an anchor inside its symmetry orbit, in memory:
load → spec → canonical form → solve → apply → verify → report."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.apply import canonicalize
from ..core.distance import parameter_keys, sq_distance
from ..core.layout import check_layouts
from ..io.layout import layout_of
from ..core.resolve import declared_ties
from ..device import resolve_device
from ..errors import SymmergeError, UsageError
from ..io.arguments import flag_arguments, keeps_models, model_argument
from ..io.reader import load_model
from ..io.prefix import adapt_pair
from ..io.sentence_transformers import check_pipelines
from ..io.tokenizers import check_tokenizers
from ..progress import running, stage, stage_printer
from .align_steps import execute_steps
from .align_steps import plan_steps
from .bound import as_model, bind, instances_for, untied  # noqa: F401  (re-exported; instances_for: the public
# (spec, instances) shortcut)
from .data import load_align_data  # noqa: F401  (re-exported)
from .matchers import MATCHERS, MatchContext
from .options import DEFAULT_SYMMETRIES, AlignOptions, refuse_unread_align_data
from .recommend import model_facts, recommended, require_declared
from .report import Distances, alignment_report
from .verify import (ELEMENT_CHECK, check_runs_on, in_dtype_of, owned_apart, verify_elements, verify_forward,
                     with_state_dict, working_copies, working_note)


def _load(x, allow_pickle: bool, progress: bool):
    """``as_model``, with a progress line when a folder is read."""
    if not isinstance(x, (str, Path)):
        return x
    with stage(f"loaded {x}", enabled=progress):
        return load_model(x, allow_pickle=allow_pickle)


def check_compatible(model, anchor) -> None:
    """Same model_type, heads, tensor names and shapes, else one clear error."""
    check_layouts([layout_of(model, "model"), layout_of(anchor, "anchor")])


def _model_wide(instances, opts) -> list:
    return [i for i in instances if not i.kind.per_layer and i.kind.active(i, opts)]


def canonical(model, options: AlignOptions):
    """``model`` in the parameterisation the options' groups act on (untied with ``untie``; norms folded
    into their readers when the residual stream's group needs it; the same function), or ``model``."""
    model = untied(model) if options.untie else model
    instances = bind(model, residual=options.residual).instances
    wide = _model_wide(instances, options.solver_options())
    sd = model.state_dict()
    new = canonicalize(sd, wide)
    return model if all(new[k] is sd[k] for k in sd) else with_state_dict(model, new)


_GROUP_NAMES = {"orthogonal": "O(d) (RMSNorm, norms folded)",
                "centered": "O(d-1) x {+-1}: orthogonal maps fixing the all-ones direction (LayerNorm, norms folded)",
                "permutation": "S_d: permutations (LayerNorm kept: post-LN, or --residual permutation)",
                "signed_permutation": "signed permutations (a norm kept: --residual permutation, a final norm that "
                                      "cannot fold into a tied head, or norms on the blocks' outputs)"}


@dataclass
class Alignment:
    """The result of :func:`align_pair`: the aligned model, the anchor in the same parameterisation
    (its norms folded when the aligned model's are), the report, the solved elements, their instances and
    the bound model. ``anchor`` is a new model when its norms were folded (or it was untied or cast to float32);
    otherwise it is the anchor given, the caller's own object (not a copy: an in-place edit of it edits both)."""

    model: object
    anchor: object
    report: dict
    elements: dict
    instances: list
    bound: object = None  # the model's BoundModel (symmerge.pipeline.bound): spec, layers, output axes


@keeps_models
def align_pair(model, anchor, options: AlignOptions | None = None, inputs: dict | None = None, progress=None,
               allow_pickle: bool = False, allow_tokenizer_mismatch: bool = False, plan=None) -> Alignment:
    """Move ``model`` inside its symmetry orbit as close as possible (L2) to ``anchor``.

    ``model``/``anchor``: transformers models or HF folder paths (folders: their tokenizers are compared
    first, see :mod:`symmerge.io.tokenizers`). ``plan``: the alignment's
    :class:`~symmerge.pipeline.align_plan.AlignPlan` (``options`` its resolved ones), whose bound instances are
    solved and whose steps are run (:mod:`symmerge.pipeline.align_steps`); without one the steps are planned
    here, on the loaded model. Returns an :class:`Alignment`; raises :class:`SymmergeError` if the tokenizers
    differ (unless ``allow_tokenizer_mismatch``), ``options`` name a symmetry the model's family does not declare
    (:func:`~symmerge.pipeline.recommend.require_declared`) or the options' verification fails. ``inputs``: the
    model's forward keywords (a dict of tensors) the verification compares the outputs on (default: made for the
    model); ``progress``: True (the stage lines the CLI prints), False/None (quiet), or a callback."""
    model, anchor = model_argument(model, "model"), model_argument(anchor, "anchor")
    options, progress = AlignOptions.of(options), _progress(progress)
    _check_inputs(inputs)
    flag_arguments(allow_pickle=allow_pickle, allow_tokenizer_mismatch=allow_tokenizer_mismatch)
    from .align_plan import AlignPlan

    if plan is not None and not isinstance(plan, AlignPlan):
        raise UsageError(f"align_pair(): plan is an AlignPlan (symmerge.pipeline.align_plan.plan_align) or None, "
                         f"got {type(plan).__name__}")
    if options.dual:  # both models move (pipeline/dual.py)
        from .dual import align_dual

        return align_dual(model, anchor, options, inputs, progress, allow_pickle, allow_tokenizer_mismatch,
                          closed_form=align_pair, load=_load, result=Alignment)
    return _align_onto(model, anchor, options, inputs, progress, allow_pickle, allow_tokenizer_mismatch, plan)


def _check_inputs(inputs) -> None:
    """``inputs`` (None, or the forward keywords the verification runs the models on: a dict of tensors), else one
    :class:`UsageError` naming what is not a tensor."""
    if inputs is None:
        return
    bad = next((k for k, v in inputs.items() if not isinstance(v, torch.Tensor)), None) \
        if isinstance(inputs, dict) else type(inputs).__name__
    if bad is not None:
        what = f"{bad!r} is {type(inputs[bad]).__name__}" if isinstance(inputs, dict) else f"got {bad}"
        raise UsageError(f"inputs must be a dict of tensors, the model's forward keywords (input_ids=...): {what}")


def _progress(progress):
    """``progress`` as the engine takes it: True, the stage lines (as the CLI prints them); False, None; or the
    callback given."""
    if isinstance(progress, bool):
        return stage_printer() if progress else None
    if progress is not None and not callable(progress):
        raise UsageError(f"progress must be True, False or a callback (symmerge.progress.stage_printer()), got "
                         f"{progress!r}")
    return progress


def _align_onto(model, anchor, options: AlignOptions, inputs, progress, allow_pickle: bool,
                allow_tokenizer_mismatch: bool, plan) -> Alignment:
    """:func:`align_pair` with ``model`` moved onto ``anchor`` (the one-sided frame)."""
    tokenizer = check_tokenizers([(str(x) if isinstance(x, (str, Path)) else label, x)
                                  for x, label in ((model, "model"), (anchor, "anchor"))], allow_tokenizer_mismatch)
    embedding = check_pipelines([(str(model), model)]) if isinstance(model, (str, Path)) else None
    loaded = plan.loaded if plan is not None else None  # a pickle checkpoint the plan read: not read again
    model, anchor = (_load(x, allow_pickle, progress is not None)
                     for x in (model if loaded is None else loaded, anchor))
    model, anchor, adapted = adapt_pair(model, anchor)  # a base model and a fine-tune of its task class
    check_compatible(model, anchor)
    check_runs_on(model, inputs)
    stored, anchor_stored = model, anchor  # the models in their own dtypes: the results are cast back to them
    model, anchor = working_copies([model, anchor])
    start = time.perf_counter()
    was_tied = bool(declared_ties(model) or declared_ties(anchor))
    if options.untie:
        model, anchor = untied(model), untied(anchor)
    bound = bind(model, options.layers, options.residual, instances=plan.bound if plan is not None else None)
    spec, instances = bound.spec, bound.instances
    require_declared(spec, options)  # a symmetry the family does not declare: one error, not aligned silently
    requested = options.requested
    options, embedding_note = recommended(options, available=[i.group.symmetry for i in instances], spec=spec,
                                          **model_facts(embedding, model.config))
    # cost GEMMs on ``options.device`` (default cpu: where the tensors are)
    gemm_device = None if options.device in (None, "cpu") else resolve_device(options.device)
    sd_a, sd_b = model.state_dict(), anchor.state_dict()
    on = {v.device for sd in (sd_a, sd_b) for v in sd.values()}
    if on != {torch.device("cpu")}:  # models on a GPU: solved from CPU copies, with the cost GEMMs on the GPU
        gpu = next((d for d in on if d.type != "cpu"), None)
        sd_a, sd_b = ({k: v.cpu() for k, v in sd.items()} for sd in (sd_a, sd_b))
        gemm_device = gemm_device if gemm_device is not None else gpu
    opts = options.solver_options(gemm_device)
    wide = _model_wide(instances, opts)
    ca, cb = canonicalize(sd_a, wide), canonicalize(sd_b, wide)
    folded = any(ca[k] is not sd_a[k] for k in sd_a)
    ctx = MatchContext(instances, model, anchor, ca, cb, options, opts, progress, {"match": options.match},
                       bound=bound)
    getattr(progress, "start", lambda: None)()  # the engine's progress lines count from here
    # a group can take minutes on a large model: the heartbeat speaks while the engine prints nothing
    with running(f"{getattr(progress, 'desc', 'aligning')}: solving ({options.match})", enabled=progress is not None):
        elements = MATCHERS[options.match](ctx)
    fields, sweeps = ctx.fields, ctx.history
    verify_elements(instances, elements)
    solved = [i for i in instances if i.kind.active(i, opts)]
    steps = plan.steps if plan is not None else plan_steps(list(ca), solved)
    aligned_sd = execute_steps(steps, ca, solved, elements)
    match_seconds = time.perf_counter() - start
    # the aligned model holds the new tensors themselves; those still shared with an input are copied
    aligned = with_state_dict(model, owned_apart(aligned_sd, model, anchor), share=True)
    keys = parameter_keys(model)
    distances = _distances(keys, ca, cb, aligned_sd, next(stored.parameters()).dtype)
    fields.update(streamed=False, mode="in-memory", verify=ELEMENT_CHECK, match_seconds=match_seconds)
    res = next((i for i in wide if i.kind.moves_heads_input), None)  # the residual stream's group, if aligned
    if res is not None:
        fields.update(residual_variant=res.info.variant, residual_group=_GROUP_NAMES[res.info.variant],
                      residual_sweeps_sq_distance=sweeps, sweeps=len(sweeps), norms_folded=folded,
                      untied=options.untie and was_tied)
        if folded:  # the distances above compare folded A and B; merging needs the anchor folded too
            fields["distance_before_unfolded"] = sq_distance(sd_a, sd_b, keys) ** 0.5
    report = alignment_report(spec, model.config.model_type, options, solved, distances, keys,
                              symmetries_requested=requested, **fields)
    if options.verify:
        with stage("verified the aligned model's outputs", enabled=progress is not None):
            report.update(verify_forward(model, aligned, spec, options.verify_tol, inputs))
    else:
        report.update(verify_max_abs_diff=None, verify_max_rel_diff=None, verify_tolerance=None)
    report["seconds"] = time.perf_counter() - start
    report["tokenizer"] = tokenizer
    note = working_note([stored, anchor_stored], [model, anchor])
    if note is not None:  # half or mixed dtypes: what verify_max_rel_diff measured, and what the rounding adds
        report["working_copies"] = note
    if adapted:
        report["base_adapted"] = adapted
    if embedding is not None:
        report["sentence_transformers"] = {**embedding, **({"note": embedding_note} if embedding_note else {})}
    anchor_out = with_state_dict(anchor, owned_apart(cb, model, anchor, aligned), share=True) if folded else anchor
    aligned = in_dtype_of(aligned, stored)
    anchor_out = anchor_stored if anchor_out is anchor else in_dtype_of(anchor_out, anchor_stored)
    return Alignment(aligned, anchor_out, report, elements, instances, bound)


def _distances(keys, ca: dict, cb: dict, aligned: dict, written) -> Distances:
    """Each tensor's squared distance to the anchor before and after alignment; after: the written model's, every
    floating tensor rounded once to ``written`` (the stored dtype), as ``align --stream`` measures it."""
    distances = Distances()
    for k in keys:
        after = {k: aligned[k].to(written) if aligned[k].is_floating_point() else aligned[k]}
        distances.add(k, sq_distance(ca, cb, [k]), sq_distance(after, cb, [k]))
    return distances


@keeps_models
def align(model, anchor, symmetries=DEFAULT_SYMMETRIES, rescale: str = "joint", verify: bool = True, layers=None,
          verify_tol: float | None = None, inputs: dict | None = None, allow_pickle: bool = False, progress=None,
          allow_tokenizer_mismatch: bool = False, **options):
    """``(aligned_model, report)``: :func:`align_pair` with keyword options (``symmetries``: ``recommended`` (the
    default, as ``symmerge align``'s: the groups of :data:`~symmerge.pipeline.options.RECOMMENDED` the model has),
    ``paper`` (attn, ffn, rescale) or a subset of ``heads`` (head permutation), ``attn`` (per-head QK and VO
    rotations; RoPE models: per frequency pair), ``ffn`` (hidden-unit permutation), ``rescale`` (per-head QK/VO
    scales, solved ``joint``ly or ``sequential``ly as in the paper; RoPE pair scales; SwiGLU unit scales),
    ``residual`` (one transform of the residual stream; with folded norms the aligned model is returned folded —
    :func:`align_pair` also returns the anchor in that form). Further keywords: see :class:`AlignOptions`. The report is
    ``symmerge align``'s (:func:`~symmerge.pipeline.align_plan.plan_report`: planned first, ``plan`` among its
    fields), but for ``command_line`` and ``symmerge_version``, which a written folder's report adds."""
    from .align_plan import plan_align, plan_report

    opts = AlignOptions(symmetries=symmetries, rescale=rescale, layers=layers, verify=verify, verify_tol=verify_tol,
                        **options)
    refuse_unread_align_data(opts)
    model, anchor = model_argument(model, "model"), model_argument(anchor, "anchor")
    _check_inputs(inputs)  # every argument checked before the plan reads anything (a pickle checkpoint: loaded)
    _progress(progress)
    flag_arguments(allow_pickle=allow_pickle, allow_tokenizer_mismatch=allow_tokenizer_mismatch)
    dual = opts.dual  # both models move (pipeline/dual.py): no one-sided plan
    plan = None if dual else plan_align(model, anchor, opts, allow_pickle=allow_pickle)
    result = align_pair(model, anchor, opts if dual else plan.options, inputs=inputs, progress=progress,
                        allow_pickle=allow_pickle, allow_tokenizer_mismatch=allow_tokenizer_mismatch, plan=plan)
    return result.model, result.report if dual else plan_report(plan, result.report)
