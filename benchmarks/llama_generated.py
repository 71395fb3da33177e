"""B7 without a corpus: the Llama pair aligned on token sequences the two models generate themselves
(``--align-data generate:N:LEN``), barrier on B7's real held-out paragraphs.

    python -m benchmarks.llama_generated [--kv-heads 2] [--rows activations@256:16,learned@64:32:40,...]
                                         [--seed S] [--repair-channels ffn,norm,qk] [--repair-samples 64]
                                         [--repeats 3] [--out DIR]

A row is ``MATCH@N:LEN[:STEPS]``: ``N`` sequences of ``LEN`` tokens sampled at temperature 1 from the pair
(half from A, half from B; each starts from the BOS token; seed 0: :mod:`symmerge.io.generate`), then
``align_pair`` with ``match=MATCH`` (``activations``, or ``learned`` for ``STEPS`` steps from activation
matching, with the fast learned settings of B7: ``--learn-batch``, ``--learn-positions``, bf16, checks on
``--learn-check-batches`` batches). Seconds: generation + alignment, as ``align --align-data
generate:N:LEN`` runs them (wall: the median of ``--repeats``; CPU: the process's user + system seconds;
load: the 1-minute load average when the row started). REPAIR (``+ REPAIR``): the endpoints' statistics on
the same generated sequences (no corpus either; ``--repair-samples N``: the first N of them), on
``--repair-channels`` (default ``ffn,norm``; the corpus-free recipe adds ``qk``); its seconds (``repair s``,
wall and CPU) are one REPAIR of the α = ½ merge, what ``merge --repair`` adds; ``total s``: generation +
alignment + that REPAIR. Loss along θ(α) (α = 0, ¼, ½, ¾, 1; θ_B: the alignment's anchor,
as ``merge`` interpolates) on B7's 200 held-out paragraphs, as in ``benchmarks.llama_text``; function
check: max |logits(aligned A) − logits(A)| on the first held-out batch.

Writes ``results.json`` into ``--out`` and prints one line per row.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ALPHAS = [0.0, 0.25, 0.5, 0.75, 1.0]
DEFAULT_ROWS = ("activations@256:16", "activations@128:64", "learned@64:32:40")


def parse_row(row: str) -> tuple[str, int, int, int | None]:
    """``MATCH@N:LEN[:STEPS]`` → (match, N, LEN, steps or None)."""
    try:
        match, rest = row.split("@")
        parts = [int(x) for x in rest.split(":")]
        n, length = parts[:2]
        steps = parts[2] if len(parts) > 2 else None
    except ValueError:
        raise SystemExit(f"row {row!r}: expected MATCH@N:LEN[:STEPS], e.g. activations@64:64 or learned@64:32:40")
    if match not in ("activations", "learned") or len(parts) > 3 or (match == "learned") != (steps is not None):
        raise SystemExit(f"row {row!r}: activations@N:LEN, or learned@N:LEN:STEPS")
    return match, n, length, steps


def row_options(args, row: str):
    from symmerge.pipeline.options import AlignOptions, LearnSettings

    match, n, length, steps = parse_row(row)
    learn = LearnSettings(steps=steps, batch=args.learn_batch, positions=args.learn_positions,
                          precision=args.learn_precision, check_batches=args.learn_check_batches,
                          lr=args.learn_lr) if match == "learned" else None
    return AlignOptions(symmetries="recommended", match=match, align_data=f"generate:{n}:{length}:{args.seed}",
                        align_samples=n, learn=learn)


def run(args, log=print) -> dict:
    from benchmarks import llama_text
    from benchmarks.llama_datafree import load_pair
    from symmerge.evaluate.metrics import interpolate, interpolation_curve
    from symmerge.merge.barrier import repaired_curve
    from symmerge.merge.repair import endpoint_stats, parse_channels, repair, statistics_data
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.data import read_once
    from symmerge.pipeline.verify import with_state_dict

    folders, a, b, curve = load_pair(args.kv_heads, args.curve_examples)
    log(f"pair {folders[0].name} / {folders[1].name}")
    rows = []
    channels = parse_channels(args.repair_channels)
    for name in args.rows:
        options = row_options(args, name)
        walls, cpus, gens, load = [], [], [], os.getloadavg()[0]
        for _ in range(max(1, args.repeats)):
            t0, c0 = time.perf_counter(), time.process_time()
            resolved = read_once(options, [a, b])  # what align / merge do with --align-data generate
            gens.append(time.perf_counter() - t0)
            res = align_pair(a, b, resolved)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        data, rep = resolved.align_data, res.report
        row = {"row": name, "align_data": options.align_data, "tokens": sum(int(x.mask.sum()) for x in data.batches),
               "align_seconds": statistics.median(walls), "align_seconds_all": walls,
               "generate_seconds": statistics.median(gens), "align_cpu_seconds": statistics.median(cpus),
               "load_average": load, "load_average_after": os.getloadavg()[0],
               "verify_max_abs_diff": rep.get("verify_max_abs_diff"),
               "function_check": llama_text.function_check(res.model, a, curve.batches[0])}
        if "learned" in rep:
            row["learned"] = {k: v for k, v in rep["learned"].items() if k != "history"}
        c = interpolation_curve(res.model, res.anchor, curve, ALPHAS, progress=False)
        row.update(loss=c["loss"], barrier=c["barrier"], loss_mid=c["loss"][2])
        if not args.no_repair:
            stats_opts = resolved.with_(symmetries="none", match="weights")
            r = repaired_curve(res.model, res.anchor, curve, ALPHAS, stats_opts, progress=False, channels=channels,
                               samples=args.repair_samples)
            row.update(repair_loss=r["loss"], repair_barrier=r["barrier"], repair_loss_mid=r["loss"][2],
                       repair_channels=list(channels), repair_samples=args.repair_samples)
            ends = [res.model, res.anchor]
            mid = with_state_dict(res.anchor, interpolate(res.model.state_dict(), res.anchor.state_dict(), 0.5))
            t0, c0 = time.perf_counter(), time.process_time()  # one REPAIR of the α = ½ merge, as merge --repair
            stats_data = statistics_data(data, args.repair_samples)
            repair(mid, ends, [0.5, 0.5], stats_data, channels=channels, stats=endpoint_stats(ends, stats_data))
            row["repair_seconds"], row["repair_cpu_seconds"] = time.perf_counter() - t0, time.process_time() - c0
            row["total_seconds"] = row["align_seconds"] + row["repair_seconds"]
            row["total_cpu_seconds"] = row["align_cpu_seconds"] + row["repair_cpu_seconds"]
        rows.append(row)
        log(f"  {name:22s} barrier {row['barrier']:.4f}  loss(½) {row['loss_mid']:.4f}"
            + (f"  +REPAIR {row['repair_barrier']:.4f} ({row['repair_seconds']:.2f} s; total {row['total_seconds']:.2f} s"
               f" wall, {row['total_cpu_seconds']:.2f} s CPU)" if "repair_barrier" in row else "")
            + f"  wall {row['align_seconds']:.2f} s (generation {row['generate_seconds']:.2f})"
              f"  CPU {row['align_cpu_seconds']:.2f} s  load {load:.1f}  check {row['function_check']:.1e}")
    return {"benchmark": "B7 alignment on generated sequences", "pair": [str(f) for f in folders],
            "alphas": ALPHAS, "curve_examples": curve.n, "repeats": args.repeats, "rows": rows,
            "command": "python -m benchmarks.llama_generated " + " ".join(args.argv)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.llama_generated", description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-heads", type=int, default=None, help="the GQA pair (2), default the MHA pair")
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS), help="comma list of MATCH@N:LEN[:STEPS]")
    p.add_argument("--repeats", type=int, default=3, help="alignments per row: the median seconds (default 3)")
    p.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    p.add_argument("--no-repair", action="store_true", help="skip the REPAIR curves")
    p.add_argument("--repair-channels", default="ffn,norm", help="REPAIR's channels (default ffn,norm)")
    p.add_argument("--repair-samples", type=int, default=None, help="REPAIR's statistics on the first N sequences")
    p.add_argument("--learn-batch", type=int, default=8)
    p.add_argument("--learn-positions", type=int, default=256)
    p.add_argument("--learn-precision", default="bfloat16")
    p.add_argument("--learn-check-batches", type=int, default=2)
    p.add_argument("--learn-lr", type=float, default=1e-2)
    p.add_argument("--curve-examples", type=int, default=200)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="folder for results.json (default: print only)")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    for r in args.rows:
        parse_row(r)  # bad rows: one error before any work
    return args


def main(argv=None) -> int:
    from benchmarks.llama_datafree import run_and_save

    return run_and_save(parse_args(argv), run)


if __name__ == "__main__":
    raise SystemExit(main())
