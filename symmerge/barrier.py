"""Loss barriers along θ(α) = α·θ_A + (1 − α)·θ_B, without and with alignment of A to B.

The Python API behind ``symmerge barrier``: :func:`barrier_study` returns the ``barrier.json``
content (``alphas``; ``curves`` with one entry per variant — ``"none"`` always, plus each alignment
spec — holding ``loss``, ``accuracy`` lists and the scalar ``barrier``), :func:`write_study` writes
``barrier.json`` and ``barrier.png`` (and ``subsets.png`` when subset matching was requested).
"""

from __future__ import annotations

import time
from pathlib import Path

from .align import align, as_model, folded, instances_for, parse_symmetries
from .data import Data, check_data, check_data_path, load_data
from .evaluate import (alpha_grid, check_same_shapes, distance_before_after, evaluate, interpolation_curve,
                       plot_curves, plot_subsets, subset_matching)
from .device import resolve_device
from .io import atomic_dir, write_json


def variant_name(spec) -> str:
    names = parse_symmetries(spec)
    return ",".join(names) if names else "none"


def barrier_study(model_a, model_b, data, aligns=("attn,ffn,rescale",), points: int = 11, rescale: str = "joint",
                  subsets: str | None = None, device="cpu", batch_size: int = 32, max_examples: int | None = None,
                  verify: bool = True, allow_pickle: bool = False, progress: bool = True) -> dict:
    t0 = time.perf_counter()
    alphas = alpha_grid(points)
    variants = ["none"] + [v for v in dict.fromkeys(variant_name(s) for s in aligns) if v != "none"]
    dev = resolve_device(device)
    if not isinstance(data, Data):
        check_data_path(data)
    names = [str(x) if isinstance(x, (str, Path)) else label for x, label in ((model_a, "A"), (model_b, "B"))]
    a, b = as_model(model_a, allow_pickle), as_model(model_b, allow_pickle)
    check_same_shapes(a, b)
    if isinstance(data, Data):
        check_data(data, a)
        d = data
    else:
        d = load_data(data, a, batch_size=batch_size, max_examples=max_examples)
    check_data(d, b)
    result = {"model_a": names[0], "model_b": names[1], "data": d.path, "examples": d.n, "alphas": alphas,
              "convention": "theta(alpha) = alpha*A + (1-alpha)*B; alpha=1 is A (aligned to B), alpha=0 is B",
              "rescale": rescale, "device": str(dev),
              "endpoints": {"A": evaluate(a, d, device=dev, progress=progress, desc="evaluating A"),
                            "B": evaluate(b, d, device=dev, progress=progress, desc="evaluating B")},
              "curves": {}, "distances": {}}
    a.to("cpu"), b.to("cpu")
    _, instances = instances_for(a)
    for v in variants:
        t = time.perf_counter()
        if v == "none":
            moved, info = a, {}
        else:
            moved, rep = align(a, b, v.split(","), rescale=rescale, verify=verify)
            info = {"distance_before": rep["distance_before"], "distance_after": rep["distance_after"],
                    "verify_max_rel_diff": rep.get("verify_max_rel_diff")}
            result["distances"][v] = distance_before_after(a, b, moved, instances)
        # the residual symmetry returns A folded (norm weights in their readers): interpolate with B folded too
        end_b = folded(b) if "residual" in v.split(",") else b
        curve = interpolation_curve(moved, end_b, d, alphas, device=dev, progress=progress, label=v)
        moved.to("cpu"), end_b.to("cpu")
        result["curves"][v] = {**curve, **info, "seconds": time.perf_counter() - t}
    if subsets:
        syms = next((parse_symmetries(v) for v in variants if v != "none"), ("attn",))
        result["subsets"] = subset_matching(a, b, d, syms, mode=subsets, rescale=rescale, device=dev, progress=progress)
    result["seconds"] = time.perf_counter() - t0
    return result


def write_study(result: dict, out) -> Path:
    """Atomically write ``out/barrier.json``, ``out/barrier.png`` (+ ``out/subsets.png``)."""
    out = Path(out)
    with atomic_dir(out) as tmp:
        write_json(tmp / "barrier.json", result)
        plot_curves(result["alphas"], result["curves"], tmp / "barrier.png")
        if "subsets" in result:
            plot_subsets(result["subsets"], tmp / "subsets.png")
    return out
