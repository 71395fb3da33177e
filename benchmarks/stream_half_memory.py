"""Peak memory of a streamed half-precision alignment, part by part (``align --stream``, low memory).

    python -m benchmarks.stream_half_memory [--dir /tmp/symmerge-stream-half] [--json FILE] [--slice]

Two random bf16 Llama checkpoints (hidden 1024, 4 layers, FFN 4096, 16 heads, vocab 32 000: 0.13 B parameters,
0.27 GB each; :func:`benchmarks.bench_streaming.generate`, reused from ``--dir``) are aligned with
``align_streaming`` (attn, ffn, rescale) in a child process with one torch thread. The child resets its peak
resident set (``/proc/self/clear_refs``, 5) before and after every phase and reads it (VmHWM) at its end, so each
phase's peak is its own: ``cost`` (an FFN part's cost matrix and assignment, from on-demand reads), ``ffn part``
(the FFN part read whole, solved, applied, its distances) and ``attention part``; ``rest`` is everything between
(copying the untouched tensors, the headers, writing). The whole run's peak is the largest of them. Run it on the
code before and after a change (``PYTHONPATH=<other tree>``) to see what the change costs.

``--slice``: instead, three layers of :mod:`benchmarks.bench_streaming`'s 3.4 B shape (hidden 3200, FFN 8640, 32
heads, vocab 32 000: 0.58 B parameters, 1.15 GB each, in ``--dir``/slice): the parts' peaks at the size whose
whole run the README quotes, in about 90 s.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

DIMS = dict(hidden_size=1024, num_hidden_layers=4, intermediate_size=4096, num_attention_heads=16,
            num_key_value_heads=16, vocab_size=32000)


def _hwm_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def _reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def child(model: str, anchor: str, out: str) -> dict:
    """The alignment in this process, every phase's own peak RSS (MB)."""
    import torch

    torch.set_num_threads(1)
    import symmerge.pipeline.stream as stream
    from symmerge.pipeline.options import AlignOptions

    peaks: dict = defaultdict(float)

    def phase(name, fn):
        def run(*args, **kwargs):
            peaks["rest"] = max(peaks["rest"], _hwm_mb())
            _reset()
            try:
                return fn(*args, **kwargs)
            finally:
                label = name(args) if callable(name) else name
                peaks[label] = max(peaks[label], _hwm_mb())
                _reset()
        return run

    ffn = lambda args: "ffn part" if any(i.kind.streams_costs for i in args[1]) else "attention part"  # noqa: E731
    stream.prepare_costly = phase("cost", stream.prepare_costly)
    stream._Job.__call__ = phase(ffn, stream._Job.__call__)
    t0 = time.perf_counter()
    stream.align_streaming(model, anchor, out, AlignOptions(symmetries=("attn", "ffn", "rescale")), progress=False)
    peaks["rest"] = max(peaks["rest"], _hwm_mb())
    return {"code": str(Path(stream.__file__).resolve()), "seconds": time.perf_counter() - t0,
            "peak_mb": {k: round(v, 1) for k, v in sorted(peaks.items())}, "overall_peak_mb": round(max(peaks.values()), 1)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/symmerge-stream-half")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--slice", action="store_true", help="three layers of the 3.4 B shape instead")
    p.add_argument("--child", nargs=3, metavar=("MODEL", "ANCHOR", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    from benchmarks.bench_streaming import LARGE, generate

    root, dims = Path(args.dir), DIMS
    if args.slice:
        root, dims = root / "slice", {**LARGE, "num_hidden_layers": 3}
    for name, seed in (("a", 0), ("b", 1)):
        if not (root / name / "config.json").exists():
            print(name, generate(root / name, dims, seed, "500MB" if args.slice else "100MB"), flush=True)
    out = root / "out"
    if out.exists():
        import shutil

        shutil.rmtree(out)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.stream_half_memory", "--child", str(root / "a"),
                           str(root / "b"), str(out)], stdout=subprocess.PIPE, text=True, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["dims"] = dims
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
