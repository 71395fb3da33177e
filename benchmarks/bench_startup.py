"""Start-up of ``symmerge run`` against ``mergekit-yaml`` (issue 41: on tiny configs start-up is most of the
wall time). Each command runs as a child of the small measuring parent of ``benchmarks/bench_configs.py``
(wall, CPU = user + system, peak RSS), ``--repeat`` times, the tools in turn within each repetition (the
order rotating), after one unmeasured run of each (numba's kernels and the tensor-name cache warm, as from a
config's second run on). Rows: ``python -c pass`` and ``import torch`` (the floor every tool pays),
``run --help``, and a tiny run of each ``--configs`` published config on the tests' stand-ins. Tools:
``symmerge`` (this checkout), ``before`` (``--before``: another install's ``symmerge``, e.g. the main
branch's, for a before/after in one run) and ``mergekit``. Printed per row: the median and least wall and CPU
seconds and the median RSS of each tool, and the CPU ratios symmerge / before and symmerge / mergekit (CPU:
on a shared, loaded machine the wall mixes in the time spent waiting for a core; the medians of both are
printed).

    nice python -m benchmarks.bench_startup --before /work/main/.venv/bin/symmerge --repeat 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.bench_configs import MERGEKIT_BIN, _write, commands, measured, published, work_folder
from benchmarks.common import machine

CONFIGS = "absa-ties-lambda,absa-slerp-v-shape,llama3-13b-passthrough-overlapping"


def _tool_commands(args, tools: dict, cfg: Path, text: str, out: Path) -> dict:
    """tool -> the command line of a tiny run of ``cfg`` into ``out/<tool>``."""
    cmds = {}
    for tool, exe in tools.items():
        if tool == "mergekit":
            cmds[tool] = commands(cfg, text, out / tool, "symmerge", Path(args.mergekit_bin))["mergekit"]
        else:
            cmds[tool] = commands(cfg, text, out / tool, exe, Path(args.mergekit_bin))["symmerge"]
    return cmds


def _rows(args, tools: dict, work: Path) -> list[tuple[str, dict]]:
    """(row name, tool -> command line, or a callable giving one with a fresh output folder) of every row."""
    py = sys.executable
    rows = [("python -c pass", {"python": [py, "-S", "-c", "pass"]}),
            ("import torch", {"python": [py, "-c", "import torch"]}),
            ("run --help", {t: ([exe, "run", "--help"] if t != "mergekit"
                                else [str(Path(args.mergekit_bin) / "mergekit-yaml"), "--help"])
                            for t, exe in tools.items()})]
    cache: dict = {}
    for name in [f for f in published.FILES if any(p in f for p in args.configs.split(","))]:
        text, _, _ = published.stand_ins((published.DATA / name).read_text(),
                                         lambda n: Path(tempfile.mkdtemp(prefix=n, dir=work)), cache)
        cfg = work / name
        cfg.write_text(text)
        rows.append((f"run {name[:-4]}", lambda i, cfg=cfg, text=text: _tool_commands(
            args, tools, cfg, text, work / f"{cfg.stem}-{i}")))
    return rows


def _measure_row(cmds, repeat: int, env: dict, log: Path) -> dict:
    """tool -> its runs (``measured``'s dicts), one unmeasured run first, then ``repeat`` rounds, the tools'
    order rotating."""
    get = cmds if callable(cmds) else (lambda i: cmds)
    tools = list(get("warm"))
    for tool, cmd in get("warm").items():
        measured(cmd, log, env)
    runs: dict = {t: [] for t in tools}
    for i in range(repeat):
        now = get(i)
        for tool in tools[i % len(tools):] + tools[:i % len(tools)]:
            runs[tool].append(measured(now[tool], log, env))
    return runs


def _summary(runs: list[dict]) -> dict:
    ok = [r for r in runs if r["rc"] == 0]
    if not ok:
        return {"rc": runs[0]["rc"]}
    walls, cpus = [r["wall_s"] for r in ok], [r["cpu_s"] for r in ok]
    return {"rc": 0, "n": len(ok), "wall_median": statistics.median(walls), "wall_min": min(walls),
            "cpu_median": statistics.median(cpus), "cpu_min": min(cpus),
            "rss_mb_median": statistics.median(r["peak_rss_kb"] for r in ok) / 1024, "runs": runs}


def print_table(result: dict, log=print, header: bool = True) -> None:
    if header:
        log(f"{'row':<44} {'tool':<9} {'wall med':>8} {'wall min':>8} {'cpu med':>8} {'cpu min':>8} {'MB':>6}  ratios")
    for row in result["rows"]:
        first = True
        for tool, s in row["tools"].items():
            if s.get("rc") != 0:
                log(f"{row['row'] if first else '':<44} {tool:<9} failed (rc {s.get('rc')})")
            else:
                log(f"{row['row'] if first else '':<44} {tool:<9} {s['wall_median']:8.2f} {s['wall_min']:8.2f} "
                    f"{s['cpu_median']:8.2f} {s['cpu_min']:8.2f} {s['rss_mb_median']:6.0f}")
            first = False
        if row.get("ratios"):
            log(f"{'':<44} {'':<9} " + ", ".join(f"{k} {v:.2f}" for k, v in row["ratios"].items()))


def _ratios(tools: dict) -> dict:
    """CPU (median) of symmerge over before and over mergekit, where both ran."""
    out = {}
    s = tools.get("symmerge", {})
    for other in ("before", "mergekit"):
        o = tools.get(other, {})
        if s.get("rc") == 0 and o.get("rc") == 0:
            out[f"cpu symmerge/{other}"] = s["cpu_median"] / o["cpu_median"]
            out[f"wall symmerge/{other}"] = s["wall_median"] / o["wall_median"]
    return out


def run(args) -> dict:
    tools = {"symmerge": args.symmerge}
    if args.before:
        tools["before"] = args.before
    tools["mergekit"] = "mergekit-yaml"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    result = {"machine_before": machine(), "tools": tools, "repeat": args.repeat, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench-startup-", dir=work_folder(args.work)) as tmp:
        work = Path(tmp)
        for name, cmds in _rows(args, tools, work):
            runs = _measure_row(cmds, args.repeat, env, work / "child.log")
            summ = {t: _summary(r) for t, r in runs.items()}
            result["rows"].append({"row": name, "tools": summ, "ratios": _ratios(summ)})
            print_table({"rows": result["rows"][-1:]}, header=len(result["rows"]) == 1)
            sys.stdout.flush()
    result["machine_after"] = machine()
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--symmerge", default=str(Path(sys.executable).parent / "symmerge"),
                   help="the symmerge command measured (default: beside this python)")
    p.add_argument("--before", help="another install's symmerge command, measured beside it (before/after)")
    p.add_argument("--mergekit-bin", default=str(MERGEKIT_BIN), help="the folder of mergekit-yaml")
    p.add_argument("--configs", default=CONFIGS, help=f"comma-separated parts of published config names ({CONFIGS})")
    p.add_argument("--repeat", type=int, default=5, help="measured runs of each command (default 5)")
    p.add_argument("--work", default=None, help="where the stand-ins and outputs go (a temporary folder in it)")
    p.add_argument("--json", help="write every run and the machine's load here")
    args = p.parse_args(argv)
    result = run(args)
    print(f"load average before {result['machine_before'].get('load_average')}, "
          f"after {result['machine_after'].get('load_average')}")
    if args.json:
        _write(Path(args.json), result)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
