"""Exact linear assignment solvers on real FFN cost matrices: scipy against the ``lap`` module (``lapx``
or ``lap``), same objective required.

The costs are the ones the FFN permutation solves (``C[i, j] = Σ_members ⟨unit i of A, unit j of B⟩``,
:func:`symmerge.groups.permutation.permutation_cost`), negated for minimisation:

* ``vit``: the B1 pair (two ViTs trained on Fashion-MNIST from different seeds, FFN 256);
* ``minilm``: the two MiniLM fine-tunes of one base (FFN 1536: nearly diagonal costs);
* ``gpt2``: the B4 pair (two GPT-2s trained from different seeds, FFN 1024);
* ``smollm2``: SmolLM2-135M-Instruct layer ℓ against layer ℓ+1 (one model only; FFN 1536, SwiGLU);
* ``random``: dense Gaussian 3072 × 3072 (the roberta-base width; the issue's planning figure).

Pairs whose cached models are missing are skipped (run the B1/B4/MiniLM benchmarks once to cache them).
Prints one JSON line: per source and solver the seconds of its solves summed over the matrices (each the
fastest of ``--repeats`` interleaved rounds: the machine is shared), and the worst relative objective gap to scipy (must be ≈ 1e-15). Also, on the random
3072 costs, two solves on two threads against one after another (whether the solver releases the GIL).

    python -m benchmarks.bench_assignment [--layers 3] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from scipy.optimize import linear_sum_assignment

from symmerge.io.cache import cache_root

CACHE = cache_root()  # $SYMMERGE_CACHE, else ~/.cache/symmerge


def _find(pattern: str) -> Path | None:
    hits = sorted(CACHE.glob(pattern))
    return hits[0] if hits else None


def _ffn_costs(path_a, path_b, layers: int, shift: int = 0) -> list[np.ndarray]:
    """Negated FFN costs of the first ``layers`` layers (``shift``: layer ℓ of A against ℓ+shift of B,
    B = A when ``path_b`` is None)."""
    from symmerge.groups.permutation import permutation_cost
    from symmerge.io.model import load_model
    from symmerge.pipeline.align import instances_for

    a = load_model(path_a)
    sd_a = a.state_dict()
    sd_b = load_model(path_b).state_dict() if path_b is not None else sd_a
    _, instances = instances_for(a)
    ffn = [i for i in instances if i.kind.name == "permutation"]
    out = []
    for inst in ffn[:layers]:
        target = dict(sd_b)
        if shift:
            nxt = ffn[inst.layer + shift]
            for s, t in zip(inst.slots, nxt.slots):
                target[s.key] = sd_b[t.key]
        out.append(np.ascontiguousarray(-permutation_cost(inst, sd_a, target).numpy()))
    return out


def sources(layers: int) -> dict[str, list[np.ndarray]]:
    out = {}
    vit_a, vit_b = _find("vit/fmnist-A-*"), _find("vit/fmnist-B-*")
    if vit_a and vit_b:
        out["vit"] = _ffn_costs(vit_a, vit_b, layers)
    m_a, m_b = _find("minilm-polarity-*"), _find("minilm-uncertainty-*")
    if m_a and m_b:
        out["minilm"] = _ffn_costs(m_a, m_b, layers)
    g_a, g_b = _find("gpt2/pydocs-A-*"), _find("gpt2/pydocs-B-*")
    if g_a and g_b:
        out["gpt2"] = _ffn_costs(g_a, g_b, layers)
    smol = _find("smollm2-135m-instruct")
    if smol:
        out["smollm2"] = _ffn_costs(smol, None, layers, shift=1)
    rng = np.random.default_rng(0)
    out["random3072"] = [rng.standard_normal((3072, 3072)) for _ in range(layers)]
    return out


def solvers() -> dict:
    """name → function(cost) → (rows, cols), all minimising in float64."""
    out = {"scipy": linear_sum_assignment}
    try:
        import lap
    except ImportError:
        return out
    version = getattr(lap, "__version__", "?")
    tag = f"lap{version}"

    def lapjv(c):
        x = lap.lapjv(c, return_cost=False)[0]
        return np.arange(len(x)), x

    out[f"{tag}.lapjv"] = lapjv
    if hasattr(lap, "lapjvs"):
        out[f"{tag}.lapjvs"] = lambda c: lap.lapjvs(c, return_cost=False, jvx_like=True, prefer_float32=False)
    if hasattr(lap, "lapjvc"):
        out[f"{tag}.lapjvc"] = lambda c: lap.lapjvc(c, return_cost=False)
    for name in ("lapjvh", "lapjvr"):  # lapx ≥ 0.9: float64 potentials, native rectangular path
        if hasattr(lap, name):
            out[f"{tag}.{name}"] = (lambda f: lambda c: f(c, return_cost=False, precision="float64"))(getattr(lap, name))
    return out


def objective(c: np.ndarray, rows, cols) -> float:
    rows, cols = np.asarray(rows), np.asarray(cols)
    assert len(rows) == min(c.shape) and len(set(cols.tolist())) == len(cols), "not a full assignment"
    return float(c[rows, cols].sum())


def best_times(funcs: dict, c: np.ndarray, repeats: int) -> dict:
    """Per solver the fastest of ``repeats`` rounds and its result; the solvers take turns within a round,
    so a burst of load from other processes hits them alike (the minimum is the least disturbed run)."""
    best: dict = {}
    for _ in range(repeats):
        for name, fn in funcs.items():
            t0 = time.perf_counter()
            res = fn(c)
            sec = time.perf_counter() - t0
            if name not in best or sec < best[name][0]:
                best[name] = (sec, res)
    return best


def two_threads(fn, costs) -> dict:
    """Two solves one after another, then on two threads (ratio ≈ 0.5 on two free cores if the GIL is released)."""
    a, b = costs[0], costs[1 % len(costs)]
    t0 = time.perf_counter()
    fn(a), fn(b)
    serial = time.perf_counter() - t0
    with ThreadPoolExecutor(2) as pool:
        t0 = time.perf_counter()
        list(pool.map(fn, [a, b]))
        parallel = time.perf_counter() - t0
    return {"serial_s": round(serial, 3), "threads_s": round(parallel, 3), "ratio": round(parallel / serial, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--layers", type=int, default=3, help="matrices per source (layers of each pair)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", help="also write the result here")
    args = p.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)
    result = {"cpus": os.cpu_count(), "load_avg_start": os.getloadavg(), "sources": {}}
    costs = sources(args.layers)
    funcs = solvers()
    for name, mats in costs.items():
        row = {"n": mats[0].shape[0], "matrices": len(mats)}
        totals, gaps = dict.fromkeys(funcs, 0.0), dict.fromkeys(funcs, 0.0)
        for c in mats:
            ref = None
            for sname, (sec, (r, cl)) in best_times(funcs, c, args.repeats).items():
                value = objective(c, r, cl)
                ref = value if ref is None else ref  # scipy comes first
                totals[sname] += sec
                gaps[sname] = max(gaps[sname], abs(value - ref) / max(abs(ref), 1e-300))
        for sname in funcs:
            row[sname] = {"s": round(totals[sname], 4), "rel_gap": gaps[sname]}
        result["sources"][name] = row
    result["two_threads_random3072"] = {s: two_threads(f, costs["random3072"]) for s, f in funcs.items()}
    result["load_avg_end"] = os.getloadavg()
    line = json.dumps(result)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")


if __name__ == "__main__":
    main()
