"""Streaming alignment: checkpoints larger than memory, aligned layer by layer.

Neither model is ever loaded whole. The spec is resolved against the safetensors headers. Tensors no
group touches (embeddings, norms, heads) are copied through one by one; then the layers, in one of
two modes:

* **low memory** (default): each layer is split into parts that share no tensor (attention QK, VO,
  FFN); one part at a time is read from both models (``safe_open``), solved (batched SVD for heads;
  for the FFN a float64 cost built block by block from GEMMs on ``device``, consumed in place by the
  exact assignment), applied, checked and handed to the shard writer, whose shards are cut at about
  one layer. Peak memory ≈ interpreter + the largest part of both models + its n × n cost.
* **pipeline**: a reader thread stays one layer ahead, the main thread solves heads and cost GEMMs,
  a worker thread runs the assignments (scipy, single-threaded, overlapping the next GEMMs) and the
  application, and a writer thread writes shards; a few layers in memory, I/O hidden behind compute.

Both use the per-layer symmetries (attn, ffn, rescale); the residual symmetry couples every layer
and is refused here. The equivalence check is per group element (orthogonal, finite, positive or
non-zero scales, bijective permutations: each such element preserves the function exactly — the
in-memory tests prove that for every spec); ``verify_forward`` additionally loads both models
afterwards and compares their outputs, for checkpoints that fit in memory.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .apply import HeadElement, PermElement, apply
from .checkpoint import LazyCheckpoint, ShardWriter, check_same_layout, parse_size
from .distance import sq_distance
from .errors import SymmergeError
from .io import atomic_dir, copy_side_files, write_json
from .resolve import config_sizes, resolve, value_keys
from .solve import RESCALE_MODES, permutation_cost, permutation_plan, solve_local, unit_scales
from .solvers.assignment import match_permutation
from .spec import PERMUTATION, spec_for

DEFAULT_SHARD = "1GB"
MIN_LOW_MEMORY_SHARD = 64 * 2 ** 20  # low-memory mode: shards of about one layer, not smaller than this


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


def _bound_malloc(mmap_threshold: int):
    """glibc only: serve every allocation over ``mmap_threshold`` bytes by its own mmap (returned to the
    OS when freed) and cap the malloc arenas at 2. Otherwise the dynamic mmap threshold grows after the
    first large frees and per-thread arenas keep freed layer tensors as fragmented heap: peak RSS then
    counts layers long gone. Returns a function that hands the heap's free pages back to the OS
    (``malloc_trim``); both are no-ops elsewhere."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
            libc.mallopt(-3, int(mmap_threshold))  # M_MMAP_THRESHOLD
            libc.mallopt(-8, 2)  # M_ARENA_MAX
            return lambda: libc.malloc_trim(0)
    except OSError:
        pass
    return lambda: None


