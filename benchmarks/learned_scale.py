"""Learned alignment against model size: wall time per step and peak memory of ``--match learned`` on random-init
Llama pairs of real shapes (issue 42, item 6), on the CPU or a GPU.

Each size runs in a child process of its own (so its peak RSS is its own): two ``LlamaForCausalLM`` of the
shape, initialised from two seeds, aligned by :func:`symmerge.pipeline.align.align_pair` with the learned
matcher (its default start, activation matching, then ``--steps`` learned steps) on ``--texts`` random token
sequences of ``--length`` tokens, verification included. Printed per size: parameters, the wall seconds of
each stage (model build, closed-form start, the endpoints' predictions, one learned step), the peak RSS of
the process and of the models alone, CUDA's peak allocation on a GPU, and the extrapolated wall time of a full
run (the closed form, the predictions and ``--full-steps`` steps; the default recipe has 200).

Random weights say nothing about the quality of an alignment; the time and memory of a step do not depend on
the values. Sizes: ``135m`` (SmolLM2-135M's shape), ``360m`` (SmolLM2-360M's), ``1b`` (Llama 3.2 1B's).

``--from-files``: the pair is first saved as safetensors folders (by a child process of its own, under
``--work``), then aligned by :func:`symmerge.pipeline.learn_layerwise_files.learn_from_checkpoints` — neither model
in memory, every layer read from the files when it runs — in the measured child; ``--start none`` there
learns from the identity (the learned steps' time and memory alone, without the closed-form start).

    python -m benchmarks.learned_scale [--sizes 135m,360m] [--device cpu|cuda] [--steps 5] [--layerwise]
        [--start activations|weights|none] [--from-files [--command]] [--positions N] [--out DIR]

``--command`` (with ``--from-files``): the measured child runs ``symmerge align A B -o OUT --match learned
--stream`` itself (a word-level tokenizer written into both folders, ``--texts`` lines of ``--length`` random
words as ``--align-data``): learning from the files, writing the aligned model shard by shard, verifying it from
the files; the row adds the seconds of writing and verifying and the bytes written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import peak_rss_kb

# name: (vocab, hidden, layers, heads, kv heads, FFN width) — tied embeddings, as the real models
SHAPES = {
    "tiny": (512, 64, 2, 4, 2, 128),  # a smoke test of the script
    "135m": (49152, 576, 30, 9, 3, 1536),
    "360m": (49152, 960, 32, 15, 5, 2560),
    "1b": (128256, 2048, 16, 32, 8, 8192),
    "1b-32k": (32000, 2048, 16, 32, 8, 8192),  # Llama-3.2-1B's layers with a 32 000-token vocabulary: 1.04 B
}


def rss_gb() -> float:
    """This process's own peak resident set so far, in GB (:func:`benchmarks.common.peak_rss_kb`)."""
    return peak_rss_kb() / 1e6


def random_tokens(vocab: int, texts: int, length: int, batch: int):
    """``texts`` random token sequences of ``length`` tokens in batches of ``batch``, as alignment data."""
    from symmerge.io.data import Batch, Data

    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, vocab, (texts, length), generator=g)
    batches = [Batch({"input_ids": ids[i:i + batch], "attention_mask": torch.ones_like(ids[i:i + batch])}, None,
                     torch.ones_like(ids[i:i + batch], dtype=torch.bool)) for i in range(0, texts, batch)]
    return Data(path="random tokens", format="lm", batches=batches, n=texts, labeled=False)


def config_of(size: str, length: int):
    from symmerge.demo.lm import llama_config

    vocab, hidden, layers, heads, kv, inner = SHAPES[size]
    return llama_config(vocab, context=max(length, 128), hidden=hidden, layers=layers, heads=heads, kv_heads=kv,
                        inner=inner, tie=True)


def save(size: str, folder: str, length: int, dtype: str = "float32") -> None:
    """The pair of ``size`` (seeds 0 and 1) saved as safetensors folders ``folder``/a and ``folder``/b, one
    model in memory at a time, stored as ``dtype`` (``bfloat16``: half the disk and the page cache; the learned
    path computes in float32 whatever the stored dtype)."""
    from transformers import LlamaForCausalLM

    for seed, name in ((0, "a"), (1, "b")):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config_of(size, length)).eval().to(getattr(torch, dtype))
        model.save_pretrained(Path(folder) / name)
        del model


