"""Streamed alignment of a mixture of experts: memory bounded by about one layer.

    python -m benchmarks.bench_moe_streaming [--dir /tmp/symmerge-bench-moe-streaming] [--json out.json] [--small]

Two random bf16 Mixtral checkpoints written as ``save_pretrained`` writes them (one tensor per expert:
``block_sparse_moe.experts.{e}.w1/w2/w3.weight``), default hidden 1024, 8 layers, 8 experts of 1024
units, 16 heads (4 KV heads), vocab 32000: 0.29 B parameters, 0.58 GB per checkpoint. Each step in its
own process (peak RSS from VmHWM, :func:`benchmarks.bench_streaming.run_measured`):

* the interpreter with torch, transformers and symmerge imported (the floor);
* ``align --stream`` (``attn,ffn,rescale,experts``; the experts read as virtual fused tensors stacked from
  their per-expert tensors, written back split), low-memory mode: wall seconds, peak RSS, the largest
  layer (both models' experts, A's moved copy and its split copies are in memory at once: what the
  experts add to the peak over the next step's, in largest layers, is printed);
* the same with ``attn`` only (the experts copied through: stacked on read, split on write), which tells
  the experts' part of the peak from the rest (the embeddings and head copied through, read from both
  models for the distance);
* ``align`` in memory, the same symmetries, for comparison (both models loaded; ``--no-verify``: the
  streamed path checks each element, and the bf16 forward of a random mixture of experts flips top-k
  choices by rounding).

Checkpoints are generated once into ``--dir`` and reused. ``--small``: a 2-layer toy (seconds).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from benchmarks.bench_streaming import run_measured, write_random

LARGE = dict(hidden_size=1024, num_hidden_layers=8, intermediate_size=1024, num_local_experts=8,
             num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
SMALL = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=64, num_local_experts=4,
             num_attention_heads=4, num_key_value_heads=2, vocab_size=500)
SYMMETRIES = "attn,ffn,rescale,experts"


def generate(folder: Path, dims: dict, seed: int, shard: str) -> dict:
    """A random bf16 MixtralForCausalLM checkpoint under the names save_pretrained writes, tensor by tensor."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    config = MixtralConfig(**dims, tie_word_embeddings=False, max_position_embeddings=2048, dtype="bfloat16",
                           architectures=["MixtralForCausalLM"])
    with torch.device("meta"):
        model = MixtralForCausalLM(config)
        shapes = {k: tuple(v.shape) for k, v in revert_weight_conversion(model, model.state_dict()).items()}
    return write_random(folder, config, shapes, seed, shard, norm_std=0.02)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_moe_streaming", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/symmerge-bench-moe-streaming")
    p.add_argument("--small", action="store_true")
    p.add_argument("--shard-size", default="300MB")
    p.add_argument("--json")
    p.add_argument("--modes", default="stream,stream_attn_only,memory",
                   help="steps to measure (default: stream,stream_attn_only,memory)")
    args = p.parse_args(argv)
    dims = SMALL if args.small else LARGE
    root = Path(args.dir) / ("small" if args.small else "large")
    a_dir, b_dir, out = root / "a", root / "b", root / "aligned"
    tag = root / "dims.json"
    if not tag.is_file() or json.loads(tag.read_text()) != dims:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        info = generate(a_dir, dims, 0, args.shard_size)
        generate(b_dir, dims, 1, args.shard_size)
        tag.write_text(json.dumps(dims))
        print(f"generated two checkpoints of {info['parameters'] / 1e9:.3f} B parameters", flush=True)
    file_gb = sum(f.stat().st_size for f in a_dir.glob("*.safetensors")) / 1e9
    _, floor, _ = run_measured(["imports"])
    figures = {"model": {**dims, "checkpoint_gb": file_gb, "dtype": "bfloat16"}, "imports_rss_gb": floor}
    stream = ["--stream", "--shard-size", args.shard_size]
    steps = {"stream": (SYMMETRIES, stream), "stream_attn_only": ("attn", stream),
             "memory": (SYMMETRIES, ["--no-verify"])}
    for mode in args.modes.split(","):
        symmetries, extra = steps[mode]
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        wall, rss, _ = run_measured(["cli", "align", str(a_dir), str(b_dir), "-o", str(out), "--symmetries",
                                     symmetries, "--progress", "none", *extra])
        report = json.loads((out / "symmerge_report.json").read_text())
        figures[mode] = {"wall_s": wall, "align_s": report["seconds"], "peak_rss_gb": rss,
                         "distance_before": report["distance_before"], "distance_after": report["distance_after"]}
        if mode.startswith("stream"):
            largest = report["largest_layer_bytes"] / 1e9
            names = {k for f in out.glob("*.safetensors") for k in _names(f)}
            figures[mode].update(largest_layer_gb=largest,
                                 per_expert_names_kept=names == {k for f in a_dir.glob("*.safetensors") for k in _names(f)})
        print(f"{mode}: {wall:.1f} s, peak RSS {rss:.3f} GB ({time.perf_counter() - t:.0f} s)", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    if "stream" in figures and "stream_attn_only" in figures:  # what matching the experts adds to the peak
        extra = figures["stream"]["peak_rss_gb"] - figures["stream_attn_only"]["peak_rss_gb"]
        figures["experts_peak_over_attn_only_gb"] = extra
        figures["experts_peak_in_largest_layers"] = extra / figures["stream"]["largest_layer_gb"]
    if "stream" in figures and "memory" in figures:
        figures["stream_over_memory_peak"] = figures["stream"]["peak_rss_gb"] / figures["memory"]["peak_rss_gb"]
    for k, v in figures.items():
        print(f"{k}: {json.dumps(v)}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


def _names(file: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(file), "pt") as h:
        return list(h.keys())


if __name__ == "__main__":
    sys.exit(main())
