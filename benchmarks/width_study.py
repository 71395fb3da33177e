"""Width study: does the barrier left by alignment shrink with the width of the models?

Pairs of ViTs (2 layers, 4 heads, FFN 2·hidden, patch 7) are trained from seeds 0 and 1 on MNIST-5k
with the demo's recipe (4 000 training digits, 800 steps of 64, cached) at several widths; A is aligned
to B (none, the paper's set, the best data-free set, the learned alignment on the training digits
without labels) and the loss barrier and the α = 0.5 accuracy are measured on the 1 000 test digits.

    .venv/bin/python -m benchmarks.width_study --out DIR [--hidden 32,64,128] [--points 5]
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.common import add_run_args, bench_main, printed, write_results
from symmerge.demo.datasets import cache_dir, mnist_5k_split, write_npz
from symmerge.demo.train import TrainSettings, train_vit, vit_config
from symmerge.merge.barrier import barrier_study
from symmerge.io.data import load_data
from symmerge.io.model import load_model
from symmerge.pipeline.options import AlignOptions

ALIGNS = {"none": None, "paper": "attn,ffn,rescale", "best data-free": "heads,attn,ffn,rescale,residual"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.width_study", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/width-study", help="output folder (must not exist or be empty)")
    p.add_argument("--hidden", default="32,64,128", help="widths (hidden sizes), comma list")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--points", type=int, default=5, help="α values on each curve (default 5)")
    p.add_argument("--seeds", default="0,1")
    add_run_args(p)
    return p.parse_args(argv)


def run(args, log=print) -> dict:
    t0 = time.perf_counter()
    x_tr, y_tr, x_te, y_te = mnist_5k_split(n_test=1000, seed=0)
    folder = cache_dir() / "mnist-5k"
    train_npz, test_npz = write_npz(folder / "train-4000.npz", x_tr, y_tr), write_npz(folder / "test-1000.npz", x_te, y_te)
    seeds = [int(s) for s in args.seeds.split(",")]
    rows = []
    for hidden in (int(h) for h in args.hidden.split(",")):
        config = vit_config(hidden, args.layers, 4, 2 * hidden, 7, labels=tuple(str(d) for d in range(10)))
        folders = [train_vit(config, x_tr, y_tr, TrainSettings(steps=args.steps, batch_size=64, lr=2e-3, seed=s),
                             name=f"width-{hidden}-{'AB'[i]}", progress=False, log=log) for i, s in enumerate(seeds)]
        a, b = (load_model(f) for f in folders)
        test = load_data(test_npz, a, batch_size=250)
        study = barrier_study(a, b, test, aligns=[v for v in ALIGNS.values() if v], points=args.points, progress=False)
        learned = barrier_study(a, b, test, aligns=[ALIGNS["best data-free"]], points=args.points, progress=False,
                                align=AlignOptions(match="learned", align_data=train_npz, align_samples=1000))
        mid = len(study["alphas"]) // 2
        curves = {label: study["curves"][v or "none"] for label, v in ALIGNS.items()}
        curves["learned"] = learned["curves"][ALIGNS["best data-free"]]
        row = {"hidden": hidden, "parameters": sum(p.numel() for p in a.parameters()),
               "endpoints": {k: v["accuracy"] for k, v in study["endpoints"].items()},
               "curves": {k: {"barrier": c["barrier"], "accuracy_mid": c["accuracy"][mid], "loss_mid": c["loss"][mid],
                              "align_seconds": c.get("align_seconds", 0.0)} for k, c in curves.items()}}
        rows.append(row)
        log(f"hidden {hidden}: endpoints {row['endpoints']['A']:.4f} / {row['endpoints']['B']:.4f}; " + "; ".join(
            f"{k} barrier {c['barrier']:.3f} acc {c['accuracy_mid']:.4f}" for k, c in row["curves"].items()))
    return {"benchmark": "width study (MNIST-5k ViTs)", "layers": args.layers, "steps": args.steps, "seeds": seeds,
            "points": args.points, "rows": rows, "load_average": os.getloadavg(),
            "seconds_total": time.perf_counter() - t0}


def print_tables(r: dict, log=print) -> None:
    log("\n| hidden | parameters | endpoints (%) | " + " | ".join(f"{k}: barrier / α=0.5 acc (%)" for k in
                                                           r["rows"][0]["curves"]) + " |")
    log("|---" * (3 + len(r["rows"][0]["curves"])) + "|")
    for row in r["rows"]:
        e = row["endpoints"]
        log(f"| {row['hidden']} | {row['parameters']} | {100 * e['A']:.1f} / {100 * e['B']:.1f} | " + " | ".join(
            f"{c['barrier']:.3f} / {100 * c['accuracy_mid']:.1f}" for c in row["curves"].values()) + " |")


def write_outputs(r: dict, out: Path) -> None:
    write_results(out, r, printed(print_tables, r))


def main(argv=None) -> int:
    args = parse_args(argv)
    return bench_main(args, lambda: None, run, print_tables, write_outputs, "tables.md")


if __name__ == "__main__":
    raise SystemExit(main())
