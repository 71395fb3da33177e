"""mergekit's interpolating methods on two models trained apart, with and without alignment.

    python -m benchmarks.interpolating_methods [--pair demo|b1|b7] [--out DIR] [--seed 0] [--quick] [--points 5]

``--pair demo`` (the default) is the demo's (:mod:`symmerge.demo.demo`): two ViTs (hidden 64, 2 layers, 4 heads) trained from seeds
``seed`` and ``seed + 1`` on 4 000 MNIST-5k digits, cached by the demo's training, scored on the 1 000 held-out
digits. ``--pair b1``: B1's two ViTs (hidden 128, 6 layers; Fashion-MNIST, seeds 0 and 1, trained and cached by
``benchmarks.vit_fashion_mnist``), the paths scored on B1's 2 000 curve images, the alignments of B1's rows "best
data-free" and "learned" (1 000 unlabeled training images). ``--pair b7``: B7's two Llamas (cached by
``benchmarks.llama_text``), the paths scored on its 200 held-out paragraphs (loss; accuracy: of the next token),
the alignments of B7's rows "recommended" and "learned" with B7's recorded learned settings (200 steps × 8
paragraphs ≤ 64 tokens, 256 positions, bf16) on its 500 validation paragraphs.

Model A is brought into B's frame three ways — not at all, the best data-free set (heads, attn, ffn,
rescale, residual; weight matching) and the learned alignment on the 1 000 training images without their labels
— and each pair is merged by ``linear``, ``slerp`` (base B, t), ``nuslerp``, ``multislerp`` and ``karcher``
(mergekit's rules, :mod:`symmerge.merge`). Per method and alignment: test accuracy and loss of the midpoint, and
along the method's own path (``t`` for slerp, the weights (1 − t, t) for the others) the loss barrier: the
largest excess of the loss over the straight line between the endpoints' losses (``karcher`` takes no weights:
its uniform mean is the midpoint only, and it has no barrier). ``model_stock`` is left out:
it needs a common base model, which models trained apart do not have.

Writes ``results.json`` into ``--out`` and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

METHODS = ("linear", "slerp", "nuslerp", "multislerp", "karcher")
ALIGN_BEST = "heads,attn,ffn,rescale,residual"


def merge_pair(method: str, a: dict, b: dict, t: float) -> dict:
    """θ of ``method`` at position ``t`` between B (t = 0) and A (t = 1), in mergekit's convention."""
    from symmerge.merge import get_method

    m = get_method(method)
    if method == "slerp":  # the base is B, the other model A
        return m.merge([a], base=b, t=t)
    if method == "karcher":  # no weights
        return m.merge([b, a])
    return m.merge([b, a], weights=[1.0 - t, t])


def path(method, a_sd, b_sd, holder, test, ts) -> dict:
    from symmerge.evaluate.metrics import evaluate

    losses, accs = [], []
    if method == "karcher":  # no weights: the uniform Karcher mean is the one point between the endpoints
        ts = [0.0, 0.5, 1.0]
    for t in ts:
        if t == 0.0:
            sd = b_sd
        elif t == 1.0:
            sd = a_sd
        else:
            sd = merge_pair(method, a_sd, b_sd, t)
        holder.load_state_dict(sd)
        r = evaluate(holder, test, progress=False)
        losses.append(r["loss"])
        accs.append(r["accuracy"])
    line = [losses[0] + (losses[-1] - losses[0]) * t for t in ts]
    return {"t": list(ts), "loss": losses, "accuracy": accs,
            "barrier": None if method == "karcher" else max(x - y for x, y in zip(losses, line))}


def demo_setup(args):
    """(folders, A, B, test data, variants, description) of the demo's pair."""
    from symmerge.demo.demo import FULL, QUICK, demo_pair
    from symmerge.io.data import load_data
    from symmerge.io.model import load_model
    from symmerge.pipeline.options import AlignOptions, LearnSettings

    setup = QUICK if args.quick else FULL
    folders, train_npz, test_npz, _, n_test, _ = demo_pair(setup, args.seed, progress=False)
    a, b = (load_model(f) for f in folders)
    test = load_data(test_npz, a, batch_size=250)
    unlabeled = load_data(train_npz, a, batch_size=50, max_examples=setup.stats_examples)
    variants = {
        "none": None,
        "data-free (best set)": AlignOptions(symmetries=ALIGN_BEST),
        "learned": AlignOptions(symmetries=ALIGN_BEST, match="learned", align_data=unlabeled,
                                align_samples=setup.stats_examples, learn=LearnSettings(steps=setup.learn_steps)),
    }
    return folders, a, b, test, variants, {"setup": "quick" if args.quick else "full", "test_digits": n_test}


