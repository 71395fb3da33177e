"""The task-vector rules before and after one implementation per rule (issue 39 item 4): today's symmerge against the
symmerge of an earlier tree, on the same configs, alternating, in one run.

    python -m benchmarks.bench_rules --before TREE [--dir /tmp/symmerge-bench-rules] [--repeats 3] [--tiny]
                                     [--dtype bfloat16] [--methods ties,ties_model] [--json out.json] [--kernel]

Inputs: :mod:`benchmarks.bench_merge`'s (generated once into ``--dir``, reused): SmolLM2-135M-Instruct as the base
``a`` and three perturbed copies (``--tiny``: a tiny random Llama). Rows: mergekit's forms of TIES, DARE-TIES,
DELLA, breadcrumbs, task arithmetic and SCE (:func:`benchmarks.bench_methods.configs`, the configs
``bench_methods`` gives mergekit), and symmerge's own variants written as a config's parameters: ``ties_model``
(density 0.2, the model-wide threshold, the disjoint mean), ``dare_ties_inverse`` (drop 0.9, 1/(1 − p), the
disjoint mean), ``dare_linear_inverse`` (drop 0.5, 1/(1 − p), the sum). Every run is ``symmerge run CONFIG OUT`` in
a child process (wall from this parent, CPU and peak RSS from ``wait4``: :func:`benchmarks.bench_merge.measure`),
after both trees' kernels were compiled (a warm-up merge of each row on the tiny inputs). Per row: medians, the
after/before ratios, and whether the two outputs are equal bit for bit (else ‖after − before‖ / ‖before − base‖).
``--kernel``: the rules alone, in process (:func:`child_kernel`), where the runs above are mostly start-up and I/O.
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


KERNEL_ROWS = {  # in-process rows of --kernel: (method, parameters)
    "ties_model": ("ties", dict(density=0.2, scope="model", normalize="count")),
    "dare_ties_inverse": ("dare_ties", dict(drop=0.9, rescale="inverse", normalize="count")),
    "dare_linear_inverse": ("dare_linear", dict(drop=0.5, rescale="inverse", normalize=False)),
    "task_arithmetic": ("task_arithmetic", {}),
    "ties": ("ties", dict(density=0.5)), "dare_ties": ("dare_ties", dict(density=0.5)),
    "breadcrumbs": ("breadcrumbs", dict(density=0.9, gamma=0.01)),
}


def child_kernel(dtype: str, repeats: str, rows: str = "") -> None:
    """Print, as JSON, each :data:`KERNEL_ROWS` row's fastest CPU and wall seconds over ``repeats`` in-process merges
    of three 4096 × 4096 tensors (the symmerge first on the path; compiled on a slice first) and a checksum."""
    import torch

    from symmerge.merge import get_method

    g = torch.Generator().manual_seed(0)
    base = torch.randn(4096, 4096, generator=g)
    models = [(base + torch.randn(base.shape, generator=g) * 0.01).to(getattr(torch, dtype)) for _ in range(3)]
    base = base.to(getattr(torch, dtype))
    out = {}
    for label, (method, params) in KERNEL_ROWS.items():
        if rows and label not in rows.split(","):
            continue
        m = get_method(method)
        m.merge([{"w": x[:64]} for x in models], base={"w": base[:64]}, weights=[1 / 3] * 3, **params)
        cpu = wall = float("inf")
        for _ in range(int(repeats)):
            c0, w0 = time.process_time(), time.perf_counter()
            merged = m.merge([{"w": x} for x in models], base={"w": base}, weights=[1 / 3] * 3, **params)["w"]
            cpu, wall = min(cpu, time.process_time() - c0), min(wall, time.perf_counter() - w0)
        out[label] = {"cpu_s": cpu, "wall_s": wall, "checksum": float(merged.double().sum())}
    print(json.dumps(out))


def kernel_rows(trees: dict, dtype, repeats: int, rows: str = "") -> dict:
    """:func:`child_kernel` in each tree (alternating twice), the fastest of both rounds per row."""
    got: dict = {}
    for r in range(2):
        for tool in (list(trees) if r == 0 else list(trees)[::-1]):
            tenv, cwd = trees[tool]
            run = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", "kernel", dtype or "float32",
                                  str(repeats), rows], capture_output=True, text=True, env=tenv, cwd=cwd, check=True)
            for label, row in json.loads(run.stdout.strip().splitlines()[-1]).items():
                have = got.setdefault(label, {}).setdefault(tool, row)
                have.update({k: min(have[k], row[k]) for k in ("cpu_s", "wall_s")})
    for label, row in got.items():
        row["cpu after/before"] = row["after"]["cpu_s"] / row["before"]["cpu_s"]
        row["same checksum"] = row["after"]["checksum"] == row["before"]["checksum"]
        print(f"{label:20s} kernel cpu after {row['after']['cpu_s']:.3f} s before {row['before']['cpu_s']:.3f} s "
              f"ratio {row['cpu after/before']:.2f} | same checksum {row['same checksum']}", flush=True)
    return got


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        {"kernel": child_kernel}[argv[1]](*argv[2:])
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_rules", description=__doc__.split("\n\n")[0])
    p.add_argument("--before", metavar="TREE", required=True, help="the symmerge of TREE (an earlier checkout)")
    p.add_argument("--dir", default="/tmp/symmerge-bench-rules", help="where the inputs are generated")
    p.add_argument("--repeats", type=int, default=3, help="runs of each tree per row (alternating; medians)")
    p.add_argument("--methods", default=None, help="comma-separated rows (default: all)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None, help="the configs' dtype")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.add_argument("--kernel", action="store_true", help="only the rules in-process on three 4096 × 4096 tensors "
                   "(no start-up, no I/O): each tree's fastest of 5 runs per row, twice alternating")
    args = p.parse_args(argv)
    env = python_env()
    if args.kernel:
        trees = {"after": (env, None), "before": (before_env(env, args.before), args.before)}
        figures = {"kernel": kernel_rows(trees, args.dtype, 5, args.methods or ""), "dtype": args.dtype,
                   "load_average": os.getloadavg()}
        if args.json:
            Path(args.json).write_text(json.dumps(figures, indent=2, default=str) + "\n")
        return 0
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
