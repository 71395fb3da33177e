"""Matching time for a pair of randomly initialised roberta-base-shaped models (no loading).

Prints one JSON line, medians over --repeats (the variants take turns within each repeat, so load from
other processes hits them alike; the load average is printed too):

* ``full_match_s``: attn + FFN permutation + joint rescale, layers on a pool of one thread per core
  (``AlignOptions(workers=None)``), with the fastest exact assignment available (lapx if installed);
  ``full_match_serial_s``: the same one layer after another (``workers=1``);
  ``full_match_serial_scipy_s``: serial with scipy's assignment (the path before layer parallelism);
* ``attn_match_s`` / ``attn_match_serial_s``: per-head QK/VO Procrustes only (paper Alg. 1);
* where the FFN time goes: one layer's cost GEMM and its exact assignment with each solver
  (``ffn_assignment_s_per_layer``; random-init costs are unstructured: see bench_assignment for trained
  models' costs);
* ``*_cpu_s``: CPU seconds of the process for the same runs (the work; on a machine shared with other
  jobs the wall time says more about the load than about the code);
* ``--extra``: also sequential rescale, FFN only, attn + joint rescale (parallel).

Usage: python -m benchmarks.bench_matching [--repeats 3] [--layers 12] [--hidden 768] [--ffn 3072] [--extra]
[--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import RobertaConfig, RobertaModel

from symmerge.core.apply import apply
from symmerge.core.solvers import match_permutation
from symmerge.core.solvers.assignment import assignment_solver
from symmerge.groups.permutation import permutation_cost
from symmerge.pipeline.align import instances_for
from symmerge.core.parallel import pool_size
from symmerge.pipeline.engine import solve
from symmerge.pipeline.options import AlignOptions


def with_solver(solver: str | None, fn):
    """``fn`` run with ``SYMMERGE_ASSIGNMENT=solver`` (None: the default choice)."""
    def run():
        old = os.environ.pop("SYMMERGE_ASSIGNMENT", None)
        if solver:
            os.environ["SYMMERGE_ASSIGNMENT"] = solver
        try:
            return fn()
        finally:
            os.environ.pop("SYMMERGE_ASSIGNMENT", None)
            if old is not None:
                os.environ["SYMMERGE_ASSIGNMENT"] = old
    return run


def timed(variants: dict, repeats: int, cpu: bool = False) -> dict:
    """Median seconds of each variant; one warm-up call each (thread pools, LAPACK workspace), then
    ``repeats`` rounds in which the variants take turns. ``cpu``: also the median CPU seconds of the
    process (all threads) as ``<name>`` with ``_s`` → ``_cpu_s``: the work, which load from other
    processes changes little (wall ≥ CPU seconds / cores)."""
    for fn in variants.values():
        fn()
    times: dict = {k: [] for k in variants}
    cpus: dict = {k: [] for k in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            times[name].append(time.perf_counter() - start)
            cpus[name].append(time.process_time() - start_cpu)
    out = {k: round(statistics.median(v), 4) for k, v in times.items()}
    if cpu:
        out.update({k[:-2] + "_cpu_s": round(statistics.median(v), 4) for k, v in cpus.items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768, help="hidden size (64 per head; smoke test: smaller)")
    parser.add_argument("--ffn", type=int, default=3072, help="FFN width")
    parser.add_argument("--extra", action="store_true", help="also time sequential rescale, FFN only, attn + rescale")
    parser.add_argument("--device", help="also time the full match with its cost GEMMs there (AlignOptions.device, "
                                         "e.g. cuda): full_match_<device>_gemm_s and the per-layer GEMM there")
    args = parser.parse_args()
    if args.device and torch.device(args.device).type == "cpu":
        parser.error("--device: a device other than the CPU (the CPU GEMMs are the other variants)")
    cfg = RobertaConfig(hidden_size=args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=max(1, args.hidden // 64), intermediate_size=args.ffn)
    torch.manual_seed(0)
    a, b = RobertaModel(cfg), RobertaModel(cfg)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    _, instances = instances_for(a)

    def match(symmetries, rescale, workers=None, solver=None, device=None):
        opts = AlignOptions(symmetries=symmetries, rescale=rescale, workers=workers,
                            device=device).solver_options(torch.device(device) if device else None)
        return with_solver(solver, lambda: apply(sd_a, instances, solve(instances, sd_a, sd_b, opts)))

    full = ("attn", "ffn", "rescale")
    result = {
        "shape": f"roberta-base ({args.layers} layers, {args.hidden} hidden, {cfg.num_attention_heads} heads, "
                 f"FFN {args.ffn})",
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "workers": pool_size(None),
        "assignment_solver": assignment_solver(),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
    }
    result.update(timed({
        "full_match_s": match(full, "joint"),
        "full_match_serial_s": match(full, "joint", workers=1),
        "full_match_serial_scipy_s": match(full, "joint", workers=1, solver="scipy"),
    }, args.repeats, cpu=True))
    if args.device:  # the same match with the cost GEMMs on the device; ratio in one run
        name = args.device.replace(":", "")
        result.update(timed({f"full_match_{name}_gemm_s": match(full, "joint", device=args.device),
                             "full_match_cpu_gemm_s": match(full, "joint")}, args.repeats))
        result[f"full_speedup_{name}_gemm"] = round(result["full_match_cpu_gemm_s"]
                                                    / result[f"full_match_{name}_gemm_s"], 2)
    result.update(timed({
        "attn_match_s": match(("attn",), "none"),
        "attn_match_serial_s": match(("attn",), "none", workers=1),
    }, args.repeats, cpu=True))
    if args.extra:
        result.update(timed({
            "full_sequential_rescale_s": match(full, "sequential"),
            "ffn_only_s": match(("ffn",), "none"),
            "attn_joint_rescale_s": match(("attn", "rescale"), "joint"),
        }, args.repeats))
    # where the FFN time goes: one layer's cost GEMM and its exact assignment, on one thread
    ffn = next(i for i in instances if i.group.kind == "permutation")
    cost = permutation_cost(ffn, sd_a, sd_b)
    result["ffn_cost_gemm_s_per_layer"] = timed({"g": lambda: permutation_cost(ffn, sd_a, sd_b)}, args.repeats)["g"]
    if args.device:
        dev = torch.device(args.device)

        def on_device():  # the cost comes back to the CPU: the time includes the copy and the GPU's work
            return permutation_cost(ffn, sd_a, sd_b, device=dev)
        result[f"ffn_cost_gemm_{args.device.replace(':', '')}_s_per_layer"] = timed({"g": on_device}, args.repeats)["g"]
    solvers = {"scipy": with_solver("scipy", lambda: match_permutation(cost))}
    if assignment_solver() != "scipy.linear_sum_assignment":
        solvers["lapx"] = with_solver(None, lambda: match_permutation(cost))
    result["ffn_assignment_s_per_layer"] = timed(solvers, args.repeats)
    result["full_speedup_vs_serial"] = round(result["full_match_serial_s"] / result["full_match_s"], 2)
    result["full_speedup_vs_serial_scipy"] = round(result["full_match_serial_scipy_s"] / result["full_match_s"], 2)
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
