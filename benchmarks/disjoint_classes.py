"""Knowledge from models trained apart (issue 42 item 5): two ViTs trained from different seeds on
disjoint halves of the Fashion-MNIST classes, merged, scored on all ten classes.

    python -m benchmarks.disjoint_classes [--out results/disjoint-classes] [--tiny]

1. Models (``symmerge.demo.disjoint``; cached under ~/.cache/symmerge/vit): A trained on the images of
   classes 0–4 only (seed 0), B on those of classes 5–9 only (seed 1); the B1 architecture (hidden 128,
   6 layers, 4 heads, FFN 256, patch 7) with a 10-way head each, 1 500 steps of 128 images.
2. Unlabeled alignment data: ``--align-samples`` training images drawn at random from **all ten
   classes** (their labels are never read). Caveat: the unlabeled set shows the merge the images of
   both halves — no label leaks, but this is more than either model saw; the merge needs it (learned
   alignment, REPAIR and distillation run the models on it).
3. Rows, each scored on the 10 000 test images — on A's half (classes 0–4), on B's half (5–9), on all:
   the endpoints; their ensemble (the average of the two models' **probabilities**, softmax outputs: the
   distillation's target; beside it the average of their logits, i.e. the normalised geometric mean of the
   probabilities);
   the plain average of the weights (no alignment); the data-free aligned average (all groups, weight
   matching); the learned aligned average (all groups, ``--match learned`` on the unlabeled images); the
   learned average with REPAIR; the learned+REPAIR average distilled toward the ensemble on the same
   unlabeled images (``--distill`` STEPS: every parameter moves: *distilled (not function-preserving)*),
   and the plain average distilled likewise (what alignment adds before distillation); ZipIt!-style
   partial merges: the first k transformer layers merged (the learned aligned average), the layers
   after k, the final norm and the head kept from each model, the two branches' probabilities averaged
   (k = 0: only the patch embeddings shared, k = all layers: the merged model with two heads; the
   alignment is ours, not ZipIt!'s
   "zip" of features within one model).
4. Heads are merged in every merge (both models have the same 10-way label space).

Prints the table and writes ``results.json`` and ``tables.md`` into ``--out``. ``--tiny``: a tiny model,
few steps, a data subset: the smoke test (< 60 s).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import add_run_args, bench_main, machine, printed, write_results
from symmerge.demo.datasets import cache_dir, fashion_mnist, pixel_values, write_npz
from symmerge.demo.disjoint import HALVES, RECIPE, TINY, DisjointRecipe, train_disjoint_pair
from symmerge.demo.train import load_report
from symmerge.io.model import load_model
from symmerge.merge.fuse import merge_models
from symmerge.merge.repair import repair
from symmerge.pipeline.align import align_pair, load_align_data
from symmerge.pipeline.distill import LABEL as DISTILLED, DistillSettings, distill
from symmerge.pipeline.options import AlignOptions, LearnSettings

ALL = "heads,attn,ffn,rescale,residual"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.disjoint_classes", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/disjoint-classes", help="output folder (must not exist or be empty)")
    p.add_argument("--tiny", action="store_true", help="tiny model, data subset, few steps: the smoke test")
    p.add_argument("--steps", type=int, default=RECIPE.steps, help=f"training steps per model (default {RECIPE.steps})")
    p.add_argument("--align-samples", type=int, default=1000,
                   help="unlabeled training images (from all ten classes) for alignment, REPAIR and distillation")
    p.add_argument("--learn-steps", type=int, default=LearnSettings.steps, help="learned alignment's steps")
    p.add_argument("--distill", type=int, default=300, metavar="STEPS", help="distillation steps (default 300)")
    p.add_argument("--distill-lr", default="1e-4,3e-4,1e-3",
                   help="distillation learning rates, comma-separated (default 1e-4,3e-4,1e-3): each is run, and the "
                        "one with the lowest KL to the ensemble on the held-out part of the unlabeled images is kept "
                        "(the test set never chooses)")
    p.add_argument("--zip-layers", default="2,4", help="ZipIt!-style partial merges: comma list of k, the number of "
                   "leading layers merged ('' for none)")
    p.add_argument("--test-examples", type=int, default=10000, help="test images scored (default all 10 000)")
    add_run_args(p)
    args = p.parse_args(argv)
    args.recipe = DisjointRecipe(steps=args.steps) if not args.tiny else TINY
    args.train_examples = 4000 if args.tiny else None
    if args.tiny:
        args.align_samples, args.learn_steps, args.distill, args.test_examples = 200, 5, 10, 500
        args.zip_layers = "1" if args.zip_layers else ""
    return args


# ---------------------------------------------------------------- scoring


def probabilities(model, x: torch.Tensor, batch: int = 500) -> torch.Tensor:
    """Softmax outputs (N, C) of a classifier (or of a callable returning probabilities), float64."""
    out = []
    with torch.no_grad():
        for i in range(0, len(x), batch):
            y = model(pixel_values=x[i:i + batch])
            out.append(y if isinstance(y, torch.Tensor) else torch.softmax(y.logits.double(), -1))
    return torch.cat(out).double()


def scores(probs: torch.Tensor, labels: np.ndarray) -> dict:
    """Accuracy (and mean cross-entropy) on A's half, B's half and all classes."""
    y = torch.from_numpy(labels)
    correct = (probs.argmax(-1) == y).numpy()
    nll = (-torch.log(probs[torch.arange(len(y)), y].clamp_min(1e-12))).numpy()
    out = {}
    for name, keep in (("half_A", np.isin(labels, HALVES[0])), ("half_B", np.isin(labels, HALVES[1])),
                       ("all", np.ones(len(labels), bool))):
        out[name] = float(correct[keep].mean())
        out[f"loss_{name}"] = float(nll[keep].mean())
    return out


class PartialMerge(torch.nn.Module):
    """ZipIt!-style partial merge of two ViT classifiers in one frame: the first ``k`` transformer layers
    (and the embeddings) from ``merged``, the rest — layers ``k..``, the final norm, the head — from each
    of ``branches``; returns the average of the branches' probabilities."""

    def __init__(self, merged, branches, k: int):
        super().__init__()
        self.merged, self.branches, self.k = merged, torch.nn.ModuleList(branches), k

    @staticmethod
    def layers(model):
        vit = model.vit
        return vit.layers if hasattr(vit, "layers") else vit.encoder.layer

    def forward(self, pixel_values):
        h = self.merged.vit.embeddings(pixel_values)
        for layer in self.layers(self.merged)[:self.k]:
            h = layer(h)
            h = h[0] if isinstance(h, tuple) else h
        probs = 0
        for m in self.branches:
            g = h
            for layer in self.layers(m)[self.k:]:
                g = layer(g)
                g = g[0] if isinstance(g, tuple) else g
            probs = probs + torch.softmax(m.classifier(m.vit.layernorm(g)[:, 0]).double(), -1) / len(self.branches)
        return probs

    def parameters_count(self) -> int:
        shared = sum(p.numel() for n, p in self.merged.named_parameters()
                     if n.startswith("vit.embeddings") or any(n.startswith(f"vit.{s}.{i}.") for i in range(self.k)
                                                             for s in ("layers", "encoder.layer")))
        own = sum(p.numel() for m in self.branches for n, p in m.named_parameters()
                  if not (n.startswith("vit.embeddings") or any(n.startswith(f"vit.{s}.{i}.") for i in range(self.k)
                                                                for s in ("layers", "encoder.layer"))))
        return shared + own


