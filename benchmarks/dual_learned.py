"""Issue 42 items 2–4: the one-sided and the dual (shared-frame) learned alignment side by side with no
alignment and data-free alignment, each with softmax-temperature calibration (Ito et al.) and REPAIR, on one
ViT pair (B1's by default). One barrier study per run (``symmerge.barrier_study``, the code behind
``symmerge barrier``), the same curve set, unlabeled data and seed; the table gives per curve the loss
barrier, the midpoint's accuracy and that accuracy as a percentage of the endpoints' mean.

    .venv/bin/python -m benchmarks.dual_learned --out DIR                        # B1, every run
    .venv/bin/python -m benchmarks.dual_learned --pair A_DIR B_DIR --out DIR     # another cached pair
    .venv/bin/python -m benchmarks.dual_learned --runs dual --learn steps=400 --out DIR   # a variant

``--runs``: any of ``plain`` (none and data-free, one study), ``one-sided``, ``dual``; ``--learn KEY=VALUE``:
a :class:`~symmerge.pipeline.options.LearnSettings` field for the learned runs (repeatable). Every run is
written as ``DIR/<run>.json`` (the study) at once, the table as ``DIR/table.md`` at the end.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from symmerge.io.cache import cache_root

B1 = tuple(str(cache_root() / "vit" / name) for name in ("fmnist-A-18e50860812c", "fmnist-B-5324b21a91cd"))
DATA = str(cache_root() / "benchmarks" / "vit-fashion-mnist")
RUNS = ("plain", "one-sided", "dual")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", nargs=2, default=B1, metavar=("A", "B"), help="the two model folders (default: B1's)")
    p.add_argument("--data", default=DATA, help="folder with curve.npz (evaluation) and stats.npz (unlabeled)")
    p.add_argument("--align-samples", type=int, default=1000, help="unlabeled images for learning, REPAIR and T")
    p.add_argument("--points", type=int, default=11)
    p.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    p.add_argument("--learn", action="append", default=[], metavar="KEY=VALUE",
                   help="a LearnSettings field for the learned runs (repeatable)")
    p.add_argument("--no-repair", action="store_true", help="leave out the REPAIR curves")
    p.add_argument("--no-temperature", action="store_true", help="leave out the temperature-calibrated curves")
    p.add_argument("--repair-samples", type=int, default=None, help="REPAIR's statistics on this many images")
    p.add_argument("--dual-from-one-sided", action="store_true",
                   help="the dual run starts from the one-sided learned alignment (not its closed-form start)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def learn_settings(pairs: list[str], frame: str):
    from symmerge.pipeline.options import LearnSettings

    fields = {f.name: f.type for f in dataclasses.fields(LearnSettings)}
    values = {}
    for item in pairs:
        key, _, text = item.partition("=")
        if key not in fields:
            raise SystemExit(f"unknown LearnSettings field {key!r}")
        values[key] = json.loads(text) if text[:1] in "0123456789-[{tfn" and text not in ("float32", "bfloat16") \
            else text
    return LearnSettings(**{**values, "frame": frame})


def study(run: str, args) -> dict:
    from symmerge import AlignOptions, BarrierOptions, barrier_study

    data = Path(os.path.expanduser(args.data))
    a, b = (os.path.expanduser(x) for x in args.pair)
    learned = run != "plain"
    align = AlignOptions(match="learned" if learned else "weights", align_data=str(data / "stats.npz"),
                         align_samples=args.align_samples,
                         **({"learn": learn_settings(args.learn, run)} if learned else {}))
    options = BarrierOptions(aligns=("none", "recommended") if run == "plain" else ("recommended",),
                             points=args.points, align=align, repair=not args.no_repair, temperature=not args.no_temperature,
                             repair_samples=args.repair_samples,
                             progress=False)
    t0 = time.perf_counter()
    result = barrier_study(a, b, str(data / "curve.npz"), options)
    result["run"] = {"name": run, "seconds": time.perf_counter() - t0, "learn": args.learn}
    return result


def rows(run: str, result: dict) -> list[str]:
    ends = result["endpoints"]
    mean = (ends["A"]["accuracy"] + ends["B"]["accuracy"]) / 2
    mid = result["alphas"].index(0.5)
    label = {"plain": "data-free (weights)", "one-sided": "learned, one-sided", "dual": "learned, dual"}[run]
    out = []
    for name, c in result["curves"].items():
        base, _, extra = name.partition("+")
        what = "none" if base == "none" else label
        acc = c["accuracy"][mid]
        learn = c.get("learned") or {}
        seconds = c.get("match_seconds")
        out.append(f"| {what} | {extra or '—'} | {c['barrier']:.3f} | {c['loss'][mid]:.3f} | {100 * acc:.1f} % | "
                   f"{100 * acc / mean:.1f} % | {'' if seconds is None else f'{seconds:.0f}'} | "
                   f"{learn.get('steps', '')} |")
    return out


def table(results: dict) -> str:
    first = next(iter(results.values()))
    ends = first["endpoints"]
    lines = [f"Endpoints on {ends['A']['n']} curve images: A {ends['A']['loss']:.3f} / {100 * ends['A']['accuracy']:.1f} %, "
             f"B {ends['B']['loss']:.3f} / {100 * ends['B']['accuracy']:.1f} %.", "",
             "| alignment | baseline | loss barrier | α = ½ loss | α = ½ accuracy | % of endpoints' mean | align s | "
             "learned steps |", "|---|---|---|---|---|---|---|---|"]
    for run, result in results.items():
        lines += rows(run, result)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.dual_from_one_sided:
        from symmerge.pipeline import dual

        dual.FROM_ONE_SIDED = True
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    for run in args.runs:
        results[run] = study(run, args)
        (out / f"{run}.json").write_text(json.dumps(results[run], indent=1, default=str))
        print("\n".join(rows(run, results[run])), flush=True)
    text = table(results)
    (out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
