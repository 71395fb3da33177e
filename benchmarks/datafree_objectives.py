"""Issue 42, item 1: two more data-free objectives for the descent on B1-recipe ViT pairs — a low-rank
(denoised) objective and a homotopy in the depth decay — against ``--depth-decay`` alone.

    python -m benchmarks.datafree_objectives --pairs 0,1 100,101 --configs plain:10 trunc:whole:f0.25:10 \
        hom:1000,100,10 --out DIR

For each pair (seeds of A and B, trained by B1's code or reused from its cache), A is aligned to B with every
group (``benchmarks.vit_fashion_mnist.BEST_ALIGN``) by the descent from today's start, once per configuration:

* ``plain:F`` — the descent on the weights, the layers' tensors decaying with depth by ``F`` (``--depth-decay``).
* ``trunc:SCOPE:RANK:F[:FLAG...]`` — the same descent, solved on copies of both canonical state dicts in which each
  layer's 2-D weight matrix is replaced by a low-rank version (``SCOPE`` ``whole``: the matrix; ``head``: the
  query/key/value row blocks and the output column blocks of each head, the FFN matrices whole). ``RANK``:
  ``f0.25`` keeps that fraction of min(shape) singular values, ``e0.8`` the leading ones holding that fraction of
  the squared singular values, ``g`` those above Gavish and Donoho's threshold from the median singular value; a
  suffix ``s0.5`` scales the tail by 0.5 instead of dropping it. Truncation commutes with every orthogonal map
  of the rows and columns (the stream rotation, the head and FFN permutations, the per-head rotations) and per
  head with the per-head scales, so it only drops the small singular directions of each model. FLAGs: ``all``
  (the stream's ends too), ``ffn`` / ``att`` (only those matrices), ``refine`` (then the descent on the real
  weights from there).
* ``hom:F1[/S1],F2[/S2],...`` — a homotopy: the descent converged (or cut at ``S`` sweeps) at decay ``F1``, then
  continued from its elements at ``F2``, and so on.

The elements found are applied to the real A and checked as ``align`` checks them (every element valid, the
outputs of A and the moved A equal); printed and written: the barrier on B1's curve set (``--points`` α values),
the plain and the ``F = 10`` weight objectives at the elements, the sweeps and seconds. ``--learned-point``: also
each ``plain``/``trunc`` objective at the stream of the learned alignment (data-dependent, ~1 min on B1: the
reference point of docs/results/datafree_frontier.md, section 1), with the per-layer groups solved for it, and at
the descent started there: does the objective prefer its own optimum to that low-barrier point?
"""

from __future__ import annotations

import argparse
import re
import sys
import time
import warnings
from pathlib import Path

import torch

from benchmarks import vit_fashion_mnist as b1
from benchmarks.common import bench_main, machine
from benchmarks.datafree_multistart import curve_of
from symmerge.core.apply import apply, canonicalize
from symmerge.core.distance import sq_distance
from symmerge.pipeline import engine
from symmerge.pipeline.bound import bind
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.verify import verify_elements, verify_forward, with_state_dict

# a head's rows (query, key, value) or columns (output) of the attention projections, in-memory ViT names
PROJECTION = re.compile(r"\.attention\.(q|k|v|o)_proj\.weight$")


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.datafree_objectives", description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", nargs="+", default=["0,1"], help="seeds of A,B per pair (default: B1's 0,1)")
    p.add_argument("--configs", nargs="+", default=["plain:10"], help="objectives (see the module's text)")
    p.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    p.add_argument("--points", type=int, default=5, help="α values of each curve (default 5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--learned-point", action="store_true",
                   help="also each plain/trunc objective at the learned alignment's stream (data-dependent reference)")
    p.set_defaults(plot_only=None, train_only=False)
    return p.parse_args(argv)