def layer_instances(ckpt: LazyCheckpoint, layers=None):
    """(spec, {layer: its group instances}) resolved against the checkpoint's headers (no residual)."""
    spec = spec_for(ckpt.config["model_type"])
    sizes = config_sizes(spec, ckpt.hf_config)
    shapes = ckpt.meta()
    shapes.update(ckpt.read(value_keys(spec, list(shapes), sizes["num_layers"])))  # a few small tensors
    instances = resolve(spec, shapes, sizes.pop("num_layers"), sizes.pop("num_heads"), layers,
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


def assign(costs: dict) -> dict:
    """The linear assignment of every cost matrix, ``{instance: (perm, scaled)}``; ``costs`` is
    emptied, each matrix consumed by its assignment and freed before the next one."""
    out = {}
    while costs:
        inst, (C, scaled) = costs.popitem()
        out[inst] = (match_permutation(C, consume=True), scaled)
        del C
    return out


def complete_layer(insts, sd_a: dict, sd_b: dict, elements: dict, costs: dict, assigned: dict | None = None):
    """Second half: the linear assignments (or the ``assigned`` result of :func:`assign`) and unit
    scales, the validity check of every element and its application. ``costs`` is emptied (its
    matrices consumed). Returns (aligned layer state dict, assignment s, check + apply s)."""
    t0 = time.perf_counter()
    assigned = {**(assigned or {}), **assign(costs)}
    for inst, (perm, scaled) in assigned.items():
        elements[inst.name] = PermElement(perm, unit_scales(inst, sd_a, sd_b, perm) if scaled else None)
    t1 = time.perf_counter()
    for inst in insts:
        if inst.name in elements:
            check_element(inst.name, elements[inst.name])
    new = apply(sd_a, insts, elements)
    return new, t1 - t0, time.perf_counter() - t1


class _OnDemand(Mapping):
    """A checkpoint's tensors ``keys`` as a read-only mapping that reads a tensor each time it is asked
    for and keeps nothing (the FFN cost GEMMs use each member once)."""

    def __init__(self, ckpt: LazyCheckpoint, keys):
        self.ckpt, self.names, self.seconds = ckpt, list(keys), 0.0

    def __getitem__(self, key):
        if key not in self.names:
            raise KeyError(key)
        t0 = time.perf_counter()
        tensor = self.ckpt.read([key])[key]
        self.seconds += time.perf_counter() - t0
        return tensor

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


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


def components(insts) -> list[list]:
    """A layer's group instances split into sets that share no tensor (attention QK, VO, FFN...):
    each set is solved, applied and written on its own, so only its tensors are ever in memory."""
    parent = list(range(len(insts)))

    def root(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, inst in enumerate(insts):
        for s in inst.slots:
            j = owner.setdefault(s.key, i)
            parent[root(i)] = root(j)
    groups: dict[int, list] = defaultdict(list)
    for i, inst in enumerate(insts):
        groups[root(i)].append(inst)
    return list(groups.values())


def _finish(ckpt_a: LazyCheckpoint, sd_a: dict, sd_b: dict, new: dict):
    """Distances before/after and the finiteness check of an aligned part; its tensors by disk name."""
    keys = list(sd_a)
    before, after = sq_distance(sd_a, sd_b, keys), sq_distance(new, sd_b, keys)
    for k in keys:
        if new[k].is_floating_point() and not torch.isfinite(new[k]).all():
            raise SymmergeError(f"{k}: aligned tensor is not finite")
    return before, after, {ckpt_a.disk_name[k]: new[k] for k in keys}


def _run_serial(by_layer, ckpt_a, ckpt_b, writer, symmetries, scale_mode, dev, pbar, per_layer, timings,
                trim=lambda: None):
    """Low-memory mode: one tensor-disjoint part of one layer at a time. A part with a unit
    permutation (the FFN) builds its cost one member at a time (read on demand) and solves the
    assignment (scipy) before the part is read whole for the unit scales and the application: the
    cost matrix never shares memory with the part's tensors. (Overlapping the assignment with the
    next layer's attention saved 3 s a layer but let the two meet: 1.75 GB peak instead of ~1.3.)"""
    def run_part(part, keys, elements=None, assigned=None) -> tuple[float, float]:
        """Read, (solve,) apply, check and write one part; its squared distances before/after."""
        writer.make_room(sum(ckpt_a.nbytes(k) for k in keys))
        t0 = time.perf_counter()
        sd_a, sd_b = ckpt_a.read(keys), ckpt_b.read(keys)
        timings["read"] += time.perf_counter() - t0
        costs = {}
        if elements is None:
            elements, costs, t_heads, t_costs = prepare_layer(part, sd_a, sd_b, symmetries, scale_mode, dev)
            timings["heads"] += t_heads
            timings["cost_gemms"] += t_costs
            trim()
        new, t_scales, t_apply = complete_layer(part, sd_a, sd_b, elements, costs, assigned)
        t0 = time.perf_counter()
        before, after, tensors = _finish(ckpt_a, sd_a, sd_b, new)
        del sd_a, sd_b, new, elements
        t1 = time.perf_counter()
        for k, t in tensors.items():
            writer.add(k, t)
        del tensors
        timings["write"] += time.perf_counter() - t1
        timings["assignments"] += t_scales
        timings["apply_and_check"] += t_apply + t1 - t0
        trim()
        return before, after

    for layer, insts in by_layer.items():
        before = after = 0.0
        for part in components(insts):
            keys = sorted({s.key for i in part for s in i.slots})
            if not any(i.group.kind == PERMUTATION and permutation_plan(i.group, symmetries, scale_mode)[0]
                       for i in part):
                b, a = run_part(part, keys)
            else:
                writer.flush()  # no pending shard beside the cost matrix (shards: about one layer each)
                trim()
                lazy_a, lazy_b = _OnDemand(ckpt_a, keys), _OnDemand(ckpt_b, keys)
                elements, costs, t_heads, t_costs = prepare_layer(part, lazy_a, lazy_b, symmetries, scale_mode, dev)
                timings["heads"] += t_heads
                timings["cost_gemms"] += t_costs - lazy_a.seconds - lazy_b.seconds
                timings["read"] += lazy_a.seconds + lazy_b.seconds
                t0 = time.perf_counter()
                assigned = assign(costs)
                timings["assignments"] += time.perf_counter() - t0
                b, a = run_part(part, keys, elements, assigned)
            before, after = before + b, after + a
        per_layer[layer] = {"sq_before": before, "sq_after": after}
        pbar.update(1)


def _run_pipelined(by_layer, ckpt_a, ckpt_b, writer, symmetries, scale_mode, dev, pbar, per_layer, timings):
    """Overlapped mode: reader thread, main thread (heads, cost GEMMs), worker (assignments, apply),
    writer thread; each queue holds one layer."""
    jobs = [(layer, sorted({s.key for i in insts for s in i.slots})) for layer, insts in by_layer.items()]
    stop, errors = threading.Event(), []
    layers_q: queue.Queue = queue.Queue(maxsize=1)
    write_q: queue.Queue = queue.Queue(maxsize=1)
    ahead = threading.Semaphore(1)
    reader = threading.Thread(target=_reader, args=(jobs, ckpt_a, ckpt_b, layers_q, stop, ahead), daemon=True)
    writer_t = threading.Thread(target=_writer, args=(writer, write_q, errors), daemon=True)
    reader.start()
    writer_t.start()

    def finish(layer, insts, sd_a, sd_b, elements, costs):
        new, t_assign, t_apply = complete_layer(insts, sd_a, sd_b, elements, costs)
        t0 = time.perf_counter()
        before, after, tensors = _finish(ckpt_a, sd_a, sd_b, new)
        write_q.put(tensors)
        return layer, before, after, t_assign, t_apply + time.perf_counter() - t0

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
    write_q.put(None)
    writer_t.join()
    if errors:
        raise errors[0]


def align_streaming(model, anchor, out, symmetries=("attn", "ffn", "rescale"), rescale: str = "joint",
                    layers=None, device="cpu", shard_size=DEFAULT_SHARD, progress: bool = True,
                    verify_forward: bool = False, verify_tol: float | None = None, log=None,
                    pipeline: bool = False) -> dict:
    """Align the safetensors checkpoint folder ``model`` to ``anchor`` layer by layer and write the
    result to the folder ``out`` (atomically, in shards of at most ``shard_size``). Returns the report
    (also written as ``out/symmerge_report.json``).

    Default (low memory): one tensor-disjoint part of a layer at a time, shards cut at about one
    layer; peak memory ≈ the largest part of both models + its cost matrix. ``pipeline=True``
    overlaps reading, matching, assignments and writing across layers (a few layers in memory)."""
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
    # pipeline: every allocation over 1 MB is its own mmap. Low memory: temporaries up to 32 MB (GEMM and
    # head blocks) are reused from the heap (a fresh mmap costs page faults on every block), whose free
    # pages are handed back after each part
    trim = _bound_malloc((1 if pipeline else 32) << 20)
    ckpt_a, ckpt_b = LazyCheckpoint(model), LazyCheckpoint(anchor)
    check_same_layout(ckpt_a, ckpt_b)
    spec, by_layer = layer_instances(ckpt_a, layers)
    trim()  # the weightless model built to map tensor names is garbage now
    scale_mode = rescale if "rescale" in symmetries else "none"
    layer_keys = [{s.key for i in insts for s in i.slots} for insts in by_layer.values()]
    touched = set().union(*layer_keys)
    passthrough = [k for k in ckpt_a.keys() if k not in touched]
    largest_layer = max([sum(ckpt_a.nbytes(k) for k in keys) for keys in layer_keys], default=0)
    if not pipeline:  # the writer's buffer is memory too: cut shards at about one layer
        max_bytes = min(max_bytes, max(largest_layer, MIN_LOW_MEMORY_SHARD))

    timings = defaultdict(float)
    sq_before = sq_after = 0.0
    per_layer = {}
    with atomic_dir(out) as tmp:
        writer = ShardWriter(tmp, max_bytes)
        # tensors no group touches: one at a time, straight through
        for k in passthrough:
            writer.make_room(ckpt_a.nbytes(k))
            ta, tb = ckpt_a.read([k]), ckpt_b.read([k])
            d = sq_distance(ta, tb, [k])
            sq_before += d
            sq_after += d
            writer.add(ckpt_a.disk_name[k], ta[k])
            del ta, tb
        writer.flush()
        pbar = bar(total=len(by_layer), desc="aligning layers", unit="layer", disable=None if progress else True)
        try:
            if pipeline:
                _run_pipelined(by_layer, ckpt_a, ckpt_b, writer, symmetries, scale_mode, dev, pbar, per_layer, timings)
            else:
                _run_serial(by_layer, ckpt_a, ckpt_b, writer, symmetries, scale_mode, dev, pbar, per_layer, timings,
                            trim)
        finally:
            pbar.close()
        names = writer.close()
        sq_before += sum(v["sq_before"] for v in per_layer.values())
        sq_after += sum(v["sq_after"] for v in per_layer.values())
        copy_side_files(Path(model), tmp)
        (tmp / "config.json").write_text((Path(model) / "config.json").read_text())
        report = {
            "family": spec.family, "model_type": ckpt_a.config["model_type"], "model": str(model),
            "anchor": str(anchor), "streamed": True, "mode": "pipeline" if pipeline else "low-memory",
            "symmetries": list(symmetries), "rescale": rescale if "rescale" in symmetries else "none",
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
