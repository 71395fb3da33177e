"""The learned joint alignment of N MNIST-5k ViTs (the models of ``benchmarks.many_models``) under
variations of its random choices and recipe: the frame (the star's anchor), the learning seed, the
steps, the Dirichlet concentration and the closed-form start. Each variant aligns models 0..N−1 with
:func:`symmerge.pipeline.learn_joint.align_joint_learned` on 1 000 unlabeled training digits, averages
all their parameters (classifiers included) and scores the average on the 1 000 test digits.

    .venv/bin/python -m benchmarks.joint_learned_variants --out DIR [--n 4] \\
        [--variants "anchor=1;anchor=1,seed=1;anchor=0,dirichlet=3;anchor=0,steps=400;anchor=0,start=weights"]
"""

from __future__ import annotations

import argparse
import os
import time

from benchmarks.common import add_run_args, bench_main, printed, write_results
from benchmarks.many_models import cached_models
from symmerge.evaluate.metrics import evaluate
from symmerge.pipeline.joint import align_joint, mean_state_dict
from symmerge.pipeline.learn_joint import DIRICHLET, align_joint_learned
from symmerge.pipeline.options import AlignOptions, LearnSettings
from symmerge.pipeline.verify import with_state_dict

DEFAULT_VARIANTS = "anchor=1;anchor=1,seed=1;anchor=1,seed=2;anchor=0;anchor=2;anchor=3;anchor=0,dirichlet=3;" \
                   "anchor=0,steps=400;anchor=0,start=weights"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.joint_learned_variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/joint-learned-variants", help="output folder (must not exist or be empty)")
    p.add_argument("--n", type=int, default=4, help="models 0..N-1 (default 4)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=800, help="training steps of the ViTs (as many_models)")
    p.add_argument("--align-samples", type=int, default=1000, help="unlabeled training digits")
    p.add_argument("--variants", default=DEFAULT_VARIANTS,
                   help="';'-separated variants, each a comma list of anchor=I, seed=S, steps=N, dirichlet=C, "
                        "start=activations|weights (unnamed: anchor 0 and the LearnSettings defaults)")
    add_run_args(p)
    return p.parse_args(argv)


def parse_variant(text: str) -> dict:
    out = {"anchor": 0, "seed": LearnSettings.seed, "steps": LearnSettings.steps, "dirichlet": DIRICHLET,
           "start": LearnSettings.start}
    for item in filter(None, (x.strip() for x in text.split(","))):
        key, _, value = item.partition("=")
        if key not in out:
            raise SystemExit(f"unknown variant key {key!r}; choose from {', '.join(out)}")
        out[key] = type(out[key])(value)
    return out


def run(args, log=print) -> dict:
    t0 = time.perf_counter()
    _, models, train_npz, test = cached_models(args, args.n, log)
    mean_acc = sum(evaluate(m, test, progress=False)["accuracy"] for m in models) / len(models)
    rows = []
    for text in args.variants.split(";"):
        v = parse_variant(text)
        options = AlignOptions(symmetries="recommended", match="learned", align_data=train_npz,
                               align_samples=args.align_samples,
                               learn=LearnSettings(steps=v["steps"], seed=v["seed"], start=v["start"])
                               ).for_model(models[0])
        t = time.perf_counter()
        result = align_joint_learned(models, options, anchor=v["anchor"], concentration=v["dirichlet"],
                                     closed_form=align_joint)
        seconds = time.perf_counter() - t
        keys = [k for k, p in result.models[0].state_dict().items() if p.is_floating_point()]
        average = with_state_dict(result.models[0], mean_state_dict([m.state_dict() for m in result.models], keys))
        e = evaluate(average, test, progress=False)
        row = {**v, "accuracy": e["accuracy"], "loss": e["loss"], "accuracy_vs_endpoints": e["accuracy"] / mean_acc,
               "seconds": seconds, "learned_seconds": result.report["learned"]["seconds"],
               "objective": (result.report["learned"]["held_out_start"], result.report["learned"]["held_out_best"])}
        rows.append(row)
        log(f"{text or 'defaults':40s} acc {100 * e['accuracy']:.2f} % ({100 * row['accuracy_vs_endpoints']:.1f} % of "
            f"endpoints), loss {e['loss']:.4f}, {seconds:.1f} s")
    return {"benchmark": "learned joint alignment: variants (MNIST-5k ViTs)", "n": args.n,
            "endpoints_mean_accuracy": mean_acc, "rows": rows, "load_average": os.getloadavg(),
            "seconds_total": time.perf_counter() - t0}


def print_tables(r: dict, log=print) -> None:
    log(f"\nN = {r['n']}, endpoints' mean {100 * r['endpoints_mean_accuracy']:.2f} %\n")
    log("| anchor | seed | steps | Dirichlet | start | average (%) | % of endpoints' mean | loss | seconds |")
    log("|---|---|---|---|---|---|---|---|---|")
    for x in r["rows"]:
        log(f"| {x['anchor']} | {x['seed']} | {x['steps']} | {x['dirichlet']:g} | {x['start']} | "
            f"{100 * x['accuracy']:.2f} | {100 * x['accuracy_vs_endpoints']:.1f} | {x['loss']:.4f} | {x['seconds']:.1f} |")


def main(argv=None) -> int:
    return bench_main(parse_args(argv), lambda: None, run, print_tables,
                      lambda r, out: write_results(out, r, printed(print_tables, r)), "tables.md")


if __name__ == "__main__":
    raise SystemExit(main())
