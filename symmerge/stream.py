"""Streaming alignment: checkpoints larger than memory, aligned layer by layer.

Neither model is ever loaded whole. The spec is resolved against the safetensors headers; then a
three-stage pipeline runs over the layers:

1. a reader thread reads layer ``i + 1`` of the model and of the anchor (``safe_open``) while
2. the main thread solves layer ``i``'s head groups (batched SVD) and computes its FFN cost matrices
   (GEMMs, on ``device``), and a worker thread finishes layer ``i - 1``: its linear assignments
   (scipy, single-threaded — so it overlaps the next layer's GEMMs), unit scales, the application of
   the group elements and their validity check; and
3. a writer thread writes the aligned tensors into bounded safetensors shards.

Every queue holds at most one layer, so memory is a few layers' worth whatever the depth (the reader stays one layer ahead). Tensors no
group touches (embeddings, norms, heads) are copied through one by one. The per-layer symmetries
(attn, ffn, rescale) are supported; the residual symmetry couples every layer and is refused here.
The equivalence check is per group element (orthogonal, finite, positive or non-zero scales,
bijective permutations: each such element preserves the function exactly — the in-memory tests
prove that for every spec); ``verify_forward`` additionally loads both models afterwards and
compares their outputs, for checkpoints that fit in memory.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .apply import HeadElement, PermElement, apply
from .checkpoint import LazyCheckpoint, ShardWriter, check_same_layout, parse_size
from .distance import sq_distance
from .errors import SymmergeError
from .io import atomic_dir, copy_side_files, write_json
from .resolve import config_sizes, resolve
from .solve import RESCALE_MODES, permutation_cost, permutation_plan, solve_local, unit_scales
from .solvers.assignment import match_permutation
from .spec import PERMUTATION, spec_for

DEFAULT_SHARD = "1GB"


class _Config:
    """Attribute view of a config.json dict (what ``config_sizes`` reads)."""

    def __init__(self, d: dict):
        self.__dict__.update(d)


def check_element(name: str, element, tol: float = 1e-6) -> None:
    """Raise unless ``element`` is a valid group element (hence function-preserving when applied)."""
    if isinstance(element, HeadElement):
        R, a = element.R.double(), element.a.double()
        eye = torch.eye(R.shape[-1], dtype=torch.float64)
        err = (R.mT @ R - eye).abs().max().item() if R.numel() else 0.0
        if not (math.isfinite(err) and err <= tol) or not bool(torch.isfinite(a).all()) or not bool((a > 0).all()):
            raise SymmergeError(f"{name}: solver returned an invalid element (orthogonality error {err:.2e})")
    elif isinstance(element, PermElement):
        n = len(element.perm)
        if not torch.equal(torch.sort(element.perm).values, torch.arange(n)):
            raise SymmergeError(f"{name}: solver returned a non-bijective permutation")
        s = element.scale
        if s is not None and (not bool(torch.isfinite(s).all()) or bool((s == 0).any())):
            raise SymmergeError(f"{name}: solver returned a zero or non-finite unit scale")


def _bound_malloc() -> None:
    """glibc only: serve every allocation over 1 MB by its own mmap (returned to the OS when freed)
    and cap the malloc arenas at 2. Otherwise the dynamic mmap threshold grows after the first large
    frees and per-thread arenas keep freed layer tensors as fragmented heap: peak RSS then counts
    layers long gone. A no-op elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
            libc.mallopt(-8, 2)  # M_ARENA_MAX
    except OSError:
        pass


def layer_instances(ckpt: LazyCheckpoint, layers=None):
    """(spec, {layer: its group instances}) resolved against the checkpoint's headers (no residual)."""
    spec = spec_for(ckpt.config["model_type"])
    sizes = config_sizes(spec, _Config(ckpt.config))
    instances = resolve(spec, ckpt.meta(), sizes.pop("num_layers"), sizes.pop("num_heads"), layers,
                        residual=False, **sizes)
    by_layer: dict[int, list] = defaultdict(list)
    for inst in instances:
        by_layer[inst.layer].append(inst)
    return spec, dict(sorted(by_layer.items()))


def prepare_layer(insts, sd_a: dict, sd_b: dict, symmetries, scale_mode: str, device=None):
    """First half of one layer's matching: the head groups' elements (batched SVD) and the FFN cost
    matrices (GEMMs on ``device``). Returns (elements, {instance: (cost, scaled)}, head s, GEMM s)."""
    t0 = time.perf_counter()
    elements = solve_local([i for i in insts if i.group.kind != PERMUTATION], sd_a, sd_b, symmetries, scale_mode)
    t1 = time.perf_counter()
    costs = {}
    for inst in insts:
        if inst.group.kind != PERMUTATION:
            continue
        permute, scaled, signed = permutation_plan(inst.group, symmetries, scale_mode)
        if permute:
            costs[inst] = (permutation_cost(inst, sd_a, sd_b, signed, device=device), scaled)
        elif scaled:
            perm = torch.arange(inst.size)
            elements[inst.name] = PermElement(perm, unit_scales(inst, sd_a, sd_b, perm))
    return elements, costs, t1 - t0, time.perf_counter() - t1


