"""The library entry that writes an alignment: ``symmerge.align_to_folder(model, anchor, out, options)``
aligns ``model`` to ``anchor`` in memory (:func:`~symmerge.pipeline.align.align_pair`) or streamed
(:func:`~symmerge.pipeline.stream.align_streaming`, ``stream=True``) and writes the folder ``out`` atomically,
exactly as ``symmerge align`` does (the command parses its flags, calls this, and prints). What a streamed
alignment cannot do is refused here, before anything is read."""

from __future__ import annotations

from pathlib import Path

from ..errors import SymmergeError
from ..io.arguments import flag_arguments, keeps_models, model_argument, output_argument
from ..io.model import check_room, ensure_output_dir, save_model
from ..io.output import writes_output
from ..progress import stage, stage_printer
from .align_plan import plan_align, plan_report
from .options import AlignOptions


def stream_refusal(options: AlignOptions, allow_pickle: bool = False) -> str | None:
    """Why ``align --stream`` cannot run with ``options`` (None: it can)."""
    if allow_pickle:
        return "--stream reads safetensors only; convert pickle checkpoints first"
    if not options.verify:
        return "--stream always checks its group elements; --no-verify does not apply"
    if options.align_data is not None and options.matcher.streams:
        return "--stream matches weights only (data-free); --align-data needs the models in memory: leave out --stream"
    return options.streamed_refusal("--stream")


def _inputs(model, anchor, options: AlignOptions, stream: bool, pipeline: bool, allow_pickle: bool):
    """(model, anchor) as folders (a single .safetensors file: its folder view, with the config beside it or the
    other input's), after the refusals of a streamed alignment; then its :class:`AlignPlan`."""
    from ..io.single import as_folder, is_single_file

    if stream:
        refusal = stream_refusal(options, allow_pickle)
        if options.matcher.learns:  # learned from the files (learn_layerwise_write.py): its own refusals
            from .learn_layerwise_write import learned_stream_refusal

            refusal = learned_stream_refusal(options, (model, anchor), allow_pickle=allow_pickle, pipeline=pipeline)
        if refusal:
            raise SymmergeError(refusal)
        if options.workers is not None and not pipeline:
            raise SymmergeError("--workers with --stream needs --pipeline (the low-memory mode solves one part of "
                                "one layer at a time, to bound memory)")
    if is_single_file(anchor):
        anchor = as_folder(anchor, model if isinstance(model, (str, Path)) and not is_single_file(model) else None)
    if is_single_file(model):
        model = as_folder(model, anchor if isinstance(anchor, (str, Path)) else None)
    return model, anchor


@writes_output
@keeps_models
def align_to_folder(model, anchor, out, options: AlignOptions | None = None, *, stream: bool = False,
                    progress: bool = True, allow_pickle: bool = False, allow_tokenizer_mismatch: bool = False,
                    shard_size=None, pipeline: bool = False, verify_forward: bool = False) -> dict:
    """Align ``model`` (an HF folder, or a transformers model in memory) to ``anchor`` with ``options`` and
    write the result to the folder ``out`` (must not exist or be empty; written atomically, with the model's
    side files, a model card and ``symmerge_report.json``). ``stream``: layer by layer from the safetensors
    files (``shard_size``, ``pipeline``, ``verify_forward`` apply there only). The alignment is planned first
    from the headers (:func:`~symmerge.pipeline.align_plan.plan_align`: 'recommended' resolved once, the group
    instances bound, the steps); the wing solves the plan's instances and runs its steps
    (:mod:`~symmerge.pipeline.align_steps`), and the report is built from the plan. Returns the report."""
    model, anchor, out = model_argument(model, "model"), model_argument(anchor, "anchor"), output_argument(out)
    flag_arguments(stream=stream, pipeline=pipeline, verify_forward=verify_forward, progress=progress,
                   allow_pickle=allow_pickle, allow_tokenizer_mismatch=allow_tokenizer_mismatch)
    options = AlignOptions.of(options)
    for flag, given in (("--pipeline", pipeline), ("--verify-forward", verify_forward),
                        ("--shard-size", shard_size is not None)):
        if given and not stream:
            raise SymmergeError(f"{flag} applies to --stream only")
    if stream and options.matcher.learns:  # learned from the files, layer by layer (scale: learn_layerwise_write.py)
        from .learn_layerwise_write import align_learned_streaming, learned_stream_refusal

        refusal = learned_stream_refusal(options, (model, anchor), allow_pickle=allow_pickle, pipeline=pipeline,
                                         verify_forward=verify_forward)
        if refusal:
            raise SymmergeError(refusal)
        return align_learned_streaming(model, anchor, out, options, shard_size=shard_size or "1GB", progress=progress,
                                       allow_tokenizer_mismatch=allow_tokenizer_mismatch)
    if options.dual:  # the anchor moves too (pipeline/dual.py): one written model would be half of it
        raise SymmergeError("--learn-frame dual moves the anchor too, and align writes one model: use symmerge merge "
                            "or symmerge barrier, which use both moved models")
    out = Path(out)
    ensure_output_dir(out, inputs=(model, anchor))  # fail before any expensive work
    model, anchor = _inputs(model, anchor, options, stream, pipeline, allow_pickle)
    check_room(out, [model])
    plan = plan_align(model, anchor, options, stream=stream, pipeline=pipeline, allow_pickle=allow_pickle,
                      verify_forward=verify_forward)
    if stream:
        from .stream import DEFAULT_SHARD, align_streaming

        # the wing solves the plan's instances and runs its steps (pipeline/align_steps.py); the report is the plan's
        return align_streaming(model, anchor, out, options, shard_size=shard_size or DEFAULT_SHARD,
                               progress=progress, pipeline=pipeline,
                               allow_tokenizer_mismatch=allow_tokenizer_mismatch, plan=plan)
    from .align import align_pair

    result = align_pair(model, anchor, plan.options, progress=stage_printer() if progress else None,
                        allow_pickle=allow_pickle, allow_tokenizer_mismatch=allow_tokenizer_mismatch, plan=plan)
    report = plan_report(plan, result.report)
    with stage(f"wrote {out}", enabled=progress):
        save_model(result.model, out, src=model if isinstance(model, (str, Path)) else None, report=report)
    return report


def print_plan(model, anchor, options: AlignOptions | None = None, *, stream: bool = False, pipeline: bool = False,
               allow_pickle: bool = False, verify_forward: bool = False) -> dict:
    """``symmerge align --print-plan``: the plan (:func:`~symmerge.pipeline.align_plan.plan_align`) and its
    steps, from the headers; nothing is written. What the alignment would refuse is refused here too."""
    options = AlignOptions.of(options)
    if verify_forward and not stream:
        raise SymmergeError("--verify-forward applies to --stream only")
    if verify_forward and options.matcher.learns:
        from .learn_layerwise_write import learned_stream_refusal

        raise SymmergeError(learned_stream_refusal(options, verify_forward=True))
    model, anchor = _inputs(model, anchor, options, stream, pipeline, allow_pickle)
    return plan_align(model, anchor, options, stream=stream, pipeline=pipeline, allow_pickle=allow_pickle,
                      verify_forward=verify_forward).printed()
