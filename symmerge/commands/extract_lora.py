"""Extract a PEFT LoRA adapter from a fine-tune: ``symmerge extract-lora FINETUNE BASE -o OUT --rank R``.

The task vector ``FINETUNE − BASE`` of every linear layer (GPT-2's Conv1D too) is cut to rank R by a truncated SVD
(batched over layers of one shape, tensors read a pair at a time); embeddings and norms are saved whole
(``modules_to_save``) or, with ``--embed-lora``, embeddings get a LoRA too — as ``mergekit-extract-lora``, whose
flags are accepted under their names (``--model``, ``--base-model``, ``--out-path``, ``--max-rank`` ...). OUT is a
PEFT adapter folder (``PeftModel.from_pretrained(base, OUT)``) with ``symmerge_report.json``: the relative
reconstruction error of every layer. Either input may be ``BASE+ADAPTER`` (merged first, ``--lora-merge-cache``).
See docs/lora.md."""

from __future__ import annotations

import argparse
import sys

from ..errors import SymmergeError
from .schema_args import add_part
from .lora_args import add_lora_arguments

# mergekit-extract-lora's flags that change nothing here, and why (accepted so that its scripts run)
NO_OPS = {
    "--transformers-cache": ("models are read from local folders only", "DIR"),
    "--trust-remote-code": ("models are built from transformers' own classes", None),
    "--lazy-unpickle": ("tensors are always read lazily (safetensors)", None),
    "--low-cpu-memory": ("tensors are read a pair at a time", None),
    "--read-to-gpu": ("tensors go to --device for their SVD", None),
    "--multi-gpu": ("one device", None),
    "--gpu-rich": ("use --device cuda", None),
    "--async-write": ("the adapter is one file, written at the end", None),
    "--write-threads": ("the adapter is one file, written at the end", "N"),
    "--out-shard-size": ("a PEFT adapter is one file", "SIZE"),
    "--copy-tokenizer": ("an adapter holds no tokenizer", None),
    "--clone-tensors": ("tensors are never shared", None),
    "--safe-serialization": ("always safetensors", None),
    "--quiet": ("use --progress none", None),
}