def complete_layer(insts, sd_a: dict, sd_b: dict, elements: dict, costs: dict):
    """Second half: the linear assignments and unit scales, the validity check of every element and
    its application. Returns (aligned layer state dict, assignment s, check + apply s)."""
    t0 = time.perf_counter()
    for inst, (C, scaled) in costs.items():
        perm = match_permutation(C)
        elements[inst.name] = PermElement(perm, unit_scales(inst, sd_a, sd_b, perm) if scaled else None)
    t1 = time.perf_counter()
    for inst in insts:
        if inst.name in elements:
            check_element(inst.name, elements[inst.name])
    new = apply(sd_a, insts, elements)
    return new, t1 - t0, time.perf_counter() - t1


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _reader(jobs, ckpt_a: LazyCheckpoint, ckpt_b: LazyCheckpoint, out: queue.Queue, stop: threading.Event,
            ahead: threading.Semaphore):
    try:
        for layer, keys in jobs:
            while not ahead.acquire(timeout=0.2):  # read layer i + 1 only once layer i is taken: one layer ahead
                if stop.is_set():
                    return
            if stop.is_set():
                return
            item = (layer, keys, ckpt_a.read(keys), ckpt_b.read(keys))
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.2)
                    break
                except queue.Full:
                    continue
        out.put(None)
    except BaseException as e:  # handed to the main thread, which raises it
        out.put(_Failure(e))


def _writer(writer: ShardWriter, inbox: queue.Queue, errors: list):
    while True:
        item = inbox.get()
        if item is None:
            return
        if errors:
            continue  # drain after a failure
        try:
            for k, t in item.items():
                writer.add(k, t)
        except BaseException as e:
            errors.append(e)


