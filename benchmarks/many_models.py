"""N models merged in one frame: the star (every model aligned to one anchor) against joint alignment
(every model to the mean of the others, until the spread stops falling), for N = 2, 3, 4, 8.

ViTs (2 layers, 4 heads, FFN 2·hidden, patch 7) trained from seeds 0..7 on MNIST-5k with the demo's
recipe (4 000 training digits, 800 steps of 64, cached); models 0..N−1 are merged by the plain average
(and, with ``--methods``, Fisher and RegMean on the training digits) and scored on the 1 000 test
digits, beside the endpoints' mean and the ensemble (mean predicted probabilities).

    .venv/bin/python -m benchmarks.many_models --out DIR [--n 2,3,4,8] [--hidden 64] [--match weights,activations]
        [--heads keep|merge] [--refine all,discrete] [--trace]

``--refine all,discrete`` compares what the joint alignment's rounds re-solve (``all``: every group,
MergeMany; ``discrete``: the permutations only, on top of the star's rotations and scales); ``--trace``
adds, for every joint row of the plain average, the average's accuracy after the star and after every
round (the same alignment run again with a callback).

``--match learned`` adds the learned alignment (star: each model learned pairwise to the anchor; joint:
the Dirichlet mixtures of all N, :mod:`symmerge.pipeline.learn_joint`) on the same unlabeled digits.
``--heads merge`` averages the classifiers too (the plain average of all parameters, which the learned
alignment's mixtures are trained as); ``keep`` (default) keeps model 0's classifier, as ``merge`` does.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.common import add_run_args, bench_main, printed, write_results
from symmerge.demo.datasets import cache_dir, mnist_5k_split, write_npz
from symmerge.demo.train import TrainSettings, train_vit, vit_config
from symmerge.evaluate.metrics import evaluate, evaluate_ensemble
from symmerge.io.data import load_data
from symmerge.io.model import load_model
from symmerge.merge.fuse import MergeOptions, merge_models
from symmerge.core.distance import parameter_keys
from symmerge.merge.heads import head_keys
from symmerge.pipeline.joint import align_joint, mean_state_dict
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.verify import with_state_dict


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.many_models", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/many-models", help="output folder (must not exist or be empty)")
    p.add_argument("--n", default="2,3,4,8", help="numbers of models merged, comma list (models 0..N-1)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--match", default="weights,activations", help="matchers compared, star and joint each")
    p.add_argument("--methods", default="average", help="merge methods (average, fisher, regmean), comma list")
    p.add_argument("--methods-at", type=int, default=4, help="N at which the other --methods run (default 4)")
    p.add_argument("--align-samples", type=int, default=1000,
                   help="unlabeled training digits for activations and learned")
    p.add_argument("--refine", default="all,discrete",
                   help="what the joint rounds re-solve (all, discrete), comma list: one joint row each")
    p.add_argument("--trace", action="store_true",
                   help="the plain average's accuracy after the star and every joint round (joint rows)")
    p.add_argument("--heads", choices=("keep", "merge"), default="keep",
                   help="the classifiers: model 0's kept (default, as merge does) or merged with the rest")
    add_run_args(p)
    return p.parse_args(argv)


def train_models(args, x_tr, y_tr, count: int, log=print) -> list:
    config = vit_config(args.hidden, args.layers, 4, 2 * args.hidden, 7, labels=tuple(str(d) for d in range(10)))
    return [train_vit(config, x_tr, y_tr, TrainSettings(steps=args.steps, batch_size=64, lr=2e-3, seed=s),
                      name=f"many-{args.hidden}-seed{s}", progress=False, log=log) for s in range(count)]


def trace_rounds(group, align: AlignOptions, anchor: int, refine: str, heads: str, test) -> list[float]:
    """The plain average's test accuracy after the star (first) and after every round of the joint
    alignment (``align_joint``'s ``on_round``); with ``heads="keep"`` model 0's classifier, as ``merge``."""
    keep = [] if heads == "merge" else sorted(head_keys(group[0]))
    accuracies = []

    def on_round(_, models):
        sds = [x.state_dict() for x in models]
        mean = mean_state_dict(sds, parameter_keys(models[0]))
        mean.update({k: sds[0][k] for k in keep})
        accuracies.append(evaluate(with_state_dict(models[0], mean), test, progress=False)["accuracy"])

    align_joint(list(group), align.for_model(group[anchor]).with_(verify=False), anchor=anchor, refine=refine,
                on_round=on_round)
    return accuracies


def cached_models(args, count: int, log=print) -> tuple[list, list, Path, object]:
    """The first ``count`` MNIST-5k ViTs (trained once, cached): their folders and models, the training
    digits' npz (unlabeled alignment data) and the 1 000 test digits loaded for evaluation."""
    x_tr, y_tr, x_te, y_te = mnist_5k_split(n_test=1000, seed=0)
    folder = cache_dir() / "mnist-5k"
    train_npz, test_npz = write_npz(folder / "train-4000.npz", x_tr, y_tr), write_npz(folder / "test-1000.npz", x_te, y_te)
    folders = train_models(args, x_tr, y_tr, count, log)
    models = [load_model(f) for f in folders]
    return folders, models, train_npz, load_data(test_npz, models[0], batch_size=250)


def run(args, log=print) -> dict:
    t0 = time.perf_counter()
    ns = [int(n) for n in args.n.split(",")]
    folders, models, train_npz, test = cached_models(args, max(ns), log)
    singles = [evaluate(m, test, progress=False) for m in models]
    rows = []
    for n in ns:
        group = models[:n]
        ens = evaluate_ensemble(group, test, progress=False)
        mean_acc = sum(s["accuracy"] for s in singles[:n]) / n
        best_loss = min(s["loss"] for s in singles[:n])
        variants = [("none", None, None, None)]
        for match in args.match.split(","):
            variants.append((f"star {match}", "star", match, None))
            for refine in args.refine.split(","):
                variants.append((f"joint {match}" + (f" ({refine})" if match != "learned" else f" ({refine} start)"),
                                 "joint", match, refine))
        for label, mode, match, refine in variants:
            methods = args.methods.split(",") if n == args.methods_at else ["average"]
            for method in methods:
                align = (AlignOptions(symmetries="none") if mode is None else
                         AlignOptions(symmetries="recommended", match=match,
                                      align_data=train_npz if match != "weights" else None,
                                      align_samples=args.align_samples))
                opts = MergeOptions(method=method, align=align, joint=mode == "joint" if mode else None, heads=args.heads,
                                    **({"joint_refine": refine} if refine else {}),
                                    data=[train_npz] if method != "average" else [], eval_data=[test],
                                    max_examples=1000, progress=False)
                t = time.perf_counter()
                _, report = merge_models(list(group), options=opts)
                merged = report["evaluation"]["merged"][0]
                joint = report["alignment"].get("joint")
                row = {"n": n, "variant": label, "method": method, "accuracy": merged["accuracy"],
                       "loss": merged["loss"], "accuracy_vs_endpoints": merged["accuracy"] / mean_acc,
                       "loss_minus_best_endpoint": merged["loss"] - best_loss, "endpoints_mean_accuracy": mean_acc,
                       "ensemble_accuracy": ens["accuracy"], "ensemble_loss": ens["loss"],
                       "align_seconds": report["timings"]["align"], "seconds": time.perf_counter() - t,
                       "joint_rounds": joint["rounds"] if joint else None,
                       "spread": (joint["objective"][0], joint["objective"][-1]) if joint else None,
                       "anchor": report["alignment"]["anchor"]["index"],
                       "learned_seconds": joint["learned"]["seconds"] if joint and "learned" in joint else None}
                if args.trace and mode == "joint" and method == "average" and match != "learned":
                    row["accuracy_per_round"] = trace_rounds(group, align, row["anchor"], refine, args.heads, test)
                rows.append(row)
                log(f"N={n} {label:18s} {method:8s} acc {100 * row['accuracy']:.2f} % "
                    f"({100 * row['accuracy_vs_endpoints']:.1f} % of endpoints), loss {row['loss']:.4f} "
                    f"(best endpoint {best_loss:.4f}), align {row['align_seconds']:.1f} s"
                    + (f"; per round {[round(100 * a, 1) for a in row['accuracy_per_round']]}"
                       if row.get("accuracy_per_round") else ""))
    return {"benchmark": "N models in one frame (MNIST-5k ViTs)", "hidden": args.hidden, "layers": args.layers,
            "heads": args.heads,
            "steps": args.steps, "endpoints": [{"folder": str(f), **s} for f, s in zip(folders, singles)],
            "rows": rows, "load_average": os.getloadavg(), "seconds_total": time.perf_counter() - t0}


def print_tables(r: dict, log=print) -> None:
    log("\n| N | alignment | method | accuracy (%) | % of endpoints' mean | loss − best endpoint | ensemble (%) | "
        "align s |")
    log("|---|---|---|---|---|---|---|---|")
    for row in r["rows"]:
        log(f"| {row['n']} | {row['variant']} | {row['method']} | {100 * row['accuracy']:.2f} | "
            f"{100 * row['accuracy_vs_endpoints']:.1f} | {row['loss_minus_best_endpoint']:+.4f} | "
            f"{100 * row['ensemble_accuracy']:.2f} | {row['align_seconds']:.1f} |")


def write_outputs(r: dict, out: Path) -> None:
    write_results(out, r, printed(print_tables, r))


def main(argv=None) -> int:
    args = parse_args(argv)
    return bench_main(args, lambda: None, run, print_tables, write_outputs, "tables.md")


if __name__ == "__main__":
    raise SystemExit(main())
