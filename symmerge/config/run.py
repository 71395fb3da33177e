"""Run a described config: each mergekit job in dependency order (intermediates of a multi-document file
in a temporary folder beside the output, removed at the end), or the symmerge command line."""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from ..errors import SymmergeError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def run_jobs(desc, shard_size="5GB", device="cpu") -> list[dict]:
    """Every job of ``desc`` (a mergekit config); the final one written to ``desc.output``. Returns one
    summary dict per job."""
    from ..io.model import ensure_output_dir

    out = Path(desc.output)
    ensure_output_dir(out)
    temp = None
    folders: list[Path] = []
    summaries = []
    try:
        for job in desc.jobs:
            if job.final:
                target = out
            else:
                if temp is None:
                    out.parent.mkdir(parents=True, exist_ok=True)
                    temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.intermediates-", dir=out.parent))
                target = temp / job.name
            inputs = [Path(i.folder) if i.folder is not None else folders[i.job] for i in job.inputs]
            t0 = time.perf_counter()
            execute(job, inputs, target, shard_size=shard_size, device=device)
            folders.append(target)
            summaries.append({"name": job.name, "method": job.method, "tensors": len(job.steps),
                              "layers": job.layers, "output": str(target), "seconds": time.perf_counter() - t0})
    finally:
        if temp is not None:
            shutil.rmtree(temp, ignore_errors=True)
    return summaries


def execute(job, inputs, out, shard_size="5GB", device="cpu") -> None:
    """One job: its steps read from ``inputs`` (folders), merged and written to ``out`` with the source's
    config.json (plus the job's edits) and side files."""
    from ..io.checkpoint import LazyCheckpoint, parse_size
    from ..io.model import atomic_dir, copy_side_files, write_json
    from ..merge import get_method
    from ..merge.base import merge_tensor
    from ..merge.steps import step_arguments
    from safetensors.torch import save_file

    method = get_method(job.method) if any(st.merge for st in job.steps) else None
    ckpts = {}

    def ckpt(i):
        if i not in ckpts:
            ckpts[i] = LazyCheckpoint(inputs[i], spec=False)
        return ckpts[i]

    compute = DTYPES.get(job.dtype) if job.dtype else None
    final = DTYPES.get(job.out_dtype or job.dtype) if (job.out_dtype or job.dtype) else None
    donor = ckpt(job.config_from)
    cache: dict = {}
    limit = parse_size(shard_size)
    with atomic_dir(out) as tmp:
        shards, current, size = [], {}, 0
        for step in job.steps:
            def read(src):
                t = ckpt(src.model).read([src.key])[src.key]
                return t.to(compute) if compute is not None and t.is_floating_point() else t

            tensors = [read(s) for s in step.sources]
            if not step.merge:
                value = tensors[0]
            else:
                base = read(step.base) if step.base is not None else None
                weights, params = step_arguments(method, step, len(step.sources), cache)
                context = None
                if method.prepare is not None:
                    sd = [{step.name: t} for t in tensors]
                    context = method.prepare(sd, None if base is None else {step.name: base}, weights, params)
                value = merge_tensor(method, step.name, tensors, weights, None, base, params, context)
            if final is not None and value.is_floating_point():
                value = value.to(final)
            for name, t in donor.to_disk(step.name, value.contiguous()):
                nbytes = t.numel() * t.element_size()
                if current and size + nbytes > limit:
                    shards.append(current)
                    current, size = {}, 0
                current[name] = t.contiguous()
                size += nbytes
        if current:
            shards.append(current)
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata={"format": "pt"})
        else:
            index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for s in shards for t in s.values())},
                     "weight_map": {}}
            for i, s in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file(s, str(tmp / name), metadata={"format": "pt"})
                index["weight_map"].update({k: name for k in s})
            write_json(tmp / "model.safetensors.index.json", index)
        config = json.loads((Path(inputs[job.config_from]) / "config.json").read_text())
        config.update(job.config_edits)
        write_json(tmp / "config.json", config)
        copy_side_files(Path(inputs[job.side_files_from]), tmp)
        if job.chat_template is not None:
            write_chat_template(tmp, job.chat_template, [Path(p) for p in inputs])


def write_chat_template(folder: Path, template: str, inputs) -> None:
    """The output's chat template: ``template``, or with ``auto`` the most common one of the inputs (none:
    left as copied)."""
    from collections import Counter

    if template == "auto":
        found = [t for t in (read_chat_template(p) for p in inputs) if t]
        if not found:
            return
        template = Counter(t.strip() for t in found).most_common(1)[0][0]
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        data = json.loads(cfg.read_text())
        if "chat_template" in data:
            data.pop("chat_template")
            cfg.write_text(json.dumps(data, indent=2) + "\n")
    (folder / "chat_template.json").unlink(missing_ok=True)
    (folder / "chat_template.jinja").write_text(template)


def read_chat_template(folder: Path) -> str | None:
    f = folder / "chat_template.jinja"
    if f.is_file():
        return f.read_text()
    cfg = folder / "tokenizer_config.json"
    if cfg.is_file():
        t = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(t, dict):
            t = t.get("default")
        if isinstance(t, list):
            t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
        return t if isinstance(t, str) else None
    return None


def print_summary(desc, summaries) -> None:
    for s in summaries:
        where = "intermediate " + s["name"] if s["output"] != str(desc.output) else str(desc.output)
        print(f"merged {s['tensors']} tensors ({s['layers']} layers) with {s['method']} -> {where} "
              f"({s['seconds']:.2f} s)")


__all__ = ["execute", "print_summary", "run_jobs"]