# ---------------------------------------------------------------- pipeline


def prepare(args, log):
    """The trained (or cached) pair, the unlabeled alignment file, the test arrays."""
    x_tr, y_tr = fashion_mnist("train")
    x_te, y_te = fashion_mnist("test")
    if args.train_examples:
        x_tr, y_tr = x_tr[:args.train_examples], y_tr[:args.train_examples]
    folders = train_disjoint_pair(args.recipe, x_tr, y_tr, x_te, y_te, log=log)
    rng = np.random.default_rng(0)
    idx = rng.permutation(len(y_tr))[:args.align_samples]  # from all ten classes; labels are never read
    work = cache_dir() / "benchmarks" / ("disjoint-classes-tiny" if args.tiny else "disjoint-classes")
    align_file = write_npz(work / "align.npz", x_tr[idx], y_tr[idx])
    n = min(args.test_examples, len(y_te))
    return folders, align_file, torch.from_numpy(pixel_values(x_te[:n])), y_te[:n], np.bincount(y_tr[idx], minlength=10)


def run(args, log=print) -> dict:
    t_start = time.perf_counter()
    folders, align_file, x_test, y_test, align_classes = prepare(args, log)
    a, b = (load_model(f) for f in folders)
    rows, timings = {}, {}

    def row(label, probs, kind, **extra):
        rows[label] = {"kind": kind, **scores(probs, y_test), **extra}
        r = rows[label]
        log(f"  {label:58s} half A {100 * r['half_A']:6.2f}  half B {100 * r['half_B']:6.2f}  "
            f"all {100 * r['all']:6.2f}")

    p_a, p_b = probabilities(a, x_test), probabilities(b, x_test)
    row("A (classes 0-4)", p_a, "endpoint")
    row("B (classes 5-9)", p_b, "endpoint")
    row("ensemble (average of probabilities)", (p_a + p_b) / 2, "ensemble", parameters=2 * _count(a))
    row("ensemble (average of logits; beside, not the distillation's target)",
        torch.softmax((torch.log(p_a) + torch.log(p_b)) / 2, -1), "ensemble", parameters=2 * _count(a))

    def merged_average(m1, m2):
        return merge_models([m1, m2], "average", align="none", heads="merge", evaluate_result=False,
                            progress=False)[0]

    plain = merged_average(a, b)
    row("plain average (no alignment)", probabilities(plain, x_test), "merge")

    t = time.perf_counter()
    datafree = align_pair(a, b, AlignOptions(symmetries=ALL, max_sweeps=200))
    timings["align_data_free"] = time.perf_counter() - t
    row("aligned average, data-free (all groups)", probabilities(merged_average(datafree.model, datafree.anchor),
                                                                  x_test), "merge")

    learn = LearnSettings(steps=args.learn_steps)
    opts = AlignOptions(symmetries=ALL, match="learned", align_data=str(align_file), align_samples=args.align_samples,
                        learn=learn)
    t = time.perf_counter()
    learned = align_pair(a, b, opts)
    timings["align_learned"] = time.perf_counter() - t
    moved, anchor = learned.model, learned.anchor
    merged = merged_average(moved, anchor)
    row("aligned average, learned (all groups)", probabilities(merged, x_test), "merge")

    data = load_align_data(opts, anchor)
    t = time.perf_counter()
    repaired, _ = repair(merged, [moved, anchor], None, data)
    timings["repair"] = time.perf_counter() - t
    row("aligned average, learned + REPAIR", probabilities(repaired, x_test), "merge")

    distilled_rows = {}
    for label, start, teachers in ((f"learned + REPAIR, {DISTILLED}", repaired, [moved, anchor]),
                                   (f"plain average, {DISTILLED}", plain, [a, b])):
        t = time.perf_counter()
        student, rep, tried = distill_chosen(start, teachers, data, args.distill, args.distill_lr, log)
        secs = time.perf_counter() - t
        row(f"{label}, {args.distill} steps", probabilities(student, x_test), "distilled", seconds=secs,
            distillation={**{k: rep[k] for k in ("kl_before", "kl_after", "examples", "steps", "lr", "target")},
                          "learning_rates_tried": tried})
        distilled_rows[label] = secs
    timings["distill"] = distilled_rows

    for k in [int(s) for s in args.zip_layers.split(",") if s.strip()]:
        zipped = PartialMerge(merged, [moved, anchor], k).eval()
        row(f"ZipIt!-style partial merge, first {k} layers merged", probabilities(zipped, x_test), "partial",
            parameters=zipped.parameters_count())

    reports = [load_report(f) for f in folders]
    return {"benchmark": "disjoint_classes", "tiny": args.tiny,
            "command": " ".join(["python -m benchmarks.disjoint_classes"] + sys.argv[1:]), "machine": machine(),
            "recipe": {k: v for k, v in vars(args.recipe).items()}, "halves": HALVES,
            "training": [{"folder": str(f), "seconds": r["seconds"], "seconds_per_step": r["seconds_per_step"],
                          "epochs": r["epochs"], "train_examples": r["train_examples"],
                          "eval_accuracy_own_half": r.get("eval_accuracy")} for f, r in zip(folders, reports)],
            "data": {"test": len(y_test), "align": int(align_classes.sum()),
                     "align_per_class": align_classes.tolist()},
            "parameters": _count(a), "rows": rows, "timings": timings,
            "learned": learned.report.get("learned"), "seconds_total": time.perf_counter() - t_start}


