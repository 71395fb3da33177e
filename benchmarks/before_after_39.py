"""Issue 39's "before and after in one run": B1's data-free and learned rows with two symmerge trees, and the
tables of ``bench_methods`` / ``bench_merge`` runs.

    python benchmarks/before_after_39.py b1 --before TREE --json OUT.json [--repeats 1]
    python benchmarks/before_after_39.py methods-table JSON...        # markdown rows from bench_methods JSONs

``b1``: the two cached ViTs of B1 (``benchmarks.vit_fashion_mnist``'s defaults: seeds 0 and 1, found in
~/.cache/symmerge, never retrained here) aligned A to B by the rows "best data-free (all groups, weights)" and
"learned" of ``benchmarks.unlabeled`` (1 000 unlabeled training images), each followed by its 11-point curve on
the 2 000-image curve set and the α = 0.5 average merge scored on the 10 000 test images. One child process per
tree and repeat, one torch thread, alternating after / before (``TREE`` first on ``PYTHONPATH`` and the working
directory, as ``bench_merge --before`` runs it). Every figure except seconds and load is compared between the two
trees: the verdict lists each that differs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
B1_ROWS = ("best data-free (all groups, weights)", "learned")
TIMING_KEYS = {"align_seconds", "align_cpu_seconds", "load_average", "seconds", "activation_seconds", "seconds_total",
               "symmerge_file", "wall_s", "elapsed", "time", "seconds_per_step"}


def child_b1(out: str, tiny: str = "") -> None:
    """In this process's symmerge: the B1 rows, written as JSON to ``out``."""
    import torch

    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import symmerge
    from benchmarks import unlabeled
    from benchmarks.vit_fashion_mnist import load_pair, parse_args

    t0 = time.perf_counter()
    args = parse_args(["--tiny"] if tiny else [])
    config, seeds, folders, arrays, files, a, b, test, curve = load_pair(args, lambda *x: None)
    alphas = [i / (args.points - 1) for i in range(args.points)]
    result = unlabeled.run_rows(a, b, files["stats"], args.align_samples, curve, test, {}, alphas, rows=B1_ROWS,
                                methods=("average",), log=lambda *x: None)
    result = {"symmerge_file": symmerge.__file__, "models": [str(f) for f in folders], "rows": result["rows"],
              "curves": result["curves"], "seconds_total": time.perf_counter() - t0}
    Path(out).write_text(json.dumps(result, indent=2, default=str) + "\n")


def tree_env(tree: str | None) -> dict:
    env = dict(os.environ)
    paths = ([str(Path(tree).resolve())] if tree else []) + [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["OMP_NUM_THREADS"] = "1"
    return env


def differences(x, y, path="") -> list[str]:
    """Every leaf that differs between ``x`` and ``y`` (timings and load left out)."""
    if isinstance(x, dict) and isinstance(y, dict):
        out = [f"{path}/{k}: only in one" for k in sorted(set(x) ^ set(y)) if k not in TIMING_KEYS and "seconds" not in k]
        for k in sorted(set(x) & set(y)):
            if k not in TIMING_KEYS and "seconds" not in k:
                out += differences(x[k], y[k], f"{path}/{k}")
        return out
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        return [d for i, (u, v) in enumerate(zip(x, y)) for d in differences(u, v, f"{path}[{i}]")]
    return [] if x == y else [f"{path}: {x!r} != {y!r}"]


def b1(args) -> int:
    runs: dict = {"after": [], "before": []}
    order = ["after", "before"]
    tmp = Path(args.json).with_suffix(".parts")
    tmp.mkdir(exist_ok=True)
    for r in range(args.repeats):
        for tool in order[r % 2:] + order[:r % 2]:
            part = (tmp / f"{tool}-{r}.json").resolve()
            load = os.getloadavg()
            t = time.perf_counter()
            tree = args.before if tool == "before" else None
            subprocess.run([sys.executable, str(Path(__file__).resolve()), "child-b1", str(part),
                            *(["tiny"] if args.tiny else [])], check=True,
                           env=tree_env(tree), cwd=tree or ROOT)
            got = json.loads(part.read_text())
            got.update(wall_s=time.perf_counter() - t, load_average=load)
            runs[tool].append(got)
            rows = got["rows"]
            print(f"{tool} #{r}: " + "; ".join(
                f"{k}: align {v['align_seconds']:.1f} s / {v['align_cpu_seconds']:.1f} CPU s, barrier "
                f"{v['barrier']:.4f}, mid acc {v['merges']['average']['test_accuracy']:.4f}" for k, v in rows.items())
                  + f" (load {load[0]:.1f})", flush=True)
    diffs = differences(runs["after"][0], runs["before"][0])
    figures = {"load_average_after": os.getloadavg(), "before": str(Path(args.before).resolve()), "runs": runs,
               "differences": diffs}
    Path(args.json).write_text(json.dumps(figures, indent=2, default=str) + "\n")
    for f in tmp.iterdir():
        f.unlink()
    tmp.rmdir()
    print("figures identical" if not diffs else "differences:\n  " + "\n  ".join(diffs[:40]))
    return 0


def methods_table(paths: list[str]) -> None:
    """Markdown rows from ``bench_methods`` JSONs (one method or many each)."""
    print("| method | dtype | after wall s | RSS GB | before wall s | RSS GB | after/before wall | CPU | RSS | mergekit wall s "
          "| RSS GB | after / before vs mergekit (wall) | gap after | gap before | load |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for p in paths:
        d = json.loads(Path(p).read_text())
        for m, r in d["methods"].items():
            s, b, k = r["symmerge"], r["before"], r["mergekit"]

            def gap(c):
                return f"{c['gap']:.2g}" + (" (=)" if c.get("equal") else "") if isinstance(c, dict) else "?"

            print(f"| {m} | {d['dtype'] or 'float32'} | {s['wall_s']:.2f} | {s['peak_rss_gb']:.2f} | {b['wall_s']:.2f} "
                  f"| {b['peak_rss_gb']:.2f} | {s['wall_s'] / b['wall_s']:.2f} | {s['cpu_s'] / b['cpu_s']:.2f} "
                  f"| {s['peak_rss_gb'] / b['peak_rss_gb']:.2f} "
                  f"| {k['wall_s']:.1f} | {k['peak_rss_gb']:.2f} | {r['ratios']['wall_s']:.3f} / "
                  f"{r['ratios_before']['wall_s']:.3f} | {gap(r['closeness'])} | {gap(r['closeness_before'])} "
                  f"| {d['load_average'][0]:.1f} |")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["child-b1"]:
        child_b1(*argv[1:])
        return 0
    if argv[:1] == ["methods-table"]:
        methods_table(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="python benchmarks/before_after_39.py", description=__doc__.split("\n\n")[0])
    p.add_argument("what", choices=("b1",))
    p.add_argument("--before", required=True, metavar="TREE", help="an earlier checkout (git archive REV | tar -x)")
    p.add_argument("--json", required=True, help="write the figures to this JSON file")
    p.add_argument("--repeats", type=int, default=1, help="runs per tree (alternating)")
    p.add_argument("--tiny", action="store_true", help="B1's tiny smoke-test pair (trained in seconds if not cached)")
    args = p.parse_args(argv)
    return b1(args)


if __name__ == "__main__":
    sys.exit(main())
