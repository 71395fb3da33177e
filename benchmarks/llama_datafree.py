"""Data-free alignment variants on the B7 pair (two Llamas, ``benchmarks.llama_text``): loss barrier and
seconds of each, against the issue's goal (barrier ≤ 0.25 within ≤ 7 s wall).

    python -m benchmarks.llama_datafree [--kv-heads 2] [--variants recommended,sweeps-2,...] [--repeats 3]
                                        [--out DIR]

Each variant aligns model A to model B without data (``align_pair``, ``match="weights"``), ``--repeats``
times (wall seconds: the median; also the process's CPU seconds and the 1-minute load average when the
first alignment started), and walks θ(α) = α·θ_A' + (1−α)·θ_B on B7's 200 held-out paragraphs at
α = 0, ¼, ½, ¾, 1 (θ_B: the anchor in the aligned model's parameterisation, its norms folded as the
aligned model's are — what ``merge`` and ``barrier`` interpolate; the endpoint losses are computed once:
every alignment keeps A's function). The variants (:data:`VARIANTS`):

* ``recommended`` — the default (heads, per-head QK/VO, FFN, joint rescale, residual O(d); the stream's
  first step from the embeddings, LM head and norms; stop when a sweep gains < 1e-4);
* ``sweeps-N`` — the same descent cut after N sweeps; ``tol-1e-6`` — run further (1e-6);
* ``init-all`` / ``init-local`` — the stream's first step from every matched tensor, or after a first
  per-layer solve (``engine.solve``'s ``init``);
* ``restarts-N`` — N descents from random per-layer elements (seeds 0..N−1) plus the default start, the
  lowest objective kept (seconds: all of them);
* ``weight-sqrt`` / ``weight-cos`` / ``weight-embhead-half`` — the stream's Procrustes cost with each
  tensor's term divided by √(‖A‖‖B‖) / by ‖A‖‖B‖ (every tensor counts alike: the embeddings and LM head no
  longer dominate), or with the embeddings' and LM head's halved (the per-layer groups unchanged);
* ``no-rescale`` / ``rescale-sequential`` — the rescale symmetry off, or solved sequentially;
* ``residual-permutation`` — the stream in signed permutations, norms kept;
* ``qk-norm`` — the default alignment; on the merge side, at every α the interpolated q/k projections
  rescaled to the interpolated Frobenius norms of the endpoints' (attention logits keep their scale);
* ``depth-decay-F`` (e.g. ``depth-decay-10``) — the default alignment with the layers' tensors weighted by depth (``--depth-decay F``);
* ``unfolded-anchor`` — the default alignment, interpolated against B as it is (norms not folded: the
  B7 benchmark's curve before this study).

Writes ``results.json`` into ``--out`` and prints one line per variant.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import re
import statistics
import time
import warnings
from pathlib import Path

import torch

ALPHAS = (0.0, 0.25, 0.5, 0.75, 1.0)
VARIANTS = ("recommended", "sweeps-1", "sweeps-2", "tol-1e-6", "init-all", "init-local", "restarts-3",
            "weight-sqrt", "weight-cos", "weight-embhead-half", "no-rescale", "rescale-sequential",
            "residual-permutation", "qk-norm", "unfolded-anchor", "depth-decay-10")
DEFAULT_VARIANTS = ("recommended", "sweeps-2", "tol-1e-6", "init-all", "init-local", "restarts-3", "weight-sqrt",
                    "weight-cos", "no-rescale", "residual-permutation", "qk-norm", "unfolded-anchor")


def pair_folders(kv_heads: int | None = None, heads: int = 4, name: str = "pydocs") -> list[Path]:
    """The B7 pair: ``name`` "pydocs" is ``benchmarks.llama_text``'s recipe (its default flags, ``--kv-heads`` for the
    GQA pair), resolved through its own training function, which reuses the cached folders (trains them if missing):
    the documented pair, whatever else the cache holds under the same names. Another ``name``: the one cached pair of
    that name (``<name>-A-<hash>``, GQA ``<name>-A-gqa2-<hash>``), refused when several match."""
    gqa = f"-gqa{kv_heads}" if kv_heads not in (None, heads) else ""
    if name == "pydocs":
        return recipe_folders(kv_heads if gqa else None)
    return cached_folders(name, gqa, kv_heads)


def recipe_folders(kv_heads: int | None) -> list[Path]:
    """The folders of ``benchmarks.llama_text``'s pair at its default flags (and ``--kv-heads``)."""
    from benchmarks import llama_text

    args = llama_text.parse_args(["--kv-heads", str(kv_heads)] if kv_heads is not None else [])
    return list(llama_text.train_pair(args, llama_text.prepare_data(args, llama_text.work_dir(args)), print)[2])


