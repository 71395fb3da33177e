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

import argparse

from ..errors import SymmergeError
from .alignment_args import add_alignment_arguments, alignment_options
from .run import shard_size
from .schema_args import add_part

NO_OPS = {  # mergekit-moe's flags that change nothing here, and why (--help)
    "--load-in-4bit": "accepted: the hidden-state pass runs the base model in bfloat16 (as mergekit without it)",
    "--load-in-8bit": "accepted: as --load-in-4bit",
    "--i-understand-this-is-not-useful-without-training": "accepted: no effect (mergekit's acknowledgement)",
    "--lazy-unpickle": "accepted: tensors are always read lazily (safetensors)",
    "--low-cpu-memory": "accepted: one tensor at a time is always held",
    "--read-to-gpu": "accepted: tensors are copied on the CPU",
    "--multi-gpu": "accepted: one device at most",
    "--async-write": "accepted: shards are written as the tensors come",
    "--clone-tensors": "accepted: every tensor is written once",
    "--safe-serialization": "accepted: the output is always safetensors",
    "--unsafe-truncate-embeddings": "accepted: the embeddings are the base model's (nothing to truncate)",
    "--write-model-card": "the default: README.md (the model card), symmerge_report.json and "
                          "mergekit_moe_config.yml are written",
    "--no-write-model-card": "no README.md (symmerge_report.json and mergekit_moe_config.yml are still written)",
    "--quiet": "no progress lines (--progress none)",
    "--copy-tokenizer": "accepted: the default",
    "--cuda": "the hidden-state pass on the GPU (--device cuda)",
    "--gpu-rich": "as --cuda",
}
VALUE_NO_OPS = {
    "--transformers-cache": "accepted: models are read from local folders only",
    "--lora-merge-cache": "accepted: no LoRA inputs here",
    "--lora-merge-dtype": "accepted: no LoRA inputs here",
    "--write-threads": "accepted: one writer",
}


def add_arguments(parser) -> None:
    from .safety_args import add_trust_remote_code

    add_trust_remote_code(parser)
    parser.add_argument("config", help="a mergekit-moe YAML config (base_model, experts, gate_mode, dtype, ...)")
    parser.add_argument("out", nargs="?", default=None, help="output folder (absent or empty)")
    parser.add_argument("-o", "--output", default=None, help="output folder (the same as OUT)")
    parser.add_argument("--device", default="cpu",
                        help="where the hidden-state pass (gate_mode hidden) runs: cpu (default), cuda, cuda:N, auto")
    parser.add_argument("--random-seed", type=int, default=0, metavar="N",
                        help="seed of gate_mode random's router rows (default 0)")
    parser.add_argument("--out-shard-size", default=None, metavar="SIZE",
                        help="largest output shard: 5B (as mergekit: bytes with K/M/B suffixes, the default) or 2GB")
    parser.add_argument("--allow-crimes", action="store_true",
                        help="experts of another family than the base (Llama experts in a Mistral base), as mergekit")
    parser.add_argument("--no-copy-tokenizer", action="store_true", help="do not copy the base's tokenizer files")
    parser.add_argument("--align", action="store_true",
                        help="align every expert to the base model first, so that experts trained apart sit in the "
                             "base's frame (with --symmetries and the alignment flags of symmerge align)")
    parser.add_argument("--symmetries", default="recommended",
                        help="with --align: the symmetries aligned (as symmerge align; default recommended)")
    parser.add_argument("--align-stream", action="store_true",
                        help="with --align: align each expert layer by layer from its checkpoint "
                             "(symmerge align --stream)")
    add_alignment_arguments(parser, repair=False)
    add_part(parser, "progress")
    mk = parser.add_argument_group("mergekit-moe's other flags (accepted)")
    for flag, text in NO_OPS.items():
        mk.add_argument(flag, action="store_true", help=text)
    for flag, text in VALUE_NO_OPS.items():
        mk.add_argument(flag, default=None, metavar="VALUE", help=text)
    mk.add_argument("-j", "--num-threads", type=int, default=None, metavar="N",
                    help="torch's CPU threads for the hidden-state pass")
    mk.add_argument("-v", action="count", default=0, help="accepted: progress lines are shown by default")
    for flag in ("--no-cuda", "--no-lazy-unpickle", "--no-low-cpu-memory", "--no-read-to-gpu", "--no-multi-gpu",
                 "--no-async-write", "--no-clone-tensors", "--no-safe-serialization", "--no-quiet",
                 "--no-allow-crimes", "--no-unsafe-truncate-embeddings"):
        mk.add_argument(flag, action="store_true", help=argparse.SUPPRESS)


def options_of(args):
    """The :class:`~symmerge.config.moe_build.MoeOptions` of the parsed flags."""
    from ..config.moe_build import MoeOptions

    if args.no_safe_serialization:
        raise SymmergeError("--no-safe-serialization: symmerge writes safetensors only")
    if args.align_stream and not args.align:
        raise SymmergeError("--align-stream applies with --align only")
    device = args.device
    if args.cuda or args.gpu_rich:
        device = "cuda" if device == "cpu" else device
    if args.num_threads is not None:
        if args.num_threads < 1:
            raise SymmergeError(f"--num-threads must be at least 1, got {args.num_threads}")
        import torch

        torch.set_num_threads(args.num_threads)
    align = None
    if args.align:
        align = alignment_options(args, args.symmetries, device="cpu")
    return MoeOptions(device=device, seed=args.random_seed, shard_size=shard_size(args.out_shard_size),
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