def one_from_files(size: str, folder: str, steps: int, texts: int, length: int, batch: int, precision: str,
                   start: str, positions: int, layers: str | None = None) -> dict:
    """One size learned from its saved folders (:func:`symmerge.pipeline.learn_layerwise_files.learn_from_checkpoints`): the row of :func:`one`.
    ``layers`` (``"0"``, ``"0,1"``): only those layers' groups (the activation start's statistics, factorisations
    and solves for them alone: its time per layer and its peak, which is one layer's whatever the depth)."""
    from symmerge.options.parse import parse_layers

    import symmerge.pipeline.learn as learn_module

    from symmerge.pipeline.learn_layerwise_files import learn_from_checkpoints
    from symmerge.pipeline.options import AlignOptions, LearnSettings

    vocab = SHAPES[size][0]
    params = _folder_params(folder)
    data = random_tokens(vocab, texts, length, batch)
    learn = LearnSettings(steps=steps, batch=batch, augment=0, precision=precision, check_every=max(steps, 1),
                          layerwise=True, start="weights" if start == "none" else start, positions=positions)
    # the paper's set, as the figures in docs/results/learned_scale.md were measured (AlignOptions' default then)
    options = AlignOptions(symmetries="paper", match="learned", align_data=data, align_samples=texts, learn=learn,
                           layers=parse_layers(layers) if layers else None, verify_tol=_tolerance(folder))
    marks = {}
    round_ = learn_module._learn_round

    def timed(*args, **kwargs):  # the peak RSS of everything before learning: the closed-form start
        marks["rss"] = rss_gb()
        return round_(*args, **kwargs)
    learn_module._learn_round = timed
    base = rss_gb()
    t = time.perf_counter()
    _, report = learn_from_checkpoints(Path(folder) / "a", Path(folder) / "b", data, options,
                                       start={} if start == "none" else None)
    wall = time.perf_counter() - t
    learned = report["learned"]
    stages = learned.get("seconds_by_stage", {})
    done = max(learned.get("steps", 0), 1)
    return {"size": size, "parameters": params, "device": "cpu", "precision": precision, "layerwise": True,
            "from_files": True, "start": start, "layers": layers or "all", "stored": _stored(folder),
            "start_peak_rss_gb": marks.get("rss"), "texts": texts,
            "length": length, "batch": batch, "positions": positions, "steps": learned.get("steps"),
            "build_seconds": report["open_seconds"], "align_seconds": wall,
            "closed_form_seconds": report["learned"]["closed_form_seconds"],
            "targets_seconds": stages.get("targets"), "checks_seconds": stages.get("checks"),
            "seconds_per_step": stages.get("steps", 0.0) / done, "peak_rss_gb": rss_gb(), "models_rss_gb": base,
            "cuda_peak_gb": None, "verify_max_rel_diff": report.get("verify_max_rel_diff")}


def _stored(folder: str) -> str:
    """The dtype the saved pair's config names (float32 when it names none)."""
    cfg = json.loads((Path(folder) / "a" / "config.json").read_text())
    return cfg.get("dtype") or cfg.get("torch_dtype") or "float32"


def _tolerance(folder: str) -> float | None:
    """The verification's tolerance for the saved pair: the default (1e-4) for float32 files; 5e-2 for bfloat16
    ones, whose aligned tensors are rounded to bfloat16 (measured on the logits: ≈ 2e-3 relative on ``tiny``,
    1.7e-2 through the 16 layers of ``1b-32k``)."""
    return 5e-2 if _stored(folder) == "bfloat16" else None


