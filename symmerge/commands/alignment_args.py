"""The alignment flags ``align``, ``merge`` and ``barrier`` share, written once: how scales are solved,
which residual group,
untying, the coordinate-descent cap, what the elements are fitted to (``--match``), the unlabeled data
(``--align-data``, ``--align-samples``), the learned alignment's settings, ``--workers``,
``--allow-tokenizer-mismatch`` and ``--repair``."""

from __future__ import annotations

import argparse

from ..errors import SymmergeError
from ..groups import RESCALE_MODES
from ..pipeline.options import LEARN_FRAMES, LEARN_PRECISIONS, MATCH_MODES, RESIDUAL_CHOICES, AlignOptions, LearnSettings
from ..pipeline.matchers import MATCHERS, matcher


def add_alignment_arguments(parser, repair: bool = True) -> None:
    parser.add_argument("--rescale", choices=list(RESCALE_MODES), default="joint",
                        help="how per-head scales are solved when 'rescale' is aligned: joint optimum (default), the "
                             "paper's sequential, or none")
    parser.add_argument("--residual", choices=list(RESIDUAL_CHOICES), default="largest",
                        help="with the residual symmetry: largest (default: the largest function-preserving group "
                             "of the family's stream — O(d-1) for pre-LN LayerNorm with the norms folded, O(d) for "
                             "RMSNorm, permutations for post-LN) or permutation (the norms kept as they are: permutations of "
                             "the stream for LayerNorm, signed permutations for RMSNorm)")
    parser.add_argument("--untie", action="store_true",
                        help="untie a tied LM head so the final norm can fold into it and the stream gets its "
                             "largest group (the output then stores the head separately)")
    parser.add_argument("--max-sweeps", type=int, default=200,
                        help="cap on the coordinate-descent sweeps over the coupled groups (default 200; it stops "
                             "earlier when a sweep lowers the objective by less than 1e-4 of it, and warns at the cap)")
    parser.add_argument("--restarts", type=int, default=None, metavar="N",
                        help="data-free solver: after its plain starts (the usual one, the identity, both models in a "
                             "canonical frame), N restarts from the best so far (its stream kicked, two heads or two "
                             "blocks of FFN units swapped, a random stream), each followed by the whole descent "
                             "(e.g. 5: seconds on a small ViT, minutes on a large model; 0: the plain starts only). "
                             "The lowest objective is kept; the report's solver entry lists every start. Default: no "
                             "search, the one descent (on B1 and three held-out pairs the search lowered the weight "
                             "objective but not the barrier: docs/results.md)")
    parser.add_argument("--solver-budget", type=float, default=None, metavar="SECONDS",
                        help="data-free solver: begin no restart after this many seconds (default: no limit; the "
                             "result then depends on the machine's speed); 0: the first descent alone")
    parser.add_argument("--solver-seed", type=int, default=0, help="data-free solver: the restarts' seed (default 0)")
    parser.add_argument("--match", choices=list(MATCH_MODES), default="weights",
                        help="what the group elements are fitted to: weights (data-free, default), activations "
                             "(statistics of both models on --align-data) or learned (from the closed form, the "
                             "continuous elements optimised so the interpolated model matches the interpolated "
                             "predictions on --align-data; no labels)")
    parser.add_argument("--align-data", default=None, metavar="FILE|generate[:N[:LEN[:SEED]]]",
                        help="unlabeled data for --match activations|learned and --repair: the formats of --data "
                             "(.npz images, .jsonl text, .txt LM lines; labels, if present, are ignored), or, for "
                             "causal LMs without a corpus, generate[:N[:LEN[:SEED]]]: N sequences of LEN tokens "
                             "sampled from the models themselves at temperature 1 (shared out over the models: half "
                             "from each of two; default generate:256:16:0; for merge and barrier the measured recipe adds --repair "
                             "--repair-channels ffn,norm,qk --repair-samples 64)")
    parser.add_argument("--align-samples", type=int, default=1000,
                        help="use at most this many examples of --align-data (default 1000)")
    parser.add_argument("--learn-steps", type=int, default=None,
                        help=f"--match learned: optimiser steps (default {LearnSettings.steps} of "
                             f"{LearnSettings.batch} examples; the start is kept if the end is not better)")
    parser.add_argument("--learn-budget", type=float, default=None, metavar="SECONDS",
                        help="--match learned: stop after this many seconds of optimisation (default: no limit)")
    parser.add_argument("--learn-seed", type=int, default=None, help="--match learned: seed (default 0)")
    parser.add_argument("--learn-batch", type=int, default=None,
                        help=f"--match learned: examples per step (default {LearnSettings.batch})")
    parser.add_argument("--learn-positions", type=int, default=None,
                        help="--match learned, text: the objective on this many random next-token positions of each "
                             f"batch, the endpoints' predictions cached there only (default {LearnSettings.positions}:"
                             " every position)")
    parser.add_argument("--learn-max-length", type=int, default=None, metavar="TOKENS",
                        help="--match learned, text: the alignment texts truncated to this many tokens (default: the "
                             "model's context)")
    parser.add_argument("--learn-precision", choices=list(LEARN_PRECISIONS), default=None,
                        help="--match learned: the training steps and the endpoints' predictions in float32 "
                             "(default) or under bfloat16 autocast (faster on CPUs with bf16 instructions; the checks "
                             "stay float32, the elements are applied and verified in float64)")
    parser.add_argument("--learn-frame", choices=list(LEARN_FRAMES), default=None,
                        help="--match learned, two models: one-sided (default: A moved onto B) or dual (both moved "
                             "into a frame between them, each folded LayerNorm split back into a per-coordinate "
                             "scale and shift of its own; both verified against their originals; "
                             "docs/results/dual_learned.md)")
    parser.add_argument("--learn-layerwise", action="store_const", const=True, default=None,
                        help="--match learned: build and differentiate the interpolated model one layer at a time "
                             "(gradient checkpointing per layer): the same objective and gradient in memory bounded "
                             "by a few layers (LLM-size pairs; docs/results/learned_scale.md)")
    parser.add_argument("--learn-check-batches", type=int, default=None, metavar="N",
                        help="--match learned: the objective checks (start/end, or held-out) on at most N batches "
                             f"(default {LearnSettings.check_batches}: all)")
    parser.add_argument("--learn-dirichlet", type=_concentration, default=None, metavar="C|auto",
                        help="--match learned with more than two models (joint): the mixture weights drawn from "
                             "Dirichlet(C, ..., C) (1: uniform on the simplex; larger C: mixtures nearer the plain "
                             f"average); auto (the default): C chosen from "
                             f"{', '.join(f'{c:g}' for c in LearnSettings.dirichlet_grid)} on a held-out "
                             f"{LearnSettings.dirichlet_holdout * 100:g}%% of --align-data by the objective at the uniform "
                             "mixture (the report's learned.dirichlet_choice)")
    parser.add_argument("--workers", type=int, default=None,
                        help="FFN layers (cost GEMM + exact assignment) solved at once on a thread pool, beside the "
                             "head groups (default: one per core; 1: one thing after another on one thread; the "
                             "result is the same). align --stream: only with --pipeline (default 2 there), the "
                             "low-memory mode solves one part of one layer at a time")
    parser.add_argument("--allow-tokenizer-mismatch", action="store_true",
                        help="go on when the models' tokenizers differ (vocabulary, special or added tokens); by "
                             "default that is an error naming the first differing tokens. The report's tokenizer "
                             "entry records the differences")
    if repair:
        parser.add_argument("--repair", action="store_true",
                            help="REPAIR: reset the per-channel means and standard deviations of the merged model "
                                 "(FFN pre-activations, norm outputs) to the interpolation of the endpoints', on "
                                 "--align-data, folded into weights and biases (architecture unchanged)")
        parser.add_argument("--repair-channels", default="ffn,norm", metavar="LIST",
                            help="the channels --repair corrects, comma-separated: ffn (FFN pre-activations), norm "
                                 "(norm outputs), attn_out, mlp_out (the stream writers), qk (per head, the RMS of "
                                 "queries and keys: the attention logits' scale); default ffn,norm")
        parser.add_argument("--repair-samples", type=int, default=None, metavar="N",
                            help="REPAIR's statistics on the first N examples of --align-data (default: all)")