def distill_chosen(start, teachers, data, steps: int, rates: str, log=print):
    """Distil ``start`` with every learning rate of ``rates``; keep the one whose KL to the ensemble on the
    held-out part of the unlabeled ``data`` is lowest. ``(model, report, {lr: held-out KL})``."""
    best, tried = None, {}
    for lr in [float(x) for x in rates.split(",") if x.strip()]:
        student, rep = distill(start, teachers, data, settings=DistillSettings(steps=steps, lr=lr))
        kl = rep["kl_after"]["held_out"] if rep["kl_after"]["held_out"] is not None else rep["kl_after"]["train"]
        tried[lr] = kl
        log(f"    distillation lr {lr:g}: KL to the ensemble {rep['kl_before']['held_out'] or float('nan'):.4f} -> "
            f"{kl:.4f} (held-out unlabeled images)")
        if best is None or kl < best[2]:
            best = (student, rep, kl)
    return best[0], best[1], tried


def _count(model) -> int:
    return sum(p.numel() for p in model.parameters())


def print_tables(r: dict, log=print) -> None:
    best_endpoint = max(r["rows"][k]["all"] for k, v in r["rows"].items() if v["kind"] == "endpoint")
    log(f"\ntwo ViTs trained on disjoint halves of Fashion-MNIST's classes; {r['data']['test']} test images; "
        f"{r['data']['align']} unlabeled training images from all classes for alignment, REPAIR, distillation")
    log(f"training: " + ", ".join(f"{t['seconds']:.0f} s ({t['seconds_per_step']:.3f} s/step, "
                                  f"{t['epochs']:.1f} epochs of {t['train_examples']} images)" for t in r["training"]))
    log("")
    log("| model | classes 0-4 (%) | classes 5-9 (%) | all 10 classes (%) | beats every endpoint on all? | "
        "parameters |")
    log("|---|---|---|---|---|---|")
    for label, x in r["rows"].items():
        beats = "" if x["kind"] == "endpoint" else ("yes" if x["all"] > best_endpoint else "no")
        params = x.get("parameters", r["parameters"])
        log(f"| {label} | {100 * x['half_A']:.2f} | {100 * x['half_B']:.2f} | {100 * x['all']:.2f} | {beats} | "
            f"{params / 1e6:.2f} M |")
    for label, x in r["rows"].items():
        if x["kind"] == "distilled":
            d = x["distillation"]
            log(f"\n{label}: lr {d['lr']:g} chosen by the held-out KL to the ensemble ("
                + ", ".join(f"{float(k):g}: {v:.4f}" for k, v in d["learning_rates_tried"].items())
                + f"; before: {d['kl_before']['held_out']:.4f}), {d['examples']['train']} images trained on, "
                f"{d['examples']['held_out']} held out")
    t = r["timings"]
    log(f"\nseconds: data-free alignment {t['align_data_free']:.1f}, learned alignment {t['align_learned']:.1f}, "
        f"REPAIR {t['repair']:.1f}, distillation " + ", ".join(f"{v:.1f}" for v in t["distill"].values())
        + f"; total {r['seconds_total']:.0f}")


def write_outputs(result: dict, out: Path) -> None:
    write_results(out, result, printed(print_tables, result))


def main(argv=None) -> int:
    args = parse_args(argv)
    return bench_main(args, lambda: train_disjoint_pair(args.recipe, train_examples=args.train_examples,
                                                        only=args.train_only),
                      run, print_tables, write_outputs, "tables.md")


if __name__ == "__main__":
    sys.exit(main())
