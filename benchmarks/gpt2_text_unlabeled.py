"""B4 with unlabeled data (issue 13): the cached GPT-2 pair of ``benchmarks.gpt2_text`` aligned from
unlabeled text — activation matching, + REPAIR, learned alignment — and the loss along θ(α) on the
held-out curve paragraphs. One row per call, printed as one JSON line:

    python -m benchmarks.gpt2_text_unlabeled --match learned --untie --residual largest [--repair]

Alignment data: the first ``--n`` paragraphs of the validation split (unlabeled text, never the
evaluation set); curves on ``curve.txt`` (300 test paragraphs), ``--points`` α values. Run
``python -m benchmarks.gpt2_text`` first (it trains or finds the pair and writes the text files).
``--untie`` gives the LM head a tensor of its own, so that the final LayerNorm folds into it and the
residual stream can take its largest group (O(d−1)); the merged model then has an untied head."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpt2_text_unlabeled")
    p.add_argument("--match", default="learned", choices=("weights", "activations", "learned"))
    p.add_argument("--symmetries", default="heads,attn,ffn,rescale,residual")
    p.add_argument("--residual", default="permutation", choices=("permutation", "largest"))
    p.add_argument("--untie", action="store_true")
    p.add_argument("--n", type=int, default=512, help="unlabeled validation paragraphs for alignment")
    p.add_argument("--steps", type=int, default=100, help="learned alignment steps")
    p.add_argument("--batch", type=int, default=32, help="paragraphs per learned step")
    p.add_argument("--points", type=int, default=5)
    p.add_argument("--repair", action="store_true", help="REPAIR at every α (statistics on the alignment data)")
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(a.threads)
    from symmerge.demo.datasets import cache_dir
    from symmerge.merge.barrier import repaired_curve
    from symmerge.evaluate.metrics import interpolation_curve
    from symmerge.io.data import load_data
    from symmerge.io.model import load_model
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions, LearnSettings

    root = cache_dir()
    folders = [sorted((root / "gpt2").glob(f"pydocs-{n}-*"))[-1] for n in "AB"]
    model_a, model_b = (load_model(f) for f in folders)
    texts = root / "benchmarks" / "gpt2-text"
    curve = load_data(texts / "curve.txt", model_a, batch_size=32)
    opts = AlignOptions(symmetries=a.symmetries, match=a.match, residual=a.residual, untie=a.untie,
                        align_data=None if a.match == "weights" else texts / "validation.txt", align_samples=a.n,
                        learn=LearnSettings(steps=a.steps, batch=a.batch))
    load = os.getloadavg()[0]
    t, cpu = time.perf_counter(), time.process_time()
    res = align_pair(model_a, model_b, opts)
    secs, cpu = time.perf_counter() - t, time.process_time() - cpu
    alphas = [i / (a.points - 1) for i in range(a.points)]
    if a.repair:
        c = repaired_curve(res.model, res.anchor, curve, alphas, opts, progress=False)
    else:
        c = interpolation_curve(res.model, res.anchor, curve, alphas, progress=False)
    learned = {k: v for k, v in res.report.get("learned", {}).items() if k != "history"}
    print(json.dumps({"args": vars(a), "align_seconds": secs, "align_cpu_seconds": cpu, "load_average": load,
                      "alphas": alphas, "loss": c["loss"], "barrier": c["barrier"],
                      "mid_loss": c["loss"][len(alphas) // 2], "learned": learned}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
