"""Run a merge config: ``symmerge run CONFIG.yml OUT`` (as ``mergekit-yaml CONFIG OUT``).

A config with mergekit's keys only (``models``/``slices``, ``merge_method``, ``base_model``, ``parameters``
with gradients and filters, ``dtype``, ``out_dtype``, ``tokenizer_source`` / ``tokenizer`` (``union``, ``base``
or a model, with ``tokens`` and ``pad_to_multiple_of``: every model's embedding rows mapped to that vocabulary),
``chat_template``, several documents with ``name``) merges exactly as mergekit does, without alignment. With
``align:`` (and the merge command's alignment options: ``anchor``, ``match``, ``rescale``, ...) or ``--align``, its
models are aligned into one frame first and the same config runs on the aligned models
(:mod:`symmerge.config.aligned`). A config with other keys of symmerge's (``eval_data``, ``data``, ``command:
align`` ...) runs the ``symmerge merge`` (``align``, ``barrier``) command it stands for. Parsing and every check:
:mod:`symmerge.config`; a bad config is one error naming the key and its line, before anything is read or written."""

from __future__ import annotations

import shlex
import sys

from ..errors import SymmergeError
from ..options.declared import MERGEKIT, TITLES
from ..options.parse import mergekit_size
from .lora_args import add_lora_arguments
from .schema_args import add_options

# the way out named when the command runs out of memory (symmerge.cli: one symmerge: error: line)
MEMORY_WAY_OUT = "a smaller --out-shard-size, fewer --num-threads"
WARNINGS_SHOWN = 50  # config warnings printed one per line; the rest counted (the report holds them all)


def add_arguments(parser) -> None:
    add_options(parser, "run", skip=(MERGEKIT, "lora"))  # declared in symmerge.options.declared
    add_mergekit_yaml_arguments(parser)


def add_mergekit_yaml_arguments(parser) -> None:
    """Every flag of ``mergekit-yaml`` 0.1.5, with its effect here or as a documented no-op (docs/configs.md,
    "mergekit-yaml's flags")."""
    mk = parser.add_argument_group(TITLES[MERGEKIT])
    add_options(mk, "run", part=MERGEKIT)
    add_lora_arguments(mk)  # BASE+ADAPTER inputs (commands/lora_args.py)


def _refusals(args) -> None:
    if args.out and args.output and args.out != args.output:
        raise SymmergeError(f"two output folders: {args.out} and -o {args.output}: give one")


def merge_device(args) -> str | None:
    """Where the merge arithmetic runs: ``--device``, or with ``--cuda`` / ``--gpu-rich`` the GPU when there is
    one (else a warning and the CPU); None: the CPU (:func:`symmerge.device.flag_device`)."""
    from ..device import cuda_flag_given, flag_device

    return flag_device(args.device, cuda_flag_given(args))


def progress_of(args) -> str:
    """--progress, unless mergekit's --quiet (none) or -v (lines) says otherwise."""
    if args.quiet:
        return "none"
    if args.verbose and args.progress == "auto":
        return "lines"
    return args.progress


def run_options(args):
    from ..config.run import RunOptions

    if not args.safe_serialization:
        print("symmerge: warning: --no-safe-serialization: symmerge writes safetensors only", file=sys.stderr)
    if args.num_threads is not None:
        import torch

        torch.set_num_threads(args.num_threads)
    return RunOptions(shard_size=mergekit_size(args.out_shard_size), progress=progress_of(args) != "none",
                      card=args.write_model_card, copy_tokenizer=args.copy_tokenizer, device=merge_device(args))


def run(args) -> int:
    from ..io.lora import merge_cache

    _refusals(args)
    with merge_cache(args.lora_merge_cache, args.lora_merge_dtype):  # BASE+ADAPTER inputs merged there
        return _run(args)


