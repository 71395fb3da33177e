"""Run a merge config: ``symmerge run CONFIG.yml OUT`` (as ``mergekit-yaml CONFIG OUT``).

A config with mergekit's keys only (``models``/``slices``, ``merge_method``, ``base_model``, ``parameters``
with gradients and filters, ``dtype``, ``out_dtype``, ``tokenizer_source`` / ``tokenizer`` (``union``, ``base``
or a model, with ``tokens`` and ``pad_to_multiple_of``: every model's embedding rows mapped to that vocabulary),
``chat_template``, several documents with ``name``) merges exactly as mergekit does, without alignment. With ``align:`` (and the merge
command's alignment options: ``anchor``, ``match``, ``rescale``, ...) or ``--align``, its models are aligned
into one frame first and the same config runs on the aligned models (:mod:`symmerge.config.aligned`). A config
with other keys of symmerge's (``eval_data``, ``data``, ``command: align`` ...) runs the ``symmerge merge``
(``align``, ``barrier``) command it stands for. Parsing and every check: :mod:`symmerge.config`; a bad
config is one error naming the key and its line, before anything is read or written."""

from __future__ import annotations

import shlex
import sys

from ..errors import SymmergeError
from .lora_args import add_lora_arguments


def add_arguments(parser) -> None:
    parser.add_argument("config", help="YAML file: a mergekit config (models or slices, merge_method, parameters, "
                                       "base_model, dtype, tokenizer_source: union, ...; several documents for "
                                       "mergekit-multi; with align: and the merge command's alignment options, "
                                       "aligned first), or one with "
                                       "symmerge's options by their long names (see docs/merge.md, Merge configs)")
    parser.add_argument("out", nargs="?", default=None, help="output folder (as mergekit-yaml CONFIG OUT)")
    parser.add_argument("-o", "--output", default=None, help="output folder (the same as OUT)")
    parser.add_argument("--align", default=None, metavar="recommended|LIST",
                        help="align every model into one frame first, then run the config on the aligned models "
                             "(gradients, filters, slices and all; the frame as symmerge merge chooses it: the base "
                             "model's, else the second of two, else joint); a mergekit config is merged without "
                             "alignment unless asked (here or with 'align:' in the config)")
    parser.add_argument("--print-command", action="store_true",
                        help="print what the config runs (the symmerge command line, or the merge plan) and exit")
    parser.add_argument("--progress", choices=["auto", "bar", "lines", "none"], default="auto",
                        help="progress on stderr, unless the config sets its own 'progress'")
    mk = parser.add_argument_group("mergekit-yaml's flags")
    mk.add_argument("--copy-tokenizer", action="store_true", help="accepted: the tokenizer is always copied")
    mk.add_argument("--no-copy-tokenizer", action="store_true", help=argparse_suppress())
    mk.add_argument("--out-shard-size", default=None, metavar="SIZE",
                    help="largest output shard, as mergekit: 5B (bytes, K/M/B suffixes) or 2GB")
    mk.add_argument("--cuda", action="store_true", help=argparse_suppress())
    mk.add_argument("--lazy-unpickle", action="store_true",
                    help="accepted: tensors are always read lazily (safetensors)")
    mk.add_argument("--allow-crimes", action="store_true", help=argparse_suppress())
    mk.add_argument("--random-seed", type=int, default=None, metavar="N",
                    help="seed of the randomised methods (DARE): their 'seed' parameter")
    add_lora_arguments(mk)  # BASE+ADAPTER inputs


def argparse_suppress():
    import argparse

    return argparse.SUPPRESS


def shard_size(text):
    """mergekit's ``--out-shard-size`` (``5B``: 5e9 bytes; K, M, B suffixes) or symmerge's (``2GB``)."""
    if text is None:
        return "5GB"
    t = str(text).strip().upper()
    for suffix, mult in (("K", 10 ** 3), ("M", 10 ** 6), ("B", 10 ** 9)):
        if t.endswith(suffix) and t[:-1].replace(".", "", 1).isdigit():
            return str(int(float(t[:-1]) * mult))
    return text


def _refusals(args) -> None:
    if args.no_copy_tokenizer:
        raise SymmergeError("--no-copy-tokenizer: symmerge always writes the tokenizer with the model; delete its "
                            "files from the output if you do not want them")
    if args.cuda:
        raise SymmergeError("--cuda: a mergekit config's merge streams tensor by tensor on the CPU (reading and writing "
                            "bound); drop --cuda")
    if args.allow_crimes:
        raise SymmergeError("--allow-crimes: symmerge merges models of one architecture only (same tensor names and "
                            "shapes); use 'slices' to take layers from models of one architecture")
    if args.out and args.output and args.out != args.output:
        raise SymmergeError(f"two output folders: {args.out} and -o {args.output}: give one")


def run(args) -> int:
    from ..io.lora import merge_cache

    _refusals(args)
    with merge_cache(args.lora_merge_cache, args.lora_merge_dtype):  # BASE+ADAPTER inputs merged there
        return _run(args)


def _run(args) -> int:
    from ..config import describe
    from ..config.command import command_parser
    from ..progress import configure

    desc = describe(args.config, output=args.out or args.output, align=args.align, seed=args.random_seed)
    if not desc.mergekit:
        if args.print_command:
            print(shlex.join(["symmerge", desc.command, *desc.argv]))
            return 0
        parsed = command_parser(desc.command).parse_args(desc.argv)
        if "--progress" not in desc.argv:
            parsed.progress = args.progress
        configure(parsed.progress)
        print(f"running: {shlex.join(['symmerge', desc.command, *desc.argv])}", file=sys.stderr)
        return parsed.handler(parsed) or 0
    from ..config.run import print_summary, run_jobs

    if args.print_command:
        if desc.alignment is not None:
            from ..config.aligned import describe_line

            print(describe_line(desc.alignment))
        for job in desc.jobs:
            where = desc.output if job.final else f"<intermediate {job.name}>"
            print(f"merge {job.name or ''} {job.method}: {len(job.steps)} tensors, {job.layers} layers -> {where}"
                  .replace("  ", " "))
        return 0
    configure(args.progress)
    summaries = run_jobs(desc, shard_size=shard_size(args.out_shard_size))
    print_summary(desc, summaries)
    return 0
