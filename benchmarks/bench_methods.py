"""Every mergekit merge method, symmerge against mergekit 0.1.5 on the same config, in one run, alternating.

    python -m benchmarks.bench_methods [--dir /tmp/symmerge-bench-merge] [--repeats 1] [--methods linear,ties]
                                       [--tiny] [--dtype bfloat16] [--before TREE] [--json out.json]

Inputs: :mod:`benchmarks.bench_merge`'s (generated once into ``--dir``, reused): the real SmolLM2-135M-Instruct
(fp32, 538 MB) as the base ``a`` and three perturbed copies ``b``, ``c``, ``d`` (``--tiny``: a tiny random Llama).
For every method one mergekit config (:func:`configs`: the method's usual inputs — two models, three, or the base
and one other — and parameters) is written once and run as written by both tools: ``symmerge run CONFIG OUT``
and ``mergekit-yaml CONFIG OUT --random-seed 0``. Every run is a child process; wall time from this parent, CPU
time and peak RSS from ``wait4`` of the child (:func:`benchmarks.bench_merge.measure`). Per method: medians,
symmerge/mergekit ratios (goal: wall ≤ 0.8, peak RSS ≤ 1), and how close the two outputs are:
‖symmerge − mergekit‖ / ‖mergekit − base‖ over every tensor (for the randomised methods, DARE and DELLA, the
masks differ by construction: the figure is then the size of that difference, not an error).

``--dtype``: every config computes in that dtype (mergekit's ``dtype:``; the inputs are float32). ``--before TREE``:
the symmerge of ``TREE`` (a checkout of an earlier commit, e.g. ``git archive REV | tar -x -C TREE``) runs the same
configs in the same loop, alternating with the others; its closeness to mergekit and its wall/RSS ratios are
reported beside today's.
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

from benchmarks.bench_merge import MERGEKIT, before_env, measure, median, python_env

RANDOMISED = ("dare_ties", "dare_linear", "della", "della_linear")


def configs(root: Path) -> dict[str, dict]:
    """One mergekit config per method on the inputs under ``root`` (``a`` the base, ``b``-``d`` fine-tunes)."""
    a, b, c, d = (str(root / x) for x in "abcd")

    def weighted(models, **per_model):
        return [{"model": m, "parameters": {"weight": 1.0 / len(models), **per_model}} for m in models]

    three = [b, c, d]
    return {
        "linear": {"merge_method": "linear", "models": weighted([b, c])},
        "slerp": {"merge_method": "slerp", "base_model": a, "models": [{"model": a}, {"model": b}],
                  "parameters": {"t": 0.5}},
        "nuslerp": {"merge_method": "nuslerp", "models": weighted([b, c])},
        "multislerp": {"merge_method": "multislerp", "models": weighted(three)},
        "karcher": {"merge_method": "karcher", "models": [{"model": m} for m in three]},
        "task_arithmetic": {"merge_method": "task_arithmetic", "base_model": a, "models": weighted(three)},
        "ties": {"merge_method": "ties", "base_model": a, "models": weighted(three, density=0.5)},
        "dare_ties": {"merge_method": "dare_ties", "base_model": a, "models": weighted(three, density=0.5)},
        "dare_linear": {"merge_method": "dare_linear", "base_model": a, "models": weighted(three, density=0.5)},
        "breadcrumbs": {"merge_method": "breadcrumbs", "base_model": a,
                        "models": weighted(three, density=0.9, gamma=0.01)},
        "breadcrumbs_ties": {"merge_method": "breadcrumbs_ties", "base_model": a,
                             "models": weighted(three, density=0.9, gamma=0.01)},
        "della": {"merge_method": "della", "base_model": a, "models": weighted(three, density=0.5, epsilon=0.1)},
        "della_linear": {"merge_method": "della_linear", "base_model": a,
                         "models": weighted(three, density=0.5, epsilon=0.1)},
        "sce": {"merge_method": "sce", "base_model": a, "models": weighted(three), "parameters": {"select_topk": 0.5}},
        "model_stock": {"merge_method": "model_stock", "base_model": a, "models": [{"model": m} for m in three]},
        "nearswap": {"merge_method": "nearswap", "base_model": a, "models": [{"model": a}, {"model": b}],
                     "parameters": {"t": 0.001}},
        "arcee_fusion": {"merge_method": "arcee_fusion", "base_model": a, "models": [{"model": a}, {"model": b}]},
        "passthrough": {"merge_method": "passthrough", "models": [{"model": b}]},
        "ram": {"merge_method": "ram", "base_model": a, "models": [{"model": m} for m in three]},
        "ramplus_tl": {"merge_method": "ramplus_tl", "base_model": a, "models": [{"model": m} for m in three]},
    }


def child_gap(ours: str, theirs: str, base: str) -> None:
    """Print ‖ours − theirs‖ / ‖theirs − base‖ over every tensor (names as stored) and whether they are equal."""
    import torch
    from safetensors.torch import load_file

    def load(folder):
        out = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            out.update(load_file(f))
        return out

    x, y, b = load(ours), load(theirs), load(base)
    if x.keys() != y.keys():
        print(json.dumps({"gap": None, "names_differ": sorted(set(x) ^ set(y))[:5]}))
        return
    num = den = 0.0
    for k, t in y.items():
        num += float((x[k].double() - t.double()).pow(2).sum())
        # the base in the output's dtype (a bfloat16 merge's base is the bfloat16 base): its rounding is not a change
        den += float((t.double() - (b[k].to(t.dtype).double() if k in b and b[k].shape == t.shape else 0))
                     .pow(2).sum())
    same = all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in y)
    print(json.dumps({"gap": (num ** 0.5) / max(den ** 0.5, 1e-30), "equal": same}))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        {"gap": child_gap}[argv[1]](*argv[2:])
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_methods", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/symmerge-bench-merge", help="where the inputs are generated (shared with "
                                                                      "bench_merge)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each tool per method (alternating; medians)")
    p.add_argument("--methods", default=None, help="comma-separated methods (default: all)")
    p.add_argument("--mergekit", default=MERGEKIT, help="mergekit-yaml executable (its own venv)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2 (smoke test)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="the configs' dtype (computing dtype of both tools; default: none, the inputs' float32)")
    p.add_argument("--before", metavar="TREE", help="also run the symmerge of TREE (an earlier checkout)")
    args = p.parse_args(argv)
    env = python_env()
    mergekit = args.mergekit if shutil.which(args.mergekit) else None
    if mergekit is None:
        raise SystemExit(f"mergekit not found at {args.mergekit} (build it as .ci/run does)")
    kind = "tiny" if args.tiny else "smollm2"
    root = Path(args.dir) / kind
    root.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "benchmarks.bench_merge", "--child", "warm"], check=True, env=env)
    subprocess.run([sys.executable, "-m", "benchmarks.bench_merge", "--child", "generate", kind, str(root)],
                   check=True, env=env)
    table = configs(root)
    wanted = args.methods.split(",") if args.methods else list(table)
    unknown = [m for m in wanted if m not in table]
    if unknown:
        raise SystemExit(f"unknown method {unknown[0]!r}; known: {', '.join(table)}")
    import yaml

    figures: dict = {"inputs": kind, "load_average": os.getloadavg(), "cpus": os.cpu_count(),
                     "repeats": args.repeats, "dtype": args.dtype, "methods": {},
                     "before": str(Path(args.before).resolve()) if args.before else None}
    tools = ["mergekit", "symmerge"] + (["before"] if args.before else [])
    envs = {"symmerge": env, "mergekit": env, "before": before_env(env, args.before) if args.before else env}
    for method in wanted:
        config = root / f"bench-{method}.yml"
        config.write_text(yaml.safe_dump({**table[method], **({"dtype": args.dtype} if args.dtype else {})},
                                         sort_keys=False))
        outs = {t: root / f"out-{t}" for t in tools}
        runs: dict = {t: [] for t in tools}
        for r in range(args.repeats):
            for tool in tools[r % len(tools):] + tools[:r % len(tools)]:  # each tool first in turn
                shutil.rmtree(outs[tool], ignore_errors=True)
                cmd = ([sys.executable, "-m", "symmerge.cli", "run", str(config), str(outs[tool]), "--progress", "none",
                        "--random-seed", "0"] if tool != "mergekit"
                       else [mergekit, str(config), str(outs[tool]), "--random-seed", "0", "--quiet"])
                runs[tool].append(measure(cmd, envs[tool], cwd=args.before if tool == "before" else None))

        def gap_of(tool):
            got = subprocess.run([sys.executable, "-m", "benchmarks.bench_methods", "--child", "gap", str(outs[tool]),
                                  str(outs["mergekit"]), str(root / "a")], capture_output=True, text=True, env=env)
            return json.loads(got.stdout.strip().splitlines()[-1]) if got.returncode == 0 else got.stderr[-500:]

        row = {tool: {k: median(rs, k) for k in ("wall_s", "cpu_s", "peak_rss_gb")} for tool, rs in runs.items()}
        row["ratios"] = {k: row["symmerge"][k] / row["mergekit"][k] for k in ("wall_s", "cpu_s", "peak_rss_gb")}
        row["closeness"] = gap_of("symmerge")
        if args.before:
            row["ratios_before"] = {k: row["before"][k] / row["mergekit"][k] for k in ("wall_s", "cpu_s", "peak_rss_gb")}
            row["closeness_before"] = gap_of("before")
        row["randomised"] = method in RANDOMISED
        row["goal_met"] = row["ratios"]["wall_s"] <= 0.8 and row["ratios"]["peak_rss_gb"] <= 1.0
        figures["methods"][method] = row
        c = row["closeness"]
        print(f"{method:17s} symmerge {row['symmerge']['wall_s']:6.2f} s {row['symmerge']['peak_rss_gb']:.2f} GB | "
              f"mergekit {row['mergekit']['wall_s']:6.2f} s {row['mergekit']['peak_rss_gb']:.2f} GB | wall ratio "
              f"{row['ratios']['wall_s']:.2f}, RSS ratio {row['ratios']['peak_rss_gb']:.2f} | gap "
              f"{c.get('gap') if isinstance(c, dict) else c}", flush=True)
        if args.before:
            cb = row["closeness_before"]
            print(f"{'':17s} before   {row['before']['wall_s']:6.2f} s {row['before']['peak_rss_gb']:.2f} GB | wall ratio "
                  f"{row['ratios_before']['wall_s']:.2f} | gap {cb.get('gap') if isinstance(cb, dict) else cb}",
                  flush=True)
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
