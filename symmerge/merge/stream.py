"""Streamed merges: checkpoints merged tensor by tensor from their safetensors files, never loaded whole.

``symmerge merge --mode stream`` (or ``auto``, see :func:`choose_mode`) runs every per-tensor method
(average, task arithmetic, TIES, DARE, DARE-TIES) this way, for any number of models and any model type
transformers knows (no symmetry spec needed):

* the inputs' headers give every tensor's name, shape and dtype; bodies must agree (names, shapes), the
  task head is kept from ``head_from`` (or merged, with ``heads="merge"``), as in memory;
* a method's model-wide quantities (TIES's magnitude threshold, ``scope="model"``) are found first by
  its ``prepare`` hook over mappings that map one tensor at a time (a sampled window, one counting visit);
* then a reader thread reads the next tensors of every model (straight from the files, no memory map)
  into a ring buffer of the read-ahead budget (:func:`default_budget`), the calling thread merges them
  with :func:`~symmerge.merge.base.merge_tensor` into the ring — the very function the in-memory loop
  runs, so both give the same bits — and a writer thread appends each result to the output shard,
  whose header was written first (:class:`~symmerge.io.checkpoint.PlannedWriter`), then frees its part
  of the ring (reused memory: no page faults on fresh pages for every tensor).

Peak memory ≈ interpreter + N × the largest tensor × a small factor, whatever the model size. The
output is written atomically (a temporary folder renamed at the end: an interrupted merge leaves none).
Methods that need statistics (Fisher, RegMean: activations of the models run on data), the architecture
(OT fusion), REPAIR and evaluation need the models in memory: ``--mode memory``.
"""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from ..core.distance import sq_distance
from ..core.parallel import put_until_stopped
from ..core.layout import Layout, check_layouts
from ..core.memory import available_memory
from ..errors import SymmergeError
from ..families import spec_for, supported_model_types
from ..io import direct
from ..io.checkpoint import LazyCheckpoint, PlannedWriter, parse_size
from ..io.card import write_card
from ..io.model import atomic_dir, copy_side_files, weight_files, write_json
from ..io.output import temp_prefix
from ..io.prefix import adapt_checkpoints, not_merged
from ..io.sentence_transformers import check_pipelines
from ..io.tokenizers import check_tokenizers
from ..progress import bar, stage
from . import kernels
from .heads import head_policy, head_report
from .modules import merge_pipeline_modules
from .base import merge_tensor, normalized_weights

MODES = ("auto", "stream", "memory")
DEFAULT_SHARD = "2GB"  # output shards: written as they come, never held, so their size costs no memory
MEMORY_FRACTION = 0.5  # auto: models larger than this fraction of the available memory are streamed


def has_spec(model_type: str) -> bool:
    try:
        spec_for(model_type)
        return True
    except SymmergeError:
        return False


def plain_fallback(align, model_type: str):
    """(alignment options, note) for a model type without a symmetry spec: 'recommended' falls back to no
    alignment with a note; an explicit list is refused naming the supported types; 'none' stays."""
    if not align.symmetries or has_spec(model_type):
        return align, None
    if align.recommended:
        return align.with_(symmetries=()), (f"no symmetry spec for model_type {model_type!r}: merged without "
                                            f"alignment (symmetry alignment supports: "
                                            f"{', '.join(supported_model_types())})")
    spec_for(model_type)  # raises the one clear error naming the supported types
    return align, None


def aligns(options, models) -> bool:
    """Whether the merge of the folders ``models`` will align anything (read from the first config.json):
    not with ``--align none``, nor with 'recommended' and a base, nor for a model type without a spec."""
    from ..io.model import read_config

    align = options.align
    if not align.symmetries or (align.recommended and options.base is not None):
        return False
    first = models[0]
    if not isinstance(first, (str, Path)):
        return True
    align, _ = plain_fallback(align, read_config(Path(first), spec=False)["model_type"])
    return bool(align.symmetries)


