"""Plain merges against mergekit: the same inputs, the same 50/50 average, in one run, alternating.

    python -m benchmarks.bench_merge [--dir /tmp/symmerge-bench-merge] [--repeats 3] [--large] [--json out.json]
                                     [--tiny] [--only-ties] [--only-large] [--large-repeats N] [--before TREE]

Inputs (generated once into ``--dir``, reused):

* ``smollm2``: the real SmolLM2-135M-Instruct (fp32, 538 MB; :func:`symmerge.demo.assets.smollm2_path`) and
  three perturbed copies (every tensor + 1 % of its standard deviation of Gaussian noise, seeds 1-3);
* ``--large``: the 3.4 B bf16 Llama pair of :mod:`benchmarks.bench_streaming` (6.9 GB each, 500 MB shards);
* ``--tiny``: a tiny random Llama pair instead of SmolLM2 (the smoke test; seconds).

Measured, every run a child process of this lean parent (no torch imported here), wall time from the
parent, CPU time (user + system) and peak RSS from ``wait4`` of that child:

* ``average``: ``symmerge merge A B --method average --align none`` against ``mergekit-yaml`` with
  ``merge_method: linear`` (weights 0.5/0.5, float32 for fp32 inputs), alternating, ``--repeats`` times;
  medians and symmerge/mergekit ratios; whether the outputs are equal bit for bit;
* ``ties`` / ``dare_ties`` on three models (base: the original) against the plain average of the same
  three (symmerge only: mergekit's TIES trims per tensor, symmerge's over the whole model);
* ``--large``: the streamed average of the pair against the disk's sequential read rate: before each
  run (``--large-repeats``), the inputs are evicted from the page cache (``posix_fadvise(DONTNEED)`` on
  these files only, never the system's caches) and ``dd`` reads their shards twice (buffered, then
  ``iflag=direct``; evicted before and after each), then the merge runs: wall, CPU, peak RSS, and its
  read rate (input bytes / wall) as a fraction of the faster ``dd``'s.

The fused kernels (numba) are compiled once before any timed run (``--child warm``).
``--only-ties``: only the three-model TIES / DARE-TIES / average runs.

mergekit comes from its own venv (``--mergekit``, default ``/tmp/symmerge-mergekit/bin/mergekit-yaml``, as
``.ci/run`` builds it); without it the mergekit columns are skipped with a note.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

MERGEKIT = "/tmp/symmerge-mergekit/bin/mergekit-yaml"
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


# ------------------------------------------------------------ children (they import torch; the parent does not)

def child_generate(kind: str, root: str) -> None:
    """Write the inputs of ``kind`` (smollm2, tiny, large) under ``root``."""
    import torch
    from safetensors import safe_open

    from symmerge.io.checkpoint import SAFETENSORS_DTYPES, PlannedWriter
    from symmerge.io.model import atomic_dir

    root_p = Path(root)
    if kind == "large":
        from benchmarks.bench_streaming import LARGE, generate

        for name, seed in (("a", 0), ("b", 1)):
            if not (root_p / name).is_dir():
                generate(root_p / name, LARGE, seed, "500MB")
        return
    if kind == "tiny":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        src = root_p / "a"
        if not src.is_dir():
            with atomic_dir(src) as tmp:
                LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1,
                                             eos_token_id=2)).save_pretrained(
                    str(tmp))
    else:
        from symmerge.demo.assets import smollm2_path

        src = root_p / "a"
        if not src.is_dir():
            shutil.copytree(smollm2_path(), src)
    for seed in (1, 2, 3):  # perturbed copies, tensor by tensor
        dst = root_p / "bcd"[seed - 1]
        if dst.is_dir():
            continue
        with atomic_dir(dst) as tmp:
            for f in src.iterdir():
                if f.suffix != ".safetensors":
                    shutil.copy2(f, tmp / f.name) if f.is_file() else shutil.copytree(f, tmp / f.name)
            for f in sorted(src.glob("*.safetensors")):
                with safe_open(str(f), "pt") as h:
                    names = list(h.keys())
                    plan = [(k, h.get_slice(k).get_dtype(), h.get_slice(k).get_shape()) for k in names]
                    writer = PlannedWriter(tmp, [(k, SAFETENSORS_DTYPES[d], s) for k, d, s in plan], 1 << 62)
                    g = torch.Generator().manual_seed(seed)
                    for k in names:
                        t = h.get_tensor(k)
                        if t.is_floating_point() and t.numel() > 1:
                            t = (t.double() + 0.01 * t.double().std() * torch.randn(t.shape, generator=g,
                                                                                dtype=torch.float64)).to(t.dtype)
                        writer.add(k, t)
                    writer.close()
                os.replace(tmp / "model.safetensors", tmp / f.name)


def child_equal(a: str, b: str) -> None:
    """Print whether two folders hold the same tensors, bit for bit."""
    import torch
    from safetensors.torch import load_file

    def load(folder):
        out = {}
        for f in sorted(Path(folder).glob("*.safetensors")):
            out.update(load_file(f))
        return out

    x, y = load(a), load(b)
    same = x.keys() == y.keys() and all(x[k].dtype == y[k].dtype and torch.equal(x[k], y[k]) for k in x)
    print(json.dumps({"equal": bool(same), "keys_a": len(x), "keys_b": len(y)}))


# ------------------------------------------------------------ the parent

def measure(cmd: list[str], env=None, cwd=None) -> dict:
    """Run ``cmd``; wall seconds, CPU seconds (user + system) and peak RSS (GB) of that child alone."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{out.decode(errors='replace')[-3000:]}")
    return {"wall_s": wall, "cpu_s": usage.ru_utime + usage.ru_stime, "peak_rss_gb": usage.ru_maxrss / 2 ** 20}


