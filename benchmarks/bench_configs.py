"""Every published mergekit config (tests/data/published_configs/) run by ``symmerge run CONFIG OUT`` and by
``mergekit-yaml CONFIG OUT`` (``mergekit-multi`` for a multi-document file) as child processes, on stand-ins
of two sizes: the tests' tiny ones (hidden 64) and ~50 M-parameter ones of the same families (wider, random
init, the layer count the config's slices need). Per row: wall time, CPU time and peak RSS of each child, the
ratios symmerge / mergekit (goal: wall ≤ 0.8, RSS ≤ 1.0; CPU for a loaded machine, where the wall ratio mixes
in the time spent waiting for a core) and the whole-model gap ‖s − m‖ / ‖m − base‖.

The two tools run alternately (symmerge first on even rows, mergekit first on odd ones), one after the other,
each from a fresh process: start-up counts. numba compiles symmerge's kernels once per install and caches them
on disk; the first run of each kind of merge (method, dtype, number of models) is therefore run and measured
apart before the row on the tiny stand-ins (``symmerge_first_run``; the kernels' types do not depend on the
sizes), and the row's figures are those of a run with the cache warm. Likewise the first run of a config of
a new family (architecture, width, layers) builds its tensor-name facts from transformers' model classes and
caches them (``symmerge/io/names_cache.py``: +2.5 s of CPU, transformers imported, on a tiny run): before a
row whose stand-ins are new, ``symmerge run CONFIG OUT --print-plan`` (headers only) fills that cache and is
measured apart (``symmerge_names_warm_up``).
Each child runs under a small measuring parent (``python -S``, about 10 MB) that forks and execs it and reads
its ``ru_maxrss`` from ``wait4``: a child's ``ru_maxrss`` starts at the resident size of the process that
forked it, so forking from this (torch-holding) process would count this process's memory (see ``benchmarks/common.py: peak_rss_kb``).

    nice python -m benchmarks.bench_configs --json /tmp/bench_configs.json
    nice python -m benchmarks.bench_configs --sizes tiny --configs absa-ties,eggs-multi --json out.json

The stand-ins and the configs' reuse of them are those of tests/config/test_published_configs.py (its helper
module tests/config/published.py, imported, not copied)."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "tests", ROOT / "tests" / "config"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import mergekit_oracle as mo  # noqa: E402
import published  # noqa: E402

from benchmarks.common import machine  # noqa: E402

MERGEKIT_BIN = Path("/tmp/symmerge-mergekit/bin")
TARGET_PARAMS = 50e6
WALL_GOAL, RSS_GOAL = 0.8, 1.0
# forks and execs argv[2:], waits for it, writes {"rc", "wall_s", "cpu_s", "peak_rss_kb"} to the file argv[1]
_MEASURE = r"""
import json, os, sys, time
t = time.perf_counter()
pid = os.fork()
if pid == 0:
    os.execvp(sys.argv[2], sys.argv[2:])
_, status, ru = os.wait4(pid, 0)
wall = time.perf_counter() - t
with open(sys.argv[1], "w") as f:
    json.dump({"rc": os.waitstatus_to_exitcode(status), "wall_s": wall, "cpu_s": ru.ru_utime + ru.ru_stime,
               "peak_rss_kb": ru.ru_maxrss}, f)
"""


def hidden_for(arch: str, layers: int, size: str) -> int:
    """The stand-ins' width: 64 (tiny), or ~50 M parameters over ``layers`` layers (about 11·h² per layer:
    attention 3 h² with 2 of 4 heads for K/V, the MLP 7.5 h²; GPT-2's 12 h²), a multiple of 64."""
    if size == "tiny":
        return 64
    per_layer = 12 if arch == "gpt2" else 10.5
    return max(64, int(round(math.sqrt(TARGET_PARAMS / (per_layer * layers)) / 64)) * 64)