def _command_inputs(folder: str, vocab: int, texts: int, length: int) -> Path:
    """What the command reads beside the saved pair: a word-level tokenizer in both folders (``w1`` … ``w999``, one
    token a word, ids below the model's vocabulary) and ``texts`` lines of ``length`` random words; the lines' path."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"[UNK]": 0, **{f"w{i}": i for i in range(1, min(vocab, 1000))}}
    for name in ("a", "b"):
        if not (Path(folder) / name / "tokenizer.json").exists():
            tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
            tok.pre_tokenizer = pre_tokenizers.Whitespace()
            PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[UNK]").save_pretrained(
                str(Path(folder) / name))
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, len(words), (texts, length), generator=g).tolist()
    lines = Path(folder) / f"lines_{texts}x{length}.txt"
    lines.write_text("".join(" ".join(f"w{i}" for i in row) + "\n" for row in ids))
    return lines


def one_command(size: str, folder: str, steps: int, texts: int, length: int, batch: int, precision: str,
                start: str, positions: int, layers: str | None = None) -> dict:
    """One size aligned by the command, ``symmerge align A B -o OUT --match learned --stream`` (learned from the
    files, the output written shard by shard and verified from the files), in this process: the row of :func:`one`
    (``write_verify_seconds``: the writing and the verification of the written output). ``layers``: the command's
    ``--layers`` (only those layers' groups solved and learned; every layer still read, run, written and verified)."""
    from symmerge.cli import main

    params = _folder_params(folder)
    lines = _command_inputs(folder, SHAPES[size][0], texts, length)
    out = Path(folder) / "aligned"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["align", str(Path(folder) / "a"), str(Path(folder) / "b"), "-o", str(out), "--match", "learned",
            "--stream", "--align-data", str(lines), "--align-samples", str(texts), "--learn-steps", str(steps),
            "--learn-batch", str(batch), "--learn-start", start, "--learn-max-length", str(length),
            "--learn-positions", str(positions), "--learn-precision", precision, "--progress", "lines",
            *(["--layers", layers] if layers else [])]
    base = rss_gb()
    t = time.perf_counter()
    if main(argv) != 0:
        raise SystemExit("the command failed")
    wall = time.perf_counter() - t
    report = json.loads((out / "symmerge_report.json").read_text())
    written = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    shutil.rmtree(out, ignore_errors=True)
    learned = report["learned"]
    stages = learned.get("seconds_by_stage", {})
    done = max(learned.get("steps", 0), 1)
    return {"size": size, "parameters": params, "device": "cpu", "precision": precision, "layerwise": True,
            "from_files": True, "command": True, "layers": layers or "all", "start": start, "start_peak_rss_gb": None, "texts": texts,
            "length": length, "batch": batch, "positions": positions, "steps": learned.get("steps"),
            "build_seconds": None, "align_seconds": wall,
            "closed_form_seconds": report["learned"]["closed_form_seconds"],
            "targets_seconds": stages.get("targets"), "checks_seconds": stages.get("checks"),
            "seconds_per_step": stages.get("steps", 0.0) / done, "write_verify_seconds": wall - report["match_seconds"],
            "written_gb": written / 1e9, "shards": len(report["shards"]), "peak_rss_gb": rss_gb(),
            "models_rss_gb": base, "cuda_peak_gb": None, "verify_max_rel_diff": report.get("verify_max_rel_diff")}


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _folder_params(folder: str) -> int:
    from safetensors import safe_open

    total = 0
    for f in sorted((Path(folder) / "a").glob("*.safetensors")):
        with safe_open(str(f), "pt") as handle:
            total += sum(_numel(handle.get_slice(k).get_shape()) for k in handle.keys())
    return total


def one(size: str, device: str, steps: int, texts: int, length: int, batch: int, precision: str,
        layerwise: bool = False, start: str = "activations") -> dict:
    from transformers import LlamaForCausalLM

    import symmerge.pipeline.learn as learn_module

    from symmerge.demo.lm import llama_config
    from symmerge.io.data import Batch, Data
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions, LearnSettings

    vocab, hidden, layers, heads, kv, inner = SHAPES[size]
    cfg = llama_config(vocab, context=max(length, 128), hidden=hidden, layers=layers, heads=heads, kv_heads=kv,
                       inner=inner, tie=True)
    t = time.perf_counter()
    torch.manual_seed(0)
    a = LlamaForCausalLM(cfg).eval()
    torch.manual_seed(1)
    b = LlamaForCausalLM(cfg).eval()
    build = time.perf_counter() - t
    params = sum(p.numel() for p in a.parameters())
    models_rss = rss_gb()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(1, vocab, (texts, length), generator=g)
    batches = [Batch({"input_ids": ids[i:i + batch], "attention_mask": torch.ones_like(ids[i:i + batch])}, None,
                     torch.ones_like(ids[i:i + batch], dtype=torch.bool)) for i in range(0, texts, batch)]
    data = Data(path="random tokens", format="lm", batches=batches, n=texts, labeled=False)
    learn = LearnSettings(steps=steps, batch=batch, augment=0, precision=precision, check_every=max(steps, 1),
                          layerwise=layerwise, start=start)
    start_peak = {}
    learn_alignment = learn_module.learn_alignment

    def timed(*args, **kwargs):  # the peak RSS of everything before learning: loading, the closed-form start
        start_peak["rss"] = rss_gb()
        return learn_alignment(*args, **kwargs)
    learn_module.learn_alignment = timed
    options = AlignOptions(symmetries="paper", match="learned", align_data=data, align_samples=texts, learn=learn,
                           device=device)  # the paper's set: the published figures' (AlignOptions' default then)
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    report = align_pair(a, b, options).report
    wall = time.perf_counter() - t
    learned = report.get("learned") or {}
    stages = learned.get("seconds_by_stage", {})
    done = max(learned.get("steps", 0), 1)
    return {"size": size, "parameters": params, "device": device, "precision": precision, "layerwise": layerwise,
            "start": start, "start_peak_rss_gb": start_peak.get("rss"), "texts": texts,
            "length": length, "batch": batch, "steps": learned.get("steps"), "build_seconds": build,
            "align_seconds": wall,
            # the closed form: activation matching before learning, or the data-free solve inside it (--start weights)
            "closed_form_seconds": (report.get("match_seconds") or 0.0) - (learned.get("seconds") or 0.0)
            + (learned.get("closed_form_seconds") or 0.0),
            "targets_seconds": stages.get("targets"), "checks_seconds": stages.get("checks"),
            "seconds_per_step": stages.get("steps", 0.0) / done, "peak_rss_gb": rss_gb(),
            "models_rss_gb": models_rss,
            "cuda_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if device != "cpu" else None,
            "verify_max_rel_diff": report.get("verify_max_rel_diff")}


def extrapolated(row: dict, full_steps: int) -> float:
    """Wall seconds of a full run: everything measured but the steps, plus ``full_steps`` steps."""
    return row["align_seconds"] - row["seconds_per_step"] * (row["steps"] or 0) + full_steps * row["seconds_per_step"]


def table(rows: list, full_steps: int) -> str:
    head = (f"{'size':>5} {'params':>8} {'dev':>5} {'path':>24} {'closed s':>8} {'targets s':>9} {'s/step':>7} "
            f"{'start GB':>8} {'peak RSS GB':>11} {'models GB':>9} {'CUDA GB':>7} {f'full ({full_steps}) min':>14}")
    lines = [head]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['size']:>5} {'':>8} {r['device']:>5} failed: {r['error']}")
            continue
        cuda = f"{r['cuda_peak_gb']:.1f}" if r["cuda_peak_gb"] is not None else "-"
        path = (f"{r.get('start', 'activations')}{'+layerwise' if r.get('layerwise') else ''}"
                f"{'+files' if r.get('from_files') else ''}{'+command' if r.get('command') else ''}")
        start = f"{r['start_peak_rss_gb']:.1f}" if r.get("start_peak_rss_gb") is not None else "-"
        lines.append(f"{r['size']:>5} {r['parameters'] / 1e6:>7.0f}M {r['device']:>5} {path:>24} "
                     f"{r['closed_form_seconds']:>8.1f} {r['targets_seconds']:>9.1f} {r['seconds_per_step']:>7.2f} "
                     f"{start:>8} {r['peak_rss_gb']:>11.1f} "
                     f"{r['models_rss_gb']:>9.1f} {cuda:>7} {extrapolated(r, full_steps) / 60:>14.1f}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.learned_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="135m", help=f"comma-separated, of {', '.join(SHAPES)} (default 135m)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--steps", type=int, default=5, help="learned steps measured (default 5)")
    p.add_argument("--full-steps", type=int, default=200, help="steps of the extrapolated full run (default 200)")
    p.add_argument("--texts", type=int, default=16, help="random token sequences (default 16)")
    p.add_argument("--length", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--precision", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--layerwise", action="store_true", help="layer-wise learned steps (LearnSettings.layerwise)")
    p.add_argument("--start", default="activations", choices=("activations", "weights", "none"),
                   help="the closed-form start (LearnSettings.start; default activations; none: the identity, "
                        "with --from-files only)")
    p.add_argument("--from-files", action="store_true",
                   help="save the pair first, then learn layer by layer from the files (learn_from_checkpoints)")
    p.add_argument("--command", action="store_true",
                   help="run the command instead, symmerge align A B -o OUT --match learned --stream (with --from-files; "
                        "the output written and removed; --start activations or weights)")
    p.add_argument("--layers", help="--from-files: only these layers' groups (e.g. 0: the activation start's time and peak for one "
                        "layer; with --command, the command's --layers); default all")
    p.add_argument("--positions", type=int, default=0,
                   help="scored positions per batch (LearnSettings.positions; 0: all)")
    p.add_argument("--work", help="--from-files: where the pair is saved (default: a temporary folder, removed)")
    p.add_argument("--save", help=argparse.SUPPRESS)
    p.add_argument("--stored", default="float32", choices=("float32", "bfloat16"),
                   help="--from-files: the dtype the pair is saved in (default float32)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--out", help="write results.json here (a new or empty folder)")
    args = p.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.save:
        save(args.save, args.work, args.length, args.stored)
        return 0
    if args.one and args.command:
        print(json.dumps(one_command(args.one, args.work, args.steps, args.texts, args.length, args.batch,
                                     args.precision, args.start, args.positions, args.layers)))
        return 0
    if args.one and args.from_files:
        print(json.dumps(one_from_files(args.one, args.work, args.steps, args.texts, args.length, args.batch,
                                        args.precision, args.start, args.positions, args.layers)))
        return 0
    if args.one:
        print(json.dumps(one(args.one, args.device, args.steps, args.texts, args.length, args.batch, args.precision,
                             args.layerwise, args.start)))
        return 0
    if args.start == "none" and not args.from_files:
        p.error("--start none needs --from-files")
    if args.command and (not args.from_files or args.start == "none"):
        p.error("--command needs --from-files and --start activations or weights")
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SHAPES]
    if unknown:
        p.error(f"unknown size(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    rows = []
    for size in sizes:
        cmd = [sys.executable, "-m", "benchmarks.learned_scale", "--one", size, "--device", args.device,
               "--steps", str(args.steps), "--texts", str(args.texts), "--length", str(args.length),
               "--batch", str(args.batch), "--precision", args.precision, "--threads", str(args.threads),
               "--start", args.start, *(["--layerwise"] if args.layerwise else [])]
        work = None
        if args.from_files:
            work = Path(args.work) / size if args.work else Path(tempfile.mkdtemp(prefix=f"learned_scale_{size}_"))
            if not (work / "b" / "config.json").exists():
                saved = subprocess.run([sys.executable, "-m", "benchmarks.learned_scale", "--save", size, "--work",
                                        str(work), "--length", str(args.length), "--stored", args.stored],
                                       capture_output=True, text=True)
                if saved.returncode:
                    rows.append({"size": size, "device": args.device,
                                 "error": (saved.stderr.strip().splitlines() or ["no output"])[-1][-200:]})
                    if not args.work:
                        shutil.rmtree(work, ignore_errors=True)
                    continue
            cmd += ["--from-files", "--work", str(work), "--positions", str(args.positions)]
            cmd += (["--command"] if args.command else []) + (["--layers", args.layers] if args.layers else [])
        done = subprocess.run(cmd, capture_output=True, text=True)
        if work is not None and not args.work:
            shutil.rmtree(work, ignore_errors=True)
        if done.returncode:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            rows.append({"size": size, "device": args.device, "error": tail[-200:]})
        else:
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    print(table(rows, args.full_steps))
    if args.out:
        out = Path(args.out)
        if out.exists() and any(out.iterdir()):
            p.error(f"--out {out} is not empty")
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps({"rows": rows, "full_steps": args.full_steps,
                                                      "argv": sys.argv[1:]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
