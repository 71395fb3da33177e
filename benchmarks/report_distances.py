"""What the streamed merge's report distances cost, this checkout against the code before (``--before``, a commit: its
whole package extracted beside, ``git archive``): ``symmerge merge --mode stream --method linear --align none`` of
random Llamas (``--hidden``, ``--layers``, FFN 4× hidden, vocabulary 32 000) in each setting of ``--settings``
(dtype and model count, e.g. ``bfloat16x2``), each version a child process in turn (the order alternating), after
one unmeasured run of each (numba's kernels compiled or loaded). Recorded per run: the report's
``stream.seconds.distances`` (the executor's clock of the distances) and the command's wall time. Printed: the
medians of each version and the ratio after / before, the load average before and after; ``--json``: the raw runs.
``--in-process``: instead, the per-step function alone (``merge.kernels.sq_distances`` of each step's inputs and
result, then, after, :class:`symmerge.merge.distances.SquaredSums`), the code before loaded beside this one in one
process, over the tensors of the same Llama's shapes (random, one torch thread), the two alternating: free of the
child processes' start and the threads' scheduling, which make the streamed runs' clock noisy on a loaded machine.

    python -m benchmarks.report_distances --before efc6e43 --repeat 7 --json docs/results/report_distances.json
    python -m benchmarks.report_distances --in-process --repeat 11 --json docs/results/report_distances_kernel.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = ("import sys; from symmerge.cli import main; sys.exit(main(sys.argv[1:]))")


def make_inputs(root: Path, hidden: int, layers: int, dtype: str, count: int) -> list[Path]:
    """``count`` random Llamas (seeds 1…) saved in ``dtype`` under ``root`` (kept: generated once)."""
    import torch
    import transformers as T

    paths = []
    for seed in range(1, count + 1):
        path = root / f"llama-{hidden}x{layers}-{dtype}" / f"m{seed}"
        if not (path / "config.json").exists():
            config = T.LlamaConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                                   num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                                   vocab_size=32000, tie_word_embeddings=False)
            torch.manual_seed(seed)
            T.LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(path)
        paths.append(path)
    return paths


def before_tree(rev: str) -> Path:
    """The package at ``rev`` extracted into a temporary folder (its own numba cache beside its kernels)."""
    tree = Path(tempfile.mkdtemp(prefix="report-distances-before-"))
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "symmerge"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive.stdout, check=True)
    return tree


def run_once(tree: Path, models, out: Path) -> dict:
    """One streamed merge with the package of ``tree``: its distances clock and wall seconds."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", CHILD, "merge", *map(str, models), "--method", "linear", "--align", "none",
                    "--mode", "stream", "--progress", "none", "-o", str(out)], check=True, env=env, cwd=str(out.parent),
                   capture_output=True)
    wall = time.perf_counter() - t
    report = json.loads((out / "symmerge_report.json").read_text())
    subprocess.run(["rm", "-rf", str(out)], check=True)
    return {"distances_s": report["stream"]["seconds"]["distances"], "wall_s": wall,
            "distances": report["distance_result_to_inputs"]}


def measure(trees: dict, models, work: Path, repeat: int) -> dict:
    """``repeat`` runs of each version, alternating (the first version of each repetition rotating)."""
    runs = {name: [] for name in trees}
    names = list(trees)
    for name in names:  # unmeasured: kernels compiled or loaded from numba's cache
        run_once(trees[name], models, work / "out")
    for r in range(repeat):
        for name in names[r % 2:] + names[:r % 2]:
            runs[name].append(run_once(trees[name], models, work / "out"))
    return runs


def summary(runs: dict) -> dict:
    med = {name: {k: statistics.median(x[k] for x in rows) for k in ("distances_s", "wall_s")}
           for name, rows in runs.items()}
    return {**med, "distances_ratio": med["after"]["distances_s"] / med["before"]["distances_s"],
            "wall_ratio": med["after"]["wall_s"] / med["before"]["wall_s"]}