def align_streaming(model, anchor, out, symmetries=("attn", "ffn", "rescale"), rescale: str = "joint",
                    layers=None, device="cpu", shard_size=DEFAULT_SHARD, progress: bool = True,
                    verify_forward: bool = False, verify_tol: float | None = None, log=None) -> dict:
    """Align the safetensors checkpoint folder ``model`` to ``anchor`` layer by layer and write the
    result to the folder ``out`` (atomically, in shards of at most ``shard_size``). Returns the report
    (also written as ``out/symmerge_report.json``)."""
    from .align import parse_symmetries
    from .device import resolve_device
    from .progress import bar

    start = time.perf_counter()
    if rescale not in RESCALE_MODES:
        raise SymmergeError(f"unknown rescale mode {rescale!r}; choose one of {', '.join(RESCALE_MODES)}")
    symmetries = parse_symmetries(symmetries)
    if "residual" in symmetries:
        raise SymmergeError("the residual symmetry couples every layer (one transform of the whole stream) and "
                            "cannot be streamed; align it in memory (without --stream) or leave it out")
    dev = resolve_device(device)
    max_bytes = parse_size(shard_size)
    _bound_malloc()
    ckpt_a, ckpt_b = LazyCheckpoint(model), LazyCheckpoint(anchor)
    check_same_layout(ckpt_a, ckpt_b)
    spec, by_layer = layer_instances(ckpt_a, layers)
    scale_mode = rescale if "rescale" in symmetries else "none"
    jobs = [(layer, sorted({s.key for i in insts for s in i.slots})) for layer, insts in by_layer.items()]
    touched = {k for _, keys in jobs for k in keys}
    passthrough = [k for k in ckpt_a.keys() if k not in touched]
    largest_layer = max([sum(ckpt_a.nbytes(k) for k in keys) for _, keys in jobs], default=0)

    timings = defaultdict(float)
    sq_before = sq_after = 0.0
    per_layer = {}
    with atomic_dir(out) as tmp:
        writer = ShardWriter(tmp, max_bytes)
        # tensors no group touches: one at a time, straight through
        for k in passthrough:
            ta, tb = ckpt_a.read([k]), ckpt_b.read([k])
            d = sq_distance(ta, tb, [k])
            sq_before += d
            sq_after += d
            writer.add(ckpt_a.disk_name[k], ta[k])
            del ta, tb
        writer.flush()

        stop, errors = threading.Event(), []
        layers_q: queue.Queue = queue.Queue(maxsize=1)
        write_q: queue.Queue = queue.Queue(maxsize=1)
        ahead = threading.Semaphore(1)
        reader = threading.Thread(target=_reader, args=(jobs, ckpt_a, ckpt_b, layers_q, stop, ahead), daemon=True)
        writer_t = threading.Thread(target=_writer, args=(writer, write_q, errors), daemon=True)
        reader.start()
        writer_t.start()
        pbar = bar(total=len(jobs), desc="aligning layers", unit="layer", disable=None if progress else True)

        def finish(layer, insts, sd_a, sd_b, elements, costs):
            new, t_assign, t_apply = complete_layer(insts, sd_a, sd_b, elements, costs)
            t0 = time.perf_counter()
            keys = list(sd_a)
            before, after = sq_distance(sd_a, sd_b, keys), sq_distance(new, sd_b, keys)
            for k in keys:
                if new[k].is_floating_point() and not torch.isfinite(new[k]).all():
                    raise SymmergeError(f"{k}: aligned tensor is not finite")
            t_apply += time.perf_counter() - t0
            write_q.put({ckpt_a.disk_name[k]: new[k] for k in keys})
            return layer, before, after, t_assign, t_apply

        pending = None
        try:
            with ThreadPoolExecutor(max_workers=1) as pool:
                while True:
                    t_wait = time.perf_counter()
                    item = layers_q.get()
                    ahead.release()
                    timings["waiting_for_reads"] += time.perf_counter() - t_wait
                    if item is None:
                        break
                    if isinstance(item, _Failure):
                        raise item.exc
                    layer, keys, sd_a, sd_b = item
                    insts = by_layer[layer]
                    elements, costs, t_heads, t_costs = prepare_layer(insts, sd_a, sd_b, symmetries, scale_mode, dev)
                    timings["heads"] += t_heads
                    timings["cost_gemms"] += t_costs
                    if pending is not None:  # at most one layer in the worker
                        _collect(pending.result(), per_layer, timings)
                        pbar.update(1)
                    pending = pool.submit(finish, layer, insts, sd_a, sd_b, elements, costs)
                    del sd_a, sd_b, elements, costs, item
                if pending is not None:
                    _collect(pending.result(), per_layer, timings)
                    pbar.update(1)
        except BaseException:
            stop.set()
            write_q.put(None)
            raise
        finally:
            pbar.close()
        write_q.put(None)
        writer_t.join()
        if errors:
            raise errors[0]
        names = writer.close()
        sq_before += sum(v["sq_before"] for v in per_layer.values())
        sq_after += sum(v["sq_after"] for v in per_layer.values())
        copy_side_files(Path(model), tmp)
        (tmp / "config.json").write_text((Path(model) / "config.json").read_text())
        report = {
            "family": spec.family, "model_type": ckpt_a.config["model_type"], "model": str(model),
            "anchor": str(anchor), "streamed": True, "symmetries": list(symmetries),
            "rescale": rescale if "rescale" in symmetries else "none",
            "layers": list(layers) if layers is not None else "all", "device": str(dev),
            "distance_before": math.sqrt(sq_before), "distance_after": math.sqrt(sq_after),
            "per_layer": {str(k): {"before": math.sqrt(v["sq_before"]), "after": math.sqrt(v["sq_after"])}
                          for k, v in sorted(per_layer.items())},
            "verify": "group elements (orthogonal, valid scales, bijective permutations)",
            "shards": names, "bytes_written": writer.total_bytes, "largest_layer_bytes": largest_layer,
            "timings": {k: round(v, 4) for k, v in timings.items()},
        }
        report["match_seconds"] = time.perf_counter() - start
        if verify_forward:
            report.update(_verify_forward(model, tmp, verify_tol))
        report["seconds"] = time.perf_counter() - start
        write_json(tmp / "symmerge_report.json", report)
    if log is not None:
        log(f"wrote {out}: {len(names)} shard(s), {writer.total_bytes / 1e9:.2f} GB")
    return report


def _collect(result, per_layer: dict, timings: dict) -> None:
    layer, before, after, t_assign, t_apply = result
    per_layer[layer] = {"sq_before": before, "sq_after": after}
    timings["assignments"] += t_assign
    timings["apply_and_check"] += t_apply


def _verify_forward(model, aligned_dir, verify_tol) -> dict:
    """Load the original and the aligned folder and compare outputs (needs both in memory)."""
    from .io import load_model
    from .verify import compare, default_tolerance, sample_inputs

    a, b = load_model(model), load_model(aligned_dir)
    tol = default_tolerance(next(a.parameters()).dtype) if verify_tol is None else verify_tol
    diff = compare(a, b, sample_inputs(a, spec_for(a.config.model_type)))
    if not diff["max_rel_diff"] <= tol:
        raise SymmergeError(f"aligned model is not equivalent: max relative output difference "
                            f"{diff['max_rel_diff']:.3g} > {tol:.3g}")
    return {"verify_max_abs_diff": diff["max_abs_diff"], "verify_max_rel_diff": diff["max_rel_diff"],
            "verify_tolerance": tol}
