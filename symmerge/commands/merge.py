"""Align models to an anchor, then merge them with a fusion method; write an HF folder + report.

symmerge merge M1 M2 [...] --method NAME [--align recommended|none|LIST] [--data FILE] [--eval-data FILE] -o OUT_DIR

Every model except the anchor is aligned to it inside its symmetry orbit (default --align recommended:
the groups of heads,attn,ffn,rescale,residual the models have), statistics (RegMean Grams, Fishers)
are gathered on the aligned models from --data, the method merges them; a language model's head (its
rows are the vocabulary) is merged with the rest, a task head is kept from one model (default: the
first; --head-from) unless --heads merge. The merged model is evaluated
on --eval-data (held-out data; without it, on --data, with a warning). OUT_DIR/symmerge_report.json
records the method, alignment, distances, timings and evaluation results. What a checkpoint's config
implies about its tensor names is kept in $SYMMERGE_CACHE/names, else ~/.cache/symmerge/names
(SYMMERGE_NAME_CACHE=0: not kept; docs/cache.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import SymmergeError
from ..io.model import ensure_output_dir
from ..io.prefix import print_notes as print_adapted
from ..io.tokenizers import print_note
from ..merge import get_method
from ..options.build import merge_options
from ..pipeline.options import RECOMMENDED_NAME
from ..pipeline.report import solver_summary
from ..progress import elapsed
from .schema_args import add_options

# the way out named when the command runs out of memory (symmerge.cli: one symmerge: error: line)
def memory_way_out(args) -> str:
    if getattr(args, "mode", None) == "stream":
        return "a smaller --shard-size (the streamed merge holds the largest tensors and the shard being written)"
    return ("merge with --mode stream (memory ~ the largest tensors; per-tensor methods: align first with symmerge "
            "align --stream, then merge the aligned folders with --align none), a smaller --shard-size, "
            "fewer --workers")



def add_arguments(parser) -> None:
    add_options(parser, "merge")  # declared in symmerge.options.declared


options_from = merge_options  # the MergeOptions of the parsed arguments (symmerge.options.build)


def print_plan(models, options) -> int:
    """``--print-plan``: the plan (:func:`~symmerge.merge.plan.plan_merge`) and its steps from the headers
    (:func:`~symmerge.merge.stream.header_steps`), printed as JSON; nothing read beyond headers, nothing written."""
    import json

    from ..merge.plan import base_among_models, plan_merge
    from ..merge.steps import describe_step
    from ..merge.stream import header_steps

    models, options = base_among_models(list(models), options)
    plan = plan_merge(models, options, mode=options.mode)
    options = plan.options  # validated
    steps = header_steps(list(models), options, plan)
    alignment = {"requested": plan.requested, "symmetries": plan.symmetries,
                 **({"note": plan.note} if plan.note else {})}
    print(json.dumps({"method": plan.method.name, "params": plan.params, "weights": plan.weights,
                      "models": plan.names, "base": str(options.base) if options.base is not None else None,
                      "model_type": plan.model_type, "alignment": alignment,
                      "heads": plan.heads, "head_from": options.head_from, "plan": plan.describe(),
                      "steps": None if steps is None else [describe_step(s) for s in steps],
                      **({"note": "the method gathers statistics or reads the architecture: its own loop, "
                                  "no per-tensor steps"} if steps is None else {})}, indent=2, default=str))
    return 0


def resolve_lora_inputs(args) -> None:
    """Models (and ``--base``, an ``--anchor`` given as one of them) written ``BASE+ADAPTER`` become the folders
    of their bases with the adapters merged in (:func:`symmerge.io.lora.resolve_input`)."""
    from ..io.lora import resolve_input

    resolved = {m: resolve_input(m, allow_pickle=args.allow_pickle)
                for m in [*args.models, *([args.base] if args.base else [])]}
    args.models = [resolved[m] for m in args.models]
    if args.base:
        args.base = resolved[args.base]
    if isinstance(args.anchor, str) and args.anchor in resolved:
        args.anchor = resolved[args.anchor]


def run(args) -> int:
    from ..io.lora import merge_cache
    from ..io.provenance import named_as
    from ..merge.api import merge_to_folder
    from ..merge.plan import base_among_models, differences_warning

    out = Path(args.output)
    ensure_output_dir(out, inputs=args.models)  # fail before any expensive work
    get_method(args.method)
    kept, options = base_among_models(args.models, options_from(args))
    options.check(len(kept))  # the options' refusals before any BASE+ADAPTER input is merged
    with merge_cache(args.lora_merge_cache, args.lora_merge_dtype, inputs=[*args.models, args.base], out=out):
        resolve_lora_inputs(args)
        if args.print_plan:
            return print_plan(args.models, options_from(args))
        report = merge_to_folder(args.models, out, options_from(args))
    why = report["plan"]["why"]
    alignment = report["alignment"]
    merged = len(report["models"])  # the base listed among them is not merged (merge.plan.base_among_models)
    print(f"merged {merged} model{'s' if merged != 1 else ''} with {report['method']} "
          f"(alignment: {','.join(alignment['symmetries']) or 'none'}"
          f"{' = recommended' if alignment['requested'] == RECOMMENDED_NAME else ''})")
    if alignment.get("note"):
        print(f"note: {alignment['note']}", file=sys.stderr)
    print_note(report.get("tokenizer"))
    config_from = report["models"][report["head"].get("from_index") or 0]  # the model config.json comes from
    differ = differences_warning(report.get("config_differences") or [], config_from)
    if differ:
        print(f"warning: {differ}", file=sys.stderr)
    for w in report.get("result_warnings") or []:
        print(f"warning: merged tensor {w['tensor']!r}: {w['warning']}", file=sys.stderr)
    print_adapted(report)  # a base-class model read as the fine-tunes' class (symmerge.io.prefix)
    for entry in alignment.get("models") or []:
        if entry.get("solver"):  # a BASE+ADAPTER input named as the user wrote it, not by its merged folder
            print(f"{named_as(entry['model']) or entry['model']}: {solver_summary(entry['solver'])}")
    if alignment.get("joint"):
        j = alignment["joint"]
        print(f"joint alignment: {j['rounds']} round(s) after the star, spread {j['objective'][0]:.6g} -> "
              f"{j['objective'][-1]:.6g}")
        if j.get("learned"):
            lj = j["learned"]
            print(f"learned joint alignment: {lj['steps']} step(s), objective {lj['held_out_start']:.4f} -> "
                  f"{lj['held_out_best']:.4f}")
    evaluation = report.get("evaluation", {})
    if evaluation.get("note"):
        print(f"warning: {evaluation['note']}", file=sys.stderr)
    if evaluation.get("max_examples"):
        print(f"note: {evaluation['max_examples']['note']}", file=sys.stderr)
    distilled = report.get("distillation")
    if distilled:
        kl = distilled["kl_before"]["held_out"], distilled["kl_after"]["held_out"]
        print(f"{distilled['label']}: {distilled['steps']} steps toward the ensemble of the inputs"
              + (f", held-out KL {kl[0]:.4f} -> {kl[1]:.4f}" if kl[0] is not None else ""))
        if distilled.get("warning"):
            print(f"warning: {distilled['warning']}", file=sys.stderr)
            distilled = None  # the written model is the merge itself: its results are not labelled distilled
    for r in evaluation.get("merged", []):
        label = f"[{distilled['label']}] " if distilled else ""
        print(f"  {label}{r['data']}: loss {r['loss']:.4f}, accuracy {r['accuracy']:.4f} (head: {r['head_from']}"
              f"{'' if r.get('as_saved', True) else '; not the saved model'})")
    for r in evaluation.get("merged", []) + evaluation.get("models", []):
        if r.get("undefined"):  # symmerge.evaluate.metrics.evaluate: NaN or +inf logits
            print(f"warning: {r.get('model', 'the merged model')} on {r['data']}: NaN or +inf logits for "
                  f"{r['undefined']} of {r['n']} scored items: loss and accuracy undefined (null in the report)",
                  file=sys.stderr)
    t = report["timings"]
    print(f"{'streamed' if report['mode'] == 'stream' else 'in memory'} ({why}): merge {t['merge']:.2f} s")
    print(f"wrote {out} (alignment {t['align']:.2f} s, statistics {t['statistics']:.2f} s, evaluation "
          f"{t['evaluate']:.2f} s, total {elapsed():.2f} s)")
    return 0