def stream_refusal(method, options) -> str | None:
    """Why this merge needs the models in memory (``None``: it can stream)."""
    if method.needs:
        return (f"method {method.name!r} needs the models in memory (its {method.needs} statistics come from "
                "running them on data)")
    if method.needs_model:
        return f"method {method.name!r} needs the models in memory (it reads the architecture)"
    if options.repair:
        return "REPAIR needs the models in memory (it runs them on data)"
    if options.joint:
        return "joint alignment (every model to the mean of the others) needs the models in memory"
    if options.data or options.eval_data:
        return "evaluating the merged model on data needs it in memory"
    return None


def checkpoint_bytes(folder) -> int:
    """Bytes of a folder's weight files (0 when it is not a folder of safetensors weights)."""
    try:
        files, safe = weight_files(Path(folder))
    except SymmergeError:
        return 0
    return sum(os.path.getsize(f) for f in files) if safe else 0


def choose_mode(mode: str, method, options, models, aligns: bool) -> tuple[str, str]:
    """('stream' or 'memory', why) for ``--mode`` ``mode``. ``auto`` streams every per-tensor merge that
    aligns nothing (reading each tensor once is faster and smaller than loading the models); an aligned
    one is loaded when the models fit in half the available memory, else streamed (each model aligned by
    ``align --stream``'s engine); a merge that cannot stream (statistics, REPAIR, evaluation) is loaded,
    or refused when it would not fit. ``stream`` refuses what cannot stream; ``memory`` always loads."""
    if mode not in MODES:
        raise SymmergeError(f"unknown --mode {mode!r}; choose one of {', '.join(MODES)}")
    if mode == "memory":
        return "memory", "--mode memory"
    refusal = stream_refusal(method, options)
    if any(not isinstance(x, (str, Path)) for x in models) or (options.base is not None and
                                                                not isinstance(options.base, (str, Path))):
        refusal = refusal or "models given as objects are already in memory"
    if refusal is None and any(checkpoint_bytes(x) == 0 for x in models):
        refusal = "streaming reads safetensors folders"
    if mode == "stream":
        if refusal:
            raise SymmergeError(f"--mode stream: {refusal}; use --mode memory")
        return "stream", "--mode stream"
    if refusal is None and not aligns:
        return "stream", "auto: a per-tensor merge without alignment streams"
    total = sum(checkpoint_bytes(x) for x in models if isinstance(x, (str, Path)))
    free = available_memory()
    too_big = free is not None and total > MEMORY_FRACTION * free
    if refusal is None:  # aligned: in memory (every group, residual included) unless the models do not fit
        if too_big:
            return "stream", (f"auto: the models ({total / 1e9:.1f} GB) exceed half the available memory: each "
                              "is aligned streamed (the groups that stream), then merged tensor by tensor")
        return "memory", "auto: aligned merges load the models when they fit"
    if too_big:
        raise SymmergeError(f"the models ({total / 1e9:.1f} GB) would not fit in memory ({free / 1e9:.1f} GB "
                            f"available) and this merge cannot stream: {refusal}")
    return "memory", f"auto: {refusal}"


def _sq(a, b, block: int = 1 << 16) -> float:
    """Squared L2 distance of two tensors for the report: differences in float32 (float64 inputs in
    float64), each block's sum of squares by a dot product, the blocks summed in float64."""
    import torch

    wide = torch.float64 if torch.float64 in (a.dtype, b.dtype) else torch.float32
    fa, fb = a.reshape(-1), b.reshape(-1)
    total = 0.0
    for i in range(0, fa.numel(), block):
        d = fa[i:i + block].to(wide) - fb[i:i + block].to(wide)
        total += float(torch.dot(d, d))
    return total


class _Lazy(Mapping):
    """A checkpoint's tensors ``keys`` read one at a time (for a method's ``prepare`` hook), each
    mapped from its file (:meth:`~symmerge.io.checkpoint.LazyCheckpoint.map_direct`: a model visited
    twice is read from the page cache in place, not copied twice)."""

    def __init__(self, ckpt: LazyCheckpoint, keys):
        self.ckpt, self.names = ckpt, list(keys)

    def __getitem__(self, key):
        return self.ckpt.map_direct(key, check=False)  # NaN/Inf: refused by the merge loop's reads, before any output

    def numel(self, key) -> int:
        return math.prod(self.ckpt.shape[key])

    def dtype(self, key):
        return self.ckpt.dtype[key]

    def read_blocks(self, key, first: int, stride: int, width: int):
        return self.ckpt.read_blocks(key, first, stride, width)

    def __iter__(self):
        return iter(self.names)

    def __len__(self):
        return len(self.names)


