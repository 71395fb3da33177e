"""The task-vector rules before and after one implementation per rule (issue 39 item 4): today's symmerge against the
symmerge of an earlier tree, on the same configs, alternating, in one run.

    python -m benchmarks.bench_rules --before TREE [--dir /tmp/symmerge-bench-rules] [--repeats 3] [--tiny]
                                     [--dtype bfloat16] [--methods ties,ties_model] [--json out.json]

Inputs: :mod:`benchmarks.bench_merge`'s (generated once into ``--dir``, reused): SmolLM2-135M-Instruct as the base
``a`` and three perturbed copies (``--tiny``: a tiny random Llama). Rows: mergekit's forms of TIES, DARE-TIES,
DELLA, breadcrumbs, task arithmetic and SCE (:func:`benchmarks.bench_methods.configs`, the configs
``bench_methods`` gives mergekit), and symmerge's own variants written as a config's parameters: ``ties_model``
(density 0.2, the model-wide threshold, the disjoint mean), ``dare_ties_inverse`` (drop 0.9, 1/(1 − p), the
disjoint mean), ``dare_linear_inverse`` (drop 0.5, 1/(1 − p), the sum). Every run is ``symmerge run CONFIG OUT`` in
a child process (wall from this parent, CPU and peak RSS from ``wait4``: :func:`benchmarks.bench_merge.measure`),
after both trees' kernels were compiled (a warm-up merge of each row on the tiny inputs). Per row: medians, the
after/before ratios, and whether the two outputs are equal bit for bit (else ‖after − before‖ / ‖before − base‖).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.bench_merge import before_env, measure, median, python_env
from benchmarks.bench_methods import configs

MERGEKIT_FORMS = ("ties", "dare_ties", "della", "breadcrumbs", "task_arithmetic", "sce")


def rows(root: Path) -> dict[str, dict]:
    """The configs: mergekit's forms (as bench_methods writes them) and symmerge's own variants."""
    table = configs(root)
    out = {name: table[name] for name in MERGEKIT_FORMS}
    a, three = str(root / "a"), [str(root / x) for x in "bcd"]
    models = [{"model": m, "parameters": {"weight": 1.0 / 3}} for m in three]

    def own(method, **parameters):
        return {"merge_method": method, "base_model": a, "models": models, "parameters": parameters}

    out["ties_model"] = own("ties", density=0.2, scope="model", normalize="count")
    out["dare_ties_inverse"] = own("dare_ties", density=0.1, rescale="inverse", normalize="count")
    out["dare_linear_inverse"] = own("dare_linear", density=0.5, rescale="inverse", normalize=False)
    return out


def run_config(config: dict, dtype, path: Path, out: Path, env, cwd=None) -> dict:
    import yaml

    path.write_text(yaml.safe_dump({**config, **({"dtype": dtype} if dtype else {})}, sort_keys=False))
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, "-m", "symmerge.cli", "run", str(path), str(out), "--progress", "none", "--random-seed", "0"]
    return measure(cmd, env, cwd=cwd)


def warm(tree_envs: dict, dtype, work: Path, wanted) -> None:
    """Compile (or load from numba's cache) each tree's kernels by merging every row once on the tiny inputs."""
    tiny = work / "tiny"
    env = python_env()
    subprocess.run([sys.executable, "-m", "benchmarks.bench_merge", "--child", "generate", "tiny", str(tiny)],
                   check=True, env=env)
    table = rows(tiny)
    for tool, (tenv, cwd) in tree_envs.items():
        for name in wanted:
            run_config(table[name], dtype, tiny / f"warm-{name}.yml", tiny / f"warm-{tool}", tenv, cwd)  # exits on failure


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_rules", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", metavar="TREE", required=True, help="the symmerge of TREE (an earlier checkout)")
    p.add_argument("--dir", default="/tmp/symmerge-bench-rules", help="where the inputs are generated")
    p.add_argument("--repeats", type=int, default=3, help="runs of each tree per row (alternating; medians)")
    p.add_argument("--methods", default=None, help="comma-separated rows (default: all)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None, help="the configs' dtype")
    p.add_argument("--json", help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    env = python_env()
    work = Path(args.dir)
    kind = "tiny" if args.tiny else "smollm2"
    root = work / kind
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "benchmarks.bench_merge", "--child", "generate", kind, str(root)],
                   check=True, env=env)
    table = rows(root)
    wanted = args.methods.split(",") if args.methods else list(table)
    trees = {"after": (env, None), "before": (before_env(env, args.before), args.before)}
    warm(trees, args.dtype, work, wanted)
    figures: dict = {"inputs": kind, "dtype": args.dtype, "repeats": args.repeats, "load_average": os.getloadavg(),
                     "cpus": os.cpu_count(), "before": str(Path(args.before).resolve()), "rows": {}}
    for name in wanted:
        runs: dict = {t: [] for t in trees}
        outs = {t: root / f"rules-out-{t}" for t in trees}
        order = list(trees)
        for r in range(args.repeats):
            for tool in order[r % 2:] + order[:r % 2]:  # each tree first in turn
                tenv, cwd = trees[tool]
                runs[tool].append(run_config(table[name], args.dtype, root / f"rules-{name}.yml", outs[tool], tenv, cwd))
        row = {t: {k: median(rs, k) for k in ("wall_s", "cpu_s", "peak_rss_gb")} for t, rs in runs.items()}
        row["after/before"] = {k: row["after"][k] / row["before"][k] for k in ("wall_s", "cpu_s", "peak_rss_gb")}
        got = subprocess.run([sys.executable, "-m", "benchmarks.bench_methods", "--child", "gap", str(outs["after"]),
                              str(outs["before"]), str(root / "a")], capture_output=True, text=True, env=env)
        row["same"] = json.loads(got.stdout.strip().splitlines()[-1]) if got.returncode == 0 else got.stderr[-300:]
        figures["rows"][name] = row
        same = row["same"]
        print(f"{name:20s} after {row['after']['wall_s']:6.2f} s cpu {row['after']['cpu_s']:6.2f} s "
              f"{row['after']['peak_rss_gb']:.2f} GB | before {row['before']['wall_s']:6.2f} s cpu "
              f"{row['before']['cpu_s']:6.2f} s {row['before']['peak_rss_gb']:.2f} GB | wall ratio "
              f"{row['after/before']['wall_s']:.2f} cpu ratio {row['after/before']['cpu_s']:.2f} | "
              f"{'equal bits' if isinstance(same, dict) and same.get('equal') else same}", flush=True)
        for d in outs.values():
            shutil.rmtree(d, ignore_errors=True)
    figures["load_average_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    sys.exit(rc)