def python_env() -> dict:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


# symmerge's own variants of ties and dare_ties (model-wide top 20 %, 1/(1 - p), disjoint mean), the rules
# bench_ties has measured since it was written: explicit parameters since every name means mergekit's method
VARIANTS = {"ties": ("density=0.2", "scope=model", "normalize=count"),
            "dare_ties": ("drop=0.9", "rescale=inverse", "normalize=count")}


def symmerge_cmd(models, out, method="average", base=None) -> list[str]:
    params = [x for p in VARIANTS.get(method, ()) for x in ("--param", p)]
    return [sys.executable, "-m", "symmerge.cli", "merge", *map(str, models), "--method", method, "--align", "none",
            *(["--base", str(base)] if base else []), *params, "--progress", "none", "-o", str(out)]


def mergekit_cmd(mergekit: str, models, out: Path, dtype: str) -> list[str]:
    config = out.parent / f"{out.name}.yml"
    lines = ["merge_method: linear", f"dtype: {dtype}", "models:"]
    for m in models:
        lines += [f"  - model: {m}", "    parameters:", f"      weight: {1 / len(models)}"]
    config.write_text("\n".join(lines) + "\n")
    return [mergekit, str(config), str(out), "--quiet"]


def evict(files) -> bool:
    """Evict ``files`` (the benchmark's own inputs) from the page cache, so that the next read comes from
    the disk: ``posix_fadvise(DONTNEED)`` on each file, never the whole system's caches (other jobs may
    be measuring too). True when it worked. A virtual disk may still be cached by its host."""
    try:
        for f in files:
            fd = os.open(f, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return True
    except (OSError, AttributeError):
        return False


def dd_rate(files, direct: bool = False) -> float:
    """Sequential read rate (bytes/s) of ``files`` with dd, from the disk (evicted first); ``direct``:
    ``iflag=direct`` (no page cache: the device's rate without the kernel's copying)."""
    evict(files)
    total, seconds = 0, 0.0
    for f in files:
        t = time.perf_counter()
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", *(["iflag=direct"] if direct else [])],
                       check=True, capture_output=True)
        seconds += time.perf_counter() - t
        total += os.path.getsize(f)
    evict(files)
    return total / seconds


def median(rows, key) -> float:
    return statistics.median(r[key] for r in rows)


def summarize(rows: list[dict]) -> dict:
    return {k: median(rows, k) for k in ("wall_s", "cpu_s", "peak_rss_gb")} | {"runs": rows}


