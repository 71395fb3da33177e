"""Streaming alignment at scale: two random Llama-architecture checkpoints (bf16 safetensors shards),
the first aligned to the second with ``symmerge align --stream``.

    python -m benchmarks.bench_streaming [--dir /tmp/symmerge-bench-streaming] [--json out.json] [--small]

Default size: hidden 3200, 26 layers, FFN 8640, 32 heads, vocab 32000 (OpenLLaMA-3B's shape): 3.43 B
parameters, 6.9 GB per checkpoint. Prints, each step in its own process (peak RSS from ``wait4``):

* ``wall_s`` / ``peak_rss_gb``: the streaming alignment (attn, ffn, rescale), end to end, in the default
  low-memory mode and (under ``modes``) with ``--pipeline``;
* ``read_write_s``: merely reading both checkpoints' tensors layer by layer and writing one of them
  back as shards (the I/O floor);
* ``compute_s``: the same matching (heads, FFN cost GEMMs, assignments, unit scales, application) on
  tensors already in memory, one layer at a time, summed;
* the goals: peak RSS ≤ 2 × largest layer + 1 GB, wall ≤ 1.3 × max(read_write, compute), and where the
  streaming time goes (per-stage seconds from the report; the stages run concurrently).

Checkpoints are generated once into ``--dir`` and reused (``--fresh`` regenerates them). ``--small``
runs the same pipeline on a 2-layer toy (seconds; the smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import peak_rss_kb

LARGE = dict(hidden_size=3200, num_hidden_layers=26, intermediate_size=8640, num_attention_heads=32,
             num_key_value_heads=32, vocab_size=32000)
# the workload of every figure in docs/results.md, named explicitly since `align` defaults to
# `recommended` (which adds the head permutation: 32 × 32 head pairs per layer to score)
SYMMETRIES = "attn,ffn,rescale"
SMALL = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=344, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=1000)


def generate(folder: Path, dims: dict, seed: int, shard: str) -> dict:
    """A random bf16 LlamaForCausalLM checkpoint written tensor by tensor (never a whole model in memory)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**dims, tie_word_embeddings=False, max_position_embeddings=2048, dtype="bfloat16",
                         architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(config).state_dict().items()}
    return write_random(folder, config, shapes, seed, shard, norm_std=0.1)


def write_random(folder: Path, config, shapes: dict, seed: int, shard: str, norm_std: float) -> dict:
    """Random bf16 tensors of ``shapes`` (in order; norm weights 1 + norm_std·N(0, 1), the rest 0.02·N(0, 1))
    written into ``folder`` shard by shard, atomically, with ``config``; the parameter count."""
    from symmerge.io.checkpoint import ShardWriter, parse_size
    from symmerge.io.model import atomic_dir

    g = torch.Generator().manual_seed(seed)
    n = 0
    with atomic_dir(folder) as tmp:
        w = ShardWriter(tmp, parse_size(shard))
        for k, shape in shapes.items():
            if k.endswith("norm.weight"):
                t = (1 + norm_std * torch.randn(shape, generator=g)).to(torch.bfloat16)
            else:
                t = (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
            n += t.numel()
            w.add(k, t)
            del t
        w.close()
        config.save_pretrained(str(tmp))
    return {"parameters": n}


def peak_rss_gb() -> float:
    """This process's own peak RSS in GiB (:func:`benchmarks.common.peak_rss_kb`: the checkpoint generator drives
    a parent's peak up, which a child's ru_maxrss would start at)."""
    kb = peak_rss_kb()
    return float("nan") if kb is None else kb / 2 ** 20


def run_measured(args: list[str]) -> tuple[float, float, str]:
    """Run a child step (``--child ...``); returns (wall seconds, its peak RSS in GB, stdout). The
    child prints its VmHWM as the last line."""
    t = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench_streaming", "--child", *args],
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(args)} failed ({p.returncode}):\n{p.stdout[-3000:]}")
    lines = p.stdout.strip().splitlines()
    return wall, json.loads(lines[-1])["peak_rss_gb"], "\n".join(lines[:-1])


