"""Issue 42, item 1: is the data-free objective or its search the limit? On a B1-recipe ViT pair
(benchmarks/vit_fashion_mnist.py: its models, data and curve set), the data-free objective (the squared weight
distance over the matched tensors, canonical form, the one the descent minimises; its stream-ends part beside it)
and the loss barrier on B1's curve set of:

* ``data-free``: the descent as ``--match weights`` runs it;
* ``learned``: A as the learned alignment moves it (``--match learned`` on 1 000 unlabeled training images);
* ``learned stream, data-free rest``: the learned residual rotation, every per-layer group solved data-free for it;
* ``descent from the learned stream``: the data-free descent started there.

    python -m benchmarks.datafree_diagnose --seeds 0,1 [--ends-weight 10]

If the learned point has the lower barrier but the higher objective, and the descent from it climbs back to the
data-free objective and barrier, the objective is the limit, not the search.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

from benchmarks import unlabeled
from benchmarks import vit_fashion_mnist as b1
from symmerge.core.apply import apply, canonicalize
from symmerge.core.distance import sq_distance
from symmerge.evaluate.metrics import interpolation_curve
from symmerge.pipeline import engine
from symmerge.pipeline.align import align_pair
from symmerge.pipeline.bound import bind
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.verify import with_state_dict


def composed_stream(element):
    """The learned residual element as one rotation (a learned alignment composes its start and its refinement,
    ``(start, refinement)``: the writers move by ``(Q₁Q₂)ᵀ``); its stream scale dropped (the data-free group has
    none)."""
    parts = element if isinstance(element, tuple) else (element,)
    Q = parts[0].Q.double()
    for p in parts[1:]:
        Q = Q @ p.Q.double()
    return type(parts[0])(Q=Q)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.datafree_diagnose", description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="0,1", help="seeds of A,B (default: B1's 0,1)")
    p.add_argument("--points", type=int, default=5, help="α values of each curve (default 5)")
    p.add_argument("--ends-weight", type=float, default=1.0, help="the data-free descent's ends weight (default 1)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    _, _, _, _, files, a, b, _, curve = b1.load_pair(b1.parse_args(["--seeds", args.seeds]), print)
    options = AlignOptions(symmetries=b1.BEST_ALIGN, ends_weight=args.ends_weight)
    bound, opts = bind(a, None, options.residual), options.solver_options()
    inst = bound.instances
    wide = [i for i in inst if not i.kind.per_layer and i.kind.active(i, opts)]
    local = [i for i in inst if i.kind.per_layer]
    ca, cb = canonicalize(a.state_dict(), wide), canonicalize(b.state_dict(), wide)
    ends = sorted(engine.ends_keys(inst, opts))
    matched = sorted({s.key for i in engine.active(inst, opts) for s in i.slots})
    alphas = [i / (args.points - 1) for i in range(args.points)]

    def row(name, sd, seconds=None):
        c = interpolation_curve(with_state_dict(a, sd), with_state_dict(b, cb), curve, alphas, progress=False)
        extra = "" if seconds is None else f"  ({seconds:.1f} s)"
        print(f"{name:34s} objective {sq_distance(sd, cb, matched):10.3f}  ends {sq_distance(sd, cb, ends):8.3f}  "
              f"barrier ({args.points} points) {c['barrier']:.4f}{extra}", flush=True)

    t = time.perf_counter()
    found, _ = engine.search(inst, ca, cb, opts, max_sweeps=options.max_sweeps, tol=options.descent_tol,
                             starts=engine.Restarts(ends_weight=args.ends_weight))
    row("data-free", apply(ca, inst, found), time.perf_counter() - t)
    t = time.perf_counter()
    learned = align_pair(a, b, unlabeled.row_options("learned", files["stats"], 1000))
    row("learned", canonicalize(learned.model.state_dict(), wide), time.perf_counter() - t)
    stream = {i.name: composed_stream(learned.elements[i.name]) for i in wide}
    around = engine.solve_local(local, apply(ca, wide, stream), cb, opts)
    row("learned stream, data-free rest", apply(ca, inst, {**stream, **around}))
    wa, wb = engine.weighted_ends(inst, ca, cb, opts, args.ends_weight)
    descended = engine.solve(inst, wa, wb, opts, max_sweeps=options.max_sweeps, tol=options.descent_tol, start=around)
    row("descent from the learned stream", apply(ca, inst, descended))
    return 0


if __name__ == "__main__":
    sys.exit(main())