def head_keys_of(ckpt: LazyCheckpoint) -> list[str]:
    """Tensors outside the base model (``base_model_prefix``), as :func:`symmerge.merge.heads.head_keys`
    finds them in memory (tied aliases are already folded into their sources)."""
    prefix = ckpt.base_model_prefix + "."
    keys = ckpt.keys()
    if prefix == "." or not any(k.startswith(prefix) for k in keys):
        return []
    return [k for k in keys if not k.startswith(prefix)]


def _body_layout(ckpt: LazyCheckpoint, name: str, heads) -> Layout:
    heads = set(heads)
    return Layout(name, ckpt.config["model_type"], ckpt.heads,
                  {k: ckpt.shape[k] for k in ckpt.keys() if k not in heads}, ckpt.disk_name)


_ALIGN = 64  # bytes: every tensor placed in the read-ahead ring starts on a cache line


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


class _Budget:
    """Bytes read but not yet written, in one preallocated ring buffer of ``limit`` bytes: the reader
    takes a region per key (its inputs and the merged output), the writer gives it back when written,
    in the same order. Reused memory: no page faults on fresh pages for every tensor read (on a large
    merge those cost more CPU than the merge itself). The reader waits while the region does not fit;
    a key larger than the ring gets fresh memory once nothing else is in flight."""

    def __init__(self, limit: int):
        self.limit, self.used, self.cond, self.peak = limit, 0, threading.Condition(), 0
        self.ring = None
        self.regions: list = []  # (start, end) of the regions in flight, oldest first; start -1: fresh memory

    def _place(self, n: int):
        """Start of a free region of ``n`` bytes, -1 for fresh memory, None to wait."""
        if n > self.limit:
            return None if self.regions else -1
        live = [r for r in self.regions if r[0] >= 0]
        if not live:
            return 0
        tail, head = live[0][0], live[-1][1]
        if live[-1][0] >= tail:  # in flight: [tail, head); free: [head, limit) and [0, tail)
            if head + n <= self.limit:
                return head
            return 0 if n <= tail else None
        return head if head + n <= tail else None  # wrapped: free [head, tail)

    def take(self, n: int, stop: threading.Event):
        """A uint8 tensor of ``n`` bytes (a view of the ring, or fresh), or None when stopped."""
        import torch

        with self.cond:
            while (start := self._place(n)) is None:
                if stop.is_set():
                    return None
                self.cond.wait(0.2)
            if stop.is_set():
                return None
            self.regions.append((start, start + n))
            self.used += n
            self.peak = max(self.peak, self.used)
        if start < 0:
            return torch.empty(n, dtype=torch.uint8)
        if self.ring is None:
            self.ring = torch.empty(self.limit, dtype=torch.uint8)
        return self.ring[start:start + n]

    def give(self, n: int) -> None:
        with self.cond:
            self.regions.pop(0)
            self.used -= n
            self.cond.notify_all()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def default_budget(sizes: list[int]) -> int:
    """Read-ahead bytes for keys of ``sizes`` bytes (inputs + output): the largest key and two of the
    next largest (the reader, the merging thread and the writer each hold one), at most twice the
    largest, at least 64 MB. The ring is allocated whole, so this is the merge's memory beyond the
    interpreter's: one embedding-sized key need not double it."""
    top = sorted(sizes, reverse=True)[:2] + [0, 0]
    return max(min(2 * top[0], top[0] + 2 * top[1]), 64 * 2 ** 20)