def kept_rank(s: torch.Tensor, rule: str, shape) -> int:
    """How many leading singular values ``s`` (descending) a rank rule keeps (at least 1)."""
    if rule == "g":  # Gavish & Donoho (2014): the optimal hard threshold for an unknown noise level
        b = min(shape) / max(shape)
        return max(1, int((s > (0.56 * b ** 3 - 0.95 * b ** 2 + 1.82 * b + 1.43) * s.median()).sum()))
    if rule[0] == "f":
        return max(1, round(float(rule[1:]) * len(s)))
    if rule[0] == "e":
        energy = (s ** 2).cumsum(0) / (s ** 2).sum()
        return min(len(s), int((energy < float(rule[1:])).sum()) + 1)
    raise SystemExit(f"unknown rank rule {rule!r} (f<fraction>, e<energy>, g)")


def low_rank(m: torch.Tensor, rule: str) -> torch.Tensor:
    """``m`` with the singular values after the rule's rank scaled by the suffix ``s<x>`` (default 0: dropped)."""
    U, s, Vh = torch.linalg.svd(m.double(), full_matrices=False)
    rank_rule, _, tail = rule.partition("s")
    s = s.clone()
    s[kept_rank(s, rank_rule, m.shape):] *= float(tail) if tail else 0.0
    return ((U * s) @ Vh).to(m.dtype)


def denoised(sd: dict, keys, scope: str, rule: str, heads: int) -> dict:
    """``sd`` with every tensor of ``keys`` of at least two axes (a convolution's or an embedding's flattened to
    a matrix over the first axis, or the last when the first is 1) replaced by :func:`low_rank`; per head with
    ``scope`` ``head`` (:data:`PROJECTION`'s tensors)."""
    out = dict(sd)
    for k in keys:
        t = sd[k]
        if t.dim() < 2:
            continue
        m = t.reshape(-1, t.shape[-1]) if t.shape[0] == 1 else t.reshape(t.shape[0], -1)
        if min(m.shape) < 2:
            continue
        hit = PROJECTION.search(k) if scope == "head" else None
        if hit is None:
            out[k] = low_rank(m, rule).reshape(t.shape)
            continue
        cols = hit.group(1) == "o"
        blocks = (m.T if cols else m).chunk(heads)
        new = torch.cat([low_rank(x, rule) for x in blocks])
        out[k] = (new.T if cols else new).reshape(t.shape)
    return out


def descent(setup: dict, ca: dict, cb: dict, decay: float, start=None, sweeps: int | None = None):
    """The elements of one descent at depth decay ``decay`` (from today's start, or from ``start``) and its
    sweep count."""
    opts, instances = setup["opts"], setup["instances"]
    cap = sweeps or setup["options"].max_sweeps
    if start is None:
        found, record = engine.search(instances, ca, cb, opts, max_sweeps=cap, tol=setup["options"].descent_tol,
                                      starts=engine.Restarts(None, None, depth_decay=decay))
        return found, record["starts"][0]["sweeps"]
    history: list = []
    wa, wb = engine.weighted(instances, ca, cb, opts, depth_decay=decay)
    with warnings.catch_warnings():  # a stage cut at S sweeps stops "while still improving": by design
        if sweeps:
            warnings.simplefilter("ignore", UserWarning)
        found = engine.solve(instances, wa, wb, opts, history=history, max_sweeps=cap,
                             tol=setup["options"].descent_tol, start=start)
    return found, len(history)


def objective_copies(config: str, setup: dict, ca: dict, cb: dict) -> tuple:
    """The state dicts a ``plain`` or ``trunc`` configuration's descent sees, its depth decay and its flags."""
    kind, *parts = config.split(":")
    if kind == "plain":
        return ca, cb, float(parts[0]), set()
    scope, rule, decay, flags = parts[0], parts[1], float(parts[2]), set(parts[3:])
    keys = [k for k in setup["matched"] if "all" in flags or ".layers." in k]
    keys = [k for k in keys if not flags & {"ffn", "att"} or (".mlp." in k if "ffn" in flags else ".attention." in k)]
    return (*(denoised(x, keys, scope, rule, setup["heads"]) for x in (ca, cb)), decay, flags)


