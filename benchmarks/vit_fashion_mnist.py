"""B1 (paper Table 2, Fig. 3, 4, 5; runtimes of Table 3): two ViTs trained from different seeds on
Fashion-MNIST, merged with the paper's six fusion methods — average (Simple), Fisher, RegMean and the
three OT fusions of Imfeld et al. (OT-WTS, OT-ACTS, OT-ACTS-EMD) — under every matching variant.

    python -m benchmarks.vit_fashion_mnist [--out results/vit-fashion-mnist] [--steps N] [--patch 4] [--tiny]

1. Fashion-MNIST (Debian package ``dataset-fashion-mnist``; fetched once into the cache) — 60 000
   train / 10 000 test images.
2. Two ``ViTForImageClassification`` models (hidden 128, 6 layers, 4 heads by default) trained from
   seeds 0 and 1 (``symmerge.train``; cached under ~/.cache/symmerge/vit and reused).
3. Matching variants (model A aligned to model B): none; full (attn+ffn+rescale, the paper's); w/o ATTN
   (ffn only); w/o FFN (attn+rescale); w/o rescale (attn+ffn); a permutation-only baseline (whole
   attention heads permuted by an exact assignment on plain distances, plus the FFN permutation — the
   Git Re-Basin-style counterpart of rotation matching); head pairing + full (heads paired by each
   pair's optimal rotation/rescale objective, jointly exact). Beyond the paper: the residual stream as
   one permutation through every layer, LayerNorm and the classifier, or in its largest group (the
   LayerNorms folded into their readers, then an orthogonal map fixing the all-ones direction), and
   all groups together, solved by coordinate descent until the distance stops decreasing.
   Our best alignment (``BEST_ALIGN``, one constant) is the last, "all groups".
4. Each variant × {average, Fisher, RegMean, OT-WTS, OT-ACTS, OT-ACTS-EMD} (statistics on training
   images, gathered on the aligned models: Fisher diagonals, Gram matrices, and for OT-ACTS the
   activations of ``--acts-examples`` images; the classifier is merged too: both models share the
   label space, and OT fusion transports the residual stream the classifier reads). Test accuracy
   and loss on the full test set; parameter distance between A (matched) and B.
5. LMC curves (loss along θ(α) = α·θ_A + (1−α)·θ_B, between the aligned A and B in A's
   parameterisation) for the variants of LMC_VARIANTS.
6. Fig. 4's external baseline: OT fusion's alignment on the FFN only (as the paper applies it), A
   transported to B by exact EMD (a permutation: the same function) from activations and from weights,
   and by the entropic plan of OT-ACTS (soft: not the same function), beside the matchings' distances.
7. Runtimes: training, matching, simple merge, Fisher, RegMean and the OT fusions (statistics + merge).

Writes ``results.json``, ``lmc.png`` (Fig. 5), ``ablation.png`` (Table 2 / Fig. 3) and ``distance.png``
(Fig. 4) into ``--out``. ``--tiny`` runs the whole pipeline on a tiny model and data subset (< 60 s).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_run_args, bench_main, machine, pair_settings, pyplot
from symmerge.pipeline.align import align_pair
from symmerge.pipeline.options import AlignOptions
from symmerge.io.data import load_data
from symmerge.demo.datasets import FASHION_CLASSES, cache_dir, fashion_mnist, write_npz
from symmerge.core.distance import distance, parameter_keys
from symmerge.evaluate.metrics import evaluate, interpolation_curve
from symmerge.merge.fuse import merge_models
from symmerge.io.model import atomic_dir, load_model, write_json
from symmerge.demo.train import load_report, train_vit, vit_config

METHODS = ("average", "fisher", "regmean", "ot_wts", "ot_acts", "ot_acts_emd")
NAMES = {"average": "Simple", "fisher": "Fisher", "regmean": "RegMean", "ot_wts": "OT-WTS", "ot_acts": "OT-ACTS",
         "ot_acts_emd": "OT-ACTS-EMD"}
# our best alignment, the third column of the Table 2 layout (one constant: change it here)
BEST_ALIGN = "heads,attn,ffn,rescale,residual"
BEST = f"all groups ({BEST_ALIGN.replace(',', '+')} rotation)"
PAPER = "full (attn+ffn+rescale)"
# label -> the alignment: symmetries, and "@permutation" where the residual stream keeps to permutations
# (LayerNorm commutes with them) instead of the largest group (O(d-1) after folding the LayerNorms).
# ``heads``: whole attention heads permuted by an exact assignment; with ``attn`` the pairing cost is each
# pair's optimal rotation/rescale objective, without it the plain distance (the Git Re-Basin-style
# counterpart of rotation matching).
VARIANTS = {
    "none": "none",
    "full (attn+ffn+rescale)": "attn,ffn,rescale",
    "w/o ATTN (ffn)": "ffn",
    "w/o FFN (attn+rescale)": "attn,rescale",
    "w/o rescale (attn+ffn)": "attn,ffn",
    "perm baseline (head perm+ffn)": "heads,ffn",
    "head perm + full": "heads,attn,ffn,rescale",
    # beyond the paper: the residual stream, as permutations and in its largest group
    "perm baseline + residual (head perm+ffn+residual perm)": "heads,ffn,residual@permutation",
    "full + residual permutation": "attn,ffn,rescale,residual@permutation",
    "full + residual LayerNorm rotation": "attn,ffn,rescale,residual",
    BEST: BEST_ALIGN,
}
# ``--variants full-group``: the rows of the full-symmetry-group study (the paper's set, then each group added)
FULL_GROUP = ("none", "full (attn+ffn+rescale)", "head perm + full", "full + residual permutation",
              "full + residual LayerNorm rotation", BEST)
# Fig. 4's OT baseline (the paper applies OT fusion to the FFN only): label -> (method, extra parameters)
OT_BASELINES = {
    "OT-FFN baseline (acts, exact EMD)": ("ot_acts_emd", {}),
    "OT-FFN baseline (wts, exact EMD)": ("ot_wts", {"reg": 0.0}),
    "OT-FFN baseline (acts, Sinkhorn; soft)": ("ot_acts", {}),
}
# Fig. 5 curves: label -> variant label above
LMC_VARIANTS = {"none": "none", "attention-only (attn+rescale)": "w/o FFN (attn+rescale)",
                "FFN-only (ffn)": "w/o ATTN (ffn)", "full (attn+ffn+rescale)": "full (attn+ffn+rescale)",
                "perm baseline (head perm+ffn)": "perm baseline (head perm+ffn)", "head perm + full": "head perm + full",
                "full + residual permutation": "full + residual permutation",
                "full + residual LayerNorm rotation": "full + residual LayerNorm rotation",
                "all groups": BEST}


def options_of(variant: str) -> AlignOptions:
    """The alignment options of a VARIANTS value ("none": no symmetries)."""
    syms, _, residual = variant.partition("@")
    return AlignOptions(symmetries=syms, residual=residual or "largest")

def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.vit_fashion_mnist", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/vit-fashion-mnist", help="output folder (must not exist or be empty)")
    p.add_argument("--tiny", action="store_true", help="tiny model, data subset, few steps: the smoke test")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=256, help="FFN width (default 256)")
    p.add_argument("--patch", type=int, default=7, help="patch size (default 7: 16 patches; patch 4 costs 3.5x more per step on CPU)")
    p.add_argument("--steps", type=int, default=5000,
                   help="training steps per model (default 5000: 10.7 epochs, ~0.17 s/step on one CPU thread)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seeds", default="0,1", help="seeds of models A and B")
    p.add_argument("--gram-examples", type=int, default=2000, help="training images for RegMean's Gram matrices")
    p.add_argument("--fisher-examples", type=int, default=500, help="training images for the Fisher (per-example)")
    p.add_argument("--acts-examples", type=int, default=200,
                   help="training images for OT-ACTS's activations (default 200, as Imfeld et al.; all tokens)")
    p.add_argument("--test-examples", type=int, default=10000, help="test images for the merged models' scores")
    p.add_argument("--curve-examples", type=int, default=2000, help="test images for the LMC curves")
    p.add_argument("--points", type=int, default=11, help="α values on each LMC curve")
    p.add_argument("--variants", choices=("all", "full-group"), default="all",
                   help="alignment variants: all (default: the paper's Table 2/Fig. 4-5 rows and ours) or full-group "
                        "(none, the paper's set, + head permutation, + residual permutation, + residual rotation, all "
                        "groups; no OT baselines)")
    p.add_argument("--data-driven", action="store_true",
                   help="only the unlabeled-data table (issue 13): none, the paper's matching, the best data-free, "
                        "activation matching and learned alignment, each with and without REPAIR, merged with "
                        "average, Fisher and RegMean (benchmarks/unlabeled.py); writes results.json, lmc.png, "
                        "tables.md")
    p.add_argument("--align-samples", type=int, default=1000,
                   help="unlabeled training images for alignment and REPAIR (--data-driven; default 1000)")
    add_run_args(p)
    args = p.parse_args(argv)
    if args.tiny:
        args.hidden, args.layers, args.heads, args.intermediate, args.patch = 16, 1, 2, 32, 7
        args.steps, args.batch_size, args.gram_examples, args.fisher_examples = 30, 64, 128, 16
        args.acts_examples = 16
        args.test_examples, args.curve_examples, args.points = 256, 128, 3
        args.train_examples = 2000
    else:
        args.train_examples = None
    return args


# ---------------------------------------------------------------- pipeline


def work_dir(args) -> Path:
    return cache_dir() / "benchmarks" / ("vit-fashion-mnist-tiny" if args.tiny else "vit-fashion-mnist")


def prepare_data(args, folder: Path):
    x_tr, y_tr = fashion_mnist("train")
    x_te, y_te = fashion_mnist("test")
    if args.train_examples:
        x_tr, y_tr = x_tr[:args.train_examples], y_tr[:args.train_examples]
    rng = np.random.default_rng(0)
    stats_idx = rng.permutation(len(y_tr))[:max(args.gram_examples, args.fisher_examples, args.acts_examples)]
    test_idx = np.arange(min(args.test_examples, len(y_te)))
    curve_idx = rng.permutation(len(y_te))[:args.curve_examples]
    files = {"stats": write_npz(folder / "stats.npz", x_tr[stats_idx], y_tr[stats_idx]),
             "test": write_npz(folder / "test.npz", x_te[test_idx], y_te[test_idx]),
             "curve": write_npz(folder / "curve.npz", x_te[curve_idx], y_te[curve_idx])}
    return (x_tr, y_tr, x_te, y_te), files


def train_pair(args, arrays, log):
    x_tr, y_tr, x_te, y_te = arrays
    config = vit_config(args.hidden, args.layers, args.heads, args.intermediate, args.patch,
                        labels=FASHION_CLASSES)
    seeds, todo = pair_settings(args)
    folders = []
    for name, settings in todo:
        folders.append(train_vit(config, x_tr, y_tr, settings, name=f"fmnist-{'tiny-' if args.tiny else ''}{name}",
                                 eval_images=x_te[:2000], eval_labels=y_te[:2000], log=log,
                                 eval_every=0 if args.tiny else max(50, args.steps // 6)))
    return config, seeds, folders


def load_pair(args, log):
    """The data files, the trained (or cached) pair, and the test and curve sets."""
    arrays, files = prepare_data(args, work_dir(args))
    config, seeds, folders = train_pair(args, arrays, log)
    a, b = (load_model(f) for f in folders)
    return (config, seeds, folders, arrays, files, a, b, load_data(files["test"], a, batch_size=500),
            load_data(files["curve"], a, batch_size=500))


def run(args, log=print) -> dict:
    t_start = time.perf_counter()
    import ot  # noqa: F401  POT's first import takes seconds: kept out of the OT merges' timings
    config, seeds, folders, arrays, files, a, b, test, curve = load_pair(args, log)
    gram = load_data(files["stats"], a, batch_size=100, max_examples=args.gram_examples)
    fisher = load_data(files["stats"], a, batch_size=100, max_examples=args.fisher_examples)
    acts = load_data(files["stats"], a, batch_size=100, max_examples=args.acts_examples)
    log(f"data: {test.n} test images for scores, {curve.n} for curves, {gram.n} / {fisher.n} / {acts.n} training "
        "images for Gram / Fisher / activation statistics")

    endpoints = {}
    for name, m, f, s in (("A", a, folders[0], seeds[0]), ("B", b, folders[1], seeds[1])):
        rep = load_report(f)
        endpoints[name] = {"seed": s, "folder": str(f), "train_seconds": rep["seconds"],
                           "seconds_per_step": rep["seconds_per_step"], "epochs": rep["epochs"],
                           "eval_curve": rep.get("eval_curve", []), **evaluate(m, test, progress=False)}
        log(f"model {name} (seed {s}): test accuracy {endpoints[name]['accuracy']:.4f}, "
            f"loss {endpoints[name]['loss']:.4f}, trained {rep['seconds']:.0f} s")

    keys = parameter_keys(a)  # the whole model (Fig. 4), and without the classifier (the merges' tables)
    body = [k for k in keys if k.startswith("vit.")]
    rows, matching = [], {}
    moved_by = {}
    variants = VARIANTS if args.variants == "all" else {k: VARIANTS[k] for k in FULL_GROUP}
    for label, syms in variants.items():
        # distance of the matched A to B (the paper's Fig. 4), from one alignment outside the merges
        t = time.perf_counter()
        res = None if syms == "none" else align_pair(a, b, options_of(syms))
        moved, end_b = (a, b) if res is None else (res.model, res.anchor)  # B in A's parameterisation
        secs = time.perf_counter() - t
        moved_by[label] = (moved, end_b)
        matching[label] = {"symmetries": syms, "seconds": secs,
                           "distance": distance(moved.state_dict(), end_b.state_dict(), keys),
                           "distance_body": distance(moved.state_dict(), end_b.state_dict(), body)}
        for method in METHODS:
            data = {"average": None, "fisher": fisher, "regmean": gram, "ot_wts": None, "ot_acts": acts,
                    "ot_acts_emd": acts}[method]
            merged, rep = merge_models([a, b], method, align=options_of(syms), data=data, heads="merge",
                                       evaluate_result=False, progress=False)
            score = evaluate(merged, test, progress=False)
            rows.append({"method": method, "variant": label, "symmetries": syms,
                         "test_accuracy": score["accuracy"], "test_loss": score["loss"],
                         "distance_after": next(iter(rep["distances_between_inputs"]["after_alignment"].values())),
                         "timings": rep["timings"]})
            log(f"  {method:11s} {label:31s} accuracy {score['accuracy']:.4f}  loss {score['loss']:.4f}  "
                f"distance {rows[-1]['distance_after']:.2f}")
    ot_distance = ot_baselines(a, b, acts, keys, body, log) if args.variants == "all" else {}

    curves = {}
    alphas = [i / (args.points - 1) for i in range(args.points)]
    for label, v in LMC_VARIANTS.items():
        if v not in moved_by:
            continue
        curves[label] = interpolation_curve(*moved_by[v], curve, alphas, progress=False)
        log(f"  LMC {label:31s} barrier {curves[label]['barrier']:.4f}")

    def mean_timing(method, syms, key):
        vals = [r["timings"][key] for r in rows if r["method"] == method and r["symmetries"] == syms]
        return float(np.mean(vals))

    runtimes = {
        "training_per_model": float(np.mean([endpoints[n]["train_seconds"] for n in "AB"])),
        "matching_full": matching["full (attn+ffn+rescale)"]["seconds"],
        "matching_in_merge_full": float(np.mean([r["timings"]["align"] for r in rows
                                                 if r["symmetries"] == "attn,ffn,rescale"])),
        "simple_merge": mean_timing("average", "none", "merge"),
        "fisher_statistics": mean_timing("fisher", "none", "statistics"),
        "fisher_merge": mean_timing("fisher", "none", "statistics") + mean_timing("fisher", "none", "merge"),
        "regmean_statistics": mean_timing("regmean", "none", "statistics"),
        "regmean_merge": mean_timing("regmean", "none", "statistics") + mean_timing("regmean", "none", "merge"),
        "matching_all_groups": matching[BEST]["seconds"],
        "head_permutation": matching.get("perm baseline (head perm+ffn)", {}).get("seconds"),
        "head_permutation_rotation_aware": matching["head perm + full"]["seconds"],
        "ot_wts_merge": mean_timing("ot_wts", "none", "merge"),
        "ot_acts_statistics": mean_timing("ot_acts", "none", "statistics"),
        "ot_acts_merge": mean_timing("ot_acts", "none", "statistics") + mean_timing("ot_acts", "none", "merge"),
        "ot_acts_emd_merge": mean_timing("ot_acts_emd", "none", "statistics") + mean_timing("ot_acts_emd", "none",
                                                                                              "merge"),
    }
    return {
        "benchmark": "B1 vit_fashion_mnist", "tiny": args.tiny, "command": " ".join(["python -m benchmarks.vit_fashion_mnist"] + sys.argv[1:]),
        "machine": machine(), "config": {k: getattr(config, k) for k in (
            "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size",
            "image_size", "num_labels")},
        "training": {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seeds": seeds,
                     "train_examples": len(arrays[1])},
        "data": {"test": test.n, "curve": curve.n, "gram": gram.n, "fisher": fisher.n, "acts": acts.n},
        "best_align": BEST_ALIGN, "endpoints": endpoints, "merges": rows, "matching": matching,
        "ot_distance": ot_distance,
        "alphas": alphas, "curves": curves, "runtimes": runtimes,
        "seconds_total": time.perf_counter() - t_start,
    }


def ot_baselines(a, b, acts, keys, body, log=print) -> dict:
    """Fig. 4's OT baseline: A transported onto B by OT fusion on the FFN units only (no averaging),
    and its distance to B — over all parameters and over the body."""
    from symmerge.merge.ot_fusion import transported
    from symmerge.merge.statistics import activation_stats

    sd_a, sd_b = a.state_dict(), b.state_dict()
    out, stats = {}, None
    for label, (method, extra) in OT_BASELINES.items():
        t = time.perf_counter()
        if method != "ot_wts" and stats is None:
            stats = [activation_stats(x, acts, progress=False).tensors for x in (a, b)]
        moved = transported(method, [sd_a, sd_b], a, stats=None if method == "ot_wts" else stats, units="ffn",
                            **extra)[0]
        out[label] = {"method": method, "params": {"units": "ffn", **extra}, "seconds": time.perf_counter() - t,
                      "distance": distance(moved, sd_b, keys), "distance_body": distance(moved, sd_b, body)}
        log(f"  {label:40s} distance {out[label]['distance']:.3f}")
    return out


# ---------------------------------------------------------------- output


def write_outputs(result: dict, out: Path) -> None:
    with atomic_dir(out) as tmp:
        write_json(tmp / "results.json", result)
        plot_lmc(result, tmp / "lmc.png")
        plot_ablation(result, tmp / "ablation.png")
        plot_distance(result, tmp / "distance.png")
        (tmp / "tables.md").write_text(markdown_tables(result))


def plot_lmc(result: dict, path) -> None:
    """Paper Fig. 5: test loss (and accuracy) along θ(α) for each matching variant."""
    plt = pyplot()
    fig, (ax_l, ax_a) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, c in result["curves"].items():
        ax_l.plot(result["alphas"], c["loss"], marker="o", ms=4, label=f"{name}: LB {c['barrier']:.3f}")
        ax_a.plot(result["alphas"], c["accuracy"], marker="o", ms=4, label=name)
    ax_l.set(xlabel="α (0 = model B, 1 = model A matched to B)", ylabel="test loss (cross-entropy)",
             title="loss along θ(α) = α·θ_A + (1−α)·θ_B")
    ax_a.set(xlabel="α (0 = model B, 1 = model A matched to B)", ylabel="test accuracy", title="accuracy")
    ax_l.legend(fontsize=8, loc="upper left")
    ax_a.legend(fontsize=8, loc="lower left")
    fig.suptitle(f"two ViTs from different seeds on Fashion-MNIST ({result['data']['curve']} test images)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _methods(r: dict) -> list[str]:
    """The fusion methods of a results file (older files have only the first three)."""
    return [m for m in METHODS if any(x["method"] == m for x in r["merges"])]


def _table2_columns(r: dict) -> list[tuple[str, str]]:
    """(header, variant) of the Table 2 layout present in ``r``."""
    cols = [("w/o match", "none"), ("w/o rescale", "w/o rescale (attn+ffn)"), ("match (paper)", PAPER),
            (f"best ({r.get('best_align', BEST_ALIGN)})", BEST)]
    return [(h, v) for h, v in cols if v in r["matching"]]


def _distances(r: dict) -> dict:
    """Fig. 4 rows: every matching, then the OT baselines (label -> entry with distance and seconds)."""
    return {**r["matching"], **r.get("ot_distance", {})}


def plot_ablation(result: dict, path) -> None:
    plt = pyplot()
    methods = _methods(result)
    fig, ax = plt.subplots(figsize=(14, 5))
    variants = list(result["matching"])
    width = 0.8 / len(variants)
    for k, v in enumerate(variants):
        vals = [next(r["test_accuracy"] for r in result["merges"] if r["method"] == m and r["variant"] == v)
                for m in methods]
        ax.bar([i + (k - (len(variants) - 1) / 2) * width for i in range(len(methods))], vals, width, label=v)
    for name, style in (("A", "--"), ("B", ":")):
        ax.axhline(result["endpoints"][name]["accuracy"], color="grey", ls=style, label=f"model {name}")
    ax.set_xticks(range(len(methods)), [NAMES[m] for m in methods])
    ax.set(ylabel="test accuracy", ylim=(0, 1), title="merged ViTs on Fashion-MNIST: matching ablation")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_distance(result: dict, path) -> None:
    plt = pyplot()
    rows = _distances(result)
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.5))
    labels = list(rows)
    colors = ["tab:orange" if v in result.get("ot_distance", {}) else "tab:blue" for v in labels]
    ax.barh(labels, [rows[v]["distance"] for v in labels], color=colors)
    ax.invert_yaxis()
    ax.set(xlabel="L2 distance ‖θ_A(matched) − θ_B‖",
           title="distance between the end models after matching\n(orange: OT fusion's alignment of the FFN units)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_tables(r: dict, log=print) -> None:
    methods = _methods(r)
    cols = _table2_columns(r)
    log(f"\nTable 2 layout — merged test accuracy (%) on {r['data']['test']} Fashion-MNIST test images "
        f"(A {100 * r['endpoints']['A']['accuracy']:.2f}, B {100 * r['endpoints']['B']['accuracy']:.2f})")
    log(f"{'method':12s}" + "".join(f"{h:>24s}" for h, _ in cols))
    for m in methods:
        acc = {x["variant"]: x["test_accuracy"] for x in r["merges"] if x["method"] == m}
        log(f"{NAMES[m]:12s}" + "".join(f"{100 * acc[v]:24.2f}" for _, v in cols))
    log("\nFig. 3 layout — accuracy (%) / loss per matching variant")
    log(f"{'variant':32s}" + "".join(f"{NAMES[m]:>18s}" for m in methods))
    for v in r["matching"]:
        cells = []
        for m in methods:
            x = next(x for x in r["merges"] if x["method"] == m and x["variant"] == v)
            cells.append(f"{100 * x['test_accuracy']:8.2f} / {x['test_loss']:6.3f}")
        log(f"{v:32s}" + "".join(f"{c:>18s}" for c in cells))
    log("\nFig. 4 layout — distance ‖θ_A(matched) − θ_B‖")
    for v, info in _distances(r).items():
        log(f"  {v:40s} {info['distance']:10.3f}   ({info['seconds']:.2f} s)")
    log("\nFig. 5 — loss barriers")
    for v, c in r["curves"].items():
        log(f"  {v:32s} {c['barrier']:10.4f}")
    log("\nTable 3 layout — runtimes (s)")
    for k, v in r["runtimes"].items():
        if v is not None:  # a variant not run (--variants full-group)
            log(f"  {k:32s} {v:10.2f}")


def markdown_tables(r: dict) -> str:
    """The tables of docs/results.md (paper Table 2, Fig. 3, Fig. 4, Fig. 5, Table 3 layouts)."""
    pct = lambda x: f"{100 * x:.2f}"  # noqa: E731
    acc = {(x["method"], x["variant"]): x for x in r["merges"]}
    methods = _methods(r)
    cols = _table2_columns(r)
    out = [f"Models: A {pct(r['endpoints']['A']['accuracy'])} %, B {pct(r['endpoints']['B']['accuracy'])} % "
           f"test accuracy ({r['data']['test']} test images).", "",
           "**Table 2 layout** — merged test accuracy (%)", "",
           "| | " + " | ".join(h for h, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for m in methods:
        out.append(f"| {NAMES[m]} | " + " | ".join(pct(acc[m, v]["test_accuracy"]) for _, v in cols) + " |")
    out += ["", "**Fig. 3 layout** — merged test accuracy (%) / test loss for every matching variant", "",
            "| matching | " + " | ".join(NAMES[m] for m in methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for v in r["matching"]:
        out.append(f"| {v} | " + " | ".join(f"{pct(acc[m, v]['test_accuracy'])} / {acc[m, v]['test_loss']:.3f}"
                                            for m in methods) + " |")
    out += ["", "**Fig. 4 layout** — L2 distance ‖θ_A(matched) − θ_B‖ over all parameters, and matching time", "",
            "| matching | distance | change | seconds |", "|---|---|---|---|"]
    base = r["matching"]["none"]["distance"]
    for v, x in _distances(r).items():
        out.append(f"| {v} | {x['distance']:.3f} | {100 * (x['distance'] / base - 1):+.1f} % | {x['seconds']:.2f} |")
    out += ["", f"**Fig. 5** — loss barrier along θ(α) ({r['data']['curve']} test images, {len(r['alphas'])} points); "
            "midpoint (α = 0.5) accuracy", "", "| matching | loss barrier | midpoint accuracy (%) |", "|---|---|---|"]
    mid = r["alphas"].index(0.5) if 0.5 in r["alphas"] else len(r["alphas"]) // 2
    for v, c in r["curves"].items():
        out.append(f"| {v} | {c['barrier']:.4f} | {pct(c['accuracy'][mid])} |")
    rt = r["runtimes"]
    out += ["", "**Table 3 layout** — seconds", "", "| stage | seconds |", "|---|---|",
            f"| training (per model, {r['training']['steps']} steps) | {rt['training_per_model']:.1f} |",
            f"| matching (attn+ffn+rescale, per pair) | {rt['matching_full']:.2f} |",
            f"| simple merging | {rt['simple_merge']:.3f} |",
            f"| Fisher merging (statistics {rt['fisher_statistics']:.1f} + merge) | {rt['fisher_merge']:.2f} |",
            f"| RegMean merging (statistics {rt['regmean_statistics']:.1f} + merge) | {rt['regmean_merge']:.2f} |"]
    if "ot_wts_merge" in rt:
        out += [f"| OT-WTS merging | {rt['ot_wts_merge']:.2f} |",
                f"| OT-ACTS merging (statistics {rt['ot_acts_statistics']:.2f} + merge) | {rt['ot_acts_merge']:.2f} |",
                f"| OT-ACTS-EMD merging (statistics + merge) | {rt['ot_acts_emd_merge']:.2f} |"]
    return "\n".join(out) + "\n"


# ---------------------------------------------------------------- unlabeled data (issue 13)


def run_data_driven(args, log=print) -> dict:
    """The unlabeled-data table: alignment on ``--align-samples`` unlabeled training images (the first of
    the statistics file), curves on the curve set, merges scored on the test set."""
    from benchmarks import unlabeled

    t_start = time.perf_counter()
    config, seeds, folders, arrays, files, a, b, test, curve = load_pair(args, log)
    stats = {"fisher": load_data(files["stats"], a, batch_size=100, max_examples=args.fisher_examples),
             "regmean": load_data(files["stats"], a, batch_size=100, max_examples=args.gram_examples)}
    endpoints = {n: evaluate(m, test, progress=False) for n, m in (("A", a), ("B", b))}
    log(f"endpoints: A {endpoints['A']['accuracy']:.4f}, B {endpoints['B']['accuracy']:.4f} test accuracy")
    alphas = [i / (args.points - 1) for i in range(args.points)]
    result = unlabeled.run_rows(a, b, files["stats"], args.align_samples, curve, test, stats, alphas, log=log)
    return {"benchmark": "B1 vit_fashion_mnist --data-driven", "tiny": args.tiny,
            "command": " ".join(["python -m benchmarks.vit_fashion_mnist"] + sys.argv[1:]), "machine": machine(),
            "config": {k: getattr(config, k) for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                         "intermediate_size", "patch_size")},
            "data": {"test": test.n, "curve": curve.n, "align": args.align_samples,
                     "fisher": stats["fisher"].n, "regmean": stats["regmean"].n},
            "endpoints": endpoints, "alphas": alphas, **result, "seconds_total": time.perf_counter() - t_start}


def _endpoints_mean(r: dict) -> float:
    return (r["endpoints"]["A"]["accuracy"] + r["endpoints"]["B"]["accuracy"]) / 2


def print_data_driven(r: dict, log=print) -> None:
    from benchmarks import unlabeled

    log(f"\nunlabeled data — endpoints A {100 * r['endpoints']['A']['accuracy']:.2f} %, "
        f"B {100 * r['endpoints']['B']['accuracy']:.2f} % ({r['data']['test']} test images); in brackets: "
        "% of the endpoints' mean")
    log(unlabeled.markdown(r, _endpoints_mean(r)))


def write_data_driven(r: dict, out: Path) -> None:
    from benchmarks import unlabeled

    with atomic_dir(out) as tmp:
        write_json(tmp / "results.json", r)
        unlabeled.plot(r, tmp / "lmc.png", f"two ViTs on Fashion-MNIST, {r['data']['align']} unlabeled training "
                       f"images for alignment ({r['data']['curve']} test images)")
        (tmp / "tables.md").write_text(unlabeled.markdown(r, _endpoints_mean(r)))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.data_driven or (args.plot_only and "--data-driven" in
                            json.loads(Path(args.plot_only).read_text()).get("benchmark", "")):
        return bench_main(args, lambda: None, run_data_driven, print_data_driven, write_data_driven,
                          "lmc.png, tables.md")
    return bench_main(args, lambda: train_pair(args, prepare_data(args, work_dir(args))[0], print), run,
                      print_tables, write_outputs, "lmc.png, ablation.png, distance.png")


if __name__ == "__main__":
    sys.exit(main())
