"""Issue 42 item 3, N models: the joint learned alignment of N ViTs of B1's recipe, one-sided (every model but the
frame model moved into its frame) against dual (every model moved into one shared frame, each with its own norm
splits; ``LearnSettings(frame="dual")``), each followed by the plain average of all parameters, scored on B1's
10 000 test images against the endpoints' mean and their ensemble.

    .venv/bin/python -m benchmarks.quality_joint --models A_DIR B_DIR C_DIR D_DIR --out DIR \\
        [--frames one-sided,dual] [--learn steps=600 --learn dirichlet=3]

The unlabeled alignment images are the first ``--align-samples`` of B1's ``stats.npz`` (labels ignored); the
frame is model ``--anchor``'s. Every aligned model is verified against its original (``verify_max_rel_diff``,
float32). Writes ``DIR/results.json`` and ``DIR/tables.md``.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks.common import add_run_args, bench_main, printed, write_results
from benchmarks.dual_learned import DATA, learn_settings
from symmerge.evaluate.metrics import evaluate, evaluate_ensemble
from symmerge.io.data import load_data
from symmerge.io.model import load_model
from symmerge.pipeline.joint import align_joint, mean_state_dict
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.verify import with_state_dict


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.quality_joint", description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", required=True, help="the model folders (three or more)")
    p.add_argument("--data", default=DATA, help="folder with test.npz (scores) and stats.npz (unlabeled)")
    p.add_argument("--align-samples", type=int, default=1000)
    p.add_argument("--anchor", type=int, default=0, help="the frame model (the one-sided path's; both paths' start)")
    p.add_argument("--frames", default="one-sided,dual", help="comma list of one-sided, dual")
    p.add_argument("--learn", action="append", default=[], metavar="KEY=VALUE",
                   help="a LearnSettings field for both frames (repeatable)")
    p.add_argument("--out", required=True)
    add_run_args(p)
    return p.parse_args(argv)


def run(args, log=print) -> dict:
    t0 = time.perf_counter()
    data = Path(os.path.expanduser(args.data))
    folders = [os.path.expanduser(f) for f in args.models]
    models = [load_model(f) for f in folders]
    test = load_data(str(data / "test.npz"), models[0], batch_size=500)
    singles = [evaluate(m, test, progress=False) for m in models]
    mean_acc = sum(s["accuracy"] for s in singles) / len(singles)
    ensemble = evaluate_ensemble(models, test, progress=False)
    log(f"endpoints {[round(100 * s['accuracy'], 2) for s in singles]}, mean {100 * mean_acc:.2f} %, ensemble "
        f"{100 * ensemble['accuracy']:.2f} %")
    rows = []
    for frame in args.frames.split(","):
        options = AlignOptions(symmetries="recommended", match="learned", align_data=str(data / "stats.npz"),
                               align_samples=args.align_samples, learn=learn_settings(args.learn, frame)
                               ).for_model(models[0])
        t, cpu = time.perf_counter(), time.process_time()
        result = align_joint(models, options, anchor=args.anchor)
        seconds, cpu = time.perf_counter() - t, time.process_time() - cpu  # CPU: what it costs on an idle machine
        keys = [k for k, v in result.models[0].state_dict().items() if v.is_floating_point()]
        average = with_state_dict(result.models[0], mean_state_dict([m.state_dict() for m in result.models], keys))
        e = evaluate(average, test, progress=False)
        learned = result.report["learned"]
        row = {"frame": frame, "learn": args.learn, "accuracy": e["accuracy"], "loss": e["loss"],
               "accuracy_vs_endpoints": e["accuracy"] / mean_acc, "seconds": seconds, "cpu_seconds": cpu,
               "learned_seconds": learned.get("seconds"), "steps": learned.get("steps"),
               "dirichlet": learned.get("dirichlet") or (learned.get("dirichlet_choice") or {}).get("chosen"),
               "objective": (learned["held_out_start"], learned["held_out_best"]),
               "verify_max_rel_diff": max(m["verify_max_rel_diff"] for m in result.report["models"]),
               "align_samples_used": result.report.get("align_samples_used"),
               "load_average": os.getloadavg()}
        rows.append(row)
        log(f"{frame}: {100 * e['accuracy']:.2f} % ({100 * row['accuracy_vs_endpoints']:.1f} % of the endpoints' "
            f"mean), loss {e['loss']:.4f}, verify {row['verify_max_rel_diff']:.1e}, {seconds:.0f} s")
    return {"benchmark": "joint learned alignment, one-sided vs dual (issue 42 item 3)", "models": folders,
            "endpoints": singles, "endpoints_mean_accuracy": mean_acc, "ensemble": ensemble, "rows": rows,
            "align_samples": args.align_samples, "anchor": args.anchor, "seconds_total": time.perf_counter() - t0}


def print_tables(r: dict, log=print) -> None:
    ends = ", ".join(f"{100 * s['accuracy']:.2f}" for s in r["endpoints"])
    log(f"\nN = {len(r['models'])}, endpoints {ends} % "
        f"(mean {100 * r['endpoints_mean_accuracy']:.2f} %), ensemble {100 * r['ensemble']['accuracy']:.2f} %\n")
    log("| frame | settings | average (%) | % of endpoints' mean | loss | Dirichlet | objective start → best | "
        "verify (rel) | seconds (CPU s) |")
    log("|---|---|---|---|---|---|---|---|---|")
    for x in r["rows"]:
        log(f"| {x['frame']} | {' '.join(x['learn']) or 'defaults'} | {100 * x['accuracy']:.2f} | "
            f"{100 * x['accuracy_vs_endpoints']:.1f} | {x['loss']:.4f} | {x['dirichlet']} | "
            f"{x['objective'][0]:.3f} → {x['objective'][1]:.3f} | {x['verify_max_rel_diff']:.1e} | "
            f"{x['seconds']:.0f} ({x['cpu_seconds']:.0f}) |" if "cpu_seconds" in x else f"{x['seconds']:.0f} |")


def main(argv=None) -> int:
    return bench_main(parse_args(argv), lambda: None, run, print_tables,
                      lambda r, out: write_results(out, r, printed(print_tables, r)), "tables.md")


if __name__ == "__main__":
    raise SystemExit(main())
