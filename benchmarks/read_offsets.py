"""A streamed align's reads, ``LazyCheckpoint.read`` at the byte offsets known since the checkpoint was opened (each
header parsed once), against the code before (``--before``, a commit: its ``symmerge/io/checkpoint.py`` loaded beside
this one, :func:`benchmarks.headers_once.before_module`, whose ``read`` opened every file with ``safe_open`` at every
call: its header parsed again, the file mapped, each tensor cloned). A random Llama (``--hidden``, ``--layers``, FFN
4× hidden, vocabulary 32 000, float32) saved in shards of ``--shard``; each repetition reads, in both versions in turn
(the order alternating), every layer's tensors one ``read`` per layer (as ``pipeline.stream.align_streaming`` reads
them), then the rest (embeddings, norm, head), from a checkpoint opened before (not timed; the files in the page
cache after one unmeasured pass). Printed: the median and least seconds of each version and the ratio of the medians;
``--json``: the raw times.

    python -m benchmarks.read_offsets --repeat 9 --json docs/results/read_offsets.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine
from benchmarks.headers_once import alternating, both_versions


def make_checkpoint(folder: Path, hidden: int, layers: int, shard: str) -> int:
    """The random Llama saved in shards of ``shard``; returns the number of shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 64),
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(str(folder), max_shard_size=shard)
    return len(list(folder.glob("*.safetensors")))


def groups(ck) -> list[list[str]]:
    """The checkpoint's tensors as a streamed align reads them: each layer's at once, then the rest."""
    by_layer: dict = {}
    for k in ck.keys():
        parts = k.split(".")
        layer = int(parts[2]) if parts[:2] == ["model", "layers"] else None
        by_layer.setdefault(layer, []).append(k)
    return [v for k, v in sorted(by_layer.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))]


def timed(ck, reads) -> float:
    start = time.perf_counter()
    for keys in reads:
        ck.read(keys)
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="efc6e43", help="the commit whose checkpoint.py is 'before'")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--shard", default="20MB", help="the shards' size (save_pretrained's max_shard_size)")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    modules = both_versions(args.before)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "m"
        shards = make_checkpoint(folder, args.hidden, args.layers, args.shard)
        cks = {v: m.LazyCheckpoint(folder, spec=False) for v, m in modules.items()}
        reads = groups(cks["after"])
        for ck in cks.values():
            timed(ck, reads)
        times = {v: [] for v in modules}
        for _, v in alternating(list(modules), args.repeat):
            times[v].append(timed(cks[v], reads))
        nbytes = sum(cks["after"].nbytes(k) for k in cks["after"].keys())
    result = {"shards": shards, "bytes": nbytes, "reads": len(reads), "before": args.before, "hidden": args.hidden,
              "layers": args.layers, "shard": args.shard, "repeat": args.repeat, "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "machine": machine(), "seconds": times}
    b, a = times["before"], times["after"]
    print(f"{shards} shards, {nbytes / 1e6:.0f} MB in {len(reads)} reads, {args.repeat} repetitions, load average "
          f"{load_before[0]:.2f} before, {result['load_average_after'][0]:.2f} after")
    print(f"before: median {statistics.median(b):.4f} s, least {min(b):.4f} s   after: median {statistics.median(a):.4f} "
          f"s, least {min(a):.4f} s   after/before (medians) {statistics.median(a) / statistics.median(b):.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
