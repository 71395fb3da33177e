"""The activation start's factorisation against its size (issue 42, item 6): wall seconds of
``symmerge.pipeline.activations.factor`` on a joint (2f × 2f) float64 Gram (``f``: the FFN width) by both of its
paths — ``torch.linalg.eigh`` (below ``activations.PIVOTED_FROM``, every published result) and the pivoted Cholesky
(LAPACK ``dpstrf`` through scipy, from the threshold up: n × rank in O(n² rank)) — each forced by setting the
threshold, and ``eigh`` in float32 beside them (not used by symmerge). Each Gram is built in float64 from ``tokens``
random activations (rank ≤ tokens), as the start accumulates it from the threshold up. Printed per size: the seconds
of each, the largest error of ``L Lᵀ`` against the Gram (relative to its largest entry), the rank found, and the n³
extrapolation of ``eigh`` to 1 B's FFN site (f = 8192, n = 16384). ``--eigh-up-to N``: ``eigh`` (both precisions)
only for Grams of size n ≤ N (it is O(n³): hours at 16384 on one loaded core).

``--memory``: instead, per width, a child process gathers one FFN site's statistics the way the start does
(``activations.Joint.add`` of float32 activations of both models) and factors its correlations
(``activations.factored``, as the start: in place from the threshold up); printed: the Gram's size, the rise of the
peak RSS (VmHWM) above the RSS before each stage, and both over the Gram's size.

    python -m benchmarks.factor_cost [--widths 256,512,1024,1536] [--tokens 128] [--threads 1] [--eigh-up-to 4096]
    python -m benchmarks.factor_cost --memory [--widths 2048,8192] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch


def gram(n: int, tokens: int) -> torch.Tensor:
    z = torch.randn(tokens, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return z.T @ z


def _err(g: torch.Tensor, L: torch.Tensor) -> float:
    return ((L @ L.T - g).abs().max() / g.abs().max()).item()


def _timed_factor(g: torch.Tensor, threshold: int):
    """symmerge's ``factor`` with ``PIVOTED_FROM`` set to ``threshold``: (seconds, L)."""
    from symmerge.pipeline import activations

    saved = activations.PIVOTED_FROM
    activations.PIVOTED_FROM = threshold
    try:
        t = time.perf_counter()
        la, lb = activations.factor(g)
        return time.perf_counter() - t, torch.cat([la, lb])
    finally:
        activations.PIVOTED_FROM = saved


def row(f: int, tokens: int, eigh_up_to: int = 1 << 30) -> dict:
    g = gram(2 * f, tokens)
    out = {"f": f, "n": 2 * f, "tokens": tokens}
    if 2 * f <= eigh_up_to:
        out["eigh_float64_s"], L = _timed_factor(g, 1 << 62)
        out["eigh_float64_err"] = _err(g, L)
        t = time.perf_counter()
        lam, V = torch.linalg.eigh(g.float())
        L = (V * lam.clamp_min(0).sqrt()).double()
        out["eigh_float32_s"] = time.perf_counter() - t
        out["eigh_float32_err"] = _err(g, L)
    out["pivoted_cholesky_s"], L = _timed_factor(g, 0)
    out["pivoted_cholesky_err"] = _err(g, L)
    out["pivoted_rank"] = L.shape[1]
    if "eigh_float64_s" in out:
        out["speedup"] = out["eigh_float64_s"] / out["pivoted_cholesky_s"]
    return out


def _status(field: str) -> float:
    """This process's ``field`` of /proc/self/status (VmRSS, VmHWM) in GB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) / 1e6


def memory_row(f: int, tokens: int) -> dict:
    """One FFN site's statistics gathered and factored as the start does, in this process: the peak rises."""
    from symmerge.pipeline import activations

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(tokens, f, generator=g), torch.randn(tokens, f, generator=g)
    out = {"f": f, "n": 2 * f, "tokens": tokens, "gram_gb": (2 * f) ** 2 * 8 / 1e9,
           "path": "pivoted" if 2 * f >= activations.PIVOTED_FROM else "eigh"}
    before = _status("VmRSS")
    joint = activations.Joint.empty(f)
    joint.add(a, b)
    out["statistics_rise_gb"] = _status("VmHWM") - before
    before = _status("VmRSS")
    t = time.perf_counter()
    act_a, _ = activations.factored({"site": joint}, {"site"})
    out["factored_s"] = time.perf_counter() - t
    out["factored_rise_gb"] = _status("VmHWM") - before
    out["rank"] = act_a["site"].shape[1]
    for k in ("statistics", "factored"):
        out[f"{k}_rise_over_gram"] = out[f"{k}_rise_gb"] / out["gram_gb"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.factor_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="256,512,1024,1536", help="FFN widths f (the Gram is 2f × 2f)")
    p.add_argument("--tokens", type=int, default=128, help="activations the Gram is built from (its rank)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eigh-up-to", type=int, default=1 << 30, help="eigh only for Grams of size n <= this")
    p.add_argument("--memory", action="store_true", help="the start's peak memory per width, a child process each")
    p.add_argument("--memory-one", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.memory_one:
        print(json.dumps(memory_row(args.memory_one, args.tokens)))
        return 0
    if args.memory:
        for w in args.widths.split(","):
            done = subprocess.run([sys.executable, "-m", "benchmarks.factor_cost", "--memory-one", w, "--tokens",
                                   str(args.tokens), "--threads", str(args.threads)], capture_output=True, text=True)
            print(done.stdout.strip().splitlines()[-1] if done.returncode == 0 else
                  json.dumps({"f": int(w), "error": (done.stderr.strip().splitlines() or ["no output"])[-1]}), flush=True)
        return 0
    _timed_factor(gram(8, 4), 0)  # scipy's import and LAPACK's first call, outside the timings
    rows = []
    for w in args.widths.split(","):
        rows.append(row(int(w), args.tokens, args.eigh_up_to))
        print(json.dumps(rows[-1]), flush=True)
    timed = [r for r in rows if "eigh_float64_s" in r]
    if timed:
        last = timed[-1]
        scale = (16384 / last["n"]) ** 3
        print(f"eigh float64 at n = 16384 (1 B's FFN site), extrapolated n^3 from n = {last['n']}: "
              f"{last['eigh_float64_s'] * scale:.0f} s; float32 {last['eigh_float32_s'] * scale:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