def _run(args) -> int:
    from ..config import describe
    from ..io.card import cards_off
    from ..io.hf import allow_remote_code
    from ..progress import configure
    from .config_options import namespace

    given = dict(output=args.out or args.output, align=args.align, seed=args.random_seed,
                 truncate_embeddings=args.unsafe_truncate_embeddings,
                 needs_output=not (args.print_plan or args.print_command))
    desc = describe(args.config, **given, merge_adapters=False)  # BASE+ADAPTER inputs planned on their bases
    if desc.mergekit:  # a cache in an input or in the output refused, adapters or not (as merge and extract-lora)
        from ..config.run import model_folders
        from ..io.lora import refuse_cache_in_inputs

        folders = model_folders(desc)
        refuse_cache_in_inputs(args.lora_merge_cache, folders, desc.output)
    if desc.mergekit and _reads_adapters(desc):  # every refusal that needs no merge made before any adapter is merged
        if not (args.print_plan or args.print_command):
            from ..io.model import ensure_output_dir

            ensure_output_dir(desc.output, inputs=folders)
        desc = describe(args.config, **given)  # planned again on the merged folders
    for line in desc.warnings[:WARNINGS_SHOWN]:
        print(f"symmerge: warning: {line}", file=sys.stderr)
    if len(desc.warnings) > WARNINGS_SHOWN:  # every one is in the report's and the plan's warnings
        print(f"symmerge: warning: and {len(desc.warnings) - WARNINGS_SHOWN} more warnings of the config (all in "
              "--print-plan's and the report's 'warnings')", file=sys.stderr)
    allow_remote_code(args.trust_remote_code or desc.trust_remote_code)  # reset when the command ends (cli)
    if not desc.mergekit:
        if args.print_command:
            print(shlex.join(["symmerge", desc.command, *desc.argv]))
            return 0
        parsed = namespace(desc.config)  # the command's options, built from the config's keys directly
        _refuse_cache_place(args.lora_merge_cache, parsed)
        if args.print_plan:
            if not hasattr(parsed, "print_plan"):
                raise SymmergeError(f"symmerge {desc.command} has no plan to print; --print-command prints the "
                                    "command line the config runs")
            parsed.print_plan = True
            return parsed.handler(parsed) or 0
        if "progress" not in desc.config.keys:
            parsed.progress = progress_of(args)
        configure(parsed.progress)
        print(f"running: {shlex.join(['symmerge', desc.command, *desc.argv])}", file=sys.stderr)
        out = getattr(parsed, "output", None)
        with cards_off(not args.write_model_card), _config_copy(desc.path, out if args.write_model_card else None):
            rc = parsed.handler(parsed) or 0  # the flag holds for the card the command writes too
        if rc == 0 and out is not None and _copied(out):
            print(f"wrote {_copied(out)} (the config)")
        return rc
    from ..config.run import print_summary, run_jobs

    if args.print_plan:
        import json

        from ..config.run_plan import printed

        print(json.dumps(printed(desc), indent=2, default=str))
        return 0
    if args.print_command:
        if desc.alignment is not None:
            from ..config.aligned import describe_line

            print(describe_line(desc.alignment))
        for job in desc.jobs:
            where = (desc.output or "OUT") if job.final else f"<intermediate {job.name}>"
            print(f"merge {job.name or ''} {job.method}: {len(job.steps)} tensors, {job.layers} layers -> {where}"
                  .replace("  ", " "))
        return 0
    configure(progress_of(args))
    summaries = run_jobs(desc, options=run_options(args))
    print_summary(desc, summaries)
    return 0


def _refuse_cache_place(cache, parsed) -> None:
    """``--lora-merge-cache`` given to ``run`` for a config of symmerge's own keys: neither in an input's folder nor
    in the output (:func:`symmerge.io.lora.refuse_cache_in_inputs`), as for ``merge``'s own flag."""
    from ..io.lora import refuse_cache_in_inputs

    inputs = [*(getattr(parsed, "models", None) or []), getattr(parsed, "base", None), getattr(parsed, "model", None)]
    refuse_cache_in_inputs(cache, inputs, getattr(parsed, "output", None))


def _reads_adapters(desc) -> bool:
    """Whether a mergekit config's description reads a ``BASE+ADAPTER`` input (one merged before it is read)."""
    from ..io.lora import is_lora_spec

    return any(is_lora_spec(i.label) for job in desc.jobs for i in job.inputs if i.folder is not None)


def _config_copy(config, out):
    """A config of symmerge's keys, copied into the output its command writes: ``symmerge_config.yml`` (not
    ``mergekit_config.yml``: mergekit-yaml could not run it), written with the output, in its temporary folder
    (:func:`symmerge.io.model.extra_files`): there when the output appears. ``out`` None: no copy."""
    import contextlib
    from pathlib import Path

    from ..config.run import SYMMERGE_CONFIG_COPY
    from ..io.model import extra_files

    if out is None:
        return contextlib.nullcontext()
    return extra_files(out, {SYMMERGE_CONFIG_COPY: Path(config).read_text(encoding="utf-8")})


def _copied(out):
    """The config's copy in the written output ``out`` (named on a last line of its own), or None."""
    from pathlib import Path

    from ..config.run import SYMMERGE_CONFIG_COPY

    copy = Path(out) / SYMMERGE_CONFIG_COPY
    return copy if copy.is_file() else None


def yaml_main(argv=None) -> int:
    """``symmerge-yaml CONFIG OUT [flags]``: mergekit-yaml's command line, run by ``symmerge run``."""
    from ..cli import main

    return main(["run", *(sys.argv[1:] if argv is None else argv)])
