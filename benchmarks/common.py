"""What the benchmark scripts share: the ``main`` flow (redraw an earlier run, torch threads,
``--train-only``, refuse a non-empty ``--out``, print and write atomically), the machine a run was
measured on, and matplotlib without a display. Imports no other benchmark module."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch


def add_run_args(p) -> None:
    """The options every benchmark has: ``--train-only``, ``--threads``, ``--plot-only``."""
    p.add_argument("--train-only", choices=("A", "B"), help="only train (or find cached) model A or B and stop: "
                   "run the two in parallel processes, then the benchmark reuses both")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1; 0: torch's default). On the shared 2-core CPU one thread trained "
                        "3x faster than two (1.6 vs 5.2 s/step under load: OpenMP threads wait for each other)")
    p.add_argument("--plot-only", metavar="RESULTS_JSON", help="only print the tables and redraw the figures of "
                   "an earlier results.json into --out")


def bench_main(args, train_only, run, print_tables, write_outputs, written: str) -> int:
    """``args.plot_only``: redraw from an earlier results.json; ``args.train_only``: ``train_only()``
    and stop; else ``run(args)`` → result, printed and written into the empty or new ``args.out``.
    Runs with ``args.threads`` torch threads (0: torch's default) and offline."""
    if args.plot_only:
        result = json.loads(Path(args.plot_only).read_text())
        print_tables(result)
        write_outputs(result, Path(args.out))
        return 0
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    before = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        if args.train_only:
            train_only()
            return 0
        out = Path(args.out)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise SystemExit(f"{out}: exists and is not empty; choose another --out")
        result = run(args)
        print_tables(result)
        write_outputs(result, out)
        print(f"\nwrote {out / 'results.json'}, {written} ({result['seconds_total']:.0f} s)")
    finally:
        torch.set_num_threads(before)
    return 0


def pair_settings(args):
    """The seeds of models A and B (``--seeds``), and for each model to train now — both, or the one
    ``--train-only`` names — its name and :class:`~symmerge.demo.train.TrainSettings`."""
    from symmerge.demo.train import TrainSettings

    seeds = [int(s) for s in args.seeds.split(",")]
    todo = [(name, TrainSettings(steps=args.steps, batch_size=args.batch_size, lr=args.lr, seed=seed))
            for name, seed in zip("AB", seeds) if getattr(args, "train_only", None) in (None, name)]
    return seeds, todo


def write_results(out: Path, result: dict, tables: str) -> None:
    """``out/results.json`` and ``out/tables.md`` (the tables as printed), written atomically."""
    from symmerge.io.model import atomic_dir, write_json

    with atomic_dir(Path(out)) as tmp:
        write_json(tmp / "results.json", result)
        (tmp / "tables.md").write_text(tables)


def printed(print_tables, result: dict) -> str:
    """What ``print_tables(result, log=...)`` prints, as one text."""
    lines: list[str] = []
    print_tables(result, log=lines.append)
    return "\n".join(lines).lstrip("\n") + "\n"


def machine() -> dict:
    """The machine a run was measured on: CPUs, torch version and threads, load average, CPU model."""
    info = {"cpus": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()}
    try:
        info["load_average"] = os.getloadavg()
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def peak_rss_kb() -> int | None:
    """This process's own peak resident set in kB (VmHWM; None where /proc has none). Not getrusage: a child's
    ru_maxrss starts at its parent's peak (a parent holding 1.5 GB gives a fresh child 1.44 GB)."""
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("VmHWM:")), None)