def _concentration(text: str):
    """``--learn-dirichlet``: a number, or ``auto``."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None


LEARN_FLAGS = {"steps": "--learn-steps", "budget": "--learn-budget", "seed": "--learn-seed", "batch": "--learn-batch",
               "positions": "--learn-positions", "max_length": "--learn-max-length",
               "precision": "--learn-precision", "check_batches": "--learn-check-batches",
               "dirichlet": "--learn-dirichlet", "frame": "--learn-frame"}  # LearnSettings field → flag


def _learn_values(args) -> dict:
    return {k: getattr(args, flag[2:].replace("-", "_")) for k, flag in LEARN_FLAGS.items()}


def learn_settings(args) -> LearnSettings:
    values = {k: v for k, v in _learn_values(args).items() if v is not None}
    if getattr(args, "learn_layerwise", None):  # a switch (no value): LearnSettings.layerwise
        values["layerwise"] = True
    return LearnSettings(**values)


def alignment_options(args, symmetries, **extra) -> AlignOptions:
    """The :class:`AlignOptions` of the parsed flags, for ``symmetries``."""
    needs_data = matcher(args.match).needs_data
    if args.align_data is None and (needs_data or getattr(args, "repair", False)):
        need = f"--match {args.match}" if needs_data else "--repair"
        raise SymmergeError(f"{need} needs unlabeled data: pass --align-data FILE (labels, if present, are ignored), "
                            "or --align-data generate for causal LMs (sequences sampled from the models)")
    given = [LEARN_FLAGS[k] for k, v in _learn_values(args).items() if v is not None]
    given += ["--learn-layerwise"] if getattr(args, "learn_layerwise", None) else []
    if not matcher(args.match).learns and given:
        learning = ", ".join(n for n, m in MATCHERS.items() if m.learns)
        raise SymmergeError(f"{', '.join(given)}: the --learn-* flags apply to --match {learning} only")
    if args.learn_frame == "dual" and len(getattr(args, "models", None) or ()) > 2:
        raise SymmergeError(f"--learn-frame dual moves both models of a pair into a frame between them; "
                            f"{len(args.models)} models are aligned to one model's frame (leave out --learn-frame)")
    if args.align_data is not None:
        from ..io.data import check_data_path
        from ..io.generate import is_generate, parse_generate

        if is_generate(args.align_data):
            parse_generate(args.align_data)  # fail before loading any model
        else:
            check_data_path(args.align_data)
    extra.setdefault("workers", args.workers)
    return AlignOptions(symmetries=symmetries, rescale=args.rescale, residual=args.residual, untie=args.untie,
                        max_sweeps=args.max_sweeps, restarts=args.restarts, solver_budget=args.solver_budget,
                        solver_seed=args.solver_seed, match=args.match, align_data=args.align_data,
                        align_samples=args.align_samples, learn=learn_settings(args), **extra)