def elements_of(config: str, setup: dict, ca: dict, cb: dict):
    """The elements of one configuration (see the module's text) and what to report of its run."""
    kind, *parts = config.split(":")
    if kind in ("plain", "trunc"):
        ta, tb, decay, flags = objective_copies(config, setup, ca, cb)
        found, sweeps = descent(setup, ta, tb, decay)
        done = [sweeps]
        if "refine" in flags:
            found, more = descent(setup, ca, cb, decay, start=found)
            done.append(more)
        return found, {"sweeps": done}
    if kind == "hom":
        found, done = None, []
        for stage in parts[0].split(","):
            decay, _, cap = stage.partition("/")
            found, sweeps = descent(setup, ca, cb, float(decay), start=found, sweeps=int(cap) if cap else None)
            done.append(sweeps)
        return found, {"sweeps": done}
    raise SystemExit(f"unknown configuration {config!r} (plain:F, trunc:SCOPE:RANK:F[:FLAG], hom:F1,F2,...)")


def learned_stream(a, b, files, setup) -> dict:
    """The residual rotation of the learned alignment (``--match learned`` on 1 000 unlabeled training images:
    data-dependent, the reference point of section 1 of docs/results/datafree_frontier.md)."""
    from benchmarks import unlabeled
    from benchmarks.datafree_diagnose import composed_stream
    from symmerge.pipeline.align import align_pair

    learned = align_pair(a, b, unlabeled.row_options("learned", files["stats"], 1000))
    wide = [i for i in engine.active(setup["instances"], setup["opts"]) if not i.kind.per_layer]
    return {i.name: composed_stream(learned.elements[i.name]) for i in wide}


def at_learned_stream(config: str, stream: dict, setup: dict, ca: dict, cb: dict) -> dict:
    """A ``plain`` or ``trunc`` configuration's objective (on its own copies, weighted) at its descent's optimum,
    at the learned ``stream`` with every per-layer group solved for it on those copies, and at the descent started
    there; ``{point: (objective, elements)}``."""
    inst, opts = setup["instances"], setup["opts"]
    ta, tb, decay, _ = objective_copies(config, setup, ca, cb)
    wa, wb = engine.weighted(inst, ta, tb, opts, depth_decay=decay)
    local = [i for i in inst if i.kind.per_layer]
    around = engine.solve_local(local, apply(wa, [i for i in inst if i.name in stream], stream), wb, opts)
    points = {"descent optimum": descent(setup, ta, tb, decay)[0], "learned stream, per-layer groups solved":
              {**stream, **around}, "descent from there": descent(setup, ta, tb, decay, start=around)[0]}
    return {name: (sq_distance(apply(wa, inst, found), wb, setup["matched"]), found) for name, found in points.items()}


def prepared(a, b) -> tuple:
    """The bound A, the solver's setup for :func:`elements_of` and both models' canonical state dicts."""
    options = AlignOptions(symmetries=b1.BEST_ALIGN)
    bound = bind(a, None, options.residual)
    opts = options.solver_options()
    wide = [i for i in bound.instances if not i.kind.per_layer and i.kind.active(i, opts)]
    setup = {"options": options, "opts": opts, "instances": bound.instances, "heads": a.config.num_attention_heads,
             "matched": sorted({s.key for i in engine.active(bound.instances, opts) for s in i.slots})}
    return bound, setup, canonicalize(a.state_dict(), wide), canonicalize(b.state_dict(), wide)


