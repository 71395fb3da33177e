"""Issue 42, item 1: the data-free solver's search (several starts, restarts within a budget) against the
descent as it was, on B1-recipe ViT pairs (benchmarks/vit_fashion_mnist.py: its models, data and curve set).

    python -m benchmarks.datafree_multistart --pairs 0,1 100,101 102,103 104,105 --out DIR

For each pair (seeds of A and B; trained by B1's code, or reused from its cache): A is aligned to B with every
group (heads, attn, ffn, rescale, residual) by :func:`symmerge.pipeline.engine.search` with the default
budget (or ``--restarts``), every start's elements kept; the winner is checked as ``align`` checks it (every
element valid, the outputs of A and the aligned A equal). Printed and written per pair: each start's
objective (the squared weight distance the descent minimises), sweeps and seconds, and its loss barrier on
B1's curve set (``--start-points`` α values); the 11-point barrier (``--points``) of today's start
(``current``: the descent as it always ran), of the best plain start (by the objective: current, identity,
canonical) and of the search's winner. ``--ends-weights 1,10``: the whole search once per weight of the stream's
ends in the objective (``--ends-weight``), in the same run (the first weight is the "before"); ``--depth-decays
1,32``: likewise for every depth decay of the layers' weights (``--depth-decay``), each with every ends weight.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks import vit_fashion_mnist as b1
from benchmarks.common import machine
from symmerge.core.apply import apply, canonicalize
from symmerge.evaluate.metrics import interpolation_curve
from symmerge.pipeline import engine
from symmerge.pipeline.bound import bind
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.verify import verify_elements, verify_forward, with_state_dict

PLAIN = ("current", "identity", "canonical")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.datafree_multistart", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", nargs="+", default=["0,1"], help="seeds of A,B per pair (default: B1's 0,1)")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--restarts", type=int, default=None, help="exactly this many restarts (default: the budget's)")
    p.add_argument("--solver-budget", type=float, default=None, help="seconds for restarts (default: automatic)")
    p.add_argument("--points", type=int, default=11, help="α values of the compared curves (default 11)")
    p.add_argument("--start-points", type=int, default=5, help="α values of every start's curve (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--ends-weights", default="1", help="comma-separated weights of the stream's ends (default 1)")
    p.add_argument("--depth-decays", default="1", help="comma-separated depth decays of the layers (default 1)")
    return p.parse_args(argv)


def curve_of(a, b, ca, cb, instances, elements, data, points):
    alphas = [i / (points - 1) for i in range(points)]
    moved = with_state_dict(a, apply(ca, instances, elements))
    c = interpolation_curve(moved, with_state_dict(b, cb), data, alphas, progress=False)
    return {"alphas": alphas, "loss": c["loss"], "accuracy": c["accuracy"], "barrier": c["barrier"]}


def run_pair(seeds: str, args, log=print) -> dict:
    pair_args = b1.parse_args(["--seeds", seeds])
    _, _, folders, _, _, a, b, _, curve, = b1.load_pair(pair_args, log)
    runs = {}
    for decay in (float(f) for f in args.depth_decays.split(",")):
        for weight in (float(w) for w in args.ends_weights.split(",")):
            name = f"{weight:g}" if decay == 1 else f"{weight:g}, depth decay {decay:g}"
            runs[name] = run_weight(seeds, folders, a, b, curve, weight, args, log, decay)
    return {"seeds": seeds, "models": [str(f) for f in folders], "weights": runs}


def run_weight(seeds, folders, a, b, curve, weight, args, log=print, decay=1.0) -> dict:
    options = AlignOptions(symmetries=b1.BEST_ALIGN, restarts=args.restarts, solver_budget=args.solver_budget,
                           ends_weight=weight, depth_decay=decay)
    bound = bind(a, None, options.residual)
    opts = options.solver_options()
    wide = [i for i in bound.instances if not i.kind.per_layer and i.kind.active(i, opts)]
    ca, cb = canonicalize(a.state_dict(), wide), canonicalize(b.state_dict(), wide)
    kept: dict = {}
    t = time.perf_counter()
    elements, record = engine.search(bound.instances, ca, cb, opts, max_sweeps=options.max_sweeps,
                                     tol=options.descent_tol,
                                     starts=engine.Restarts(args.restarts, args.solver_budget, ends_weight=weight,
                                                            depth_decay=decay),
                                     keep=kept)
    seconds = time.perf_counter() - t
    verify_elements(bound.instances, elements)
    check = verify_forward(a, with_state_dict(a, apply(ca, bound.instances, elements)), bound.spec)
    for run in record["starts"]:
        run["barrier"] = curve_of(a, b, ca, cb, bound.instances, kept[run["start"]], curve, args.start_points)["barrier"]
        log(f"  {seeds} W={weight:g} F={decay:g} {run['start']:12s} objective {run['objective']:.4f}  sweeps {run['sweeps']:3d}  "
            f"{run['seconds']:6.1f} s  barrier ({args.start_points} points) {run['barrier']:.4f}")
    plain = min((r for r in record["starts"] if r["start"] in PLAIN), key=lambda r: r["objective"])
    curves = {"today (current start)": "current", f"best plain start ({plain['start']})": plain["start"],
              f"search ({record['winner']})": record["winner"]}
    out = {"seeds": seeds, "ends_weight": weight, "depth_decay": decay, "search": record, "search_seconds": seconds,
           "best_plain": plain["start"], "verify": check, "load_average": os.getloadavg()[0], "curves": {}}
    for label, start in curves.items():
        out["curves"][label] = curve_of(a, b, ca, cb, bound.instances, kept[start], curve, args.points)
        out["curves"][label]["objective"] = next(r["objective"] for r in record["starts"] if r["start"] == start)
        log(f"  {seeds} W={weight:g} F={decay:g} {label:32s} objective {out['curves'][label]['objective']:.4f}  barrier "
            f"{out['curves'][label]['barrier']:.4f}")
    return out


def markdown(result: dict) -> str:
    lines = ["| pair (seeds) | ends weight (depth decay) | current start: objective / barrier | best plain start: objective / "
             "barrier | search: objective / barrier (winner) | starts run | search seconds |",
             "|---|---|---|---|---|---|---|"]
    for pair in result["pairs"]:
        for w, p in pair["weights"].items():
            c = list(p["curves"].values())
            lines.append(f"| {pair['seeds']} | {w} | {c[0]['objective']:.2f} / {c[0]['barrier']:.4f} | "
                         f"{c[1]['objective']:.2f} / {c[1]['barrier']:.4f} ({p['best_plain']}) | "
                         f"{c[2]['objective']:.2f} / {c[2]['barrier']:.4f} ({p['search']['winner']}) | "
                         f"{len(p['search']['starts'])} | "
                         f"{p['search_seconds']:.1f} |")
    lines += ["", "Every start (objective / barrier on the curve set's " + str(result["start_points"]) + " points):", ""]
    for pair in result["pairs"]:
        for w, p in pair["weights"].items():
            lines.append(f"- {pair['seeds']}, ends weight {w}: " + ", ".join(
                f"{r['start']} {r['objective']:.2f} / {r['barrier']:.3f}" for r in p["search"]["starts"]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from symmerge.io.model import atomic_dir, write_json

    args = parse_args(argv)
    out = Path(args.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"{out}: exists and is not empty; choose another --out")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    result = {"benchmark": "datafree_multistart", "command": " ".join(["python -m benchmarks.datafree_multistart"]
                                                                      + sys.argv[1:]),
              "machine": machine(), "start_points": args.start_points, "points": args.points,
              "pairs": [run_pair(s, args) for s in args.pairs]}
    result["seconds_total"] = time.perf_counter() - t0
    text = markdown(result)
    print("\n" + text)
    with atomic_dir(out) as tmp:
        write_json(tmp / "results.json", result)
        (tmp / "tables.md").write_text(text)
    print(f"wrote {out / 'results.json'} ({result['seconds_total']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
