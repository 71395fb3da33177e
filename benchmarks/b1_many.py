"""B1 × 4 (issue 20): four B1 ViTs from seeds 0–3 merged in one frame — the star (every model aligned to
one anchor) against joint alignment (every model to the mean of the others), each with the ``weights``
(data-free), ``activations`` and ``learned`` matchers — by the plain average, Fisher and RegMean.

    .venv/bin/python -m benchmarks.b1_many --out DIR [--n 2,3,4] [--match weights,activations,learned]
        [--methods average,fisher,regmean] [--methods-at 4] [--methods-for ROWS] [--refine all] [--trace] [--tiny]

1. The models are B1's (``benchmarks.vit_fashion_mnist``: ``ViTForImageClassification``, hidden 128, 6
   layers, 4 heads, FFN 256, patch 7, 5 000 steps of 128 on Fashion-MNIST), loaded from its cache by
   its own training function and names: seeds 0, 1 as ``fmnist-A`` / ``fmnist-B`` (``--seeds 0,1``),
   seeds 2, 3 as ``fmnist-A`` / ``fmnist-B`` with ``--seeds 2,3``. Train them first with
   ``python -m benchmarks.vit_fashion_mnist [--seeds 2,3] --train-only A|B`` (a missing one is trained
   here, ~20 minutes each).
2. For each N of ``--n`` (models 0..N−1, N ≤ 4): the endpoints, their ensemble (mean predicted
   probabilities), and one row per alignment — none; star and joint with every ``--match``. Each
   alignment runs once (as ``merge`` runs it: the anchor closest to the average, two models: the
   second; ``recommended`` groups; unlabeled data: the first ``--align-samples`` images of B1's
   statistics file, labels ignored, never the test set), and the aligned models are merged by
   :func:`~symmerge.merge.fuse.merge_models` with every method of ``--methods`` (at N =
   ``--methods-at``, for the rows of ``--methods-for``; the plain average elsewhere), all parameters merged (the classifiers too:
   the models share the label space, as in B1). Fisher: 500 training images (per-example); RegMean:
   2 000 (B1's statistics).
3. Scores on all 10 000 test images: accuracy and loss of each merge, its accuracy as a fraction of the
   endpoints' mean and its loss minus the best endpoint's.
4. Speed: one pairwise data-free alignment (model 0 to model 1, ``recommended``) timed in the same
   process, against the joint data-free alignment of the N models (ratio; issue 20's goal: ≤ 3× at
   N = 4) and the joint learned alignment's seconds (goal: ≤ 3 minutes); wall and process CPU seconds,
   with the load average at each row.

``--tiny``: B1's ``--tiny`` models (hidden 16, one layer, 30 steps) and data subset, the learned
alignment shortened to a few steps: the smoke test. N = 8 with B1's models is too expensive here (four
more models, ~20 minutes each): ``benchmarks.many_models --n 8`` gives the N = 8 figures on the
MNIST-5k ViTs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from benchmarks import vit_fashion_mnist as b1
from benchmarks.common import add_run_args, bench_main, printed, write_results
from symmerge.evaluate.metrics import evaluate, evaluate_ensemble
from symmerge.io.data import load_data
from symmerge.io.model import load_model
from symmerge.merge.fuse import MergeOptions, align_all, choose_anchor, merge_models, resolve_alignment
from symmerge.merge.heads import check_bodies
from symmerge.pipeline.align import align_pair
from symmerge.core.distance import parameter_keys
from symmerge.pipeline.joint import JointSteps, align_joint, mean_state_dict
from symmerge.pipeline.options import AlignOptions, LearnSettings
from symmerge.pipeline.verify import with_state_dict

PAIRS = ("0,1", "2,3")  # B1's seeds, as trained by ``vit_fashion_mnist --seeds S,T --train-only A|B``


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.b1_many", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/b1-many", help="output folder (must not exist or be empty)")
    p.add_argument("--n", default="2,3,4", help="numbers of models merged, comma list (models 0..N-1, N <= 4)")
    p.add_argument("--match", default="weights,activations,learned", help="matchers compared, star and joint each")
    p.add_argument("--methods", default="average,fisher,regmean", help="merge methods, comma list")
    p.add_argument("--methods-at", type=int, default=4, help="N at which the methods besides average run")
    p.add_argument("--methods-for", default="all", help="the rows (variant labels, comma list, e.g. 'none,star "
                   "weights,joint weights') that the methods besides average run for (default: all)")
    p.add_argument("--refine", default="all", help="what the joint rounds re-solve (all, discrete), comma list: "
                   "one joint row each for the closed-form matchers")
    p.add_argument("--descent-rounds", action="store_true", help="also the joint data-free alignment with the "
                   "rounds it had before the sweeps (each step a capped pairwise re-alignment from the stream tensors, "
                   "after a converged star: align_joint(steps=JointSteps(warm=False))), for the speed and accuracy "
                   "comparison in one run")
    p.add_argument("--align-samples", type=int, default=1000,
                   help="unlabeled training images for activations and learned (default 1000)")
    p.add_argument("--trace", action="store_true", help="the plain average's test accuracy after the star and "
                   "every round of the closed-form joint rows (diagnosis only: nothing is chosen by it)")
    p.add_argument("--depth-decay", type=float, default=1.0,
                   help="the data-free objective's layers weighted by depth (--depth-decay; default 1: off): the "
                        "star's alignments and the joint rounds")
    p.add_argument("--tiny", action="store_true", help="B1's tiny models and data subset: the smoke test")
    add_run_args(p)
    args = p.parse_args(argv)
    args.ns = [int(n) for n in args.n.split(",")]
    if not all(2 <= n <= 2 * len(PAIRS) for n in args.ns):
        p.error(f"--n: every N must lie in 2..{2 * len(PAIRS)} (B1 models from seeds 0-3)")
    if args.tiny:
        args.align_samples = min(args.align_samples, 64)
    return args


def b1_args(tiny: bool, seeds: str):
    """B1's own settings (``vit_fashion_mnist``'s defaults) for the pair of ``seeds``: its cache names."""
    return b1.parse_args((["--tiny"] if tiny else []) + ["--seeds", seeds])


def load_b1(args, count: int, log=print):
    """B1's data files and its first ``count`` models (seeds 0..count−1, from B1's cache)."""
    first = b1_args(args.tiny, PAIRS[0])
    arrays, files = b1.prepare_data(first, b1.work_dir(first))
    folders = []
    for seeds in PAIRS[:(count + 1) // 2]:
        folders += b1.train_pair(b1_args(args.tiny, seeds), arrays, log)[2]
    return first, files, folders[:count]


def align_options(args, match: str, stats_npz) -> AlignOptions:
    learn = LearnSettings(steps=3) if args.tiny else None  # --tiny: a few steps only (the recipe's defaults else)
    return AlignOptions(symmetries="recommended", match=match, align_samples=args.align_samples,
                        align_data=stats_npz if match != "weights" else None,
                        depth_decay=args.depth_decay, **({"learn": learn} if learn else {}))


def align_group(group, names, options: AlignOptions, mode: str, refine: str = "all", trace=None, warm: bool = True):
    """``group`` aligned as ``merge`` aligns it: the anchor by its rule, ``recommended`` resolved against
    it, then the star (``align_all``) or the joint alignment. Returns (aligned models, info). ``trace``
    (test data): for a closed-form joint alignment, the plain average's accuracy and loss after the star
    and every round (``per_round``: (accuracy, loss) pairs; their evaluation is not counted in the seconds)."""
    body = check_bodies(group, names)
    anchor_model, anchor = choose_anchor(group, names, body, None, None, None)
    opts, _ = resolve_alignment(list(zip(names, group)), anchor_model, options)
    t, cpu, load = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    info = {"anchor": anchor["index"], "symmetries": list(opts.symmetries)}
    traced, off = [], [0.0, 0.0]

    def on_round(_, current):
        t1, c1 = time.perf_counter(), time.process_time()
        sds = [x.state_dict() for x in current]
        e = evaluate(with_state_dict(current[0], mean_state_dict(sds, parameter_keys(current[0]))), trace,
                     progress=False)
        traced.append((e["accuracy"], e["loss"]))
        off[0] += time.perf_counter() - t1
        off[1] += time.process_time() - c1

    if mode == "joint":
        joint = align_joint(list(group), opts, anchor=anchor["index"], names=names, refine=refine,
                            steps=JointSteps(warm=warm) if warm else JointSteps(star_sweeps=None, warm=False),
                            on_round=on_round if trace is not None and opts.match != "learned" else None)
        aligned = joint.models
        info.update(rounds=joint.report["rounds"], spread=(joint.report["objective"][0], joint.report["objective"][-1]),
                    learned_seconds=joint.report.get("learned", {}).get("seconds"))
    else:
        aligned, _ = align_all(list(zip(names, group)), anchor_model, body, opts)
    info.update(seconds=time.perf_counter() - t - off[0], cpu_seconds=time.process_time() - cpu - off[1], load=load)
    if traced:
        info["per_round"] = traced
    return aligned, info


def merged_scores(aligned, method: str, stats, test, fit=None) -> dict:
    """``aligned`` merged by ``method`` through ``merge_models`` (already aligned: no alignment there; all
    parameters merged), scored on ``test`` (and, given ``fit``, on the alignment images: ``fit``)."""
    opts = MergeOptions(method=method, align=AlignOptions(symmetries="none"), heads="merge",
                        data=[stats[method]] if method in stats else [], evaluate=False, progress=False)
    t = time.perf_counter()
    merged, _ = merge_models(list(aligned), options=opts)
    seconds = time.perf_counter() - t
    fitted = {} if fit is None else {"fit": evaluate(merged, fit, progress=False)}
    return {**evaluate(merged, test, progress=False), "merge_seconds": seconds, **fitted}


def pairwise_seconds(group, options: AlignOptions) -> dict:
    """One pairwise alignment, model 0 to model 1 (``recommended`` resolved against model 1), timed."""
    opts = options.for_model(group[1])
    t, cpu, load = time.perf_counter(), time.process_time(), os.getloadavg()[0]
    align_pair(group[0], group[1], opts)
    return {"seconds": time.perf_counter() - t, "cpu_seconds": time.process_time() - cpu, "load": load}


def run(args, log=print) -> dict:
    t0 = time.perf_counter()
    settings, files, folders = load_b1(args, max(args.ns), log)
    models = [load_model(f) for f in folders]
    names = [f"seed {i}" for i in range(len(models))]
    test = load_data(files["test"], models[0], batch_size=500)
    stats = {"fisher": load_data(files["stats"], models[0], batch_size=100, max_examples=settings.fisher_examples),
             "regmean": load_data(files["stats"], models[0], batch_size=100, max_examples=settings.gram_examples)}
    # the unlabeled alignment images, labelled here only to measure how well the average fits where it was aligned
    fit = load_data(files["stats"], models[0], batch_size=500, max_examples=args.align_samples)
    singles = [{**evaluate(m, test, progress=False), "fit": evaluate(m, fit, progress=False)} for m in models]
    for name, s in zip(names, singles):
        log(f"{name}: test accuracy {100 * s['accuracy']:.2f} %, loss {s['loss']:.4f}")
    t = time.perf_counter()
    speed = {"pairwise_weights": pairwise_seconds(models[:2], align_options(args, "weights", None))}
    log(f"one pairwise data-free alignment: {speed['pairwise_weights']['seconds']:.1f} s")
    rows = []
    for n in args.ns:
        group, group_names = models[:n], names[:n]
        ens = evaluate_ensemble(group, test, progress=False)
        mean_acc = sum(s["accuracy"] for s in singles[:n]) / n
        best_loss = min(s["loss"] for s in singles[:n])
        variants = [("none", None, None, None)]
        for match in args.match.split(","):
            variants.append((f"star {match}", "star", match, None))
            refines = ["all"] if match == "learned" else args.refine.split(",")
            variants += [(f"joint {match}" + (f" ({r})" if len(refines) > 1 else ""), "joint", match, r)
                         for r in refines]
            if match == "weights" and args.descent_rounds:
                variants.append(("joint weights (all, descent rounds)", "joint", match, "all-descent"))
        for label, mode, match, refine in variants:
            methods = (args.methods.split(",") if n == args.methods_at and
                       (args.methods_for == "all" or label in args.methods_for.split(",")) else ["average"])
            if mode is None:
                aligned, info = group, {"anchor": None, "seconds": 0.0, "cpu_seconds": 0.0, "load": os.getloadavg()[0]}
            else:
                aligned, info = align_group(group, group_names, align_options(args, match, files["stats"]), mode,
                                            refine.removesuffix("-descent") if refine else refine,
                                            test if args.trace else None, warm=not (refine or "").endswith("-descent"))
            row = {"n": n, "variant": label, "mode": mode, "match": match, "refine": refine, **info,
                   "endpoints_mean_accuracy": mean_acc, "best_endpoint_loss": best_loss,
                   "ensemble_accuracy": ens["accuracy"], "ensemble_loss": ens["loss"], "merges": {}}
            for method in methods:
                s = merged_scores(aligned, method, stats, test, fit if method == "average" else None)
                row["merges"][method] = {**s, "accuracy_vs_endpoints": s["accuracy"] / mean_acc,
                                         "loss_minus_best_endpoint": s["loss"] - best_loss}
            rows.append(row)
            avg = row["merges"]["average"]
            log(f"N={n} {label:22s} average {100 * avg['accuracy']:.2f} % ({100 * avg['accuracy_vs_endpoints']:.1f} % "
                f"of endpoints), loss {avg['loss']:.4f} (best endpoint {best_loss:.4f})"
                + "".join(f", {m} {100 * row['merges'][m]['accuracy']:.2f} %" for m in methods if m != "average")
                + (f"; per round {[round(100 * a, 2) for a, _ in info['per_round']]}" if "per_round" in info else "")
                + f"; align {info['seconds']:.1f} s wall, {info['cpu_seconds']:.1f} s CPU (load {info['load']:.1f})")
    # the same pairwise alignment again after the rows: how much the machine's load moved the figures
    speed["pairwise_weights_after"] = pairwise_seconds(models[:2], align_options(args, "weights", None))
    top = max(args.ns)
    for key, mode, match, refine in (("joint_weights", "joint", "weights", "all"), ("joint_learned", "joint", "learned", "all"),
                                     ("joint_weights_discrete", "joint", "weights", "discrete"),
                                     ("joint_weights_descent", "joint", "weights", "all-descent"),
                                     ("star_weights", "star", "weights", None)):
        row = next((r for r in rows if (r["n"], r["mode"], r["match"], r["refine"]) == (top, mode, match, refine)), None)
        if row is not None:
            speed[key] = {"n": top, **{k: row[k] for k in ("seconds", "cpu_seconds", "load")}}
    if "joint_weights" in speed:
        p = speed["pairwise_weights"]
        speed["joint_weights_over_pairwise"] = speed["joint_weights"]["seconds"] / p["seconds"]
        speed["joint_weights_over_pairwise_cpu"] = speed["joint_weights"]["cpu_seconds"] / p["cpu_seconds"]
    return {"benchmark": "B1 x N: B1 ViTs from seeds 0..N-1 in one frame (issue 20)", "tiny": args.tiny,
            "command": " ".join(["python -m benchmarks.b1_many"] + (sys.argv[1:] if sys.argv[0].endswith("b1_many.py")
                                                                    else [])),
            "config": {k: getattr(settings, k) for k in ("hidden", "layers", "heads", "intermediate", "patch",
                                                          "steps", "batch_size", "lr")},
            "data": {"test": test.n, "test_npz": str(files["test"]), "stats_npz": str(files["stats"]),
                     "align": args.align_samples, "fisher": stats["fisher"].n,
                     "regmean": stats["regmean"].n},
            "endpoints": [{"name": nm, "folder": str(f), **s} for nm, f, s in zip(names, folders, singles)],
            "rows": rows, "speed": speed, "load_average": os.getloadavg(), "seconds_total": time.perf_counter() - t0,
            "seconds_rows": time.perf_counter() - t}


def _cell(row: dict, method: str, key: str = "accuracy") -> str:
    m = row["merges"].get(method)
    return "" if m is None else f"{100 * m[key]:.2f}"


def _fit(r: dict, row: dict) -> str:
    """The average's accuracy on the alignment images against the endpoints' mean there."""
    fit = row["merges"]["average"].get("fit")
    ends = [e["fit"]["accuracy"] for e in r["endpoints"][:row["n"]] if "fit" in e]
    return "" if fit is None or not ends else f"{100 * fit['accuracy']:.2f} / {100 * sum(ends) / len(ends):.2f}"


def print_tables(r: dict, log=print) -> None:
    log("\nendpoints: " + ", ".join(f"{e['name']} {100 * e['accuracy']:.2f} % / {e['loss']:.4f}" for e in r["endpoints"])
        + f" ({r['data']['test']} test images)")
    log("\n| N | alignment | average (%) | % of endpoints' mean | loss − best endpoint | ensemble (%) | Fisher (%) | "
        "RegMean (%) | align s wall / CPU (load) | alignment images: average / endpoints (%) |")
    log("|---|---|---|---|---|---|---|---|---|---|")
    for row in r["rows"]:
        avg = row["merges"]["average"]
        log(f"| {row['n']} | {row['variant']} | {100 * avg['accuracy']:.2f} | {100 * avg['accuracy_vs_endpoints']:.1f} | "
            f"{avg['loss_minus_best_endpoint']:+.4f} | {100 * row['ensemble_accuracy']:.2f} | {_cell(row, 'fisher')} | "
            f"{_cell(row, 'regmean')} | {row['seconds']:.1f} / {row['cpu_seconds']:.1f} ({row['load']:.1f}) | "
            f"{_fit(r, row)} |")
    for row in r["rows"]:
        if row.get("per_round"):
            log(f"N={row['n']} {row['variant']}: average after the star, round 1, 2, ... (%): "
                + ", ".join(f"{100 * a:.2f}" for a, _ in row["per_round"]))
    s = r["speed"]
    p = s["pairwise_weights"]
    log(f"\nspeed: one pairwise data-free alignment {p['seconds']:.1f} s wall / {p['cpu_seconds']:.1f} s CPU "
        f"(load {p['load']:.1f})" + (f"; again after the rows: {s['pairwise_weights_after']['seconds']:.1f} s wall / "
                                     f"{s['pairwise_weights_after']['cpu_seconds']:.1f} s CPU"
                                     if "pairwise_weights_after" in s else ""))
    if "joint_weights" in s:
        j = s["joint_weights"]
        log(f"joint data-free alignment of {j['n']}: {j['seconds']:.1f} s wall / {j['cpu_seconds']:.1f} s CPU = "
            f"{s['joint_weights_over_pairwise']:.2f}x / {s['joint_weights_over_pairwise_cpu']:.2f}x one pairwise "
            "(goal <= 3x)")
    for key, what in (("joint_weights_discrete", "joint data-free alignment of {n}, permutations re-solved only (discrete)"),
                      ("joint_weights_descent", "joint data-free alignment of {n}, the rounds before the sweeps (descent rounds)"),
                      ("star_weights", "the star of {n} (converged pairwise alignments to the anchor)")):
        if key in s:
            j = s[key]
            log(f"{what.format(n=j['n'])}: {j['seconds']:.1f} s wall / {j['cpu_seconds']:.1f} s CPU = "
                f"{j['seconds'] / p['seconds']:.2f}x / {j['cpu_seconds'] / p['cpu_seconds']:.2f}x")
    if "joint_learned" in s:
        j = s["joint_learned"]
        log(f"joint learned alignment of {j['n']}: {j['seconds']:.1f} s wall / {j['cpu_seconds']:.1f} s CPU "
            f"(load {j['load']:.1f}; goal <= 180 s)")


def main(argv=None) -> int:
    return bench_main(parse_args(argv), lambda: None, run, print_tables,
                      lambda r, out: write_results(out, r, printed(print_tables, r)), "tables.md")


if __name__ == "__main__":
    raise SystemExit(main())
