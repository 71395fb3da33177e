"""The selection methods' cost on one SmolLM2-embedding-size tensor (49 152 × 576, float32), three fine-tunes.

    PYTHONPATH=TREE python benchmarks/bench_selection.py      # TREE: a symmerge checkout (this one, or an earlier one)

Prints the mean wall seconds of two in-memory merges (``get_method(name).merge``) of ``ties`` (density 0.5,
per-tensor top-k) and ``breadcrumbs`` (density 0.9, gamma 0.01), after a warm-up on a slice (numba compiled).
Run it for two trees one after the other to compare them.
"""

from __future__ import annotations

import time

import torch

from symmerge.merge import get_method


def main() -> None:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(49152, 576, generator=g)
    models = [{"w": base + 0.01 * torch.randn(base.shape, generator=g)} for _ in range(3)]
    cases = (("ties", {"density": 0.5, "scope": "topk", "normalize": True}),
             ("breadcrumbs", {"density": 0.9, "gamma": 0.01}))
    for name, params in cases:
        method = get_method(name)
        method.merge([{"w": m["w"][:100]} for m in models], base={"w": base[:100]}, weights=[1 / 3] * 3, **params)
        t = time.perf_counter()
        for _ in range(2):
            method.merge(models, base={"w": base}, weights=[1 / 3] * 3, **params)
        print(f"{name} {(time.perf_counter() - t) / 2:.2f} s", flush=True)


if __name__ == "__main__":
    main()
