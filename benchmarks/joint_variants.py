"""Why the data-free joint alignment merges worse than the star: variants of the rounds after the star on
subsets of the eight cached MNIST-5k ViTs of ``benchmarks.many_models`` (trained there; not retrained).

For each subset (models by index, e.g. ``0123``; the star's anchor is the model closest to the average,
as ``merge`` chooses), the plain average of **all** parameters is scored on the 1 000 test digits after:

* ``star``: every model aligned to the anchor (``recommended`` groups);
* ``all``: rounds of "each model to the mean of the others" re-solving every group (MergeMany with the
  continuous groups, ``align_joint(refine="all")``), the average measured after every round;
* ``discrete``: the same rounds re-solving only the permutations (``refine="discrete"``);
* ``rounds:SYMS``: rounds re-solving only the symmetries SYMS (``+``-separated, e.g. ``rounds:residual``,
  ``rounds:heads+attn+ffn+rescale``), with the same acceptance rule (a step must lower the distance to the
  mean of the others);
* ``progressive``: from the anchor, model k aligned to the mean of the k models already aligned;
* ``weighted``: rounds whose target is the mean of the others with the anchor weighted N − 2 times (half
  the target is the anchor, as in the star, half the mean of the rest).

    .venv/bin/python -m benchmarks.joint_variants --out DIR [--subsets 0123,4567] [--match weights]
        [--variants star,all,discrete] [--rounds 2] [--timing REPEATS]

``--timing R``: instead, the seconds (best of R, in one process) of one pairwise alignment (the first
subset's second model to its first) against the joint alignment of the first subset with ``refine``
``all`` and ``discrete`` (rounds up to 10, as ``merge``), and their ratios (issue 20's speed goal:
joint data-free alignment of four models in at most 3× one pairwise alignment).
"""

from __future__ import annotations

import argparse
import os
import time
import warnings
from pathlib import Path

import torch

from benchmarks.common import add_run_args, bench_main, printed, write_results
from benchmarks.many_models import cached_models
from symmerge.core.distance import parameter_keys, sq_distance
from symmerge.evaluate.metrics import evaluate
from symmerge.merge.plan import closest_to_average
from symmerge.pipeline.align import align_pair, canonical
from symmerge.pipeline.joint import JointSteps, align_joint, mean_state_dict, spread
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.verify import with_state_dict


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.joint_variants", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/joint-variants", help="output folder (must not exist or be empty)")
    p.add_argument("--subsets", default="0123,4567,0246,1357,012,345",
                   help="comma list of model index sets (digits 0-7)")
    p.add_argument("--variants", default="star,all,discrete,progressive,weighted,rounds:heads+ffn,"
                                         "rounds:heads+attn+ffn+rescale,rounds:residual")
    p.add_argument("--rounds", type=int, default=2, help="rounds after the star (each measured)")
    p.add_argument("--match", default="weights", choices=("weights", "activations"))
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=800)
    p.add_argument("--align-samples", type=int, default=1000)
    p.add_argument("--timing", type=int, default=0, metavar="REPEATS",
                   help="time one pairwise against the joint alignments of the first subset instead")
    add_run_args(p)
    return p.parse_args(argv)


def weighted_mean(sds: list[dict], weights: list[float], keys) -> dict:
    out = dict(sds[0])
    total = sum(weights)
    for k in keys:
        out[k] = sum(w / total * sd[k].double() for w, sd in zip(weights, sds) if w).to(sds[0][k].dtype)
    return out


