"""B4, the text counterpart of B1: two small GPT-2 language models trained from different seeds on
the Python documentation, aligned under several symmetry variants, loss barriers on held-out text.

    python -m benchmarks.gpt2_text [--out results/gpt2-text] [--steps N] [--tiny] [--train-only A|B]
                                   [--residual permutation|largest]

1. Corpus: the reST sources of the Python 3.11 documentation (Debian package ``python3.11-doc``,
   PSF License 2.0; fetched once into the cache), cleaned to plain English paragraphs, split by
   document into train / validation / test (5 % / 5 % of the characters held out, seed 0).
2. A byte-level BPE (4 096 tokens) trained on the training split; the training split as
   non-overlapping blocks of ``--context`` tokens (paragraphs joined with ``<|endoftext|>``).
3. Two ``GPT2LMHeadModel`` (6 layers, d = 256, 4 heads, tied LM head by default) trained from seeds 0
   and 1 (``symmerge.demo.lm.train_gpt2``; cached under ~/.cache/symmerge/gpt2 and reused); the seed
   drives the initialisation and the block order. Validation loss every ``--eval-every`` steps.
4. Held-out ``.txt`` files (one paragraph a line, the ``--data`` format): ``test.txt`` for the
   endpoints' scores, ``curve.txt`` for the interpolation curves, ``validation.txt``.
5. For every variant of :data:`VARIANTS` (model A aligned to model B): L2 distance to the anchor,
   matching seconds (the alignment report's ``match_seconds``), the loss along θ(α) = α·θ_A + (1−α)·θ_B,
   its barrier and the α = 0.5 loss (``symmerge.merge.barrier.barrier_study``).

Writes ``results.json``, ``lmc.png`` and ``tables.md`` into ``--out``. ``--tiny`` runs the whole
pipeline on a tiny model and a corpus subset (< 60 s).

One row of the unlabeled-data table instead (the cached pair aligned from unlabeled text; :func:`unlabeled_row`,
its own options)::

    python -m benchmarks.gpt2_text --unlabeled-row --match learned --untie --residual largest [--repair]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import add_run_args, bench_main, machine, pair_settings, pyplot
from symmerge.core.distance import distance, parameter_keys
from symmerge.demo import text
from symmerge.demo.datasets import cache_dir
from symmerge.demo.lm import gpt2_config, train_gpt2
from symmerge.demo.train import load_report
from symmerge.merge.barrier import barrier_study
from symmerge.evaluate.metrics import evaluate
from symmerge.io.data import load_data
from symmerge.io.model import atomic_dir, load_model, write_json
from symmerge.pipeline.options import RESIDUAL_CHOICES, AlignOptions

# the matching variants, as symmetry strings (model A aligned to model B); extend here
VARIANTS = (
    "none",
    "attn,ffn,rescale",  # the paper's
    "heads,attn,ffn,rescale",  # heads paired first by a rotation-aware assignment
    "attn,ffn,rescale,residual",  # beyond the paper: the residual stream permuted too
    "heads,attn,ffn,rescale,residual",
)


def add_text_args(p, out: str, hidden: int, layers: int, steps: int, lr: float) -> None:
    """The options the Python-docs LM benchmarks share (B4, B6): output, corpus, model size, training,
    held-out data (``hidden``, ``layers``, ``steps``, ``lr``: the benchmark's defaults)."""
    p.add_argument("--out", default=out, help="output folder (must not exist or be empty)")
    p.add_argument("--tiny", action="store_true", help="tiny model, corpus subset, few steps: the smoke test")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    p.add_argument("--context", type=int, default=128, help="tokens per training block = the context (default 128)")
    p.add_argument("--hidden", type=int, default=hidden)
    p.add_argument("--layers", type=int, default=layers)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--steps", type=int, default=steps, help=f"training steps per model (default {steps})")
    p.add_argument("--batch-size", type=int, default=16, help="blocks per step (default 16)")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps (default 50)")
    p.add_argument("--seeds", default="0,1", help="seeds of models A and B")
    p.add_argument("--test-examples", type=int, default=1000, help="held-out paragraphs for the endpoints' scores")
    p.add_argument("--curve-examples", type=int, default=300, help="held-out paragraphs for the LMC curves")
    p.add_argument("--points", type=int, default=11, help="α values on each LMC curve")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpt2_text", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_text_args(p, "results/gpt2-text", hidden=256, layers=6, steps=600, lr=1.5e-3)
    p.add_argument("--untied", action="store_true", help="an LM head of its own (default: tied to the embedding)")
    p.add_argument("--residual", choices=RESIDUAL_CHOICES, default="permutation",
                   help="the residual-stream group of the '…residual' variants (AlignOptions.residual)")
    p.add_argument("--untie", action="store_true",
                   help="untie the LM head in the aligned variants (AlignOptions.untie), so that ln_f folds into it and "
                        "the stream gets its largest group with --residual largest")
    p.add_argument("--unlabeled-row", action="store_true",
                   help="one row of the unlabeled-data table instead (its own options: --unlabeled-row --help)")
    add_run_args(p)
    args = p.parse_args(argv)
    if args.tiny:
        args.vocab, args.context, args.hidden, args.layers, args.heads = 384, 32, 32, 2, 2
        args.steps, args.batch_size, args.eval_every, args.points = 40, 16, 20, 3
        args.test_examples, args.curve_examples, args.train_lines = 200, 60, 3000
    else:
        args.train_lines = None
    return args


# ---------------------------------------------------------------- pipeline


def work_dir(args) -> Path:
    return cache_dir() / "benchmarks" / ("gpt2-text-tiny" if args.tiny else "gpt2-text")


def prepare_data(args, folder: Path) -> dict:
    """Splits, tokenizer, token blocks and the held-out ``.txt`` files (in ``folder``)."""
    splits = text.python_docs_splits()
    lines = {s: text.read_lines(p) for s, p in splits.items()}
    if args.train_lines:
        lines["train"] = lines["train"][:args.train_lines]
    tokenizer = text.train_tokenizer(lines["train"], args.vocab, args.context)
    rng = np.random.default_rng(0)
    test = [lines["test"][i] for i in sorted(rng.permutation(len(lines["test"]))[:args.test_examples])]
    curve = [lines["test"][i] for i in sorted(rng.permutation(len(lines["test"]))[:args.curve_examples])]
    files = {"test": text.write_lines(folder / "test.txt", test),
             "curve": text.write_lines(folder / "curve.txt", curve),
             "validation": text.write_lines(folder / "validation.txt", lines["validation"])}
    return {"splits": splits, "tokenizer": tokenizer, "files": files,
            "train": text.blocks(text.token_stream(lines["train"], tokenizer), args.context),
            "validation": text.blocks(text.token_stream(lines["validation"], tokenizer), args.context),
            "lines": {s: len(v) for s, v in lines.items()}}


def train_pair(args, data: dict, log):
    tok = data["tokenizer"]
    config = gpt2_config(len(tok), args.context, args.hidden, args.layers, args.heads,
                         eos_token_id=tok.eos_token_id, tie=not args.untied)
    seeds, todo = pair_settings(args)
    folders = []
    for name, settings in todo:
        folders.append(train_gpt2(config, data["train"], settings, tok, name=f"pydocs-{'tiny-' if args.tiny else ''}{name}",
                                  eval_blocks=data["validation"], eval_every=args.eval_every, log=log))
    return config, seeds, folders


def run(args, log=print) -> dict:
    t_start = time.perf_counter()
    data = prepare_data(args, work_dir(args))
    config, seeds, folders = train_pair(args, data, log)
    a, b = (load_model(f) for f in folders)
    test = load_data(data["files"]["test"], a, batch_size=32)
    curve = load_data(data["files"]["curve"], a, batch_size=32)
    log(f"data: {test.n} held-out paragraphs for scores, {curve.n} for curves; "
        f"{data['train'].size} training tokens, {data['validation'].size} validation tokens")

    endpoints = {}
    for name, m, f, s in (("A", a, folders[0], seeds[0]), ("B", b, folders[1], seeds[1])):
        rep = load_report(f)
        score = evaluate(m, test, progress=False)
        endpoints[name] = {"seed": s, "folder": str(f), "train_seconds": rep["seconds"],
                           "seconds_per_step": rep["seconds_per_step"], "epochs": rep["epochs"],
                           "validation_loss": rep["eval_loss"], "validation_accuracy": rep["eval_accuracy"],
                           "eval_curve": rep.get("eval_curve", []), "test_loss": score["loss"],
                           "test_accuracy": score["accuracy"], "test_tokens": score["n"]}
        log(f"model {name} (seed {s}): validation loss {rep['eval_loss']:.4f}, test loss {score['loss']:.4f}, "
            f"next-token accuracy {score['accuracy']:.4f}, trained {rep['seconds']:.0f} s")

    options = AlignOptions(residual=args.residual, untie=args.untie)
    study = barrier_study(a, b, curve, aligns=VARIANTS[1:], points=args.points, align=options, progress=False)
    mid = study["alphas"].index(0.5) if 0.5 in study["alphas"] else len(study["alphas"]) // 2
    none_distance = distance(a.state_dict(), b.state_dict(), parameter_keys(a))
    rows = []
    for v in VARIANTS:
        c = study["curves"][v]
        rows.append({"variant": v, "distance": c.get("distance_after", none_distance),
                     "barrier": c["barrier"], "loss_mid": c["loss"][mid], "accuracy_mid": c["accuracy"][mid],
                     "match_seconds": c.get("match_seconds", 0.0), "seconds": c["seconds"],
                     "loss": c["loss"], "accuracy": c["accuracy"]})
        log(f"  {v:34s} distance {rows[-1]['distance']:.3f}  barrier {c['barrier']:.4f}  "
            f"loss(0.5) {c['loss'][mid]:.4f}")
    return {
        "benchmark": "B4 gpt2_text", "tiny": args.tiny,
        "command": " ".join(["python -m benchmarks.gpt2_text"] + sys.argv[1:]), "machine": machine(),
        "corpus": {"name": "Python 3.11 documentation (reST sources)", "package": text.PYDOCS_PACKAGE,
                   "license": text.PYDOCS_LICENSE, "lines": data["lines"],
                   "splits": {k: str(v) for k, v in data["splits"].items()}},
        "config": {k: getattr(config, k) for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head",
                                                   "tie_word_embeddings")},
        "training": {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seeds": seeds,
                     "train_tokens": int(data["train"].size), "eval_every": args.eval_every},
        "data": {"test": test.n, "curve": curve.n, "files": {k: str(v) for k, v in data["files"].items()}},
        "residual": args.residual, "endpoints": endpoints, "alphas": study["alphas"], "variants": rows,
        "seconds_barrier_study": study["seconds"], "seconds_total": time.perf_counter() - t_start,
    }


