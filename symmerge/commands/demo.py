"""Run the built-in demo: align a disguised copy of the real all-MiniLM-L6-v2 back to the original.

A second model is made from the real MiniLM weights by a hidden random group element (per-head
QK/VO rotations and scales, FFN permutations) plus small Gaussian noise — the same function up
to the noise, with very different weights. Each alignment variant is solved, verified on real
sentences and compared: distance to the anchor, equivalence, seconds. Prints a table and writes
a per-layer distance plot and demo.json.
"""

from pathlib import Path


def add_arguments(parser) -> None:
    parser.add_argument("-o", "--output", default="symmerge-demo", help="folder for demo.json and demo.png")
    parser.add_argument("--noise", type=float, default=0.01,
                        help="noise std relative to each tensor's std (default 0.01)")
    parser.add_argument("--seed", type=int, default=0)


def run(args) -> int:
    from ..demo import run_demo

    run_demo(Path(args.output), noise=args.noise, seed=args.seed)
    return 0