def child(argv: list[str]) -> None:
    """``--child STEP ARGS...``: one measured step, then its peak RSS as a JSON line."""
    step, rest = argv[0], argv[1:]
    if step == "read_write":
        child_read_write(*rest)
    elif step == "compute":
        child_compute(*rest)
    elif step == "cli":
        from symmerge.cli import main as cli_main

        if cli_main(rest) != 0:
            raise SystemExit(1)
    elif step == "imports":
        import symmerge.cli  # noqa: F401
        import symmerge.pipeline.stream  # noqa: F401
        import transformers  # noqa: F401
    print(json.dumps({"peak_rss_gb": peak_rss_gb()}))


# ------------------------------------------------------------ child steps (run in their own process)

def child_read_write(model: str, anchor: str, out: str, shard: str) -> None:
    """Read both checkpoints layer by layer, write the first back: the I/O the alignment must do."""
    from symmerge.io.checkpoint import LazyCheckpoint, ShardWriter, parse_size
    from symmerge.io.model import atomic_dir

    from symmerge.pipeline.stream import layer_instances

    a, b = LazyCheckpoint(model), LazyCheckpoint(anchor)
    t = time.perf_counter()
    _, by_layer = layer_instances(a)
    touched = {s.key for insts in by_layer.values() for i in insts for s in i.slots}
    groups = [[k] for k in a.keys() if k not in touched]
    groups += [sorted({s.key for i in insts for s in i.slots}) for _, insts in sorted(by_layer.items())]
    with atomic_dir(out) as tmp:
        w = ShardWriter(tmp, parse_size(shard))
        for keys in groups:
            sa, _ = a.read(keys), b.read(keys)
            for k in keys:
                w.add(a.disk_name[k], sa[k])
            del sa, _
        w.close()
    print(json.dumps({"read_write_s": time.perf_counter() - t}))


def child_compute(model: str, anchor: str) -> None:
    """The matching of every layer on tensors already in memory (reads not timed), one layer at a time,
    through the same engine as the streamed alignment."""
    from collections import defaultdict

    from symmerge.core.apply import apply
    from symmerge.io.checkpoint import LazyCheckpoint
    from symmerge.pipeline.engine import solve_local
    from symmerge.pipeline.options import AlignOptions
    from symmerge.pipeline.stream import layer_instances

    opts = AlignOptions(symmetries=tuple(SYMMETRIES.split(","))).solver_options()
    a, b = LazyCheckpoint(model), LazyCheckpoint(anchor)
    parts: dict = defaultdict(float)
    for layer, insts in layer_instances(a, opts=opts)[1].items():
        keys = sorted({s.key for i in insts for s in i.slots})
        sa, sb = a.read(keys), b.read(keys)
        elements = solve_local(insts, sa, sb, opts, timings=parts)
        t0 = time.perf_counter()
        apply(sa, insts, elements)
        parts["apply"] += time.perf_counter() - t0
        del sa, sb, elements
    print(json.dumps({"compute_s": sum(parts.values()), "compute_parts": dict(parts)}))


# ------------------------------------------------------------ driver

