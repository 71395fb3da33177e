"""Loss barrier between two models along θ(α) = α·θ_A + (1−α)·θ_B, with and without aligning A to B.

symmerge barrier A B --data FILE [--align recommended|LIST ...] [--points 11] -o DIR
symmerge barrier M1 M2 M3 ... --data FILE [--align ...] -o DIR


Writes DIR/barrier.json (alphas, where α = 1 is A and α = 0 is B; curves: one per variant, "none"
plus each --align spec, named by the symmetries it aligned, with loss and accuracy lists and the
scalar barrier; distance tables) and DIR/barrier.png. --data is the evaluation data (use held-out
data). --subsets single|last adds subset-of-layers matching (DIR/subsets.png).

With more than two models: for no alignment and each --align spec (all models brought into one frame
by joint alignment), the pairwise barrier matrix, and the N-way plain average's loss and accuracy
beside each model's and the ensemble's (mean predicted probabilities).
"""

from __future__ import annotations

import sys
from pathlib import Path

from ..errors import SymmergeError
from ..io.data import check_data_path
from ..io.model import ensure_output_dir
from ..io.tokenizers import print_note
from ..options.build import align_options
from ..pipeline.options import RECOMMENDED_NAME
from ..progress import elapsed
from .schema_args import add_options

# the way out named when the command runs out of memory (symmerge.cli: one symmerge: error: line)
MEMORY_WAY_OUT = ("fewer models, a smaller --batch-size or --max-examples (the study holds the models and an "
                  "interpolated one in memory)")


def add_arguments(parser) -> None:
    add_options(parser, "barrier")  # declared in symmerge.options.declared


def run(args) -> int:
    from ..merge.barrier import barrier_study, write_study
    from ..merge.repair import parse_channels, statistics_data

    out = Path(args.output)
    if len(args.models) < 2:
        raise SymmergeError(f"barrier needs at least two models, got {len(args.models)}")
    if not args.print_plan:
        ensure_output_dir(out, inputs=args.models)
    options = align_options(args, RECOMMENDED_NAME, verify=not args.no_verify)
    channels = parse_channels(args.repair_channels)
    statistics_data(None, args.repair_samples)  # samples >= 1, before any model is loaded
    study = _study_options(args, options, channels)
    if args.print_plan:
        import json

        from ..merge.barrier import plan_barrier

        print(json.dumps(plan_barrier(list(args.models), args.data, study).printed(), indent=2, default=str))
        return 0
    check_data_path(args.data, "--data")  # before any model is loaded, naming the flag (barrier_study: unnamed)
    if len(args.models) > 2:
        return _run_many(args, out, study)
    result = barrier_study(args.models[0], args.models[1], args.data, study)
    write_study(result, out)
    print_note(result.get("tokenizer"))
    width = max(len(name) for name in result["curves"])
    alphas = result["alphas"]
    mid = min(range(len(alphas)), key=lambda i: (abs(alphas[i] - 0.5), alphas[i]))  # 0.5, else the α nearest it
    label = "loss(0.5)" if alphas[mid] == 0.5 else f"loss({alphas[mid]:.3g})"
    for name, c in result["curves"].items():
        print(f"{name:{width}s}  barrier {c['barrier']:.4f}  {label} {c['loss'][mid]:.4f}")
    for name, c in result["curves"].items():
        if c.get("note"):
            print(f"warning: {name}: {c['note']}", file=sys.stderr)
    _endpoints_only(result["alphas"])
    aligning = sum(c.get("align_seconds", 0.0) for name, c in result["curves"].items()
                   if "+" not in name)  # a +repair or +temperature curve repeats its variant's alignment info
    print(f"wrote {_written(out)} (alignment {aligning:.2f} s, total {elapsed():.2f} s)")
    return 0


def _endpoints_only(alphas) -> None:
    """The warning of a study of the endpoints alone (``--points 2``), after its table: the barrier is measured
    against the endpoints' line, and at the endpoints it is 0."""
    if len(alphas) == 2:
        print("warning: --points 2 evaluates the endpoints only: every barrier is 0 by definition (give --points 3 "
              "or more to measure one)", file=sys.stderr)


def _written(out: Path) -> str:
    """Every file of the output folder (written whole by the study: ``barrier.json``, ``barrier.png``, and
    ``subsets.png`` with ``--subsets``), as the final line lists them."""
    names = [str(p) for p in sorted(out.iterdir()) if p.is_file()]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _study_options(args, options, channels):
    """The study's :class:`~symmerge.merge.barrier.BarrierOptions` from the flags (two models or more)."""
    from ..merge.barrier import BarrierOptions

    many = len(args.models) > 2
    return BarrierOptions(aligns=tuple(args.align or [RECOMMENDED_NAME]), points=args.points, subsets=args.subsets,
                          device=args.device, batch_size=args.batch_size, max_examples=args.max_examples,
                          allow_pickle=args.allow_pickle, align=options, repair=args.repair and not many,
                          repair_channels=channels, repair_samples=args.repair_samples,
                          allow_tokenizer_mismatch=args.allow_tokenizer_mismatch,
                          joint_rounds=args.joint_rounds, joint_refine=args.joint_refine,
                          temperature=args.temperature)


def _run_many(args, out: Path, study) -> int:
    from ..merge.barrier import barrier_many, write_many

    result = barrier_many(args.models, args.data, study)
    write_many(result, out)
    n = len(result["models"])
    mean, ens = result["endpoints_mean"], result["ensemble"]
    print(f"endpoints (mean)  loss {mean['loss']:.4f}  accuracy {mean['accuracy']:.4f}")
    print(f"ensemble          loss {ens['loss']:.4f}  accuracy {ens['accuracy']:.4f}")
    width = max(len(name) for name in result["variants"])
    for name, v in result["variants"].items():
        avg = v["average"]
        print(f"{name:{width}s}  mean pairwise barrier {v['mean_barrier']:.4f}  {n}-way average: loss "
              f"{avg['loss']:.4f}, accuracy {avg['accuracy']:.4f}")
    for name, v in result["variants"].items():
        for pair, c in v["pairs"].items():
            if c.get("note"):
                print(f"warning: {name}, models {pair}: {c['note']}", file=sys.stderr)
    _endpoints_only(result["alphas"])
    print(f"wrote {_written(out)} (total {elapsed():.2f} s)")
    return 0