def in_process(rev: str, hidden: int, layers: int, setting: str, repeat: int) -> dict:
    """Seconds of one pass of the per-step distances over a Llama's tensors, before and after, alternating."""
    import torch

    from symmerge.merge.distances import SquaredSums

    from benchmarks.headers_once import before_module

    old = before_module(rev, "symmerge/merge/kernels.py")
    torch.set_num_threads(1)
    dtype, n = setting.split("x")
    dtype, n = getattr(torch, dtype), int(n)
    g = torch.Generator().manual_seed(0)
    shapes = [(32000, hidden)] * 2 + [(hidden, hidden)] * 4 * layers + [(4 * hidden, hidden)] * 3 * layers + \
        [(hidden,)] * (2 * layers + 1)
    steps = [[torch.randn(s, generator=g).to(dtype) for _ in range(n + 1)] for s in shapes]

    def before():
        for t in steps:
            old.sq_distances(t[:n], t[n])

    def after():
        sums = SquaredSums()
        for t in steps:
            sums.add(t[:n], t[n])
        sums.totals()

    versions = {"before": before, "after": after}
    for f in versions.values():
        f()
    times = {v: [] for v in versions}
    for r in range(repeat):
        for v in (["before", "after"] if r % 2 else ["after", "before"]):
            t = time.perf_counter()
            versions[v]()
            times[v].append(time.perf_counter() - t)
    med = {v: statistics.median(x) for v, x in times.items()}
    return {"seconds": times, "median_s": med, "ratio": med["after"] / med["before"]}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m benchmarks.report_distances", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", default="efc6e43", help="the commit whose package is the 'before' (default efc6e43)")
    p.add_argument("--repeat", type=int, default=7, help="runs of each version per setting (alternating; medians)")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--settings", default="float32x2,float32x3,bfloat16x2,bfloat16x3",
                   help="comma-separated DTYPExCOUNT: the inputs' dtype and how many models are merged")
    p.add_argument("--dir", default=str(Path(tempfile.gettempdir()) / "symmerge-report-distances"),
                   help="where the inputs are generated (kept)")
    p.add_argument("--json", help="also write the settings, the raw runs and the medians to this file")
    p.add_argument("--in-process", action="store_true", help="time the per-step function alone, in one process")
    args = p.parse_args(argv)
    if args.in_process:
        return _in_process_main(args)
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    trees = {"before": before_tree(args.before), "after": ROOT}
    result = {"before": args.before, "hidden": args.hidden, "layers": args.layers, "repeat": args.repeat,
              "load_average_start": os.getloadavg(), "settings": {}}
    for setting in args.settings.split(","):
        dtype, count = setting.split("x")
        models = make_inputs(root, args.hidden, args.layers, dtype, int(count))
        runs = measure(trees, models, root, args.repeat)
        result["settings"][setting] = {"runs": runs, **summary(runs)}
        s = result["settings"][setting]
        print(f"{setting}: distances {s['before']['distances_s']:.3f} s before, {s['after']['distances_s']:.3f} s after "
              f"({s['distances_ratio']:.3f}x); wall {s['before']['wall_s']:.2f} / {s['after']['wall_s']:.2f} s "
              f"({s['wall_ratio']:.3f}x)", flush=True)
    result["load_average_end"] = os.getloadavg()
    print(f"load average {result['load_average_start'][0]:.2f} at the start, {result['load_average_end'][0]:.2f} at "
          "the end")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    subprocess.run(["rm", "-rf", str(trees["before"])], check=True)
    return result


def _in_process_main(args) -> dict:
    result = {"before": args.before, "hidden": args.hidden, "layers": args.layers, "repeat": args.repeat,
              "load_average_start": os.getloadavg(), "in_process": {}}
    for setting in args.settings.split(","):
        s = result["in_process"][setting] = in_process(args.before, args.hidden, args.layers, setting, args.repeat)
        print(f"{setting} (in process): {s['median_s']['before'] * 1e3:.1f} ms before, {s['median_s']['after'] * 1e3:.1f} "
              f"ms after ({s['ratio']:.3f}x; least {min(s['seconds']['before']) * 1e3:.1f} / "
              f"{min(s['seconds']['after']) * 1e3:.1f} ms)", flush=True)
    result["load_average_end"] = os.getloadavg()
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
