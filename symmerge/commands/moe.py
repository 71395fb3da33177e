"""Build a mixture of experts from dense models: ``symmerge moe CONFIG OUT`` (as ``mergekit-moe CONFIG OUT``).

CONFIG is a mergekit-moe config, run as written: ``base_model`` (attention, norms, embeddings and head of the
output), ``experts`` (``source_model``, ``positive_prompts``, ``negative_prompts``: each expert's MLP becomes
that expert in every layer), ``gate_mode`` (hidden | cheap_embed | random: how the router is initialised),
``dtype``, ``experts_per_token``, ``shared_experts`` (one, with ``residual_scale``: a Qwen2-MoE output),
``architecture`` (mixtral | qwen). The output is a Mixtral (from Llama / Mistral models) or Qwen2-MoE (from
Qwen2 models) folder; for the deterministic gate modes the same tensors as mergekit-moe 0.1.5 writes.
Streamed: one tensor at a time, one model in memory for the hidden-state pass; written atomically.

--align (beyond mergekit): every expert is aligned to the base model first (symmetry-aware: the
alignment flags of ``symmerge align``), so experts trained apart read and write the base's residual
stream in its coordinates. See docs/moe.md."""

from __future__ import annotations

from ..errors import SymmergeError
from ..options.declared import MOE, MOE_MERGEKIT, TITLES
from ..options.parse import mergekit_size
from .alignment_args import add_alignment_arguments, alignment_options
from .schema_args import add_part

# the way out named when the command runs out of memory (symmerge.cli: one symmerge: error: line)
MEMORY_WAY_OUT = "--align-stream (with --align), a smaller --out-shard-size, fewer --num-threads"


def add_arguments(parser) -> None:
    """moe's flags, declared in :mod:`symmerge.options.declared` (its own, the alignment flags of ``symmerge align``,
    the progress flag, mergekit-moe's other flags in a group of their own)."""
    from .safety_args import add_trust_remote_code

    add_trust_remote_code(parser)
    add_part(parser, MOE)
    add_alignment_arguments(parser, repair=False)
    add_part(parser, "progress")
    add_part(parser.add_argument_group(TITLES[MOE_MERGEKIT]), MOE_MERGEKIT)


def options_of(args):
    """The :class:`~symmerge.config.moe_build.MoeOptions` of the parsed flags."""
    from ..config.moe_build import MoeOptions
    from ..device import cuda_flag_given, flag_device
    from ..options.build import unread_alignment_flags

    if args.no_safe_serialization:
        raise SymmergeError("--no-safe-serialization: symmerge writes safetensors only")
    if args.align_stream and not args.align:
        raise SymmergeError("--align-stream applies with --align only")
    if not args.align:
        given = unread_alignment_flags(args, MOE, also=("symmetries",))
        if given:
            raise SymmergeError(f"{', '.join(given)}: the alignment flags apply with --align only (without it the "
                                "experts are not aligned and nothing reads them)")
    cuda_flag = cuda_flag_given(args)  # --cuda / --gpu-rich: the GPU when there is one, as in run and extract-lora
    device = flag_device(None if cuda_flag and args.device == "cpu" else args.device, cuda_flag, default="cpu")
    if args.num_threads is not None:  # at least 1: the flag's declared range
        import torch

        torch.set_num_threads(args.num_threads)
    align = None
    if args.align:
        align = alignment_options(args, args.symmetries, device="cpu")
    return MoeOptions(device=device, seed=args.random_seed, shard_size=mergekit_size(args.out_shard_size),
                      align=align, align_stream=args.align_stream, allow_crimes=args.allow_crimes,
                      copy_tokenizer=not args.no_copy_tokenizer, progress=args.progress != "none",
                      card=not args.no_write_model_card)


def run(args) -> int:
    from ..config.moe_build import build_moe
    from ..progress import configure

    if args.out and args.output and args.out != args.output:
        raise SymmergeError(f"two output folders: {args.out} and -o {args.output}: give one")
    out = args.out or args.output
    if out is None:
        raise SymmergeError("no output folder: symmerge moe CONFIG OUT")
    if args.quiet:
        args.progress = "none"
        configure("none")
    options = options_of(args)
    from ..io.hf import allow_remote_code

    allow_remote_code(args.trust_remote_code)  # reset when the command ends (cli)
    report = build_moe(args.config, out, options)
    shared = f" + {len(report['shared_experts'])} shared" if report["shared_experts"] else ""
    aligned = " (experts aligned to the base)" if report["aligned"] else ""
    print(f"wrote {out}: {report['architecture']}, {len(report['experts'])} experts{shared}, "
          f"{report['experts_per_token']} per token, gate_mode {report['gate_mode']}, {report['dtype']}{aligned} "
          f"({report['seconds']:.1f} s)")
    return 0
