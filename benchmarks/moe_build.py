"""A mixture of experts from two Llamas trained apart, with and without ``symmerge moe --align``.

    python -m benchmarks.moe_build [--out DIR] [B7's model flags: --hidden --layers --inner --steps ...] [--tiny]

1. B7's pair (``benchmarks.llama_text``: the Python docs, a BPE tokenizer, two ``LlamaForCausalLM`` trained
   from seeds 0 and 1; cached and reused, whatever sizes the flags give).
2. MoEs with model A as the base (its attention, norms, embeddings, head), built by ``build_moe`` (what
   ``symmerge moe`` runs), each as mergekit-moe builds it, then with every expert aligned to the base first
   (``--align``: the recommended symmetries; data-free, then ``--match activations`` on the first
   ``--align-examples`` validation paragraphs):
   * ``A+B``: experts A's and B's MLPs, 2 per token, ``gate_mode: cheap_embed`` (prompts: validation
     paragraphs, different ones per expert);
   * ``B in A``: B's MLP as the only expert behind A's attention (two copies, 1 per token: routing plays no
     part): how well B's MLP reads and writes A's residual stream.
3. Held-out loss (mean next-token cross-entropy) and accuracy on ``--curve-examples`` test paragraphs, in
   blocks of ``--context`` tokens, for A, B and every MoE.

Writes ``results.json`` and ``tables.md`` into ``--out``.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.common import bench_main, machine, printed, write_results
from benchmarks.gpt2_text import prepare_data
from benchmarks.llama_text import parse_args, train_pair, work_dir
from symmerge.config.moe_build import MoeOptions, build_moe
from symmerge.demo import text
from symmerge.demo.lm import lm_scores
from symmerge.io.model import load_model
from symmerge.pipeline.options import RECOMMENDED_NAME, AlignOptions


def moes(folders, prompts) -> dict:
    """name -> the mergekit-moe config (as a dict) of each MoE."""
    a, b = (str(f) for f in folders)
    return {
        "A+B": {"base_model": a, "gate_mode": "cheap_embed", "dtype": "float32", "experts_per_token": 2,
                "experts": [{"source_model": a, "positive_prompts": prompts[0]},
                            {"source_model": b, "positive_prompts": prompts[1]}]},
        "B in A": {"base_model": a, "gate_mode": "random", "dtype": "float32", "experts_per_token": 1,
                   "experts": [{"source_model": b}, {"source_model": b}]},
    }


def run(args, log=print) -> dict:
    start = time.perf_counter()
    folder = work_dir(args)
    folder.mkdir(parents=True, exist_ok=True)
    data = prepare_data(args, folder)
    _, seeds, folders = train_pair(args, data, log)
    curve = text.read_lines(data["files"]["curve"])
    held_out = text.blocks(text.token_stream(curve, data["tokenizer"]), args.context)
    validation = text.read_lines(data["files"]["validation"])
    prompts = [validation[:8], validation[8:16]]
    rows = []

    def score(name, path, aligned=None, seconds=None):
        model = load_model(str(path), spec=False)
        loss, acc = lm_scores(model, held_out)
        rows.append({"model": name, "aligned": aligned, "loss": loss, "accuracy": acc, "build_seconds": seconds})
        log(f"{name:<10} {'' if aligned is None else (aligned or 'plain'):<12} loss {loss:.4f} "
            f"accuracy {acc:.4f}")

    score("A", folders[0])
    score("B", folders[1])
    with tempfile.TemporaryDirectory(prefix="moe-build-") as tmp:
        tmp = Path(tmp)
        for name, doc in moes(folders, prompts).items():
            config = tmp / f"{name.replace(' ', '_').replace('+', '_')}.yml"
            config.write_text(yaml.safe_dump(doc, sort_keys=False))
            for aligned in (None, "weights", "activations"):
                out = tmp / f"{config.stem}-{aligned or 'plain'}"
                align = None if aligned is None else AlignOptions(
                    symmetries=RECOMMENDED_NAME, match=aligned,
                    align_data=data["files"]["validation"] if aligned == "activations" else None,
                    align_samples=args.align_examples)
                t0 = time.perf_counter()
                report = build_moe(config, out, MoeOptions(align=align, progress=False))
                seconds = time.perf_counter() - t0
                score(name, out, aligned or False, seconds)
                if aligned:
                    rows[-1]["alignment"] = report["alignment"]
    return {"benchmark": "moe_build", "seeds": seeds, "models": [str(f) for f in folders],
            "held_out": {"paragraphs": len(curve), "blocks": int(len(held_out)), "context": args.context},
            "sizes": {"hidden": args.hidden, "layers": args.layers, "inner": args.inner, "vocab": args.vocab,
                      "steps": args.steps}, "rows": rows, "machine": machine(),
            "seconds_total": time.perf_counter() - start}


def print_tables(result: dict, log=print) -> None:
    log(f"held-out: {result['held_out']['blocks']} blocks of {result['held_out']['context']} tokens "
        f"({result['held_out']['paragraphs']} test paragraphs); sizes {result['sizes']}")
    log("")
    log("| model | experts aligned to the base | held-out loss | accuracy | build s |")
    log("|---|---|---|---|---|")
    for r in result["rows"]:
        aligned = ("—" if r["aligned"] is None else "no (as mergekit-moe)" if not r["aligned"]
                   else f"`--align` (match {r['aligned']})")
        secs = "—" if r["build_seconds"] is None else f"{r['build_seconds']:.1f}"
        log(f"| {r['model']} | {aligned} | {r['loss']:.4f} | {r['accuracy']:.4f} | {secs} |")


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.out == "results/llama-text":
        args.out = "results/moe-build"

    def write_outputs(result, out):
        write_results(out, result, printed(print_tables, result))

    def train_only():
        folder = work_dir(args)
        folder.mkdir(parents=True, exist_ok=True)
        train_pair(args, prepare_data(args, folder), print)

    return bench_main(args, train_only, run, print_tables, write_outputs, written="results.json, tables.md")


if __name__ == "__main__":
    sys.exit(main())