def add_arguments(parser) -> None:
    parser.add_argument("finetune", nargs="?", default=None, help="the fine-tuned model (HF folder, or BASE+ADAPTER)")
    parser.add_argument("base", nargs="?", default=None, help="its base model (HF folder)")
    parser.add_argument("-o", "--output", "--out-path", dest="output", default=None,
                        help="output folder: the PEFT adapter (must not exist or be empty)")
    parser.add_argument("--rank", "--max-rank", dest="rank", type=int, default=128, metavar="R",
                        help="largest rank of a layer's LoRA (default 128, as mergekit)")
    parser.add_argument("--model", dest="model_flag", default=None, help="the fine-tuned model (as FINETUNE)")
    parser.add_argument("--base-model", dest="base_flag", default=None, help="the base model (as BASE)")
    parser.add_argument("--distribute-scale", action=argparse.BooleanOptionalAction, default=True,
                        help="split the singular values evenly between A and B (√S each; default) or put them in A")
    parser.add_argument("--embed-lora", action=argparse.BooleanOptionalAction, default=False,
                        help="a LoRA for the embeddings too (default: saved whole, in modules_to_save)")
    parser.add_argument("--save-module", action="append", default=[], metavar="NAME",
                        help="save this module whole (its last name, e.g. lm_head; repeatable)")
    parser.add_argument("-e", "--exclude-regex", "--exclude-regexes", dest="exclude", action="append", default=[],
                        metavar="REGEX", help="leave out modules whose name matches (repeatable)")
    parser.add_argument("-i", "--include-regex", "--include-regexes", dest="include", action="append", default=[],
                        metavar="REGEX", help="only modules whose name matches (repeatable)")
    parser.add_argument("--sv-epsilon", type=float, default=0.0, metavar="EPS",
                        help="drop singular values at or below EPS (a layer's rank may fall below R)")
    parser.add_argument("--skip-undecomposable", action="store_true",
                        help="leave out modules that are neither linear layers nor embeddings (norms) instead of "
                             "saving them whole")
    parser.add_argument("--svd", choices=["full", "lowrank"], default="full",
                        help="full: each layer's exact SVD (torch.linalg.svd; mergekit's result, default); lowrank: "
                             "randomized (R + 10 directions, 4 subspace iterations), much faster when R is small "
                             "against the layers' sizes, its error in the report")
    parser.add_argument("--random-seed", type=int, default=0, metavar="N", help="seed of --svd lowrank")
    parser.add_argument("--device", default=None, help="where the SVDs run: cpu (default), cuda, cuda:N")
    parser.add_argument("--cuda", action=argparse.BooleanOptionalAction, default=False, help="--device cuda")
    parser.add_argument("-j", "--num-threads", type=int, default=None, metavar="N", help="torch's CPU threads")
    parser.add_argument("--write-model-card", action=argparse.BooleanOptionalAction, default=True,
                        help="write a README.md model card (default)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="print every layer's error")
    parser.add_argument("--allow-crimes", action=argparse.BooleanOptionalAction, default=False,
                        help=argparse.SUPPRESS)
    parser.add_argument("--unsafe-truncate-embeddings", action=argparse.BooleanOptionalAction, default=False,
                        help=argparse.SUPPRESS)
    add_lora_arguments(parser)
    add_part(parser, "progress")
    noop = parser.add_argument_group("mergekit-extract-lora's flags accepted with no effect")
    for flag, (why, metavar) in NO_OPS.items():
        if metavar:
            noop.add_argument(flag, dest=f"noop_{flag[2:].replace('-', '_')}", default=None, metavar=metavar,
                              help=f"accepted: {why}")
        else:
            noop.add_argument(flag, dest=f"noop_{flag[2:].replace('-', '_')}", action=argparse.BooleanOptionalAction,
                              default=None, help=f"accepted: {why}")


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

    from ..io.lora import merge_cache
    from ..merge.extract_lora import ExtractOptions, extract_lora, summary_rows
    from ..progress import elapsed

    ft, base, out = _inputs(args)
    device = args.device or ("cuda" if args.cuda else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise SymmergeError(f"--device {device}: no CUDA device here")
    if args.num_threads is not None:
        if args.num_threads <= 0:
            raise SymmergeError(f"--num-threads must be positive, got {args.num_threads}")
        torch.set_num_threads(args.num_threads)
    options = ExtractOptions(rank=args.rank, distribute_scale=args.distribute_scale, embed_lora=args.embed_lora,
                             save_modules=tuple(args.save_module), exclude_regexes=tuple(args.exclude),
                             include_regexes=tuple(args.include), sv_epsilon=args.sv_epsilon,
                             skip_undecomposable=args.skip_undecomposable, device=device, svd=args.svd,
                             seed=args.random_seed,
                             write_model_card=args.write_model_card)
    with merge_cache(args.lora_merge_cache, args.lora_merge_dtype):
        report = extract_lora(ft, base, out, options)
    for note in report["notes"]:
        print(f"note: {note}", file=sys.stderr)
    print(f"{'module':<24} {'count':>5} {'shape':>14} {'rank':>7} {'mean error':>11} {'max error':>10}")
    for name, n, shape, rank, mean, worst in summary_rows(report):
        print(f"{name:<24} {n:>5} {shape:>14} {rank:>7} {mean:>11.4g} {worst:>10.4g}")
    if args.verbose:
        for r in report["modules"]:
            print(f"  {r['module']}: rank {r['rank']}, relative error {r['relative_error']:.4g}")
    saved = report["saved_whole"]
    print(f"wrote {out}: LoRA of {len(report['modules'])} modules (r={report['r']}, relative error mean "
          f"{report['relative_error']['mean']:.4g}, max {report['relative_error']['max']:.4g}), {len(saved)} saved "
          f"whole ({', '.join(report['modules_to_save'] or []) or 'none'}) in {elapsed():.1f} s")
    return 0