def cached_folders(name: str, gqa: str, kv_heads: int | None) -> list[Path]:
    """The one cached pair ``<name>-A/B<gqa>-<hash>`` (the MHA pattern never matches the GQA pair's folders)."""
    from symmerge.demo.datasets import cache_dir

    root = cache_dir() / "llama"
    out = []
    for m in "AB":
        pattern = re.compile(rf"{re.escape(name)}-{m}{re.escape(gqa)}-[0-9a-f]{{12}}")
        found = sorted(p for p in root.glob(f"{name}-{m}*") if pattern.fullmatch(p.name)) if root.is_dir() else []
        if not found:
            raise SystemExit(f"no cached model {name}-{m}{gqa} under {root}: run python -m benchmarks.llama_text "
                             f"--train-only {m}" + (f" --kv-heads {kv_heads}" if gqa else "") + " first")
        if len(found) > 1:
            raise SystemExit(f"several cached models {name}-{m}{gqa} under {root} ({', '.join(p.name for p in found)}): "
                             "which pair is meant is not known from the name; pass the folders")
        out.append(found[0])
    return out


@contextlib.contextmanager
def stream_weights(rule: str | None):
    """The residual kind's cost with each non-norm tensor's term weighted by ``rule`` (None: unchanged)."""
    from symmerge.core.slots import fast_dtype, unit_matrix
    from symmerge.groups.residual import Residual

    if rule is None:
        yield
        return
    original = Residual.cost

    def weight(key, x1, x2):
        if rule == "sqrt":
            return 1.0 / float(x1.norm() * x2.norm()) ** 0.5
        if rule == "cos":
            return 1.0 / float(x1.norm() * x2.norm())
        return 0.5 if ("embed" in key or "lm_head" in key) else 1.0  # embhead-half

    def cost(self, inst, sd_a, sd_b, keys=None):
        dtype = fast_dtype(*(sd_a[s.key] for s in inst.slots))
        C = torch.zeros(inst.size, inst.size, dtype=torch.float64)
        D = torch.zeros(inst.size, inst.size, dtype=torch.float64)
        for s in inst.slots:
            if keys is not None and s.key not in keys:
                continue
            x1, x2 = unit_matrix(sd_a[s.key], s, dtype).double(), unit_matrix(sd_b[s.key], s, dtype).double()
            if s.diag:
                D += x1 @ x2.T
            elif x1.norm() > 0 and x2.norm() > 0:
                C += weight(s.key, x1, x2) * (x1 @ x2.T)
        return C, D

    Residual.cost = cost
    try:
        yield
    finally:
        Residual.cost = original


@contextlib.contextmanager
def solve_with(**kw):
    """``engine.solve`` (which the weight matcher calls) with extra keywords."""
    import functools

    from symmerge.pipeline import engine

    original = engine.solve
    engine.solve = functools.partial(original, **kw) if kw else original
    try:
        yield
    finally:
        engine.solve = original


def qk_norm(sd_a: dict, sd_b: dict, alpha: float, mixed: dict) -> dict:
    """The interpolated q/k projections rescaled to α‖q_A‖ + (1−α)‖q_B‖ (Frobenius), the rest as interpolated."""
    out = dict(mixed)
    for k, v in mixed.items():
        if k.endswith(("q_proj.weight", "k_proj.weight")) and v.norm() > 0:
            target = alpha * sd_a[k].double().norm() + (1 - alpha) * sd_b[k].double().norm()
            out[k] = (v.double() * (target / v.double().norm())).to(v.dtype)
    return out


def variant_setup(name: str):
    """``(AlignOptions kwargs, solve kwargs, stream weighting rule, merge transform, unfolded anchor, restarts)``."""
    opts, solve_kw, rule, merge, unfolded, restarts = {"symmetries": "recommended"}, {}, None, None, False, 0
    if name.startswith("sweeps-"):
        opts["max_sweeps"] = int(name.split("-")[1])
    elif name == "tol-1e-6":
        opts["descent_tol"] = 1e-6
    elif name.startswith("init-"):
        solve_kw["init"] = name.split("-")[1]
    elif name.startswith("restarts-"):
        restarts = int(name.split("-")[1])
    elif name.startswith("weight-"):
        rule = name[len("weight-"):]
    elif name == "no-rescale":
        opts["symmetries"] = "heads,attn,ffn,residual"
    elif name == "rescale-sequential":
        opts["rescale"] = "sequential"
    elif name == "residual-permutation":
        opts["residual"] = "permutation"
    elif name.startswith("depth-decay-"):
        try:
            opts["depth_decay"] = float(name[len("depth-decay-"):])
        except ValueError:
            raise SystemExit(f"unknown variant {name!r}: depth-decay-F takes a number F") from None
    elif name == "qk-norm":
        merge = qk_norm
    elif name == "unfolded-anchor":
        unfolded = True
    elif name != "recommended":
        raise SystemExit(f"unknown variant {name!r}; choose from {', '.join(VARIANTS)}")
    return opts, solve_kw, rule, merge, unfolded, restarts