def measured(cmd: list[str], log: Path, env: dict) -> dict:
    """``cmd`` run as a child of the measuring parent: rc, wall_s, peak_rss_kb (its stdout/stderr in ``log``)."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    try:
        with open(log, "w") as out:
            subprocess.run([sys.executable, "-S", "-c", _MEASURE, str(result), *cmd], stdout=out,
                           stderr=subprocess.STDOUT, env=env, check=False)
        return json.loads(result.read_text())
    finally:
        result.unlink(missing_ok=True)


def commands(cfg: Path, text: str, out: Path, symmerge: str, mergekit_bin: Path) -> dict:
    """The two command lines of one row: ``symmerge run``, and ``mergekit-yaml`` (``mergekit-multi`` with an
    intermediate folder for a file of several documents)."""
    ours = [symmerge, "run", str(cfg), str(out / "symmerge"), "--progress", "none"]
    if len(published.docs_of(text)) > 1:
        theirs = [str(mergekit_bin / "mergekit-multi"), str(cfg), "--out-path", str(out / "mergekit"),
                  "-I", str(out / "mergekit-steps")]
    else:
        theirs = [str(mergekit_bin / "mergekit-yaml"), str(cfg), str(out / "mergekit")]
    return {"symmerge": ours, "mergekit": theirs}


def gap(ours: Path, theirs: Path, base: Path) -> float:
    """‖symmerge − mergekit‖ / ‖mergekit − base‖ over the whole model, mergekit's tensors read in symmerge's
    dtype (mergekit writes some methods in float32)."""
    got, want, ref = mo.tensors(ours), mo.tensors(theirs), mo.tensors(base)
    want = {k: v.to(got[k].dtype) for k, v in want.items() if k in got}
    return mo.relative_gap(got, want, ref)


def warm_ups(name: str, written: str, text: str, size: str, row_dir: Path, args, env: dict, warmed: set,
             mktemp, warmed_cache: dict) -> dict:
    """symmerge's first runs before a row, measured apart: a run of a kind of merge that has not run yet
    (``symmerge_first_run``: numba compiles its kernels once per install — per method, dtype, count of models —
    and caches them on disk; on the tiny stand-ins, the kernels' types do not depend on the sizes), and the
    plan of a config whose stand-ins are new (``symmerge_names_warm_up``: their tensor-name facts cached)."""
    out = {"symmerge_first_run": None, "symmerge_names_warm_up": None}
    kernels = tuple((d["merge_method"], d.get("dtype"), len(published.refs(d))) for d in published.docs_of(text))
    if kernels not in warmed:
        warmed.add(kernels)
        tiny, _, _ = published.stand_ins(written, mktemp, warmed_cache, hidden=64)
        (row_dir / "warm-up").mkdir()
        (row_dir / "warm-up" / name).write_text(tiny)
        first = commands(row_dir / "warm-up" / name, tiny, row_dir / "warm-up", args.symmerge,
                         Path(args.mergekit_bin))["symmerge"]
        out["symmerge_first_run"] = measured(first, row_dir / "warm-up.log", env)
    family = (size, published.family_key(text))
    if family not in warmed:
        warmed.add(family)
        plan = [args.symmerge, "run", str(row_dir / name), str(row_dir / "plan-only"), "--print-plan"]
        out["symmerge_names_warm_up"] = measured(plan, row_dir / "names-warm-up.log", env)
    return out


def one_row(name: str, size: str, i: int, args, work: Path, cache: dict, env: dict, warmed: set,
            warmed_cache: dict) -> dict:
    """One config at one size: stand-ins, both tools (alternating order), their figures and the gap; before
    them, symmerge's first runs where this kind of merge or these stand-ins are new (:func:`warm_ups`)."""
    written = (published.DATA / name).read_text()
    arch, _, _, layers, _ = published.family_key(written)
    hidden = hidden_for(arch, layers, size)
    mktemp = lambda n: Path(tempfile.mkdtemp(prefix=n, dir=work))  # noqa: E731
    text, base, dtype = published.stand_ins(written, mktemp, cache, hidden=hidden)
    row_dir = work / f"{name[:-4]}-{size}"
    row_dir.mkdir()
    cfg = row_dir / name
    cfg.write_text(text)
    cmds = commands(cfg, text, row_dir, args.symmerge, Path(args.mergekit_bin))
    first = warm_ups(name, written, text, size, row_dir, args, env, warmed, mktemp, warmed_cache)
    order = ("symmerge", "mergekit") if i % 2 == 0 else ("mergekit", "symmerge")
    row = {"config": name[:-4], "size": size, "family": arch, "dtype": dtype, "hidden": hidden, "layers": layers,
           "params": sum(t.numel() for t in mo.tensors(base).values()), "order": list(order),
           "method": published.docs_of(text)[-1]["merge_method"], **first, "load_before": os.getloadavg()[0]}
    for tool in order:
        row[tool] = measured(cmds[tool], row_dir / f"{tool}.log", env)
        if row[tool]["rc"] != 0:
            row[tool]["log_tail"] = (row_dir / f"{tool}.log").read_text()[-600:]
    if row["symmerge"]["rc"] == 0 and row["mergekit"]["rc"] == 0:
        row["wall_ratio"] = row["symmerge"]["wall_s"] / row["mergekit"]["wall_s"]
        row["rss_ratio"] = row["symmerge"]["peak_rss_kb"] / row["mergekit"]["peak_rss_kb"]
        # CPU time (user + system) of each child: on a loaded machine, the wall ratio mixes in waiting for cores
        row["cpu_ratio"] = row["symmerge"]["cpu_s"] / max(row["mergekit"]["cpu_s"], 1e-9)
        row["gap"] = gap(row_dir / "symmerge", row_dir / "mergekit", base)
        row["over"] = [k for k, goal in (("wall", WALL_GOAL), ("rss", RSS_GOAL)) if row[f"{k}_ratio"] > goal]
        if args.spread:  # mergekit once more: its own run-to-run gap, the yardstick of a randomized row's gap
            (row_dir / "again").mkdir()
            again = commands(cfg, text, row_dir / "again", args.symmerge, Path(args.mergekit_bin))["mergekit"]
            row["mergekit_again"] = measured(again, row_dir / "mergekit-again.log", env)
            if row["mergekit_again"]["rc"] == 0:
                row["mergekit_spread"] = gap(row_dir / "again" / "mergekit", row_dir / "mergekit", base)
    shutil.rmtree(row_dir, ignore_errors=True)
    return row


def print_row(row: dict, log=print) -> None:
    s, m = row["symmerge"], row["mergekit"]
    if "wall_ratio" not in row:
        log(f"{row['config']:<44} {row['size']:<5} failed: symmerge rc {s['rc']}, mergekit rc {m['rc']}")
        return
    log(f"{row['config']:<44} {row['size']:<5} {row['params'] / 1e6:6.1f}M {s['wall_s']:6.2f} {m['wall_s']:6.2f} "
        f"{row['wall_ratio']:5.2f} {s['peak_rss_kb'] / 1024:6.0f} {m['peak_rss_kb'] / 1024:6.0f} "
        f"{row['rss_ratio']:5.2f} {row['cpu_ratio']:5.2f} {s['cpu_s']:5.2f} {m['cpu_s']:5.2f} "
        f"{row.get('load_before', float('nan')):5.1f} {row['gap']:8.2e} {' '.join(row['over']) or 'ok'}"
        + (f" (mergekit's own spread {row['mergekit_spread']:.2e})" if "mergekit_spread" in row else ""))


HEADER = (f"{'config':<44} {'size':<5} {'params':>7} {'s wall':>6} {'m wall':>6} {'wall×':>5} {'s MB':>6} "
          f"{'m MB':>6} {'rss×':>5} {'cpu×':>5} {'s cpu':>5} {'m cpu':>5} {'load':>5} {'gap':>8} over")


def selected(patterns: str | None) -> list[str]:
    if not patterns:
        return list(published.FILES)
    pats = [p.strip() for p in patterns.split(",") if p.strip()]
    files = [f for f in published.FILES if any(p in f for p in pats)]
    if not files:
        raise SystemExit(f"--configs {patterns}: matches none of {', '.join(published.FILES)}")
    return files


def work_folder(work: str | None) -> str | None:
    """``--work``: the folder the run's temporary folder goes in, made (with its parents) when missing; a path
    that is not a folder is one clear error (None: the system's temporary folder)."""
    if work is None:
        return None
    path = Path(work)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise SystemExit(f"--work {work}: not a folder") from None
    return str(path)


def run(args) -> dict:
    files, sizes = selected(args.configs), [s.strip() for s in args.sizes.split(",")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    started = time.time()
    result = {"machine_before": machine(), "goal": {"wall": WALL_GOAL, "rss": RSS_GOAL}, "rows": [],
              "commands": {"symmerge": f"{args.symmerge} run CONFIG OUT --progress none",
                           "mergekit": f"{args.mergekit_bin}/mergekit-yaml CONFIG OUT "
                                       "(mergekit-multi CONFIG --out-path OUT -I STEPS for several documents)"}}
    print(HEADER)
    warmed: set = set()
    warmed_cache: dict = {}  # the tiny stand-ins of the warm-up runs
    with tempfile.TemporaryDirectory(prefix="bench-configs-", dir=work_folder(args.work)) as tmp:
        work = Path(tmp)
        for size in sizes:
            cache: dict = {}  # stand-in families of this size, reused by the configs that need the same ones
            for name in files:
                row = one_row(name, size, len(result["rows"]), args, work, cache, env, warmed, warmed_cache)
                result["rows"].append(row)
                print_row(row)
                sys.stdout.flush()
                if args.json:  # after every row: an interrupted run keeps its rows
                    _write(Path(args.json), result)
            for folder in {base.parent for base, _ in cache.values()}:  # free the disk before the next size
                shutil.rmtree(folder, ignore_errors=True)
    result["machine_after"] = machine()
    result["seconds_total"] = time.time() - started
    return result


def summary(result: dict, log=print) -> None:
    done = [r for r in result["rows"] if "wall_ratio" in r]
    over = [r for r in done if r["over"]]
    failed = [r for r in result["rows"] if "wall_ratio" not in r]
    for size in dict.fromkeys(r["size"] for r in done):
        rs = [r for r in done if r["size"] == size]
        log(f"{size}: wall× {min(r['wall_ratio'] for r in rs):.2f}–{max(r['wall_ratio'] for r in rs):.2f}, "
            f"rss× {min(r['rss_ratio'] for r in rs):.2f}–{max(r['rss_ratio'] for r in rs):.2f} over {len(rs)} rows")
    log(f"rows over the goal (wall > {WALL_GOAL} or rss > {RSS_GOAL}): {len(over)} of {len(done)}"
        + (f"; failed: {', '.join(r['config'] + '/' + r['size'] for r in failed)}" if failed else ""))
    if over:
        log(HEADER)
        for r in over:
            print_row(r, log)


def _write(path: Path, result: dict) -> None:
    """``result`` as JSON at ``path``, atomically (a temporary file beside it, then renamed)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, path)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="tiny,50m", help="tiny and/or 50m (default both)")
    p.add_argument("--configs", help="comma-separated parts of config file names (default: every published one)")
    p.add_argument("--json", help="write every row and the machine's load here")
    p.add_argument("--symmerge", default=str(Path(sys.executable).parent / "symmerge"),
                   help="the symmerge command (default: beside this python)")
    p.add_argument("--mergekit-bin", default=str(MERGEKIT_BIN), help="the folder of mergekit-yaml/mergekit-multi")
    p.add_argument("--spread", action="store_true",
                   help="run mergekit a second time per row and record its own run-to-run gap (mergekit_spread)")
    p.add_argument("--work", default=None, help="where the stand-ins and outputs go (a temporary folder in it)")
    args = p.parse_args(argv)
    if not set(s.strip() for s in args.sizes.split(",")) <= {"tiny", "50m"}:
        raise SystemExit(f"--sizes: tiny and/or 50m, got {args.sizes}")
    result = run(args)
    summary(result)
    if args.json:
        _write(Path(args.json), result)
        print(f"wrote {args.json} ({result['seconds_total']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
