"""Opening a checkpoint of many shards, each safetensors header read once (``io.model.safetensors_headers``) against
the code before (``--before``, a commit: its ``symmerge/io/checkpoint.py`` loaded beside this one as a module of the
package, reading each header 3 times at open and a 4th at a file's first direct read). A tiny Llama saved with one
tensor per shard (``--layers`` 28: 207 shards); each repetition times, in both versions in turn (the order rotating),
``LazyCheckpoint(folder)`` (open) and open plus one ``read_direct`` of a tensor in the last shard (the offsets cache of
each version emptied first), after one unmeasured open of each (the tensor-name cache warm). Printed: the median and
least seconds of each and the ratio of the medians; the load average before and after, with ``--json`` the raw times.

    python -m benchmarks.headers_once --repeat 15 --json docs/results/headers_once/run.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine

ROOT = Path(__file__).resolve().parents[1]


def before_module(rev: str, source: str = "symmerge/io/checkpoint.py"):
    """The module ``source`` at ``rev`` (default ``symmerge/io/checkpoint.py``), loaded beside this checkout's as
    ``<its name>_before`` (``symmerge.io.checkpoint_before``; its relative imports resolve in this checkout's
    package)."""
    text = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:{source}"], check=True,
                          capture_output=True, text=True).stdout
    stem = Path(source).stem
    path = Path(tempfile.mkdtemp(prefix="headers-once-")) / f"{stem}_before.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(source[:-3].replace("/", ".") + "_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def both_versions(rev: str) -> dict:
    """``{"after": this checkout's symmerge.io.checkpoint, "before": rev's}`` (:func:`before_module`), with one torch
    thread."""
    torch.set_num_threads(1)
    from symmerge.io import checkpoint

    return {"after": checkpoint, "before": before_module(rev)}


def alternating(names: list, repeat: int):
    """``(repetition, name)`` for every repetition and name, the first name of each repetition rotating."""
    for i in range(repeat):
        for name in names[i % 2:] + names[:i % 2]:
            yield i, name


def make_checkpoint(folder: Path, layers: int) -> int:
    """A tiny Llama of ``layers`` layers saved one tensor per shard; returns the number of shards."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
                         max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(str(folder), max_shard_size="1KB")
    return len(list(folder.glob("*.safetensors")))


def timed(module, folder: Path, read: bool) -> float:
    module._OFFSETS.clear()
    start = time.perf_counter()
    ck = module.LazyCheckpoint(folder, spec=False)
    if read:
        key = max(ck.keys(), key=lambda k: str(ck.file_of[k]))
        ck.read_direct(key)
    return time.perf_counter() - start


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default="d41bcf4", help="the commit whose checkpoint.py is 'before'")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    versions = both_versions(args.before)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "m"
        shards = make_checkpoint(folder, args.layers)
        for module in versions.values():
            timed(module, folder, True)
        times = {f"{v}_{what}": [] for v in versions for what in ("open", "open_read")}
        for _, v in alternating(list(versions), args.repeat):
            times[f"{v}_open"].append(timed(versions[v], folder, False))
            times[f"{v}_open_read"].append(timed(versions[v], folder, True))
    result = {"shards": shards, "before": args.before, "repeat": args.repeat, "load_average_before": load_before,
              "load_average_after": os.getloadavg(), "machine": machine(), "seconds": times}
    print(f"{shards} shards, {args.repeat} repetitions, load average {load_before} before, "
          f"{result['load_average_after']} after")
    for what in ("open", "open_read"):
        b, a = times[f"before_{what}"], times[f"after_{what}"]
        print(f"{what:9s}  before: median {statistics.median(b):.4f} s, least {min(b):.4f} s   after: median "
              f"{statistics.median(a):.4f} s, least {min(a):.4f} s   after/before (medians) "
              f"{statistics.median(a) / statistics.median(b):.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