def align_once(a, b, name: str):
    """One alignment of ``a`` to ``b`` by the variant: (Alignment, wall s, CPU s, lowest objective)."""
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.bound import bind
    from symmerge.pipeline.options import AlignOptions

    opts, solve_kw, rule, _, _, restarts = variant_setup(name)
    options = AlignOptions(**opts)
    t0, c0 = time.perf_counter(), time.process_time()
    with stream_weights(rule), solve_with(**solve_kw):
        res = align_pair(a, b, options)
    best = (min(res.report["residual_sweeps_sq_distance"]), res)
    if restarts:
        instances = bind(a, None, options.residual).instances
        for seed in range(restarts):
            g = torch.Generator().manual_seed(seed)
            start = {i.name: i.kind.random(i, g, scale=False) for i in instances if i.kind.per_layer}
            with solve_with(start=start):
                r = align_pair(a, b, options)
            best = min(best, (min(r.report["residual_sweeps_sq_distance"]), r), key=lambda x: x[0])
    return best[1], time.perf_counter() - t0, time.process_time() - c0, best[0]


def load_pair(kv_heads: int | None, curve_examples: int, folders=None):
    """(folders, model A, model B, B7's held-out curve data) of the cached pair (or of the two model
    ``folders`` given)."""
    from symmerge.io.data import load_data
    from symmerge.io.model import load_model

    from benchmarks import llama_text

    folders = pair_folders(kv_heads) if folders is None else [Path(f) for f in folders]
    a, b = (load_model(f) for f in folders)
    curve_file = llama_text.work_dir(llama_text.parse_args([])) / "curve.txt"
    if not curve_file.is_file():
        raise SystemExit(f"{curve_file}: missing; run python -m benchmarks.llama_text first")
    return folders, a, b, load_data(curve_file, a, batch_size=32, max_examples=curve_examples)


def run_and_save(args, run) -> int:
    """``run(args)`` offline, with ``args.threads`` torch threads, warnings off; the result into
    ``args.out``/results.json (atomically), or its rows printed."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    result = run(args)
    if args.out:
        from symmerge.io.model import atomic_dir, write_json

        with atomic_dir(Path(args.out)) as tmp:
            write_json(tmp / "results.json", result)
    else:
        print(json.dumps(result["rows"]))
    return 0


def run(args, log=print) -> dict:
    from symmerge.evaluate.metrics import barrier, evaluate, interpolate

    folders, a, b, curve = load_pair(args.kv_heads, args.curve_examples)
    probe = copy.deepcopy(b)

    def loss(sd):
        probe.load_state_dict(sd)
        return evaluate(probe, curve, progress=False)["loss"]

    ends = {1.0: loss(a.state_dict()), 0.0: loss(b.state_dict())}
    log(f"pair {folders[0].name} / {folders[1].name}; endpoint losses A {ends[1.0]:.4f}, B {ends[0.0]:.4f}")
    rows = []
    for name in args.variants:
        walls, cpus, load = [], [], os.getloadavg()[0]
        for _ in range(max(1, args.repeats)):
            res, wall, cpu, objective = align_once(a, b, name)
            walls.append(wall)
            cpus.append(cpu)
        _, _, _, merge, unfolded, _ = variant_setup(name)
        sa, sb = res.model.state_dict(), (b if unfolded else res.anchor).state_dict()
        losses = []
        for alpha in ALPHAS:
            if alpha in ends:
                losses.append(ends[alpha])
                continue
            mixed = interpolate(sa, sb, alpha)
            losses.append(loss(merge(sa, sb, alpha, mixed) if merge else mixed))
        rep = res.report
        row = {"variant": name, "barrier": barrier(ALPHAS, losses), "loss_mid": losses[2], "loss": losses,
               "align_seconds": statistics.median(walls), "align_seconds_all": walls,
               "align_cpu_seconds": statistics.median(cpus), "load_average": load,
               "sweeps": rep.get("sweeps"), "objective": objective,
               "residual_group": rep.get("residual_group"), "verify_max_abs_diff": rep.get("verify_max_abs_diff")}
        rows.append(row)
        log(f"  {name:22s} barrier {row['barrier']:.4f}  loss(½) {row['loss_mid']:.4f}  "
            f"wall {row['align_seconds']:.2f} s  CPU {row['align_cpu_seconds']:.2f} s  load {load:.1f}  "
            f"sweeps {row['sweeps']}  objective {objective:.2f}")
    return {"benchmark": "B7 data-free variants", "pair": [str(f) for f in folders], "endpoints": ends,
            "alphas": ALPHAS, "curve_examples": curve.n, "repeats": args.repeats, "rows": rows,
            "command": "python -m benchmarks.llama_datafree " + " ".join(args.argv)}


def main(argv=None) -> int:
    import sys

    p = argparse.ArgumentParser(prog="python -m benchmarks.llama_datafree", description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-heads", type=int, default=None, help="the GQA pair (2), default the MHA pair")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma list among {', '.join(VARIANTS)}")
    p.add_argument("--repeats", type=int, default=3, help="alignments per variant: the median seconds (default 3)")
    p.add_argument("--curve-examples", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="folder for results.json (default: print only)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for v in args.variants:
        variant_setup(v)  # unknown names: one error before any work
    return run_and_save(args, run)


if __name__ == "__main__":
    raise SystemExit(main())