def merge_streaming(models, out, options, shard_size=DEFAULT_SHARD, budget=None, write_hook=None) -> dict:
    """Merge the safetensors folders ``models`` tensor by tensor into the folder ``out`` (atomically)
    with a per-tensor method of ``options`` (a :class:`~symmerge.merge.fuse.MergeOptions`); returns the
    report (also written as ``out/symmerge_report.json``). ``budget``: bytes the reader may hold ahead,
    the size of its ring buffer (default: :func:`default_budget`). ``write_hook(tmp)``,
    if given, runs on the finished temporary folder before it is renamed (extra files)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # parallel work: the reader, merging and writer threads (chunks are single-threaded)
    try:
        return _merge_streaming(models, out, options, shard_size, budget, write_hook)
    finally:
        torch.set_num_threads(threads)


def _merge_streaming(models, out, options, shard_size, budget, write_hook) -> dict:
    t0 = time.perf_counter()
    m = options.check(len(models))
    refusal = stream_refusal(m, options)
    if refusal:
        raise SymmergeError(f"streamed merge: {refusal}; use --mode memory")
    names = [str(x) for x in models]
    # the same checks as in memory, before anything is read: tokenizers, sentence-transformers pipelines
    tokenizer = check_tokenizers([(n, x) for n, x in zip(names, models)] +
                                 [(str(x), x) for x in (options.base, options.anchor) if isinstance(x, (str, Path))],
                                 options.allow_tokenizer_mismatch)
    embedding = check_pipelines(list(zip(names, models)), m, options.base, options.allow_pickle)
    timings = {"load": 0.0, "align": 0.0, "statistics": 0.0, "merge": 0.0, "evaluate": 0.0}
    with stage("read the checkpoint headers", enabled=options.progress):
        ckpts = [LazyCheckpoint(x, spec=False) for x in models]
        base = LazyCheckpoint(options.base, spec=False) if options.base is not None else None
    model_type = ckpts[0].config["model_type"]
    align, note = plain_fallback(options.align, model_type)
    alignment = {"symmetries": [], "requested": options.align.requested, "rescale": "none",
                 "anchor": {"index": None, "name": None, "rule": None}, "models": []}
    if align.symmetries and base is not None and align.recommended:
        align = align.with_(symmetries=())
        note = ("'recommended' aligns nothing when a --base is given: models fine-tuned from one base share its "
                "parameterisation (B2: matching changed no accuracy); name symmetries to align anyway")
    if align.symmetries:
        return _aligned_streaming(models, out, options, align, ckpts, base, shard_size, budget, write_hook, t0)
    if note:
        alignment["note"] = note
    (*ckpts, base), adapted = adapt_checkpoints(ckpts + [base], names + [str(options.base)], options.head_from)

    # ------------------------------------------------ layouts: bodies agree; heads kept or merged
    requested_heads = options.heads
    options = replace(options, heads=head_policy(options.heads, ckpts[0].class_name))  # 'auto': by class
    heads = [head_keys_of(c) for c in ckpts]
    everything = ckpts + ([base] if base is not None else [])
    labels = names + (["base"] if base is not None else [])
    check_layouts([_body_layout(c, n, head_keys_of(c)) for c, n in zip(everything, labels)])
    holder = ckpts[options.head_from]
    body = [k for k in ckpts[0].keys() if k not in set(heads[0])]
    merged_keys = list(body)
    if options.heads == "merge":
        for i in range(1, len(ckpts)):
            if sorted(heads[i]) != sorted(heads[0]) or any(ckpts[i].shape[k] != ckpts[0].shape[k] for k in heads[0]):
                raise SymmergeError(f"cannot merge task heads: {names[0]} and {names[i]} have different heads/label "
                                    "spaces (use --heads keep)")
            if ckpts[i].config.get("id2label") != ckpts[0].config.get("id2label"):
                raise SymmergeError(f"cannot merge task heads: label names differ between {names[0]} and "
                                    f"{names[i]}; use --heads keep")
        merged_keys += heads[0]
        if base is not None:
            missing = [k for k in heads[0] if k not in base.shape]
            if missing:
                raise SymmergeError(f"base model lacks tensor {base.disk_name.get(missing[0], missing[0])!r}")
    merged_keys = [k for k in merged_keys if k not in not_merged(adapted)]  # a base model's missing head: kept
    merged_set = set(merged_keys)
    order = [k for k in holder.keys() if k in merged_set or k in set(heads[options.head_from])]
    ref = base if base is not None else ckpts[0]
    plan = [(holder.save_name(k), (ref if k in merged_set else holder).dtype[k], holder.shape[k]) for k in order]
    weights = normalized_weights(options.weights, len(models), normalize=m.normalize_weights)
    params = options.params

    # ------------------------------------------------ model-wide quantities (TIES's threshold), streamed
    t = time.perf_counter()
    context = None
    if m.prepare is not None:
        lazies = [_Lazy(c, merged_keys) for c in ckpts]
        with stage(f"{m.name}: model-wide quantities (one read of every model)", enabled=options.progress):
            context = m.prepare(lazies, _Lazy(base, merged_keys) if base is not None else None, weights, params)
    timings["prepare"] = time.perf_counter() - t

    # ------------------------------------------------ read ahead, merge, write behind
    def sources(k):
        return [holder] if k not in merged_set else ckpts + ([base] if base is not None else [])

    sizes = {k: sum(_aligned(c.room(k)) for c in sources(k)) + _aligned(holder.nbytes(k)) for k in order}
    limit = budget if budget is not None else default_budget(list(sizes.values()))
    gate, stop = _Budget(int(limit)), threading.Event()
    read_q: queue.Queue = queue.Queue(maxsize=4)
    write_q: queue.Queue = queue.Queue(maxsize=4)
    clock = {"read": 0.0, "write": 0.0, "distances": 0.0, "waiting_for_reads": 0.0}
    n = len(ckpts)
    pair_sq = {(i, j): 0.0 for i in range(n) for j in range(i + 1, n)}
    result_sq = [0.0] * n
    largest = max((max(c.nbytes(k) for c in sources(k)) for k in order), default=0)

    pool = ThreadPoolExecutor(max_workers=len(everything))  # one read per model at once: a deeper I/O queue

    def reader():
        try:
            for k in order:
                region = gate.take(sizes[k], stop)  # the inputs' bytes, then the merged output's
                if region is None:
                    return
                places, at = [], 0
                for c in sources(k):
                    places.append((c, region[at:at + c.room(k)]))
                    at += _aligned(c.room(k))
                t1 = time.perf_counter()
                tensors = list(pool.map(lambda cb: cb[0].read_direct(k, buffer=cb[1]), places))
                clock["read"] += time.perf_counter() - t1
                put_until_stopped(read_q, (k, tensors, region[at:]), stop)
                del region, places
            put_until_stopped(read_q, None, stop)
        except BaseException as e:  # raised in the calling thread
            put_until_stopped(read_q, _Failure(e), stop)

    def distances(tensor, inputs):
        """The report's distances of one key (squared, summed into pair_sq and result_sq)."""
        t1 = time.perf_counter()
        fused = kernels.sq_distances(inputs, tensor) if kernels.AVAILABLE else None
        for i in range(n):
            result_sq[i] += fused[1][i] if fused else _sq(tensor, inputs[i])
        for i, j in pair_sq:
            pair_sq[i, j] += fused[0][i, j] if fused else _sq(inputs[i], inputs[j])
        clock["distances"] += time.perf_counter() - t1

    # the distances run where there is time: in the merging thread when the fused kernels make the merge
    # cheap (the writer's O_DIRECT writes then set the pace), else in the writer thread beside the merge
    distances_in_writer = not kernels.AVAILABLE

    def writer(target: PlannedWriter):
        try:
            while True:
                item = write_q.get()
                if item is None:
                    return
                k, tensor, inputs = item
                if inputs is not None:
                    distances(tensor, inputs)
                t1 = time.perf_counter()
                target.add(holder.save_name(k), tensor)
                clock["write"] += time.perf_counter() - t1
                del tensor, item, inputs
                gate.give(sizes[k])
        except BaseException as e:
            failures.append(e)
            stop.set()

    failures: list = []
    with atomic_dir(out) as tmp:
        target = PlannedWriter(tmp, plan, parse_size(shard_size))
        threads = [threading.Thread(target=reader, daemon=True), threading.Thread(target=writer, args=(target,),
                                                                                    daemon=True)]
        for th in threads:
            th.start()
        pbar = bar(total=len(order), desc=f"merging tensors ({m.name})", unit="tensors", enabled=options.progress)
        t = time.perf_counter()
        try:
            while True:
                t1 = time.perf_counter()
                try:  # a failed writer stops the reader, which then sends nothing more: look at failures too
                    item = read_q.get(timeout=0.2)
                except queue.Empty:
                    clock["waiting_for_reads"] += time.perf_counter() - t1
                    if failures:
                        raise failures[0]
                    continue
                clock["waiting_for_reads"] += time.perf_counter() - t1
                if item is None:
                    break
                if isinstance(item, _Failure):
                    raise item.exc
                if failures:
                    raise failures[0]
                k, tensors, room = item
                del item
                inputs = None
                if k in merged_set:
                    inputs, b = tensors[:n], (tensors[n] if base is not None else None)
                    value = merge_tensor(m, k, inputs, weights, None, b, params, context, out=room)
                    if not value.is_floating_point():
                        inputs = None
                    del b
                else:
                    value = tensors[0]
                del tensors, room
                if inputs is not None and not distances_in_writer:
                    distances(value, inputs)
                    inputs = None
                put_until_stopped(write_q, (k, value, inputs), stop)  # inputs: held (within the budget) until written
                del value, inputs
                pbar.update(1)
            write_q.put(None)
            threads[1].join()
            if failures:
                raise failures[0]
        except BaseException:
            stop.set()
            target.abort()
            raise
        finally:
            pbar.close()
            pool.shutdown(wait=False)
        timings["merge"] = time.perf_counter() - t
        files = target.close()
        (tmp / "config.json").write_text(_config_text(holder))
        hk = heads[0]
        head_info = head_report(hk, options.heads, requested_heads, options.head_from, names,
                                heads[options.head_from])
        import math

        pairs = {f"{names[i]} | {names[j]}": math.sqrt(v) for (i, j), v in pair_sq.items()}
        report = {
            "method": m.name, "params": params,
            "weights": list(options.weights) if options.weights is not None else None,
            "models": names, "base": str(options.base) if options.base is not None else None,
            "model_type": model_type, "alignment": alignment, "head": head_info, "statistics": None,
            "distances_between_inputs": {"before_alignment": pairs, "after_alignment": dict(pairs)},
            "distance_result_to_inputs": {nm: math.sqrt(v) for nm, v in zip(names, result_sq)},
            "device": "cpu", "repair": None,
            "mode": "stream",
            "stream": {"shards": files, "bytes_written": target.total_bytes, "largest_tensor_bytes": largest,
                       "read_ahead_budget_bytes": int(limit), "read_ahead_peak_bytes": gate.peak,
                       "direct_io": {"reads": sum(any(direct.reads_directly(f) for f in set(c.file_of.values()))
                                                  for c in everything),
                                     "writes": target.wrote_directly},
                       "seconds": {k: round(v, 4) for k, v in clock.items()}},
            "tokenizer": tokenizer,
            **({"sentence_transformers": embedding} if embedding else {}),
            **({"base_adapted": adapted} if adapted else {}),
        }
        # side files, and a sentence-transformers pipeline with its module weights merged by the same method
        report["side_files"] = copy_side_files(holder.folder, tmp, report, merge_pipeline_modules)
        timings["total"] = time.perf_counter() - t0
        report["timings"] = timings
        if write_hook is not None:
            write_hook(tmp, report)
        write_card(tmp, report)  # README.md, the output's own model card
        write_json(tmp / "symmerge_report.json", report)
    return report