def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["--child"]:
        child(argv[1:])
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_streaming", description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/symmerge-bench-streaming", help="where the checkpoints are generated")
    p.add_argument("--small", action="store_true", help="a 2-layer toy instead of the 3.4 B model (smoke test)")
    p.add_argument("--fresh", action="store_true", help="regenerate the checkpoints")
    p.add_argument("--shard-size", default="500MB", help="shard size of the inputs and the output (default 500MB; "
                   "the writer holds up to one shard in memory)")
    p.add_argument("--modes", default="low-memory,pipeline",
                   help="streaming modes to measure, the first one being the headline (default: low-memory,pipeline; "
                        "pipeline adds --pipeline)")
    p.add_argument("--json", help="also write the figures to this JSON file")
    p.add_argument("--floors", metavar="JSON", help="reuse read_write_s and compute_s from an earlier --json of the "
                   "same checkpoints; only the streamed alignment is measured")
    args = p.parse_args(argv)

    import shutil

    from symmerge.io.checkpoint import LazyCheckpoint

    dims = SMALL if args.small else LARGE
    root = Path(args.dir) / ("small" if args.small else "large")
    a_dir, b_dir, out, copy = root / "a", root / "b", root / "aligned", root / "copy"
    tag = root / "dims.json"
    if args.fresh or not tag.is_file() or json.loads(tag.read_text()) != dims:
        shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True)
        t = time.perf_counter()
        info = generate(a_dir, dims, 0, args.shard_size)
        generate(b_dir, dims, 1, args.shard_size)
        tag.write_text(json.dumps(dims))
        print(f"generated two checkpoints of {info['parameters'] / 1e9:.2f} B parameters in "
              f"{time.perf_counter() - t:.0f} s", flush=True)
    for d in (out, copy):
        shutil.rmtree(d, ignore_errors=True)
    ck = LazyCheckpoint(a_dir)
    n_params = sum(ck.nbytes(k) for k in ck.keys()) // 2
    file_bytes = sum(f.stat().st_size for f in a_dir.glob("*.safetensors"))
    _, base_rss, _ = run_measured(["imports"])
    if args.floors:
        old = json.loads(Path(args.floors).read_text())
        read_write, rw_rss = old["read_write_s"], old.get("read_write_peak_rss_gb")
        compute = {"compute_s": old["compute_s"], "compute_parts": old["compute_parts_s"]}
        c_rss = old.get("compute_peak_rss_gb")
    else:
        _, rw_rss, rw_out = run_measured(["read_write", str(a_dir), str(b_dir), str(copy), args.shard_size])
        read_write = json.loads(rw_out.strip().splitlines()[-1])["read_write_s"]
        shutil.rmtree(copy, ignore_errors=True)
        print(f"read + write: {read_write:.1f} s", flush=True)
        _, c_rss, c_out = run_measured(["compute", str(a_dir), str(b_dir)])
        compute = json.loads(c_out.strip().splitlines()[-1])
        print(f"compute on in-memory tensors: {compute['compute_s']:.1f} s", flush=True)
    floor = max(read_write, compute["compute_s"])
    modes = {}
    for mode in args.modes.split(","):
        extra = ["--pipeline"] if mode == "pipeline" else []
        s_wall, s_rss, _ = run_measured(["cli", "align", str(a_dir), str(b_dir), "-o", str(out), "--stream",
                                         "--symmetries", SYMMETRIES, "--shard-size", args.shard_size, *extra])
        report = json.loads((out / "symmerge_report.json").read_text())
        shutil.rmtree(out, ignore_errors=True)
        largest = report["largest_layer_bytes"] / 1e9
        modes[mode] = {
            "wall_s": s_wall, "align_s": report["seconds"], "peak_rss_gb": s_rss,
            "rss_ratio_to_goal": s_rss / (2 * largest + 1), "wall_over_max_rw_compute": report["seconds"] / floor,
            "stream_stage_s": report["timings"], "distance_before": report["distance_before"],
            "distance_after": report["distance_after"], "shards": len(report["shards"]),
        }
        print(f"{mode}: {report['seconds']:.1f} s, peak RSS {s_rss:.2f} GB", flush=True)
    main_mode = next(iter(modes))
    figures = {
        "model": {**dims, "parameters_b": n_params / 1e9, "checkpoint_gb": file_bytes / 1e9, "dtype": "bfloat16"},
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "mode": main_mode, **modes[main_mode], "python_torch_import_rss_gb": base_rss,
        "largest_layer_gb": largest, "rss_goal_gb": 2 * largest + 1, "wall_goal_ratio": 1.3,
        "read_write_s": read_write, "read_write_peak_rss_gb": rw_rss, "compute_s": compute["compute_s"],
        "compute_parts_s": compute["compute_parts"], "compute_peak_rss_gb": c_rss, "modes": modes,
    }
    for k, v in figures.items():
        print(f"{k}: {json.dumps(v) if isinstance(v, dict) else (f'{v:.3f}' if isinstance(v, float) else v)}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