def before_env(env: dict, tree: str) -> dict:
    """``env`` with ``tree`` (a checkout of an earlier symmerge) first on the path: its ``symmerge`` is run (from
    ``tree`` as the working directory, which ``python -m`` puts first)."""
    out = dict(env)
    out["PYTHONPATH"] = str(Path(tree).resolve()) + os.pathsep + env["PYTHONPATH"]
    return out


def bench_average(root: Path, args, mergekit: str | None, env) -> dict:
    a, b = root / "a", root / "b"
    tools = ["mergekit", "symmerge"] * (mergekit is not None) or ["symmerge"]
    if args.before:
        tools.append("before")
    envs = {"symmerge": env, "mergekit": env, "before": before_env(env, args.before) if args.before else env}
    runs = {t: [] for t in tools}
    outs = {t: root / f"out-{t}" for t in tools}
    equal = None
    for r in range(args.repeats):
        for tool in tools[r % len(tools):] + tools[:r % len(tools)]:  # each tool first in turn
            shutil.rmtree(outs[tool], ignore_errors=True)
            cmd = mergekit_cmd(mergekit, [a, b], outs[tool], "float32") if tool == "mergekit" else \
                symmerge_cmd([a, b], outs[tool])
            runs[tool].append(measure(cmd, envs[tool], cwd=args.before if tool == "before" else None))
            print(f"  average, {tool}: {runs[tool][-1]['wall_s']:.2f} s wall, {runs[tool][-1]['cpu_s']:.2f} s CPU, "
                  f"{runs[tool][-1]['peak_rss_gb']:.2f} GB", flush=True)
        if mergekit is not None and equal is None:
            p = subprocess.run([sys.executable, "-m", "benchmarks.bench_merge", "--child", "equal",
                                str(outs["symmerge"]), str(outs["mergekit"])], capture_output=True, text=True, env=env)
            equal = json.loads(p.stdout.strip().splitlines()[-1])["equal"] if p.returncode == 0 else None
    result = {"symmerge": summarize(runs["symmerge"])}
    keys = ("wall_s", "cpu_s", "peak_rss_gb")
    if args.before:
        result["before"] = {"tree": str(Path(args.before).resolve()), **summarize(runs["before"])}
        result["ratios_symmerge_over_before"] = {k: result["symmerge"][k] / result["before"][k] for k in keys}
    if mergekit is not None:
        mk = summarize(runs["mergekit"])
        result["mergekit"] = mk
        result["ratios_symmerge_over_mergekit"] = {k: result["symmerge"][k] / mk[k] for k in keys}
        if args.before:
            result["ratios_before_over_mergekit"] = {k: result["before"][k] / mk[k] for k in keys}
        result["outputs_equal_bit_for_bit"] = equal
        result["goal"] = {"wall_ratio_max": 0.8, "rss_ratio_max": 1.0,
                          "met": result["ratios_symmerge_over_mergekit"]["wall_s"] <= 0.8
                          and result["ratios_symmerge_over_mergekit"]["peak_rss_gb"] <= 1.0}
    else:
        result["mergekit"] = f"skipped: {args.mergekit} not found (build it as .ci/run does)"
    for d in outs.values():
        shutil.rmtree(d, ignore_errors=True)
    return result