def _closest_to_average(ckpts) -> tuple[int, list[float]]:
    """(index of the model closest (L2) to the plain average, every model's distance), one tensor at a time."""
    import math

    sq = [0.0] * len(ckpts)
    for k in ckpts[0].keys():
        ts = [c.read_direct(k) for c in ckpts]
        if not ts[0].is_floating_point():
            continue
        avg = {"x": sum(t.double() for t in ts) / len(ts)}
        for i, t in enumerate(ts):
            sq[i] += sq_distance({"x": t}, avg, ["x"])
    dists = [math.sqrt(v) for v in sq]
    return min(range(len(dists)), key=dists.__getitem__), dists


def _aligned_streaming(models, out, options, align, ckpts, base, shard_size, budget, write_hook, t0) -> dict:
    """Each model aligned to the anchor with :func:`symmerge.pipeline.stream.align_streaming` (one part of
    a layer at a time, into temporary shards beside ``out``), then the aligned folders merged tensor by
    tensor; the temporary folders are removed whatever happens."""
    import shutil
    import tempfile

    from ..pipeline.options import AlignOptions
    from ..pipeline.stream import align_streaming

    names = [str(x) for x in models]
    anchor = options.anchor
    if isinstance(anchor, int):
        if not -len(models) <= anchor < len(models):
            raise SymmergeError(f"anchor index {anchor} out of range for {len(models)} models")
        idx, info = anchor % len(models), {"rule": "given"}
    elif anchor is not None:
        idx, info = None, {"rule": "given"}
    elif base is not None:
        idx, info = None, {"rule": "base model"}
        anchor = options.base
    elif len(models) == 2:
        idx, info = 1, {"rule": "second of two"}
    else:
        with stage("chose the anchor (closest to the average)", enabled=options.progress):
            idx, dists = _closest_to_average(ckpts)
        info = {"rule": "closest to the average", "distances_to_average": dists}
    anchor_path = Path(models[idx]) if idx is not None else Path(anchor)
    info = {"index": idx, "name": str(anchor_path), **info}
    targets = [(i, Path(x)) for i, x in enumerate(models) if i != idx]
    if options.base is not None and Path(options.base) != anchor_path:
        targets.append(("base", Path(options.base)))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=temp_prefix(out, "aligned"), dir=out.parent))  # a later run knows it
    t = time.perf_counter()
    try:
        aligned, base_path, rows, resolved = list(models), options.base, [], None
        for i, path in targets:
            with stage(f"aligned {path} to the anchor (streamed)", enabled=options.progress):
                rep = align_streaming(path, anchor_path, work / f"model-{i}", options=align,
                                      progress=options.progress)
            resolved = rep.get("symmetries", resolved)
            if i == "base":
                base_path = work / f"model-{i}"
            else:
                aligned[i] = work / f"model-{i}"
            rows.append({"model": str(path), "anchor": False, "distance_before": rep["distance_before"],
                         "distance_after": rep["distance_after"], "verify_max_rel_diff": None,
                         "seconds": rep.get("seconds")})
        if idx is not None:
            rows.insert(idx, {"model": names[idx], "anchor": True})
        alignment = {"symmetries": list(resolved or []), "requested": options.align.requested,
                     "rescale": align.effective_rescale, "anchor": info, "models": rows, "streamed": True}
        if options.use_joint(len(models)):  # auto: more than two models, no anchor
            alignment["note"] = ("streamed: every model was aligned to one anchor (the star); joint alignment into "
                                 "one frame needs the models in memory (--mode memory)")
        timings = {"align": time.perf_counter() - t}
        plain = replace(options, align=AlignOptions(symmetries="none"), base=base_path, anchor=None)
        report = _merge_streaming(aligned, out, plain, shard_size, budget,
                                  _renamed(names, options, write_hook, alignment, timings, t0))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _renamed(names, options, write_hook, alignment, timings, t0):
    """A write hook that gives the merged report the input models' names (not the temporary aligned
    folders'), the alignment and its time before calling ``write_hook``."""
    def hook(tmp, report):
        report["alignment"] = alignment
        report["timings"].update(timings, total=time.perf_counter() - t0)
        aligned = report["models"]
        rename = dict(zip(aligned, names))
        report["models"] = list(names)
        report["base"] = str(options.base) if options.base is not None else None
        after = report["distances_between_inputs"]["after_alignment"]
        report["distances_between_inputs"] = {  # before alignment: per model, alignment.models' distance_before
            "before_alignment": None,
            "after_alignment": {" | ".join(rename.get(p, p) for p in pair.split(" | ")): v for pair, v in after.items()}}
        report["distance_result_to_inputs"] = {rename.get(k, k): v for k, v in report["distance_result_to_inputs"].items()}
        if report["head"].get("from"):
            report["head"]["from"] = names[options.head_from]
        if write_hook is not None:
            write_hook(tmp, report)
    return hook


def _config_text(ckpt: LazyCheckpoint) -> str:
    """The holder's config.json, with the inferred ``architectures`` written in when it had none."""
    import json

    text = (ckpt.folder / "config.json").read_text()
    config = json.loads(text)
    if not config.get("architectures") and ckpt.config.get("architectures"):
        config["architectures"] = ckpt.config["architectures"]
        return json.dumps(config, indent=2, sort_keys=True) + "\n"
    return text
