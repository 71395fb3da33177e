"""Matching time for a pair of randomly initialised roberta-base-shaped models (no loading).

Prints one JSON line: attn_match_s (per-head QK/VO Procrustes, paper Alg. 1), full_match_s
(attn + FFN permutation + joint rescale), medians over --repeats, plus a breakdown.
Usage: python -m benchmarks.bench_matching [--repeats 3] [--layers 12]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from transformers import RobertaConfig, RobertaModel

from symmerge.pipeline.align import instances_for
from symmerge.core.apply import apply
from symmerge.solve import permutation_cost, solve
from symmerge.core.solvers import match_permutation


def timed(fn, repeats: int) -> float:
    fn()  # warm-up: first calls pay for thread pools and LAPACK workspace
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--layers", type=int, default=12)
    args = parser.parse_args()
    cfg = RobertaConfig(hidden_size=768, num_hidden_layers=args.layers, num_attention_heads=12, intermediate_size=3072)
    torch.manual_seed(0)
    a, b = RobertaModel(cfg), RobertaModel(cfg)
    sd_a, sd_b = a.state_dict(), b.state_dict()
    _, instances = instances_for(a)

    def match(symmetries, rescale):
        return lambda: apply(sd_a, instances, solve(instances, sd_a, sd_b, symmetries, rescale))

    result = {
        "shape": f"roberta-base ({args.layers} layers, 768 hidden, 12 heads, FFN 3072)",
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "attn_match_s": timed(match(("attn",), "none"), args.repeats),
        "full_match_s": timed(match(("attn", "ffn", "rescale"), "joint"), args.repeats),
        "full_sequential_rescale_s": timed(match(("attn", "ffn", "rescale"), "sequential"), args.repeats),
        "ffn_only_s": timed(match(("ffn",), "none"), args.repeats),
        "attn_joint_rescale_s": timed(match(("attn", "rescale"), "joint"), args.repeats),
    }
    # where the FFN time goes: one layer's cost GEMM and its exact assignment, single-threaded scipy
    ffn = next(i for i in instances if i.group.kind == "permutation")
    cost = permutation_cost(ffn, sd_a, sd_b)
    result["ffn_cost_gemm_s_per_layer"] = timed(lambda: permutation_cost(ffn, sd_a, sd_b), args.repeats)
    result["ffn_assignment_s_per_layer"] = timed(lambda: match_permutation(cost), args.repeats)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