def bench_ties(root: Path, args, env) -> dict:
    models, base = [root / "b", root / "c", root / "d"], root / "a"
    out = root / "out-ties"
    runs: dict = {"average": [], "ties": [], "dare_ties": []}
    for _ in range(args.repeats):
        for method in runs:
            shutil.rmtree(out, ignore_errors=True)
            runs[method].append(measure(symmerge_cmd(models, out, method, base if method != "average" else None), env))
            print(f"  three models, {method}: {runs[method][-1]['wall_s']:.2f} s wall, {runs[method][-1]['cpu_s']:.2f} s "
                  f"CPU, {runs[method][-1]['peak_rss_gb']:.2f} GB; load {os.getloadavg()[0]:.1f}", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    result = {m: summarize(r) for m, r in runs.items()}
    for m in ("ties", "dare_ties"):
        result[f"{m}_over_average_wall"] = result[m]["wall_s"] / result["average"]["wall_s"]
        result[f"{m}_over_average_cpu"] = result[m]["cpu_s"] / result["average"]["cpu_s"]
    result["goal"] = {"ratio_max": 1.5, "met": max(result["ties_over_average_wall"],
                                                   result["dare_ties_over_average_wall"]) <= 1.5}
    return result


def bench_large(root: Path, args, mergekit: str | None, env) -> dict:
    """The 3.4 B pair, inputs evicted from the page cache before every run; ``dd`` on the same shards
    right before each merge run (alternating), so each run's read rate is compared with the disk's rate
    at that moment (other jobs share the disk)."""
    subprocess.run([sys.executable, "-m", "benchmarks.bench_merge", "--child", "generate", "large", str(root)],
                   check=True, env=env)
    a, b = root / "a", root / "b"
    files = sorted(a.glob("*.safetensors")) + sorted(b.glob("*.safetensors"))
    input_bytes = sum(os.path.getsize(f) for f in files)
    result: dict = {"input_bytes": input_bytes, "evicted_with_fadvise": evict(files)}
    out = root / "out"
    tools = ["symmerge"] + (["mergekit"] if mergekit is not None and args.large_mergekit else [])
    runs: dict = {tool: [] for tool in tools}
    for _ in range(args.large_repeats):
        for tool in tools:
            shutil.rmtree(out, ignore_errors=True)
            buffered = dd_rate(files) / 1e6  # evicts before and after
            direct = dd_rate(files, direct=True) / 1e6
            rate = max(buffered, direct)  # the disk's rate: the faster of the two reads
            cmd = symmerge_cmd([a, b], out) if tool == "symmerge" else mergekit_cmd(mergekit, [a, b], out, "bfloat16")
            r = measure(cmd, env)
            evict(files)
            r["dd_read_rate_mb_s"] = rate
            r["dd_buffered_mb_s"], r["dd_direct_mb_s"] = buffered, direct
            r["read_rate_mb_s"] = input_bytes / r["wall_s"] / 1e6
            r["fraction_of_dd"] = r["read_rate_mb_s"] / rate
            r["load_average"] = os.getloadavg()
            runs[tool].append(r)
            print(f"  large pair, {tool}: {r['wall_s']:.1f} s, {r['cpu_s']:.1f} s CPU, {r['peak_rss_gb']:.2f} GB, "
                  f"{r['read_rate_mb_s']:.0f} MB/s = {r['fraction_of_dd']:.2f} of dd ({buffered:.0f} MB/s buffered, "
                  f"{direct:.0f} MB/s iflag=direct just before); "
                  f"load {r['load_average'][0]:.1f}", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    for tool, rows in runs.items():
        result[tool] = {k: median(rows, k) for k in ("wall_s", "cpu_s", "peak_rss_gb", "read_rate_mb_s",
                                                     "dd_read_rate_mb_s", "fraction_of_dd")} | {"runs": rows}
    s = result["symmerge"]
    result["goal"] = {"rss_max_gb": 2.0, "fraction_of_dd_min": 0.8,
                      "met": s["peak_rss_gb"] <= 2.0 and s["fraction_of_dd"] >= 0.8}
    return result


def child_warm() -> None:
    """Compile (or load from numba's cache) the fused kernels for the benchmarks' dtypes and model counts,
    so that no timed run pays for compiling them."""
    import torch

    from symmerge.merge import kernels
    from symmerge.merge.kernels_whole import task_vector_into

    import numpy as np

    for dtype in (torch.float32, torch.bfloat16):
        for n in (2, 3):
            ts, b = [torch.randn(64).to(dtype) for _ in range(n)], torch.randn(64).to(dtype)
            for rule in (("weighted", 0.5), ("weighted_dare", 1, 0.5)):  # symmerge's own variants
                task_vector_into(ts, b, [1.0] * n, [rule] * n, [None] * n, "ties", "count", 1.0,
                                 torch.empty(64, dtype=dtype))
            kernels.sq_distances(ts, b)
            kernels.magnitude_sample(ts, b, [1.0] * n, 0, 16, 4)
            kernels.magnitude_windows(ts, b, [1.0] * n, [0] * n, [0x7FFFFFFF] * n, np.zeros((1, n), dtype=np.int64),
                                      np.zeros((1, n), dtype=np.int64), [[np.empty(64, dtype=np.int32)] * n])
        kernels.magnitude_histogram(ts[0], b, 1.0, np.zeros(1 << 16, dtype=np.int64))
        kernels.magnitude_histogram(ts[0], b, 1.0, np.zeros(1 << 16, dtype=np.int64), 5)
    for n in (2, 3):  # mergekit's whole-tensor rules, ties at their cuts (the window selection) and the election
        b = torch.zeros(64)
        ts = [b + torch.tensor([0.5, -0.25]).repeat(32) for _ in range(n)]
        for rule, consensus in ((("topk", 7), "ties"), (("band", 3, 40), "sum")):
            task_vector_into(ts, b, [1.0] * n, [rule] * n, [None] * n, consensus, True, 1.0, torch.empty(64))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        {"generate": child_generate, "equal": child_equal, "warm": child_warm}[argv[1]](*argv[2:])
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_merge", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/symmerge-bench-merge", help="where the inputs are generated")
    p.add_argument("--repeats", type=int, default=3, help="runs of each tool (alternating; medians)")
    p.add_argument("--mergekit", default=MERGEKIT, help="mergekit-yaml executable (its own venv)")
    p.add_argument("--tiny", action="store_true", help="a tiny random Llama instead of SmolLM2 (smoke test)")
    p.add_argument("--large", action="store_true", help="also the 3.4 B bf16 pair (generated once, 14 GB of disk)")
    p.add_argument("--large-mergekit", action="store_true", help="also run mergekit on the 3.4 B pair")
    p.add_argument("--large-repeats", type=int, default=1, help="runs on the 3.4 B pair (each after a dd)")
    p.add_argument("--only-ties", action="store_true", help="only TIES / DARE-TIES against the average (three models)")
    p.add_argument("--skip-ties", action="store_true", help="leave out TIES / DARE-TIES on three models")
    p.add_argument("--only-large", action="store_true", help="only the 3.4 B pair (implies --large)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.add_argument("--before", metavar="TREE", help="also run the plain average with the symmerge of TREE (a "
                   "checkout of an earlier commit, e.g. `git worktree add /tmp/before REV`), alternating with the "
                   "two others: before/after figures from one run")
    args = p.parse_args(argv)
    env = python_env()
    mergekit = args.mergekit if shutil.which(args.mergekit) else None
    kind = "tiny" if args.tiny else "smollm2"
    root = Path(args.dir) / kind
    root.mkdir(parents=True, exist_ok=True)
    figures = {"inputs": "large" if args.only_large else kind, "load_average": os.getloadavg(),
               "cpus": os.cpu_count(), "repeats": args.repeats}
    subprocess.run([sys.executable, "-m", "benchmarks.bench_merge", "--child", "warm"], check=True, env=env)
    if args.before:
        args.before = str(Path(args.before).resolve())
        subprocess.run([sys.executable, "-m", "benchmarks.bench_merge", "--child", "warm"], check=True,
                       env=before_env(env, args.before), cwd=args.before)
    if not args.only_large:
        t = time.perf_counter()
        subprocess.run([sys.executable, "-m", "benchmarks.bench_merge", "--child", "generate", kind, str(root)],
                       check=True, env=env)
        print(f"inputs ready ({time.perf_counter() - t:.0f} s)", flush=True)
        if not args.only_ties:
            figures["average"] = bench_average(root, args, mergekit, env)
        if not args.skip_ties:
            figures["three_models"] = bench_ties(root, args, env)
    if args.large or args.only_large:
        figures["large"] = bench_large(Path(args.dir) / "large", args, mergekit, env)
    figures["load_average_after"] = os.getloadavg()
    for k, v in figures.items():
        if isinstance(v, dict):
            v = {kk: vv for kk, vv in v.items() if kk != "runs"}
        print(f"{k}: {json.dumps(v, default=str)}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
