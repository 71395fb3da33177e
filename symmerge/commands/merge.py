"""Align models to an anchor, then merge them with a fusion method; write an HF folder + report.

symmerge merge M1 M2 [...] --method NAME [--align recommended|none|LIST] [--data FILE] [--eval-data FILE] -o OUT_DIR

Every model except the anchor is aligned to it inside its symmetry orbit (default --align recommended:
the groups of heads,attn,ffn,rescale,residual the models have), statistics (RegMean Grams, Fishers)
are gathered on the aligned models from --data, the method merges them; a language model's head (its
rows are the vocabulary) is merged with the rest, a task head is kept from one model (default: the
first; --head-from) unless --heads merge. The merged model is evaluated
on --eval-data (held-out data; without it, on --data, with a warning). OUT_DIR/symmerge_report.json
records the method, alignment, distances, timings and evaluation results.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import SymmergeError
from ..io.model import ensure_output_dir
from ..io.prefix import print_notes as print_adapted
from ..io.tokenizers import print_note
from ..merge import METHODS, get_method
from ..pipeline.options import DEFAULT_REFINE, JOINT_REFINE, RECOMMENDED, RECOMMENDED_NAME, describe_symmetries
from ..pipeline.report import solver_summary
from ..progress import add_argument as add_progress_argument
from ..progress import elapsed
from .alignment_args import add_alignment_arguments, alignment_options
from .safety_args import add_trust_remote_code
from .lora_args import add_lora_arguments


def add_arguments(parser) -> None:
    parser.add_argument("models", nargs="+", help="HF model folders to merge (two or more)")
    parser.add_argument("-o", "--output", required=True, help="output folder (must not exist or be empty)")
    parser.add_argument("--method", required=True, help=f"fusion method: {', '.join(sorted(METHODS))}")
    parser.add_argument("--align", default=RECOMMENDED_NAME,
                        help="symmetries to align before merging: " + describe_symmetries(
                            f"{RECOMMENDED_NAME} (= {','.join(RECOMMENDED)} where the model has them; residual is "
                            "also left out when the task heads differ)"))
    parser.add_argument("--anchor", default=None,
                        help="anchor: index of a model (0-based) or a folder (default: base model for task-vector "
                             "methods; the second of two models; else the model closest to the average). With more "
                             "than two models and no anchor, every model is aligned jointly into one frame (each to "
                             "the mean of the others, from the star on the model closest to the average; with --match "
                             "learned, then random convex combinations of the models learned against the same "
                             "combinations of their predictions); an anchor keeps the star: every model aligned to it")
    parser.add_argument("--star", action="store_true",
                        help="with more than two models: align every model to one anchor (the default rule's, or "
                             "--anchor) instead of jointly into one frame")
    parser.add_argument("--joint-rounds", type=int, default=10, metavar="N",
                        help="joint alignment (more than two models, no --anchor): at most N rounds of 'each model "
                             "to the mean of the others' after the star (default 10; it stops when a round lowers the "
                             "spread by less than 1e-3 data-free, where a round is one sweep per model, 1e-4 with "
                             "activations)")
    parser.add_argument("--joint-refine", choices=JOINT_REFINE, default=DEFAULT_REFINE,
                        help="what the joint alignment's rounds re-solve: 'all' the groups (MergeMany; for the "
                             "continuous groups generalized Procrustes) or 'discrete' only the head and unit "
                             f"permutations, keeping the star's rotations and scales (default {DEFAULT_REFINE})")
    parser.add_argument("--base", default=None, help="base (pre-trained) model folder for task_arithmetic, ties, dare")
    parser.add_argument("--data", action="append", default=None, metavar="FILE",
                        help="data (.npz, .jsonl, .txt) for the statistics of fisher and regmean (training data); "
                             "give it once for all models or once per model (in model order)")
    parser.add_argument("--eval-data", action="append", default=None, metavar="FILE",
                        help="held-out data (.npz, .jsonl, .txt) the merged model and the inputs are scored on; once "
                             "for all models or once per model (file i scored with model i's head). Without it the "
                             "evaluation uses --data, and the report and stderr say so")
    parser.add_argument("--weights", default=None, help="comma-separated model weights, e.g. 0.7,0.3")
    parser.add_argument("--param", action="append", default=[], metavar="KEY=VALUE",
                        help="method parameter, e.g. alpha=0.9 (regmean), scale=0.5, density=0.2, drop=0.9, seed=1")
    parser.add_argument("--heads", choices=["auto", "keep", "merge"], default="auto",
                        help="heads outside the base model: auto (default: a language model's head, whose rows are "
                             "the vocabulary, is merged like the embeddings; a task head is kept), keep one model's "
                             "(--head-from), or merge them (same label space only)")
    parser.add_argument("--head-from", type=int, default=0, help="index of the model whose head is kept (default 0)")
    parser.add_argument("--fisher", choices=["empirical", "sampled"], default="empirical",
                        help="Fisher variant: true labels (empirical) or labels sampled from the model")
    parser.add_argument("--fisher-samples", type=int, default=1, help="label samples per example (sampled Fisher)")
    parser.add_argument("--fisher-normalize", action="store_true", help="scale each model's Fisher to mean 1")
    parser.add_argument("--gram-sum", action="store_true",
                        help="RegMean with summed Grams (weights models by data size) instead of per-token means")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-examples", type=int, default=None, help="use at most this many examples per file")
    parser.add_argument("--max-length", type=int, default=None, help="truncate texts to this many tokens")
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:N or auto")
    parser.add_argument("--no-verify", action="store_true", help="skip the equivalence check of each alignment")
    parser.add_argument("--allow-pickle", action="store_true", help="accept pytorch_model.bin checkpoints")
    add_trust_remote_code(parser)
    parser.add_argument("--mode", choices=["auto", "stream", "memory"], default="auto",
                        help="stream: merge tensor by tensor from the safetensors files (memory ~ the largest "
                             "tensors, any model size; per-tensor methods without alignment); memory: load the "
                             "models; auto (default): stream whatever can stream, else load")
    parser.add_argument("--shard-size", default="2GB", help="streamed output: largest shard (default 2GB)")
    parser.add_argument("--print-plan", action="store_true",
                        help="print the resolved plan and its steps (one per output tensor: copy, or merge with "
                             "which inputs and parameters) as JSON, then exit without reading weights or writing")
    add_lora_arguments(parser)  # a model given as BASE+ADAPTER: a LoRA adapter merged into its base first
    add_alignment_arguments(parser)
    parser.add_argument("--distill", default="0", metavar="STEPS",
                        help="after the merge (and --repair), STEPS optimiser steps of KL distillation of the merged "
                             "model toward the ensemble of the aligned inputs (the average of their probabilities) on "
                             "the unlabeled --align-data; every parameter moves, so the result is no longer "
                             "function-preserving alignment and the report labels it 'distilled (not "
                             "function-preserving)' (default 0: none)")
    parser.add_argument("--distill-lr", default="1e-4", metavar="LR",
                        help="the distillation's learning rate (Adam, cosine decay to 0; default 1e-4)")
    add_progress_argument(parser)


def parse_value(text: str):
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_params(items) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SymmergeError(f"--param expects KEY=VALUE, got {item!r}")
        out[key.strip()] = parse_value(value)
    return out


def parse_weights(text):
    if text is None:
        return None
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise SymmergeError(f"--weights expects comma-separated numbers, got {text!r}") from None


def parse_anchor(text):
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return text


def options_from(args):
    """The :class:`~symmerge.merge.fuse.MergeOptions` the Python API takes, from the parsed arguments."""
    from ..merge.fuse import MergeOptions
    from ..merge.repair import parse_channels
    from ..merge.param_values import check_param_values
    from ..pipeline.distill import parse_flags

    distill, distill_lr = parse_flags(args.distill, args.distill_lr)
    return MergeOptions(
        method=args.method, align=alignment_options(args, args.align, verify=not args.no_verify), repair=args.repair,
        repair_channels=parse_channels(args.repair_channels), repair_samples=args.repair_samples,
        anchor=parse_anchor(args.anchor), data=list(args.data or []), eval_data=list(args.eval_data or []),
        weights=parse_weights(args.weights),
        params=check_param_values(args.method, parse_params(args.param)), base=args.base, heads=args.heads, head_from=args.head_from,
        device=args.device, fisher_variant=args.fisher, fisher_normalize=args.fisher_normalize,
        fisher_samples=args.fisher_samples, gram_normalize=not args.gram_sum, batch_size=args.batch_size,
        max_examples=args.max_examples, max_length=args.max_length, allow_pickle=args.allow_pickle,
        allow_tokenizer_mismatch=args.allow_tokenizer_mismatch, joint=False if args.star else None,
        joint_rounds=args.joint_rounds, joint_refine=args.joint_refine, mode=args.mode, shard_size=args.shard_size,
        distill=distill, distill_lr=distill_lr)


def print_plan(models, options) -> int:
    """``--print-plan``: the plan (:func:`~symmerge.merge.plan.plan_merge`) and its steps from the headers
    (:func:`~symmerge.merge.stream.header_steps`), printed as JSON; nothing read beyond headers, nothing written."""
    import json

    from ..merge.plan import plan_merge
    from ..merge.steps import describe_step
    from ..merge.stream import header_steps

    plan = plan_merge(list(models), options, mode=options.mode)
    steps = header_steps(list(models), options, plan)
    print(json.dumps({"method": plan.method.name, "params": plan.params, "weights": plan.weights,
                      "models": plan.names, "base": str(options.base) if options.base is not None else None,
                      "model_type": plan.model_type, "alignment": {"requested": plan.requested,
                                                                   "symmetries": list(plan.align.symmetries or [])},
                      "heads": plan.heads, "head_from": options.head_from, "plan": plan.describe(),
                      "steps": None if steps is None else [describe_step(s) for s in steps],
                      **({"note": "the method gathers statistics or reads the architecture: its own loop, "
                                  "no per-tensor steps"} if steps is None else {})}, indent=2, default=str))
    return 0


def resolve_lora_inputs(args) -> None:
    """Models (and ``--base``, an ``--anchor`` given as one of them) written ``BASE+ADAPTER`` become the folders
    of their bases with the adapters merged in (:func:`symmerge.io.lora.resolve_input`)."""
    from ..io.lora import resolve_input

    resolved = {m: resolve_input(m) for m in [*args.models, *([args.base] if args.base else [])]}
    args.models = [resolved[m] for m in args.models]
    if args.base:
        args.base = resolved[args.base]
    if isinstance(args.anchor, str) and args.anchor in resolved:
        args.anchor = resolved[args.anchor]


def run(args) -> int:
    from ..io.lora import merge_cache
    from ..merge.api import merge_to_folder

    out = Path(args.output)
    ensure_output_dir(out)  # fail before any expensive work
    get_method(args.method)
    with merge_cache(args.lora_merge_cache, args.lora_merge_dtype):
        resolve_lora_inputs(args)
        if args.print_plan:
            return print_plan(args.models, options_from(args))
        report = merge_to_folder(args.models, out, options_from(args))
    why = report["plan"]["why"]
    alignment = report["alignment"]
    print(f"merged {len(args.models)} models with {report['method']} "
          f"(alignment: {','.join(alignment['symmetries']) or 'none'}"
          f"{' = recommended' if alignment['requested'] == RECOMMENDED_NAME else ''})")
    if alignment.get("note"):
        print(f"note: {alignment['note']}", file=sys.stderr)
    print_note(report.get("tokenizer"))
    for w in report.get("result_warnings") or []:
        print(f"warning: merged tensor {w['tensor']!r}: {w['warning']}", file=sys.stderr)
    print_adapted(report)  # a base-class model read as the fine-tunes' class (symmerge.io.prefix)
    for entry in alignment.get("models") or []:
        if entry.get("solver"):
            print(f"{entry['model']}: {solver_summary(entry['solver'])}")
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
    for r in evaluation.get("merged", []):
        print(f"  {'[' + distilled['label'] + '] ' if distilled else ''}{r['data']}: loss {r['loss']:.4f}, accuracy {r['accuracy']:.4f} (head: {r['head_from']}"
              f"{'' if r.get('as_saved', True) else '; not the saved model'})")
    t = report["timings"]
    print(f"{'streamed' if report['mode'] == 'stream' else 'in memory'} ({why}): merge {t['merge']:.2f} s")
    print(f"wrote {out} (alignment {t['align']:.2f} s, statistics {t['statistics']:.2f} s, evaluation "
          f"{t['evaluate']:.2f} s, total {elapsed():.2f} s)")
    return 0