def run(args, log=print) -> dict:
    t0 = time.perf_counter()
    subsets = [[int(c) for c in s] for s in args.subsets.split(",")]
    _, models, train_npz, test = cached_models(args, max(max(s) for s in subsets) + 1, log)
    extra = dict(align_data=train_npz, align_samples=args.align_samples) if args.match == "activations" else {}

    def options(symmetries="recommended", **kw):
        return AlignOptions(symmetries=symmetries, match=args.match, verify=False, **extra, **kw).for_model(models[0])

    def average(current) -> tuple[float, float]:
        sds = [x.state_dict() for x in current]
        r = evaluate(with_state_dict(current[0], mean_state_dict(sds, parameter_keys(current[0]))), test,
                     progress=False)
        return r["accuracy"], r["loss"]

    rows = []
    if args.timing:
        return timing(args, [models[i] for i in subsets[0]], options(), t0)
    for subset in subsets:
        group = [models[i] for i in subset]
        n, keys = len(group), parameter_keys(group[0])
        anchor, _ = closest_to_average(lambda k: [x.state_dict()[k] for x in group], keys)
        full = options()
        frame = canonical(group[anchor], full)

        def record(variant, step, current, seconds):
            acc, loss = average(current)
            row = {"subset": "".join(map(str, subset)), "n": n, "anchor": subset[anchor], "variant": variant,
                   "step": step, "accuracy": acc, "loss": loss,
                   "spread": spread([x.state_dict() for x in current], keys), "seconds": seconds}
            rows.append(row)
            log(f"{row['subset']} (anchor {row['anchor']}) {variant:32s} {step:8s} average {100 * acc:5.1f} % "
                f"loss {loss:.3f} spread {row['spread']:.1f} ({seconds:.1f} s)")

        for variant in args.variants.split(","):
            t = time.perf_counter()
            if variant in ("star", "all", "discrete"):
                def on_round(r, current, variant=variant):
                    if variant != "star" and r == 0:
                        return
                    record(variant, "star" if r == 0 else f"round {r}", current, time.perf_counter() - t)

                align_joint(group, full, anchor=anchor, max_rounds=0 if variant == "star" else args.rounds,
                            steps=JointSteps(tol=0.0), refine="all" if variant == "star" else variant,
                            on_round=on_round)
                continue
            if variant == "progressive":
                current, sds = list(group), [None] * n
                current[anchor], sds[anchor] = frame, frame.state_dict()
                done = [anchor]
                for i in [i for i in range(n) if i != anchor]:
                    target = with_state_dict(frame, mean_state_dict([sds[j] for j in done], keys))
                    current[i] = align_pair(group[i], target, full).model
                    sds[i] = current[i].state_dict()
                    done.append(i)
                record(variant, "end", current, time.perf_counter() - t)
                continue
            step_opts = (options(variant.split(":", 1)[1].replace("+", ",")) if variant.startswith("rounds:")
                         else full).with_(max_sweeps=10)
            current = [frame if i == anchor else align_pair(x, frame, full).model for i, x in enumerate(group)]
            sds = [x.state_dict() for x in current]
            for r in range(args.rounds):
                t = time.perf_counter()
                for i in range(n):
                    if variant == "weighted":
                        w = [0.0 if j == i else (1.0 if j != anchor or i == anchor else n - 2.0) for j in range(n)]
                        target_sd = weighted_mean(sds, w, keys)
                    else:
                        target_sd = mean_state_dict([sds[j] for j in range(n) if j != i], keys)
                    target = with_state_dict(current[i], target_sd)
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        moved = align_pair(current[i], target, step_opts).model
                    new = moved.state_dict()
                    if sq_distance(new, target_sd, keys) < sq_distance(sds[i], target_sd, keys):
                        current[i], sds[i] = moved, new
                record(variant, f"round {r + 1}", current, time.perf_counter() - t)
    return {"benchmark": "joint alignment variants (MNIST-5k ViTs)", "match": args.match, "rounds": args.rounds,
            "rows": rows, "load_average": os.getloadavg(), "threads": torch.get_num_threads(),
            "seconds_total": time.perf_counter() - t0}


def timing(args, group, opts, t0) -> dict:
    """Best-of-``args.timing`` seconds of one pairwise alignment and of the joint alignments of ``group``."""
    def best(fn):
        times = []
        for _ in range(args.timing):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return min(times)

    anchor, _ = closest_to_average(lambda k: [x.state_dict()[k] for x in group], parameter_keys(group[0]))
    seconds = {"pairwise": best(lambda: align_pair(group[1], group[0], opts))}
    for refine in ("discrete", "all"):
        seconds[f"joint {refine}"] = best(lambda refine=refine: align_joint(group, opts, anchor=anchor, refine=refine))
    rows = [{"what": k, "seconds": v, "ratio_to_pairwise": v / seconds["pairwise"]} for k, v in seconds.items()]
    return {"benchmark": "joint alignment timing (MNIST-5k ViTs)", "match": args.match, "n": len(group),
            "repeats": args.timing, "rows": rows, "load_average": os.getloadavg(),
            "threads": torch.get_num_threads(), "seconds_total": time.perf_counter() - t0}


def print_tables(r: dict, log=print) -> None:
    if "repeats" in r:
        log(f"\nmatch {r['match']}; best of {r['repeats']}; N = {r['n']}; load {r['load_average']}\n")
        log("| alignment | seconds | × one pairwise |")
        log("|---|---|---|")
        for row in r["rows"]:
            log(f"| {row['what']} | {row['seconds']:.2f} | {row['ratio_to_pairwise']:.2f} |")
        return
    log(f"\nmatch {r['match']}; plain average of all parameters, test accuracy (%)\n")
    log("| subset | anchor | variant | step | average (%) | loss | spread | s |")
    log("|---|---|---|---|---|---|---|---|")
    for row in r["rows"]:
        log(f"| {row['subset']} | {row['anchor']} | {row['variant']} | {row['step']} | {100 * row['accuracy']:.1f} | "
            f"{row['loss']:.3f} | {row['spread']:.1f} | {row['seconds']:.1f} |")


def write_outputs(r: dict, out: Path) -> None:
    write_results(out, r, printed(print_tables, r))


def main(argv=None) -> int:
    args = parse_args(argv)
    return bench_main(args, lambda: None, run, print_tables, write_outputs, "tables.md")


if __name__ == "__main__":
    raise SystemExit(main())
