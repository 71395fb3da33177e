"""B6, mixtures of experts: two small Mixtral-style language models trained from different seeds on
the Python documentation (the B4 corpus and tokenizer), aligned with and without the ``experts`` group,
loss barriers on held-out text.

    python -m benchmarks.moe_text [--out results/moe-text] [--steps N] [--tiny] [--train-only A|B]
                                  [--learn-steps N] [--activations]

1. Data as in B4 (:mod:`benchmarks.gpt2_text`): the Python 3.11 documentation's prose, split by
   document, a byte-level BPE (4 096 tokens), blocks of ``--context`` tokens.
2. Two ``MixtralForCausalLM`` (default 4 layers, d = 128, 4 heads, 8 experts of 128 units, top-2,
   untied LM head; ``symmerge.demo.lm.mixtral_config``) trained from seeds 0 and 1 with the router's
   load-balancing loss (``symmerge.demo.lm.train_lm``; cached under ~/.cache/symmerge/moe and reused).
   Smaller and shorter than B4's models so that each trains in about 15 minutes on a busy 2-core CPU.
3. Variants (model A aligned to model B; the residual stream in its largest group, O(d) with the
   RMSNorms folded): no alignment; the dense groups only (``heads,attn,ffn,rescale,residual``: the FFN
   inside each expert is permuted, but expert e of A stays paired with expert e of B); plus ``experts``
   (the experts permuted with the router's rows, matched jointly with the FFN inside them); and, with
   ``--learn-steps`` > 0, that alignment refined by learned alignment on unlabeled training paragraphs.
   ``--activations``: the per-layer groups without the residual stream (``heads,attn,ffn,rescale,experts``)
   from the weights and from activations on the unlabeled paragraphs (the experts from the correlations
   of their router logits and hidden units), and the full set with the stream from activations (the
   per-layer groups then from the weights, given it).
4. For each: the L2 distance to the anchor, matching seconds, the loss along θ(α) = α·θ_A + (1−α)·θ_B,
   its barrier and the α = 0.5 loss.

Writes ``results.json`` and ``tables.md`` into ``--out``. ``--tiny`` runs the whole pipeline on a tiny
model and a corpus subset (< 2 min).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import add_run_args, bench_main, machine, pair_settings, write_results
from benchmarks.gpt2_text import HEADER, add_text_args, prepare_data, print_tables, table_rows
from symmerge.core.distance import distance, parameter_keys
from symmerge.demo import text
from symmerge.demo.datasets import cache_dir
from symmerge.demo.lm import mixtral_config, train_lm
from symmerge.demo.train import load_report
from symmerge.merge.barrier import barrier_study
from symmerge.evaluate.metrics import evaluate
from symmerge.io.data import load_data
from symmerge.io.model import load_model
from symmerge.pipeline.options import AlignOptions, LearnSettings

DENSE = "heads,attn,ffn,rescale,residual"
EXPERTS = DENSE + ",experts"
VARIANTS = ("none", DENSE, EXPERTS)
LOCAL = "heads,attn,ffn,rescale,experts"  # every per-layer group, no residual stream (activations: all of them)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.moe_text", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_text_args(p, "results/moe-text", hidden=128, layers=4, steps=800, lr=2e-3)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--inner", type=int, default=128, help="units per expert (default 128)")
    p.add_argument("--learn-steps", type=int, default=0,
                   help="learned alignment steps after the closed form with experts (0: no learned variant)")
    p.add_argument("--learn-examples", type=int, default=400,
                   help="unlabeled training paragraphs for learning and for --activations")
    p.add_argument("--activations", action="store_true",
                   help="also the rows matched from activations on the unlabeled paragraphs: without the residual "
                        "stream, the per-layer groups with experts from activations against the same groups from "
                        "the weights (the experts from the router's logits and their units' correlations); with it, "
                        "the stream from activations and the per-layer groups from the weights")
    add_run_args(p)
    args = p.parse_args(argv)
    if args.tiny:
        args.vocab, args.context, args.hidden, args.layers, args.heads = 384, 32, 32, 2, 2
        args.experts, args.inner = 4, 32
        args.steps, args.batch_size, args.eval_every, args.points = 30, 16, 15, 3
        args.test_examples, args.curve_examples, args.train_lines = 100, 40, 3000
        args.learn_examples = 64
    else:
        args.train_lines = None
    return args


def work_dir(args) -> Path:
    return cache_dir() / "benchmarks" / ("moe-text-tiny" if args.tiny else "moe-text")


def train_pair(args, data: dict, log):
    tok = data["tokenizer"]
    config = mixtral_config(len(tok), args.context, args.hidden, args.layers, args.heads, args.experts, args.top_k,
                            args.inner, eos_token_id=tok.eos_token_id)
    seeds, todo = pair_settings(args)
    folders = [train_lm(config, data["train"], settings, tok, name=f"pydocs-{'tiny-' if args.tiny else ''}{name}",
                        eval_blocks=data["validation"], eval_every=args.eval_every, log=log, subdir="moe",
                        train_kwargs={"output_router_logits": True})
               for name, settings in todo]
    return config, seeds, folders


def run(args, log=print) -> dict:
    t_start = time.perf_counter()
    folder = work_dir(args)
    data = prepare_data(args, folder)
    config, seeds, folders = train_pair(args, data, log)
    a, b = (load_model(f) for f in folders)
    test = load_data(data["files"]["test"], a, batch_size=32)
    curve = load_data(data["files"]["curve"], a, batch_size=32)
    endpoints = {}
    for name, m, f, s in (("A", a, folders[0], seeds[0]), ("B", b, folders[1], seeds[1])):
        rep = load_report(f)
        score = evaluate(m, test, progress=False)
        endpoints[name] = {"seed": s, "folder": str(f), "train_seconds": rep["seconds"],
                           "seconds_per_step": rep["seconds_per_step"], "validation_loss": rep["eval_loss"],
                           "eval_curve": rep.get("eval_curve", []), "test_loss": score["loss"],
                           "test_accuracy": score["accuracy"], "test_tokens": score["n"]}
        log(f"model {name} (seed {s}): validation loss {rep['eval_loss']:.4f}, test loss {score['loss']:.4f}, "
            f"trained {rep['seconds']:.0f} s")

    options = AlignOptions(residual="largest")
    study = barrier_study(a, b, curve, aligns=VARIANTS[1:], points=args.points, options=options, progress=False)
    curves = dict(study["curves"])
    if args.learn_steps or args.activations:
        lines = text.read_lines(data["splits"]["train"])
        rng = np.random.default_rng(1)
        unlabeled = text.write_lines(folder / "unlabeled.txt",
                                     [lines[i] for i in sorted(rng.permutation(len(lines))[:args.learn_examples])])
    if args.activations:
        on_acts = options.with_(match="activations", align_data=str(unlabeled), align_samples=args.learn_examples)
        weights = barrier_study(a, b, curve, aligns=(LOCAL,), points=args.points, options=options, progress=False)
        curves[f"{LOCAL} (weights)"] = weights["curves"][LOCAL]
        acts = barrier_study(a, b, curve, aligns=(LOCAL, EXPERTS), points=args.points, options=on_acts,
                             progress=False)
        curves[f"{LOCAL} (activations)"] = acts["curves"][LOCAL]
        curves[f"{EXPERTS} (activations: stream)"] = acts["curves"][EXPERTS]
    if args.learn_steps:
        learned = options.with_(match="learned", align_data=str(unlabeled), align_samples=args.learn_examples,
                                learn=LearnSettings(steps=args.learn_steps, batch=32, start="weights"))
        extra = barrier_study(a, b, curve, aligns=(EXPERTS,), points=args.points, options=learned, progress=False)
        curves["learned"] = extra["curves"][EXPERTS]
    mid = study["alphas"].index(0.5) if 0.5 in study["alphas"] else len(study["alphas"]) // 2
    none_distance = distance(a.state_dict(), b.state_dict(), parameter_keys(a))
    rows = []
    for v, c in curves.items():
        rows.append({"variant": v, "distance": c.get("distance_after", none_distance), "barrier": c["barrier"],
                     "loss_mid": c["loss"][mid], "accuracy_mid": c["accuracy"][mid],
                     "match_seconds": c.get("match_seconds", 0.0), "seconds": c["seconds"],
                     "loss": c["loss"], "accuracy": c["accuracy"]})
        log(f"  {v:40s} distance {rows[-1]['distance']:.3f}  barrier {c['barrier']:.4f}  loss(0.5) {c['loss'][mid]:.4f}")
    return {
        "benchmark": "B6 moe_text", "tiny": args.tiny,
        "command": " ".join(["python -m benchmarks.moe_text"] + sys.argv[1:]), "machine": machine(),
        "corpus": {"name": "Python 3.11 documentation (reST sources)", "package": text.PYDOCS_PACKAGE,
                   "license": text.PYDOCS_LICENSE, "lines": data["lines"]},
        "config": {k: getattr(config, k) for k in ("vocab_size", "max_position_embeddings", "hidden_size",
                                                   "num_hidden_layers", "num_attention_heads", "num_local_experts",
                                                   "num_experts_per_tok", "intermediate_size")},
        "training": {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seeds": seeds,
                     "train_tokens": int(data["train"].size), "router_aux_loss_coef": config.router_aux_loss_coef},
        "data": {"test": test.n, "curve": curve.n}, "learn_steps": args.learn_steps,
        "endpoints": endpoints, "alphas": study["alphas"], "variants": rows,
        "seconds_total": time.perf_counter() - t_start,
    }


def markdown_tables(r: dict) -> str:
    c, ea, eb = r["config"], r["endpoints"]["A"], r["endpoints"]["B"]
    out = [f"Models (Mixtral, {c['num_hidden_layers']} layers, d = {c['hidden_size']}, {c['num_attention_heads']} heads, "
           f"{c['num_local_experts']} experts of {c['intermediate_size']} units, top-{c['num_experts_per_tok']}, "
           f"vocab {c['vocab_size']}): A test loss {ea['test_loss']:.4f}, B test loss {eb['test_loss']:.4f}.", "",
           f"Loss along θ(α) on {r['data']['curve']} held-out paragraphs, {len(r['alphas'])} points.", "",
           "| " + " | ".join(HEADER) + " |", "|---|---|---|---|---|"]
    out += ["| " + " | ".join(row) + " |" for row in table_rows(r)]
    return "\n".join(out) + "\n"


def write_outputs(result: dict, out: Path) -> None:
    write_results(out, result, markdown_tables(result))


def main(argv=None) -> int:
    args = parse_args(argv)
    return bench_main(args, lambda: train_pair(args, prepare_data(args, work_dir(args)), print), run,
                      print_tables, write_outputs, "tables.md")


if __name__ == "__main__":
    sys.exit(main())
