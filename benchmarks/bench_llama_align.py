"""Data-free alignment time on the B7 pair (two Llamas, ``benchmarks.llama_text``), before and after the
descent changes, in one run: where the seconds go and how the variants compare.

Prints one JSON line. The variants take turns within each repeat (load from other processes hits them
alike); medians over ``--repeats`` and ratios to ``eager`` (the descent before issue 25: head pairing
re-solved on every sweep, relative stopping tolerance 1e-9):

* ``eager``: ``solve(lazy=False)`` with ``descent_tol=1e-9`` (the descent before issue 25);
* ``eager_tol<T>`` / ``lazy_tol<T>`` for each ``--tols`` value: the descent stopping when a sweep gains
  less than T (relative: early exit), with the head pairing re-solved every sweep or held between full
  sweeps (``lazy``, the default; ``AlignOptions.descent_tol`` defaults to 1e-4); the objective's excess
  over ``eager``'s is printed (``excess``).

For each: wall seconds of ``align_pair`` (``recommended``, verification included), sweeps, the final
squared distance over the matched tensors; and, once, the split of one ``align_pair``: set-up
(binding, folding), the descent, the report's distances, the verification forward.

    python -m benchmarks.bench_llama_align [--pair pydocs] [--random] [--repeats 3] [--tols 1e-5,1e-4]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time
import warnings

import torch


def load_pair(name: str, random: bool, kv_heads: int | None = None):
    from symmerge.io.model import load_model

    if random:
        from transformers import LlamaForCausalLM

        from symmerge.demo.lm import llama_config

        cfg = llama_config(4096)
        torch.manual_seed(0)
        a = LlamaForCausalLM(cfg).eval()
        torch.manual_seed(1)
        return a, LlamaForCausalLM(cfg).eval()
    from benchmarks.llama_datafree import pair_folders

    return tuple(load_model(f) for f in pair_folders(kv_heads, name=name))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_llama_align")
    p.add_argument("--pair", default="pydocs", help="cached pair name under ~/.cache/symmerge/llama (default pydocs)")
    p.add_argument("--random", action="store_true", help="a random-init pair of the B7 shape instead")
    p.add_argument("--kv-heads", type=int, default=None, help="the GQA pair (2; default: the MHA pair)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--tols", default="1e-5,1e-4", help="relative stopping tolerances of the early-exit variants")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(a.threads)
    warnings.simplefilter("ignore")
    import symmerge.pipeline.align as align_mod
    from symmerge.pipeline import engine
    from symmerge.pipeline.options import AlignOptions

    model, anchor = load_pair(a.pair, a.random, a.kv_heads)
    options = AlignOptions(symmetries="recommended")
    variants = {"eager": (False, 1e-9)}
    for t in [float(x) for x in a.tols.split(",") if x.strip()]:
        variants[f"eager_tol{t:g}"] = (False, t)
        variants[f"lazy_tol{t:g}"] = (True, t)
    original = engine.solve
    runs = {k: [] for k in variants}
    info = {}
    try:
        for _ in range(a.repeats):
            for name, (lazy, tol) in variants.items():
                engine.solve = functools.partial(original, lazy=lazy)
                t0 = time.perf_counter()
                res = align_mod.align_pair(model, anchor, options.with_(descent_tol=tol))
                runs[name].append(time.perf_counter() - t0)
                r = res.report
                info[name] = {"sweeps": r["sweeps"], "objective": min(r["residual_sweeps_sq_distance"]),
                              "match_seconds": r["match_seconds"], "verify_max_abs_diff": r["verify_max_abs_diff"]}
        # where one default alignment's seconds go
        engine.solve = original
        stages = {}
        t0 = time.perf_counter()
        res = align_mod.align_pair(model, anchor, options.with_(verify=False))  # the defaults
        no_verify = time.perf_counter() - t0
        from symmerge.families import spec_for
        from symmerge.pipeline.verify import verify_forward

        t1 = time.perf_counter()
        verify_forward(model, res.model, spec_for(model.config.model_type))
        stages["verify_forward_s"] = time.perf_counter() - t1
        stages["descent_s"] = res.report["match_seconds"]
        stages["report_and_setup_s"] = no_verify - res.report["match_seconds"]
    finally:
        engine.solve = original
    base = statistics.median(runs["eager"])
    out = {"pair": "random" if a.random else a.pair, "load_average": os.getloadavg()[0], "repeats": a.repeats,
           "stages_of_default": stages}
    for name in variants:
        med = statistics.median(runs[name])
        out[name] = {"seconds": round(med, 3), "ratio": round(med / base, 3), **info[name],
                     "excess": info[name]["objective"] / info["eager"]["objective"] - 1}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