def b1_setup(args):
    """B1's pair (trained and cached by ``benchmarks.vit_fashion_mnist``), its curve images and its rows."""
    from benchmarks import unlabeled, vit_fashion_mnist

    b1 = vit_fashion_mnist.parse_args(["--tiny"] if args.tiny else [])
    if args.tiny:
        b1.align_samples = 64
    _config, _seeds, folders, _arrays, files, a, b, _test, curve = vit_fashion_mnist.load_pair(b1, print)
    variants = {"none": None,
                "data-free (best set)": unlabeled.row_options("best data-free (all groups, weights)", files["stats"],
                                                              b1.align_samples),
                "learned": unlabeled.row_options("learned", files["stats"], b1.align_samples)}
    return folders, a, b, curve, variants, {"curve_images": curve.n, "align_images": b1.align_samples}


def b7_setup(args):
    """B7's pair (trained and cached by ``benchmarks.llama_text``), its curve paragraphs and its rows."""
    from benchmarks import llama_text
    from symmerge.io.data import load_data
    from symmerge.io.model import load_model

    b7 = llama_text.parse_args(["--tiny"] * args.tiny + [
        "--learn-batch", "8", "--learn-max-length", "64", "--learn-positions", "256",
        "--learn-steps", "5" if args.tiny else "200", "--learn-precision", "bfloat16", "--learn-check-batches", "4"])
    data = llama_text.prepare_data(b7, llama_text.work_dir(b7))
    _config, _seeds, folders = llama_text.train_pair(b7, data, print)
    a, b = (load_model(f) for f in folders)
    curve = load_data(data["files"]["curve"], a, batch_size=32, max_examples=b7.curve_examples)
    align_file = data["files"]["validation"]
    variants = {"none": None, "data-free (recommended)": llama_text.row_options(b7, "recommended", align_file),
                "learned": llama_text.row_options(b7, "learned", align_file)}
    return folders, a, b, curve, variants, {"curve_paragraphs": curve.n, "align_paragraphs": b7.align_examples}


SETUPS = {"demo": demo_setup, "b1": b1_setup, "b7": b7_setup}


def run(args) -> dict:
    import torch

    from symmerge.pipeline.align import align_pair

    t_start = time.perf_counter()
    torch.manual_seed(0)
    folders, a, b, test, variants, about = SETUPS[args.pair](args)
    ts = [i / (args.points - 1) for i in range(args.points)]
    if 0.5 not in ts:
        raise SystemExit("--points must be odd (the midpoint is measured)")
    rows = []
    for variant, options in variants.items():
        t0 = time.perf_counter()
        if options is None:
            a_sd, b_sd, holder = a.state_dict(), b.state_dict(), copy.deepcopy(b)
        else:
            res = align_pair(a, b, options, progress=None)
            a_sd, b_sd, holder = res.model.state_dict(), res.anchor.state_dict(), copy.deepcopy(res.anchor)
        align_s = time.perf_counter() - t0
        for method in METHODS:
            t1 = time.perf_counter()
            p = path(method, a_sd, b_sd, holder, test, ts)
            mid = p["t"].index(0.5)
            rows.append({"method": method, "alignment": variant, "midpoint_accuracy": p["accuracy"][mid],
                         "midpoint_loss": p["loss"][mid], "barrier": p["barrier"], "path": p,
                         "align_seconds": align_s, "seconds": time.perf_counter() - t1})
            barrier = "n/a" if p["barrier"] is None else f"{p['barrier']:.4f}"
            print(f"{method:11s} {variant:22s} midpoint acc {p['accuracy'][mid]:.4f} loss {p['loss'][mid]:.4f} "
                  f"barrier {barrier}", flush=True)
    return {"pair": args.pair, "folders": [str(f) for f in folders], **about, "seed": args.seed, "points": ts,
            "rows": rows, "seconds_total": time.perf_counter() - t_start}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.interpolating_methods", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/interpolating-methods")
    p.add_argument("--pair", choices=tuple(SETUPS), default="demo",
                   help="demo (default): the demo's MNIST ViTs; b1: B1's Fashion-MNIST ViTs; b7: B7's Llamas "
                        "(b1 and b7 train their pair first when it is not cached: about 20 / 30 minutes per model)")
    p.add_argument("--seed", type=int, default=0, help="the demo pair's seed (--pair demo)")
    p.add_argument("--quick", action="store_true", help="the demo's quick setup (a smaller pair, seconds)")
    p.add_argument("--tiny", action="store_true", help="--pair b1 / b7: their --tiny setups (the smoke test)")
    p.add_argument("--points", type=int, default=5, help="positions along each path (odd: the midpoint is one)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    result = run(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
