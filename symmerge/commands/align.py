"""Align MODEL to ANCHOR inside its symmetry orbit and write it as an HF model folder.

The output computes the same function as MODEL (verified on sample inputs before anything is
written) and lies as close as possible, in L2 over the matched parameters, to ANCHOR.
OUT_DIR/symmerge_report.json records distances before/after, per-module distances, the
verification difference and timings.

With --stream neither model is loaded whole: the checkpoints (safetensors, one file or shards) are
read one part of a layer at a time (attention QK, VO, FFN), solved and written shard by shard (memory:
about the largest part of both models plus its cost matrix, whatever the depth). --pipeline overlaps
reads, GEMMs, assignments and writes across layers instead (a few layers in memory). Use streaming
for checkpoints near or above RAM. --device cuda runs the FFN cost GEMMs on a GPU. In memory the FFN
layers are solved on a pool of one thread per core (--workers).
"""

import sys
from pathlib import Path

from ..io.prefix import print_notes as print_adapted
from ..io.tokenizers import print_note
from ..options.build import align_options
from ..options.parse import parse_layers
from ..pipeline.options import RECOMMENDED_NAME
from ..pipeline.report import solver_summary
from ..progress import elapsed
from .schema_args import add_options

# the way out named when the command runs out of memory (symmerge.cli: one symmerge: error: line)
def memory_way_out(args) -> str:
    if getattr(args, "stream", False):
        return "a smaller --shard-size, without --pipeline and --verify-forward (they hold more)"
    return "align with --stream (one part of one layer at a time), fewer --workers"



def add_arguments(parser) -> None:
    add_options(parser, "align")  # declared in symmerge.options.declared


def run(args) -> int:
    from ..pipeline.to_folder import align_to_folder

    out = Path(args.output)
    options = align_options(args, args.symmetries, verify=not args.no_verify, layers=parse_layers(args.layers),
                                verify_tol=args.verify_tol, device=args.device)
    if args.print_plan:
        import json

        from ..pipeline.to_folder import print_plan

        plan = print_plan(args.model, args.anchor, options, stream=args.stream, pipeline=args.pipeline,
                          allow_pickle=args.allow_pickle, verify_forward=args.verify_forward)
        print(json.dumps(plan, indent=2, default=str))
        return 0
    report = align_to_folder(args.model, args.anchor, out, options, stream=args.stream,
                             allow_pickle=args.allow_pickle, allow_tokenizer_mismatch=args.allow_tokenizer_mismatch,
                             shard_size=args.shard_size, pipeline=args.pipeline, verify_forward=args.verify_forward)
    if args.stream:
        _summary(report, out, f"{len(report['shards'])} shard(s); reading, alignment and writing "
                              f"{report['match_seconds']:.2f} s, total {elapsed():.2f} s")
    else:
        _summary(report, out, f"alignment {report['match_seconds']:.2f} s, alignment and verification "
                              f"{report['seconds']:.2f} s, total {elapsed():.2f} s")
    return 0


def _summary(report: dict, out: Path, timing: str) -> None:
    print_note(report.get("tokenizer"))
    print_adapted(report)  # a base model and a fine-tune of its task class (symmerge.io.prefix)
    if (report.get("sentence_transformers") or {}).get("note"):
        print(f"note: {report['sentence_transformers']['note']}", file=sys.stderr)
    print(f"aligned with {','.join(report['symmetries']) or 'nothing'}"
          f"{' (= recommended)' if report.get('symmetries_requested') == RECOMMENDED_NAME else ''}")
    print(f"distance to anchor (all parameters, head included): {report['distance_before']:.4f} -> "
          f"{report['distance_after']:.4f}")
    if report.get("solver"):
        print(solver_summary(report["solver"]))
    if report.get("verify_max_abs_diff") is not None:
        work = report.get("working_copies")  # half models: verified on float32 copies, then rounded when written
        on = f"; on {work['dtype']} copies, written in {'/'.join(dict.fromkeys(work['stored']))}" if work else ""
        print(f"equivalence: max |Δoutput| = {report['verify_max_abs_diff']:.3g} "
              f"(relative {report['verify_max_rel_diff']:.3g}{on})")
    left_out = report.get("side_files", {}).get("left_out", [])
    if left_out:
        print(f"left out of the output (not model files): {', '.join(left_out[:5])}"
              f"{f' and {len(left_out) - 5} more' if len(left_out) > 5 else ''} (see the report's side_files)")
    print(f"wrote {out} ({timing})")