# ---------------------------------------------------------------- output


def write_outputs(result: dict, out: Path) -> None:
    with atomic_dir(out) as tmp:
        write_json(tmp / "results.json", result)
        plot_lmc(result, tmp / "lmc.png")
        (tmp / "tables.md").write_text(markdown_tables(result))


def plot_lmc(result: dict, path) -> None:
    """Held-out loss (and next-token accuracy) along θ(α) per variant; the endpoints' validation curves."""
    plt = pyplot()
    fig, (ax_l, ax_a, ax_t) = plt.subplots(1, 3, figsize=(16, 4.5))
    for r in result["variants"]:
        ax_l.plot(result["alphas"], r["loss"], marker="o", ms=4, label=f"{r['variant']}: LB {r['barrier']:.3f}")
        ax_a.plot(result["alphas"], r["accuracy"], marker="o", ms=4, label=r["variant"])
    for name, e in result["endpoints"].items():
        curve = e["eval_curve"]
        ax_t.plot([p["step"] for p in curve], [p["loss"] for p in curve], marker=".", label=f"model {name} (seed {e['seed']})")
    ax_l.set(xlabel="α (0 = model B, 1 = model A matched to B)", ylabel="held-out loss (next-token cross-entropy)",
             title="loss along θ(α) = α·θ_A + (1−α)·θ_B")
    ax_a.set(xlabel="α", ylabel="next-token accuracy", title="accuracy")
    ax_t.set(xlabel="training step", ylabel="validation loss", title="training")
    for ax in (ax_l, ax_a, ax_t):
        ax.legend(fontsize=7)
    fig.suptitle(f"two GPT-2s from different seeds on the Python docs ({result['data']['curve']} held-out paragraphs)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def table_rows(r: dict) -> list[tuple]:
    return [(x["variant"], f"{x['distance']:.3f}", f"{x['barrier']:.4f}", f"{x['loss_mid']:.4f}",
             f"{x['match_seconds']:.2f}") for x in r["variants"]]


HEADER = ("variant", "L2 to anchor", "loss barrier", "α = 0.5 loss", "matching s")


def print_tables(r: dict, log=print) -> None:
    ea, eb = r["endpoints"]["A"], r["endpoints"]["B"]
    log(f"\nendpoints: A validation loss {ea['validation_loss']:.4f}, test loss {ea['test_loss']:.4f} "
        f"(accuracy {ea['test_accuracy']:.4f}); B validation loss {eb['validation_loss']:.4f}, test loss "
        f"{eb['test_loss']:.4f} (accuracy {eb['test_accuracy']:.4f})")
    widths = (34, 13, 13, 13, 11)
    log("".join(f"{h:>{w}s}" if i else f"{h:{w}s}" for i, (h, w) in enumerate(zip(HEADER, widths))))
    for row in table_rows(r):
        log("".join(f"{c:>{w}s}" if i else f"{c:{w}s}" for i, (c, w) in enumerate(zip(row, widths))))


def markdown_tables(r: dict) -> str:
    ea, eb = r["endpoints"]["A"], r["endpoints"]["B"]
    out = [f"Models (GPT-2, {r['config']['n_layer']} layers, d = {r['config']['n_embd']}, {r['config']['n_head']} heads, "
           f"vocab {r['config']['vocab_size']}, context {r['config']['n_positions']}): "
           f"A validation loss {ea['validation_loss']:.4f}, test loss {ea['test_loss']:.4f} "
           f"(next-token accuracy {100 * ea['test_accuracy']:.2f} %); B validation loss {eb['validation_loss']:.4f}, "
           f"test loss {eb['test_loss']:.4f} ({100 * eb['test_accuracy']:.2f} %).", "",
           f"Loss along θ(α) on {r['data']['curve']} held-out paragraphs, {len(r['alphas'])} points; "
           f"residual group: {r['residual']}.", "",
           "| " + " | ".join(HEADER) + " |", "|---|---|---|---|---|"]
    out += ["| " + " | ".join(row) + " |" for row in table_rows(r)]
    return "\n".join(out) + "\n"


def unlabeled_row(argv) -> int:
    """``--unlabeled-row``: B4 with unlabeled data — the cached pair aligned from unlabeled text (activation
    matching, + REPAIR, learned alignment) and the loss along θ(α) on the held-out curve paragraphs; one row per
    call, printed as one JSON line. Alignment data: the first ``--n`` paragraphs of the validation split
    (unlabeled text, never the evaluation set); curves on ``curve.txt`` (300 test paragraphs), ``--points`` α
    values. Run the benchmark first (it trains or finds the pair and writes the text files). ``--untie`` gives
    the LM head a tensor of its own, so that the final LayerNorm folds into it and the residual stream can take
    its largest group (O(d−1)); the merged model then has an untied head."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpt2_text --unlabeled-row")
    p.add_argument("--match", default="learned", choices=("weights", "activations", "learned"))
    p.add_argument("--symmetries", default="heads,attn,ffn,rescale,residual")
    p.add_argument("--residual", default="permutation", choices=("permutation", "largest"))
    p.add_argument("--untie", action="store_true")
    p.add_argument("--n", type=int, default=512, help="unlabeled validation paragraphs for alignment")
    p.add_argument("--steps", type=int, default=100, help="learned alignment steps")
    p.add_argument("--batch", type=int, default=32, help="paragraphs per learned step")
    p.add_argument("--points", type=int, default=5)
    p.add_argument("--repair", action="store_true", help="REPAIR at every α (statistics on the alignment data)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(a.threads)
    from symmerge.merge.barrier import repaired_curve
    from symmerge.evaluate.metrics import interpolation_curve
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import LearnSettings

    root = cache_dir()
    folders = [sorted((root / "gpt2").glob(f"pydocs-{n}-*"))[-1] for n in "AB"]
    model_a, model_b = (load_model(f) for f in folders)
    texts = root / "benchmarks" / "gpt2-text"
    curve = load_data(texts / "curve.txt", model_a, batch_size=32)
    opts = AlignOptions(symmetries=a.symmetries, match=a.match, residual=a.residual, untie=a.untie,
                        align_data=None if a.match == "weights" else texts / "validation.txt", align_samples=a.n,
                        learn=LearnSettings(steps=a.steps, batch=a.batch))
    load = os.getloadavg()[0]
    t, cpu = time.perf_counter(), time.process_time()
    res = align_pair(model_a, model_b, opts)
    secs, cpu = time.perf_counter() - t, time.process_time() - cpu
    alphas = [i / (a.points - 1) for i in range(a.points)]
    if a.repair:
        c = repaired_curve(res.model, res.anchor, curve, alphas, opts, progress=False)
    else:
        c = interpolation_curve(res.model, res.anchor, curve, alphas, progress=False)
    learned = {k: v for k, v in res.report.get("learned", {}).items() if k != "history"}
    print(json.dumps({"args": vars(a), "align_seconds": secs, "align_cpu_seconds": cpu, "load_average": load,
                      "alphas": alphas, "loss": c["loss"], "barrier": c["barrier"],
                      "mid_loss": c["loss"][len(alphas) // 2], "learned": learned}))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--unlabeled-row" in argv:
        return unlabeled_row([x for x in argv if x != "--unlabeled-row"])
    args = parse_args(argv)
    return bench_main(args, lambda: train_pair(args, prepare_data(args, work_dir(args)), print), run,
                      print_tables, write_outputs, "lmc.png, tables.md")


if __name__ == "__main__":
    sys.exit(main())
