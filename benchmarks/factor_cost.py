"""The activation start's factorisation against its size (issue 42, item 6): wall seconds of
``symmerge.pipeline.activations.factor`` (``torch.linalg.eigh`` of the joint (2f × 2f) float64 Gram of a layer's
FFN site; ``f``: the FFN width) at the widths of SmolLM2-135M (1536), SmolLM2-360M (2560) and smaller ones, and
of two cheaper factorisations measured beside it, not used by symmerge: ``eigh`` in float32, and LAPACK's
pivoted Cholesky (``dpstrf``, through scipy) — exact for a positive semi-definite Gram of rank ``r`` (the
tokens seen) in O(n² r) instead of O(n³). Each Gram is built from ``tokens`` random activations (rank ≤ tokens),
as the start gathers it. Printed per size: the seconds of each, the largest error of ``L Lᵀ`` against the Gram
(relative to its largest entry), and the n³ extrapolation of ``eigh`` to 1 B's width (f = 8192, n = 16384).

    python -m benchmarks.factor_cost [--widths 256,512,1024,1536] [--tokens 128] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def gram(n: int, tokens: int) -> torch.Tensor:
    z = torch.randn(tokens, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return z.T @ z


def _err(g: torch.Tensor, L: torch.Tensor) -> float:
    return ((L @ L.T - g).abs().max() / g.abs().max()).item()


def pivoted(g: torch.Tensor) -> torch.Tensor:
    """``L`` (n × r) with ``L Lᵀ = g`` by LAPACK's pivoted Cholesky (``dpstrf``), r its numerical rank."""
    from scipy.linalg import lapack

    c, piv, rank, _ = lapack.dpstrf(g.numpy(), lower=1, tol=-1.0)
    L = torch.zeros_like(g)
    L[torch.as_tensor(piv - 1)] = torch.from_numpy(c).tril()
    return L[:, :rank]


def row(f: int, tokens: int) -> dict:
    from symmerge.pipeline.activations import factor

    g = gram(2 * f, tokens)
    out = {"f": f, "n": 2 * f, "tokens": tokens}
    t = time.perf_counter()
    la, lb = factor(g)
    out["eigh_float64_s"] = time.perf_counter() - t
    out["eigh_float64_err"] = _err(g, torch.cat([la, lb]))
    t = time.perf_counter()
    lam, V = torch.linalg.eigh(g.float())
    L = (V * lam.clamp_min(0).sqrt()).double()
    out["eigh_float32_s"] = time.perf_counter() - t
    out["eigh_float32_err"] = _err(g, L)
    t = time.perf_counter()
    L = pivoted(g)
    out["pivoted_cholesky_s"] = time.perf_counter() - t
    out["pivoted_cholesky_err"] = _err(g, L)
    out["pivoted_rank"] = L.shape[1]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.factor_cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--widths", default="256,512,1024,1536", help="FFN widths f (the Gram is 2f × 2f)")
    p.add_argument("--tokens", type=int, default=128, help="activations the Gram is built from (its rank)")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    pivoted(gram(8, 4))  # scipy's import and LAPACK's first call, outside the timings
    rows = [row(int(w), args.tokens) for w in args.widths.split(",")]
    for r in rows:
        print(json.dumps(r))
    last = rows[-1]
    scale = (16384 / last["n"]) ** 3
    print(f"eigh float64 at n = 16384 (1 B's FFN site), extrapolated n^3 from n = {last['n']}: "
          f"{last['eigh_float64_s'] * scale:.0f} s; float32 {last['eigh_float32_s'] * scale:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
