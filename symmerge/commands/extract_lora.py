"""Extract a PEFT LoRA adapter from a fine-tune: ``symmerge extract-lora FINETUNE BASE -o OUT --rank R``.

The task vector ``FINETUNE − BASE`` of every linear layer (GPT-2's Conv1D too) is cut to rank R by a truncated SVD
(batched over layers of one shape, tensors read a pair at a time); embeddings and norms are saved whole
(``modules_to_save``) or, with ``--embed-lora``, embeddings get a LoRA too — as ``mergekit-extract-lora``, whose
flags are accepted under their names (``--model``, ``--base-model``, ``--out-path``, ``--max-rank`` ...). OUT is a
PEFT adapter folder (``PeftModel.from_pretrained(base, OUT)``) with ``symmerge_report.json``: the relative
reconstruction error of every layer. Either input may be ``BASE+ADAPTER`` (merged first, ``--lora-merge-cache``).
See docs/lora.md."""

from __future__ import annotations

import sys

from ..errors import SymmergeError
from ..options.declared import EXTRACT, EXTRACT_NOOPS, TITLES
from .schema_args import add_part
from .lora_args import add_lora_arguments

# the way out named when the command runs out of memory (symmerge.cli: one symmerge: error: line)
MEMORY_WAY_OUT = "--svd lowrank, fewer --num-threads"


def add_arguments(parser) -> None:
    """extract-lora's flags, declared in :mod:`symmerge.options.declared` (its own, the LoRA inputs' flags, the
    progress flag, mergekit-extract-lora's flags that change nothing in a group of their own)."""
    add_part(parser, EXTRACT)
    add_lora_arguments(parser)
    add_part(parser, "progress")
    add_part(parser.add_argument_group(TITLES[EXTRACT_NOOPS]), EXTRACT_NOOPS)


def _inputs(args) -> tuple[str, str, str]:
    ft = args.finetune or args.model_flag
    base = args.base or args.base_flag
    if args.finetune and args.model_flag and args.finetune != args.model_flag:
        raise SymmergeError(f"two fine-tuned models: {args.finetune} and --model {args.model_flag}: give one")
    if args.base and args.base_flag and args.base != args.base_flag:
        raise SymmergeError(f"two base models: {args.base} and --base-model {args.base_flag}: give one")
    if not ft or not base:
        raise SymmergeError("give the fine-tuned model and its base: symmerge extract-lora FINETUNE BASE -o OUT "
                            "(or --model FINETUNE --base-model BASE)")
    if not args.output:
        raise SymmergeError("give the output folder: -o OUT (or --out-path OUT)")
    if args.allow_crimes:
        raise SymmergeError("--allow-crimes: extract-lora takes a fine-tune and its base, of one architecture")
    if args.unsafe_truncate_embeddings:
        raise SymmergeError("--unsafe-truncate-embeddings: embeddings of another vocabulary are saved whole "
                            "(modules_to_save); nothing is truncated")
    if args.noop_safe_serialization is False:
        raise SymmergeError("--no-safe-serialization: symmerge writes safetensors only")
    return ft, base, args.output


def run(args) -> int:
    import torch

    from ..device import cuda_flag_given, flag_device
    from ..io.lora import merge_cache
    from ..merge.extract_lora import ExtractOptions, extract_lora, summary_rows
    from ..progress import elapsed

    ft, base, out = _inputs(args)
    device = flag_device(args.device, cuda_flag_given(args), default="cpu")  # one rule with run's and moe's
    if args.num_threads is not None:  # at least 1: the flag's declared range
        torch.set_num_threads(args.num_threads)
    options = ExtractOptions(rank=args.rank, distribute_scale=args.distribute_scale, embed_lora=args.embed_lora,
                             save_modules=tuple(args.save_module), exclude_regexes=tuple(args.exclude),
                             include_regexes=tuple(args.include), sv_epsilon=args.sv_epsilon,
                             skip_undecomposable=args.skip_undecomposable, device=device, svd=args.svd,
                             seed=args.random_seed,
                             write_model_card=args.write_model_card)
    with merge_cache(args.lora_merge_cache, args.lora_merge_dtype, inputs=(ft, base), out=out):
        report = extract_lora(ft, base, out, options)
    for note in report["notes"]:
        print(f"note: {note}", file=sys.stderr)
    for warning in report["warnings"]:
        print(f"symmerge: warning: {warning}", file=sys.stderr)
    print(f"{'module':<24} {'count':>5} {'shape':>14} {'rank':>7} {'mean error':>11} {'max error':>10}")
    for name, n, shape, rank, mean, worst in summary_rows(report):
        print(f"{name:<24} {n:>5} {shape:>14} {rank:>7} {mean:>11.4g} {worst:>10.4g}")
    if args.verbose:
        for r in report["modules"]:
            print(f"  {r['module']}: rank {r['rank']}, relative error {r['relative_error']:.4g}")
    saved = report["saved_whole"]
    kinds = list(dict.fromkeys(name.split(".")[-1] for name in saved))  # the names saved, not a misspelt --save-module
    written = sum(r["rank"] > 0 for r in report["modules"])  # a layer --sv-epsilon left without rank is not in it
    print(f"wrote {out}: LoRA of {written} modules (r={report['r']}, relative error mean "
          f"{report['relative_error']['mean']:.4g}, max {report['relative_error']['max']:.4g}), {len(saved)} saved "
          f"whole ({', '.join(kinds) or 'none'}) in {elapsed():.1f} s")
    return 0