def measured(config: str, a, b, curve, points: int) -> dict:
    """One configuration's run on the pair ``a``, ``b``: its elements checked as ``align`` checks them, the weight
    objectives (plain and ``F = 10``) at them, the curve and barrier on ``curve``."""
    bound, setup, ca, cb = prepared(a, b)
    t = time.perf_counter()
    found, row = elements_of(config, setup, ca, cb)
    row["seconds"] = time.perf_counter() - t
    verify_elements(bound.instances, found)
    moved = apply(ca, bound.instances, found)
    row.update(verify_forward(a, with_state_dict(a, moved), bound.spec))
    row["objective"] = sq_distance(moved, cb, setup["matched"])
    row["objective_F10"] = sq_distance(*engine.weighted(bound.instances, moved, cb, setup["opts"], depth_decay=10),
                                       setup["matched"])
    row.update(curve_of(a, b, ca, cb, bound.instances, found, curve, points))
    return row


def run_pair(seeds: str, args, log=print) -> dict:
    _, _, folders, _, files, a, b, _, curve = b1.load_pair(b1.parse_args(["--seeds", seeds]), log)
    rows, learned = {}, {}
    for config in args.configs:
        row = rows[config] = measured(config, a, b, curve, args.points)
        log(f"  {seeds} {config:28s} barrier {row['barrier']:.4f}  objective {row['objective']:.2f} "
            f"(F=10: {row['objective_F10']:.2f})  sweeps {row['sweeps']}  {row['seconds']:.1f} s  "
            f"verified {row['verify_max_rel_diff']:.1e}")
    if args.learned_point:
        bound, setup, ca, cb = prepared(a, b)
        stream = learned_stream(a, b, files, setup)
        for config in (c for c in args.configs if c.split(":")[0] in ("plain", "trunc")):
            learned[config] = {}
            for point, (value, found) in at_learned_stream(config, stream, setup, ca, cb).items():
                verify_elements(bound.instances, found)
                barrier = curve_of(a, b, ca, cb, bound.instances, found, curve, args.points)["barrier"]
                learned[config][point] = {"objective": value, "barrier": barrier}
                log(f"  {seeds} {config:28s} {point:40s} objective {value:9.3f}  barrier {barrier:.4f}")
    return {"seeds": seeds, "models": [str(f) for f in folders], "configs": rows, "learned_point": learned}


def markdown(result: dict) -> str:
    pairs = result["pairs"]
    lines = ["| configuration | " + " | ".join(p["seeds"] for p in pairs) + " |", "|---" * (len(pairs) + 1) + "|"]
    for config in result["configs"]:
        lines.append(f"| `{config}` | " + " | ".join(f"{p['configs'][config]['barrier']:.4f}" for p in pairs) + " |")
    for pair in (p for p in pairs if p.get("learned_point")):
        lines += ["", f"Pair {pair['seeds']}, each objective (on its own copies) / barrier at three points:", "",
                  "| objective | " + " | ".join(next(iter(pair["learned_point"].values()))) + " |", "|---" * 4 + "|"]
        lines += [f"| `{c}` | " + " | ".join(f"{v['objective']:.2f} / {v['barrier']:.4f}" for v in points.values())
                  + " |" for c, points in pair["learned_point"].items()]
    return "\n".join(lines) + "\n"


def run(args) -> dict:
    t0 = time.perf_counter()
    result = {"benchmark": "datafree_objectives",
              "command": " ".join(["python -m benchmarks.datafree_objectives"] + sys.argv[1:]),
              "machine": machine(), "points": args.points, "configs": args.configs,
              "pairs": [run_pair(s, args) for s in args.pairs]}
    result["seconds_total"] = time.perf_counter() - t0
    return result


def write_outputs(result: dict, out: Path) -> None:
    from symmerge.io.model import atomic_dir, write_json

    with atomic_dir(out) as tmp:
        write_json(tmp / "results.json", result)
        (tmp / "tables.md").write_text(markdown(result))


def main(argv=None) -> int:
    args = parse_args(argv)
    return bench_main(args, None, run, lambda result: print("\n" + markdown(result)), write_outputs, "tables.md")


if __name__ == "__main__":
    sys.exit(main())
