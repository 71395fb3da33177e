"""B7, two Llamas from different seeds: two small ``LlamaForCausalLM`` trained from seeds 0 and 1 on the
Python documentation (B4's corpus, split and BPE), aligned data-free and from unlabeled text, merged at
α = ½, loss barriers on held-out text.

    python -m benchmarks.llama_text [--out results/llama-text] [--rows none,recommended,...] [--repeats N]
                                    [--kv-heads 2] [--steps N] [--tiny] [--train-only A|B]

1. Corpus, split, tokenizer and token blocks: exactly B4's (``benchmarks.gpt2_text.prepare_data``: the
   reST sources of the Python 3.11 docs, a byte-level BPE of 4 096 tokens, blocks of 128 tokens).
2. Two ``LlamaForCausalLM`` (4 layers, hidden 256, 4 heads — ``--kv-heads 2`` for the GQA pair —,
   SwiGLU FFN 688, RMSNorm, RoPE, untied LM head), trained 400 steps of 16 × 128 tokens from seeds 0 and
   1 (``symmerge.demo.lm.train_llama``, cached under ~/.cache/symmerge/llama and reused).
3. Every row of :data:`ROWS` aligns model A to model B (``align_pair``, wall seconds: the median of
   ``--repeats`` runs; also the process's CPU seconds — user + system of all its threads, what a quiet
   machine would take with one torch thread and no worker pool —, and the load average before and
   after), checks the function (max |logits(aligned A) − logits(A)| on the first held-out
   batch, and the report's own ``verify_max_abs_diff``), and walks θ(α) = α·θ_A + (1−α)·θ_B (θ_B: the
   alignment's anchor, its norms folded where the aligned model's are — what ``merge`` interpolates) on
   ``--curve-examples`` held-out paragraphs (``curve.txt``), plain and with REPAIR at every α
   (statistics on the first ``--repair-examples`` alignment paragraphs). The unlabeled alignment data are the first
   ``--align-examples`` paragraphs of the validation split (never the evaluation set).

Row ``learned-dual`` moves both models into a frame between them (``--learn-frame dual``; θ(α) between the two
moved models, each checked against its original); ``--learn-alpha-low/--learn-alpha-high`` set the learned
steps' α range; ``--temperature`` adds a ``+temperature`` curve per row (θ(α)'s softmax temperature fitted at
every α on the first ``--temperature-examples`` alignment paragraphs, labels unused: Ito et al.'s calibration).

Writes ``results.json`` and ``tables.md`` into ``--out``; timings are also given as ratios to the
``recommended`` row's (the default of ``align`` and ``merge``), measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import add_run_args, bench_main, machine, pair_settings, write_results
from benchmarks.gpt2_text import prepare_data
from symmerge.demo.datasets import cache_dir
from symmerge.demo.lm import llama_config, train_llama
from symmerge.demo.train import load_report
from symmerge.io.model import load_model
from symmerge.pipeline.options import AlignOptions, LearnSettings

# row name -> AlignOptions arguments (None: no alignment); extend here
ROWS = {
    "none": None,
    "paper": {"symmetries": "paper"},
    "recommended": {"symmetries": "recommended"},
    "residual-permutation": {"symmetries": "recommended", "residual": "permutation"},
    "activations": {"symmetries": "recommended", "match": "activations"},
    "learned": {"symmetries": "recommended", "match": "learned"},
    # both models moved into a frame between them (LearnSettings.frame = "dual"); θ(α) between the two moved models
    "learned-dual": {"symmetries": "recommended", "match": "learned", "frame": "dual"},
}
DEFAULT_ROW = "recommended"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.llama_text", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results/llama-text", help="output folder (must not exist or be empty)")
    p.add_argument("--tiny", action="store_true", help="tiny model, corpus subset, few steps: the smoke test")
    p.add_argument("--rows", default=",".join(ROWS), help=f"comma list of rows among {', '.join(ROWS)}")
    p.add_argument("--no-repair", action="store_true", help="skip the REPAIR curves")
    p.add_argument("--temperature", action="store_true",
                   help="also a '+temperature' curve per row: θ(α)'s softmax temperature fitted at every α on the "
                        "first --temperature-examples alignment paragraphs against the endpoints' mixed predictions "
                        "(Ito et al.'s calibration; symmerge barrier --temperature)")
    p.add_argument("--progress", action="store_true",
                   help="progress lines on stderr while aligning (the learned steps' pace; off: the timed runs as before)")
    p.add_argument("--temperature-examples", type=int, default=100,
                   help="validation paragraphs the temperature is fitted on (the first of the alignment data; default 100)")
    p.add_argument("--repeats", type=int, default=1, help="alignments per row; the median wall time is reported")
    p.add_argument("--vocab", type=int, default=4096, help="BPE vocabulary size (default 4096)")
    p.add_argument("--context", type=int, default=128, help="tokens per training block (default 128)")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads (default: --heads, MHA; fewer: GQA)")
    p.add_argument("--inner", type=int, default=688, help="FFN width (default 688)")
    p.add_argument("--steps", type=int, default=400, help="training steps per model (default 400)")
    p.add_argument("--batch-size", type=int, default=16, help="blocks per step (default 16)")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--eval-every", type=int, default=50, help="validation loss every N steps (default 50)")
    p.add_argument("--seeds", default="0,1", help="seeds of models A and B")
    p.add_argument("--curve-examples", type=int, default=200, help="held-out paragraphs for the LMC curves")
    p.add_argument("--align-examples", type=int, default=500, help="unlabeled validation paragraphs for alignment")
    p.add_argument("--points", type=int, default=5, help="α values on each LMC curve")
    p.add_argument("--repair-examples", type=int, default=100,
                   help="validation paragraphs for REPAIR's statistics (the first of the alignment data; default 100)")
    p.add_argument("--learn-steps", type=int, default=None, help="learned alignment steps (default: LearnSettings')")
    p.add_argument("--learn-batch", type=int, default=None, help="paragraphs per learned step")
    p.add_argument("--learn-positions", type=int, default=None,
                   help="learned: the objective on this many random positions per batch (LearnSettings.positions)")
    p.add_argument("--learn-max-length", type=int, default=None,
                   help="learned: alignment texts truncated to this many tokens (LearnSettings.max_length)")
    p.add_argument("--learn-lr", type=float, default=None, help="learned: Adam's learning rate")
    p.add_argument("--learn-alpha-low", type=float, default=None,
                   help="learned: each step's α drawn from U(LO, HI) (LearnSettings.alpha_low; LO = HI: one α)")
    p.add_argument("--learn-alpha-high", type=float, default=None, help="learned: the upper end of α's range")
    p.add_argument("--learn-seed", type=int, default=None,
                   help="learned: the seed of the batch order, the α draws and the positions (LearnSettings.seed)")
    p.add_argument("--learn-budget", type=float, default=None,
                   help="learned: stop the steps after this many seconds (LearnSettings.budget; the report says so)")
    p.add_argument("--learn-precision", choices=("float32", "bfloat16"), default=None,
                   help="learned: the training steps' precision (LearnSettings.precision)")
    p.add_argument("--learn-check-batches", type=int, default=None,
                   help="learned: the start/end objective checks on at most this many batches "
                        "(LearnSettings.check_batches)")
    add_run_args(p)
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        p.error(f"unknown row {unknown[0]!r}; choose from {', '.join(ROWS)}")
    args.test_examples = 1  # prepare_data writes test.txt; B7 scores the endpoints on the curve
    if args.tiny:
        args.vocab, args.context, args.hidden, args.layers, args.heads, args.inner = 384, 32, 32, 2, 2, 64
        args.steps, args.batch_size, args.eval_every, args.points = 40, 16, 20, 3
        args.curve_examples, args.align_examples, args.train_lines, args.repair_examples = 40, 60, 3000, 30
        args.learn_steps, args.learn_batch = args.learn_steps or 5, args.learn_batch or 20
    else:
        args.train_lines = None
    return args


def work_dir(args) -> Path:
    return cache_dir() / "benchmarks" / ("llama-text-tiny" if args.tiny else "llama-text")


def pair_name(args, name: str) -> str:
    gqa = f"-gqa{args.kv_heads}" if args.kv_heads not in (None, args.heads) else ""
    return f"pydocs-{'tiny-' if args.tiny else ''}{name}{gqa}"


def train_pair(args, data: dict, log):
    tok = data["tokenizer"]
    config = llama_config(len(tok), args.context, args.hidden, args.layers, args.heads, args.kv_heads, args.inner,
                          eos_token_id=tok.eos_token_id)
    seeds, todo = pair_settings(args)
    folders = [train_llama(config, data["train"], settings, tok, name=pair_name(args, name),
                           eval_blocks=data["validation"], eval_every=args.eval_every, log=log)
               for name, settings in todo]
    return config, seeds, folders


def row_options(args, name: str, align_file) -> AlignOptions | None:
    spec = ROWS[name]
    if spec is None:
        return None
    spec = dict(spec)
    learn = LearnSettings(frame=spec.pop("frame", "one-sided"),
                          **{k: v for k, v in (("steps", args.learn_steps), ("batch", args.learn_batch),
                                               ("positions", args.learn_positions),
                                               ("max_length", args.learn_max_length), ("lr", args.learn_lr),
                                               ("precision", args.learn_precision),
                                               ("alpha_low", args.learn_alpha_low),
                                               ("alpha_high", args.learn_alpha_high),
                                               ("budget", args.learn_budget), ("seed", args.learn_seed),
                                               ("check_batches", args.learn_check_batches))
                             if v is not None})
    return AlignOptions(**spec, align_data=align_file if spec.get("match", "weights") != "weights" else None,
                        align_samples=args.align_examples, learn=learn)


def function_check(aligned, original, batch) -> float:
    """max |logits(aligned) − logits(original)| on one held-out batch (float64 difference)."""
    return function_checks(aligned, original, batch)[0]


def function_checks(aligned, original, batch) -> tuple[float, float]:
    """max |logits(aligned) − logits(original)| on one held-out batch (float64 difference), and that
    difference relative to max |logits(original)| (the scale ``verify_forward``'s relative figure uses)."""
    with torch.no_grad():
        a = aligned(**batch.inputs).logits.double()
        b = original(**batch.inputs).logits.double()
    diff, scale = (a - b).abs().max().item(), b.abs().max().item()
    return diff, diff / scale if scale else diff


def function_fields(aligned, a, end_b, b, batch) -> dict:
    """The function checks of a row: aligned A against A, and (an anchor that moved: norms folded, or the dual
    frame) B's aligned form against B; absolute and relative to the original's largest logit."""
    fields = dict(zip(("function_check", "function_check_rel"), function_checks(aligned, a, batch)))
    if end_b is not b:
        fields.update(zip(("function_check_anchor", "function_check_anchor_rel"), function_checks(end_b, b, batch)))
    return fields


def run(args, log=print) -> dict:
    from symmerge.merge.barrier import repaired_curve, tempered_curve
    from symmerge.evaluate.metrics import interpolation_curve
    from symmerge.io.data import load_data
    from symmerge.pipeline.align import align_pair
    from symmerge.progress import stage_printer

    t_start = time.perf_counter()
    data = prepare_data(args, work_dir(args))
    config, seeds, folders = train_pair(args, data, log)
    a, b = (load_model(f) for f in folders)
    curve = load_data(data["files"]["curve"], a, batch_size=32, max_examples=args.curve_examples)
    align_file = data["files"]["validation"]
    alphas = [i / (args.points - 1) for i in range(args.points)]
    mid = alphas.index(0.5) if 0.5 in alphas else len(alphas) // 2
    repair_opts = AlignOptions(symmetries="none", align_data=align_file, align_samples=args.repair_examples)
    temperature_opts = repair_opts.with_(align_samples=args.temperature_examples)
    endpoints = {n: {"seed": s, "folder": str(f), **{k: load_report(f).get(k) for k in
                                                       ("seconds", "seconds_per_step", "eval_loss", "eval_accuracy")}}
                 for n, s, f in (("A", seeds[0], folders[0]), ("B", seeds[1], folders[1]))}
    rows = []
    for name in args.rows:
        opts = row_options(args, name, align_file)
        row = {"row": name}
        if opts is None:
            aligned, end_b, times = a, b, []
        else:
            times, cpu = [], []
            for _ in range(max(1, args.repeats)):
                load = os.getloadavg()[0]
                t0, c0 = time.perf_counter(), time.process_time()
                res = align_pair(a, b, opts, progress=stage_printer(desc=f"aligning ({name})") if args.progress else None)
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
            aligned, rep = res.model, res.report
            end_b = res.anchor  # B in the aligned model's parameterisation (norms folded as A's), as merge
            # (the dual frame: B moved into the shared frame, verified against B)
            row.update({"align_seconds": statistics.median(times), "align_seconds_all": times, "load_average": load,
                        "align_cpu_seconds": statistics.median(cpu), "load_average_after": os.getloadavg()[0],
                        "verify_max_abs_diff": rep.get("verify_max_abs_diff"), "symmetries": rep.get("symmetries"),
                        "residual_group": rep.get("residual_group"), "match_seconds": rep.get("match_seconds"),
                        "verify_max_rel_diff": rep.get("verify_max_rel_diff"),
                        **function_fields(aligned, a, end_b, b, curve.batches[0])})
            if opts.match == "learned":
                row["learn_settings"] = dataclasses.asdict(opts.learn)
            if "learned" in rep:
                row["learned"] = {k: v for k, v in rep["learned"].items() if k != "history"}
        c = interpolation_curve(aligned, end_b, curve, alphas, progress=False)
        row.update({"loss": c["loss"], "barrier": c["barrier"], "loss_mid": c["loss"][mid]})
        if not args.no_repair:
            r = repaired_curve(aligned, end_b, curve, alphas, repair_opts, progress=False)
            row.update({"repair_loss": r["loss"], "repair_barrier": r["barrier"], "repair_loss_mid": r["loss"][mid]})
        if args.temperature:
            t = tempered_curve(aligned, end_b, curve, alphas, temperature_opts, progress=False)
            row.update({"temperature_loss": t["loss"], "temperature_barrier": t["barrier"],
                        "temperature_loss_mid": t["loss"][mid], "temperatures": t["temperatures"]})
        rows.append(row)
        log(f"  {name:22s} barrier {row['barrier']:.4f}  loss(0.5) {row['loss_mid']:.4f}"
            + (f"  +REPAIR {row['repair_barrier']:.4f} / {row['repair_loss_mid']:.4f}" if "repair_barrier" in row else "")
            + (f"  align {row['align_seconds']:.2f} s  check {row['function_check']:.1e}" if times else ""))
    base = next((r["align_seconds"] for r in rows if r["row"] == DEFAULT_ROW), None)
    for r in rows:
        if base and "align_seconds" in r:
            r["align_ratio"] = r["align_seconds"] / base
    return {
        "benchmark": "B7 llama_text", "tiny": args.tiny,
        "command": " ".join(["python -m benchmarks.llama_text"] + sys.argv[1:]), "machine": machine(),
        "config": {k: getattr(config, k) for k in ("vocab_size", "max_position_embeddings", "hidden_size",
                                                   "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                                   "intermediate_size", "tie_word_embeddings")},
        "training": {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seeds": seeds},
        "data": {"curve": curve.n, "align": args.align_examples, "files": {k: str(v) for k, v in data["files"].items()}},
        "endpoints": endpoints, "alphas": alphas, "rows": rows, "seconds_total": time.perf_counter() - t_start,
    }


# ---------------------------------------------------------------- output

HEADER = ("row", "barrier", "α = ½ loss", "+REPAIR barrier", "+REPAIR α = ½ loss", "+T barrier", "+T α = ½ loss",
          "align s", "CPU s", "load", "ratio", "function check", "relative (A; B)")


def table_rows(r: dict) -> list[tuple]:
    def f(x, fmt):
        return "—" if x is None else format(x, fmt)
    return [(x["row"], f(x["barrier"], ".4f"), f(x["loss_mid"], ".4f"), f(x.get("repair_barrier"), ".4f"),
             f(x.get("repair_loss_mid"), ".4f"), f(x.get("temperature_barrier"), ".4f"),
             f(x.get("temperature_loss_mid"), ".4f"), f(x.get("align_seconds"), ".2f"),
             f(x.get("align_cpu_seconds"), ".2f"), f(x.get("load_average"), ".1f"), f(x.get("align_ratio"), ".2f"),
             f(x.get("function_check"), ".1e"),
             "; ".join(f(x.get(k), ".1e") for k in ("function_check_rel", "function_check_anchor_rel") if k in x) or "—")
            for x in r["rows"]]


def print_tables(r: dict, log=print) -> None:
    ea, eb = r["endpoints"]["A"], r["endpoints"]["B"]
    log(f"\nendpoints: A validation loss {ea['eval_loss']:.4f}, B {eb['eval_loss']:.4f}")
    log(" | ".join(HEADER))
    for row in table_rows(r):
        log(" | ".join(row))


def markdown_tables(r: dict) -> str:
    c, ea, eb = r["config"], r["endpoints"]["A"], r["endpoints"]["B"]
    out = [f"Models (LlamaForCausalLM, {c['num_hidden_layers']} layers, d = {c['hidden_size']}, "
           f"{c['num_attention_heads']} query / {c['num_key_value_heads']} KV heads, FFN {c['intermediate_size']}, "
           f"vocab {c['vocab_size']}): A validation loss {ea['eval_loss']:.4f}, B {eb['eval_loss']:.4f}.", "",
           f"Loss along θ(α) on {r['data']['curve']} held-out paragraphs, {len(r['alphas'])} points; alignment data "
           f"{r['data']['align']} validation paragraphs.", "",
           "| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    out += ["| " + " | ".join(row) + " |" for row in table_rows(r)]
    return "\n".join(out) + "\n"


def write_outputs(result: dict, out: Path) -> None:
    write_results(out, result, markdown_tables(result))


def main(argv=None) -> int:
    args = parse_args(argv)
    return bench_main(args, lambda: train_pair(args, prepare_data(args, work_dir(args)), print), run,
                      print_tables, write_outputs, "tables.md")


if __name__ == "__main__":
    sys.exit(main())
