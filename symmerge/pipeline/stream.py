"""Streaming alignment: checkpoints larger than memory, aligned layer by layer.

Neither model is ever loaded whole. The spec is resolved against the safetensors headers. Tensors no
group touches (embeddings, norms, heads) are copied through one by one; then the layers go through
the same engine as in-memory alignment (:mod:`symmerge.pipeline.engine`), in one of two modes:

* **low memory** (default): each layer is split into parts that share no tensor (attention, FFN);
  one part at a time is read from both models (``safe_open``), solved, checked, applied and handed to
  the shard writer, whose shards are cut at about one layer. A part whose kind has a read-once costly
  step (the FFN permutation: its float64 cost built block by block from GEMMs on ``device``, consumed
  in place by the exact assignment) runs that step first on tensors read on demand, before the part
  is read whole. Peak memory ≈ interpreter + the largest part of both models + its n × n cost.
  The engine's layer pool does not apply here: the engine is handed one part of one layer at a time,
  which it solves in the calling thread with torch's intra-op threads (the GEMMs use every core), so
  memory stays bounded by one part whatever ``workers`` is.
* **pipeline**: a reader thread stays one layer ahead, layers are solved on a pool of threads
  (the GEMMs of one layer overlap another's assignment), and a writer thread writes shards; a few
  layers in memory (``workers``, default 2, layers solved at once; the reader stays at most that many
  layers ahead), I/O hidden behind compute.

Both use the per-layer symmetries; the residual stream couples every layer and is refused here, and so is
a group tied across a stack (T5's self-attention heads; 'recommended' leaves it out).
Every group element is checked to be valid (hence function-preserving); ``verify_forward``
additionally loads both models afterwards and compares their outputs, for checkpoints that fit.
"""

from __future__ import annotations

import json
import queue
import shutil
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..core.distance import sq_distance
from ..core.layout import check_layouts
from ..core.parallel import put_until_stopped
from ..core.resolve import config_sizes, resolve, value_keys
from ..core.slots import HALF
from ..errors import SymmergeError
from ..families import spec_for
from ..io.finite import non_finite
from ..io.checkpoint import LazyCheckpoint, ShardWriter, parse_size
from ..io.model import atomic_dir, copy_side_files, write_json, written_dtype
from ..io.prefix import adapt_checkpoint_pair
from ..io.card import write_card
from ..io.sentence_transformers import check_pipelines
from ..io.tokenizers import check_tokenizers
from .engine import SolveContext, active, parts, prepare_costly, solve_local
from .align_steps import execute_steps, source
from .align_plan import per_layer_only, plan_align, plan_report, streamed_spec
from .options import AlignOptions
from .recommend import recommended
from .report import Distances, alignment_report
from .verify import ELEMENT_CHECK, copies_entry, out_of_range, verify_elements

DEFAULT_SHARD = "1GB"
MIN_LOW_MEMORY_SHARD = 64 * 2 ** 20  # low-memory mode: shards of about one layer, not smaller than this


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


def layer_instances(ckpt: LazyCheckpoint, layers=None, opts=None, options: AlignOptions | None = None):
    """(spec, {layer: its active group instances}) resolved against the checkpoint's headers (the
    per-layer groups; the few tensors whose values binding needs are read). With ``options`` instead of
    ``opts``: (spec, instances, ``options`` resolved against them — 'recommended' keeps the symmetries
    whose groups stream)."""
    spec = streamed_spec(ckpt.config["model_type"])
    sizes = config_sizes(spec, ckpt.hf_config)
    shapes = ckpt.meta()
    shapes.update(ckpt.read(value_keys(spec, list(shapes), sizes["num_layers"])))  # a few small tensors
    instances = resolve(spec, shapes, sizes.pop("num_layers"), sizes.pop("num_heads"), layers, model_wide=False,
                        ties=ckpt.ties, disk_names=ckpt.disk_name, **sizes)
    asked = options is not None and options.recommended
    if options is not None:
        options, _ = recommended(options, available=[i.group.symmetry for i in instances], streamed=True)
        opts = options.solver_options(opts.device if opts is not None else None)
    if opts is not None:
        instances = active(instances, opts)
    by_layer = _by_layer(per_layer_only(instances, asked))
    if options is not None:
        return spec, by_layer, options
    return spec, by_layer


def _by_layer(instances) -> dict:
    """``{layer: its instances}``, layers in order."""
    by_layer: dict[int, list] = defaultdict(list)
    for inst in instances:
        by_layer[inst.layer].append(inst)
    return dict(sorted(by_layer.items()))


class OnDemand(Mapping):
    """A checkpoint's tensors ``keys`` as a read-only mapping that reads a tensor each time it is asked
    for and keeps nothing (a cost GEMM uses each member once)."""

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


def _part_keys(part) -> list[str]:
    return sorted({s.key for i in part for s in i.slots})


class _Job:
    """Solving one part (or layer): solve, check, run the plan's steps of its tensors, distances; ``(the new
    tensors by disk name, their float32 values before rounding or None)``. The job owns the dicts of the part's
    tensors it is given (the callers keep no reference): it empties them, a tensor of each model as soon as its
    new tensor is made, so the part's inputs and outputs are not all in memory at once."""

    def __init__(self, ckpt_a, opts, timings, distances, lock, steps: dict, exact: bool = False, bound=()):
        self.ckpt_a, self.opts, self.timings, self.distances, self.lock = ckpt_a, opts, timings, distances, lock
        self.steps = steps  # the plan's steps by tensor
        self.exact = exact  # --verify-forward of half-precision files: the float32 values before rounding too
        # every per-layer instance bound, by layer: what a kind reads of the groups beside it (GQA heads pair their
        # query heads on the attention groups' tensors, aligned or not), as the in-memory solve sees every one
        self.bound: dict = defaultdict(list)
        for inst in bound:
            if inst.layer >= 0:  # a model-wide group (layer -1) is never a part's neighbour
                self.bound[inst.layer].append(inst)

    def context(self, part) -> SolveContext:
        """The part's instances, and the bound ones of its layers that read only its tensors (not solved)."""
        keys = {s.key for i in part for s in i.slots}
        names = {i.name for i in part}
        beside = [i for layer in {i.layer for i in part} for i in self.bound.get(layer, ())
                  if i.name not in names and {s.key for s in i.slots} <= keys]
        return SolveContext(list(part) + beside)

    def __call__(self, part, sd_a, sd_b, prepared=None) -> tuple:
        self._no_alias(sd_a)
        t0 = time.perf_counter()
        group_times: dict = defaultdict(float)
        # solved on float32 copies of half tensors, as in memory (verify.working_copies): the head blocks are then
        # float64 (core.slots.precise_dtype), not float32; each copy is made when a kind reads the tensor
        elements = solve_local(part, Lifted(sd_a), Lifted(sd_b), self.opts, prepared=prepared,
                               ctx=self.context(part), timings=group_times)
        t1 = time.perf_counter()
        verify_elements(part, elements)
        out, exact = {}, ({} if self.exact else None)
        for k in list(sd_a):  # one tensor at a time: one float32 result in memory, not the part's
            new = execute_steps([self.steps[k]], sd_a, part, elements, rounded=False)[k]
            if new.is_floating_point() and not torch.isfinite(new).all():
                raise SymmergeError(f"{self.ckpt_a.disk_name[k]}: aligned tensor is not finite")
            if exact is not None:
                exact.update(self.ckpt_a.to_disk(k, _float32(new)))
            new = new.to(sd_a[k].dtype)  # the one rounding
            if non_finite({k: new}) is not None:  # past float16's range, say
                raise SymmergeError(out_of_range(self.ckpt_a.disk_name[k], new.dtype))
            before, after = (sq_distance(x, sd_b, [k]) for x in (sd_a, {k: new}))  # of what is written, as in memory
            with self.lock:
                self.distances.add(k, before, after)
            out.update(self.ckpt_a.to_disk(k, new))
            del sd_a[k], sd_b[k], new  # the job owns the part's tensors: each goes once its result is made
        with self.lock:
            for name, sec in group_times.items():
                self.timings[f"solve {name}"] += sec
            self.timings["check_apply_distances"] += time.perf_counter() - t1
        return out, exact

    def _no_alias(self, sd_a) -> None:
        """Every tensor of a part is its own maps' source: a declared tie's alias never reaches a job
        (``LazyCheckpoint`` folds an alias stored beside its source, the prefix view has no ties, ``--stream --untie``
        is refused); one that did would be written from its source's step, so it is one error, not a silent copy."""
        aliases = [k for k in sd_a if self.steps[k].maps and source(self.steps[k]) != k]
        if aliases:
            raise SymmergeError(f"streamed alignment: {', '.join(self.ckpt_a.disk_name.get(k, k) for k in aliases)} "
                                f"reached a part as a tie's alias (of {source(self.steps[aliases[0]])}); the "
                                "checkpoint should have folded it into its source")


def _float32(t: torch.Tensor) -> torch.Tensor:
    return t.float() if t.is_floating_point() else t


def _lifted(dtype: torch.dtype) -> torch.dtype:
    """The working copy's dtype of a tensor stored in ``dtype``: float32 for float16/bfloat16, else ``dtype``."""
    return torch.float32 if dtype in HALF else dtype


def _lift(t: torch.Tensor) -> torch.Tensor:
    """A float16/bfloat16 tensor's float32 copy (exact); any other tensor itself."""
    return t.to(_lifted(t.dtype))  # ``to`` its own dtype: the tensor itself


class Lifted(Mapping):
    """``sd`` as the in-memory alignment's working copies see it (:func:`~symmerge.pipeline.verify.working_copies`):
    every float16/bfloat16 tensor as a float32 copy, made each time it is read and kept by no one here (one part's
    float32 copies are never all in memory at once unless a kind holds them)."""

    def __init__(self, sd: Mapping):
        self.sd = sd

    def __getitem__(self, key):
        return _lift(self.sd[key])

    def stored(self, key):
        """The tensor as stored, for readers whose arithmetic is float64 whatever its dtype
        (:func:`~symmerge.core.slots.stored`)."""
        return self.sd[key]

    def working_dtype(self, key) -> torch.dtype:
        """The dtype of ``self[key]``, without its copy (:func:`~symmerge.core.slots.working_dtype`)."""
        return _lifted(self.sd[key].dtype)

    def __iter__(self):
        return iter(self.sd)

    def __len__(self):
        return len(self.sd)


def _write(writer, exact_writer, result) -> None:
    """A job's result into the output's writer (and its float32 values into ``exact_writer``, if any)."""
    tensors, exact = result
    for k, t in tensors.items():
        writer.add(k, t)
    if exact_writer is not None:
        for k, t in exact.items():
            exact_writer.add(k, t)


def _run_low_memory(by_layer, ckpt_a, ckpt_b, writers, job: _Job, opts, pbar, timings, trim):
    """One tensor-disjoint part of one layer at a time. A part with a read-once costly step (the FFN
    assignment) runs it on tensors read on demand before the part is read whole: the cost matrix never
    shares memory with the part's tensors. ``writers``: the output's and the float32 copies' (or None)."""
    writer, exact_writer = writers
    for layer, insts in by_layer.items():
        for part in parts(insts):
            keys = _part_keys(part)
            prepared = None
            if any(i.kind.streams_costs for i in part):
                writer.flush()  # no pending shard beside the cost matrix (shards: about one layer each)
                trim()
                lazy_a, lazy_b = OnDemand(ckpt_a, keys), OnDemand(ckpt_b, keys)
                t0 = time.perf_counter()
                prepared = prepare_costly(part, lazy_a, lazy_b, opts, SolveContext(list(part)))
                timings["read"] += lazy_a.seconds + lazy_b.seconds
                timings["costs_and_assignments"] += time.perf_counter() - t0 - lazy_a.seconds - lazy_b.seconds
                trim()
            writer.make_room(sum(ckpt_a.nbytes(k) for k in keys))
            t0 = time.perf_counter()
            sd_a, sd_b = ckpt_a.read(keys), ckpt_b.read(keys)
            timings["read"] += time.perf_counter() - t0
            result = job(part, sd_a, sd_b, prepared)
            del sd_a, sd_b
            t0 = time.perf_counter()
            _write(writer, exact_writer, result)
            del result
            timings["write"] += time.perf_counter() - t0
            trim()
        pbar.update(1)


def _reader(jobs, ckpt_a: LazyCheckpoint, ckpt_b: LazyCheckpoint, out: queue.Queue, stop: threading.Event,
            ahead: threading.Semaphore):
    try:
        for layer, keys in jobs:
            while not ahead.acquire(timeout=0.2):  # stay a bounded number of layers ahead
                if stop.is_set():
                    return
            if stop.is_set():
                return
            put_until_stopped(out, (layer, ckpt_a.read(keys), ckpt_b.read(keys)), stop)
        out.put(None)
    except BaseException as e:  # handed to the main thread, which raises it
        out.put(_Failure(e))


def _run_pipelined(by_layer, ckpt_a, ckpt_b, writers, job: _Job, pbar, timings, workers: int):
    """Reader thread one layer ahead, ``workers`` layers solved at once, results written in layer order
    (``writers``: the output's and the float32 copies' or None)."""
    jobs = [(layer, _part_keys(insts)) for layer, insts in by_layer.items()]
    stop = threading.Event()
    layers_q: queue.Queue = queue.Queue(maxsize=1)
    ahead = threading.Semaphore(workers)
    reader = threading.Thread(target=_reader, args=(jobs, ckpt_a, ckpt_b, layers_q, stop, ahead), daemon=True)
    reader.start()
    pending: list = []

    def drain(limit: int):
        while len(pending) > limit:
            result = pending.pop(0).result()
            t0 = time.perf_counter()
            _write(*writers, result)
            timings["write"] += time.perf_counter() - t0
            pbar.update(1)

    try:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            while True:
                t_wait = time.perf_counter()
                item = layers_q.get()
                timings["waiting_for_reads"] += time.perf_counter() - t_wait
                if item is None:
                    break
                if isinstance(item, _Failure):
                    raise item.exc
                layer, sd_a, sd_b = item
                future = pool.submit(job, by_layer[layer], sd_a, sd_b)
                future.add_done_callback(lambda _: ahead.release())
                pending.append(future)
                del sd_a, sd_b, item
                drain(workers)
            drain(0)
    except BaseException:
        stop.set()
        raise


def align_streaming(model, anchor, out, options: AlignOptions | None = None, *, shard_size=DEFAULT_SHARD,
                    progress: bool = True, pipeline: bool = False, allow_tokenizer_mismatch: bool = False,
                    plan=None, model_heads=()) -> dict:
    """Align the safetensors checkpoint folder ``model`` to ``anchor`` layer by layer and write the
    result to the folder ``out`` (atomically, in shards of at most ``shard_size``) with ``options`` (an
    :class:`AlignOptions`; default: ``recommended``, less what cannot stream; its ``symmetries``, ``rescale``,
    ``layers``, ``device``, ``verify_tol`` and ``workers`` apply; its matcher must stream). Returns the report
    (also written as ``out/symmerge_report.json``).

    Default (low memory): one tensor-disjoint part of a layer at a time, shards cut at about one
    layer; peak memory ≈ the largest part of both models + its cost matrix. ``pipeline=True``
    overlaps reading, solving (``options.workers`` layers at once, default 2) and writing across layers.
    ``plan``: the alignment's :class:`~symmerge.pipeline.align_plan.AlignPlan` (``options`` are its resolved ones;
    without one it is planned here, from the headers), from which the report is built; its ``verify_forward``
    (``--verify-forward``) loads both models after writing and compares their outputs. ``model_heads``: tensors the
    anchor takes from the model (a streamed merge's anchor proxy, as in memory and as
    :func:`~symmerge.pipeline.learn_layerwise_write.align_learned_streaming` takes it: a head's distance is 0.0, so
    the whole model's distance is the body's, summed once)."""
    from ..device import resolve_device
    from ..progress import stage

    start = time.perf_counter()
    options = options if options is not None else AlignOptions()
    tokenizer, embedding = _checked_streaming(model, anchor, options, allow_tokenizer_mismatch)
    workers = options.workers or 2
    dev = resolve_device(options.device)
    max_bytes = parse_size(shard_size)
    # pipeline: every allocation over 1 MB is its own mmap. Low memory: temporaries up to 32 MB (GEMM and
    # head blocks) are reused from the heap (a fresh mmap costs page faults on every block), whose free
    # pages are handed back after each part
    trim = _bound_malloc((1 if pipeline else 32) << 20)
    with stage("read the checkpoint headers", enabled=progress):
        ckpt_a, ckpt_b = LazyCheckpoint(model, fused=True), LazyCheckpoint(anchor, fused=True)
    ckpt_a, ckpt_b, adapted = adapt_checkpoint_pair(ckpt_a, ckpt_b)  # a base model and a fine-tune of its task class
    check_layouts([ckpt_a.layout("model"), ckpt_b.layout("anchor")])
    if plan is None:  # planned here, from the checkpoints just read
        plan = plan_align(model, anchor, options, stream=True, pipeline=pipeline, checkpoints=(ckpt_a, ckpt_b))
    verify_forward = plan.verify_forward
    requested, options = plan.requested, plan.options  # 'recommended' resolved by the plan
    spec, by_layer = streamed_spec(plan.model_type), _by_layer(plan.solved())
    opts = options.solver_options(dev)
    trim()  # the weightless model built to map tensor names is garbage now
    layer_keys = [set(_part_keys(insts)) for insts in by_layer.values()]
    passthrough = [s.tensor for s in plan.steps if s.op == "copy"]  # the plan's copies, in the output's order
    largest_layer = max([sum(ckpt_a.nbytes(k) for k in keys) for keys in layer_keys], default=0)
    if not pipeline:  # the writer's buffer is memory too: cut shards at about one layer
        max_bytes = min(max_bytes, max(largest_layer, MIN_LOW_MEMORY_SHARD))

    timings: dict = defaultdict(float)
    distances = Distances()
    exact = verify_forward and _half(ckpt_a)  # half-precision files: checked on float32 values, as in memory
    job = _Job(ckpt_a, opts, timings, distances, threading.Lock(), {s.tensor: s for s in plan.steps}, exact, plan.bound)
    with atomic_dir(out) as tmp:
        writer = ShardWriter(tmp, max_bytes)
        writers = (writer, _exact_writer(tmp, max_bytes) if exact else None)
        _copy_untouched(passthrough, (ckpt_a, ckpt_b), writers, distances, progress, set(model_heads))
        _run_layers(by_layer, (ckpt_a, ckpt_b), writers, job, opts, timings, trim, workers if pipeline else 0, progress)
        names = writer.close()
        side_files = copy_side_files(Path(model), tmp, {"sentence_transformers": embedding})
        (tmp / "config.json").write_text(written_dtype((Path(model) / "config.json").read_text(),
                                                          set(ckpt_a.dtype.values())))
        instances = [i for insts in by_layer.values() for i in insts]
        report = alignment_report(
            spec, ckpt_a.config["model_type"], options, instances, distances, model=str(model), anchor=str(anchor),
            streamed=True, mode="pipeline" if pipeline else "low-memory", device=str(dev), verify=ELEMENT_CHECK,
            shards=names, bytes_written=writer.total_bytes, largest_layer_bytes=largest_layer,
            timings={k: round(v, 4) for k, v in timings.items()}, symmetries_requested=requested,
            side_files=side_files, tokenizer=tokenizer, **({"base_adapted": adapted} if adapted else {}),
            **({"sentence_transformers": embedding} if embedding else {}))
        report["match_seconds"] = time.perf_counter() - start
        if _half(ckpt_a) or _half(ckpt_b):  # solved on float32 copies (Lifted), as in memory: the same entry
            report["working_copies"] = copies_entry("float32", [_stored(c) for c in (ckpt_a, ckpt_b)])
        if verify_forward:
            with stage("verified the aligned model's outputs", enabled=progress):
                report.update(_verify_forward(model, tmp, options.verify_tol, (ckpt_a, ckpt_b) if exact else None))
        report["seconds"] = time.perf_counter() - start
        report = plan_report(plan, report)  # the CLI's report, whoever planned
        write_card(tmp, report)  # README.md, the output's own model card
        write_json(tmp / "symmerge_report.json", report)
    return report


def _run_layers(by_layer, ckpts, writers, job: _Job, opts, timings, trim, workers: int, progress: bool) -> None:
    """Every layer through ``job`` into ``writers`` (the output's and the float32 copies' or None, which is closed
    here), low memory or (``workers`` > 0) pipelined."""
    from ..progress import bar

    pbar = bar(total=len(by_layer), desc="aligning layers", unit="layers", enabled=progress)
    try:
        if workers:
            _run_pipelined(by_layer, *ckpts, writers, job, pbar, timings, workers)
        else:
            _run_low_memory(by_layer, *ckpts, writers, job, opts, pbar, timings, trim)
    finally:
        pbar.close()
    if writers[1] is not None:
        writers[1].close()


def _checked_streaming(model, anchor, options: AlignOptions, allow_tokenizer_mismatch: bool) -> tuple:
    """(the tokenizers' facts, a sentence-transformers pipeline's) of a streamed alignment, after the checks made
    before anything is read: the options stream (:meth:`AlignOptions.streamed_refusal`), the tokenizers agree, an
    explicit symmetry can stream."""
    refusal = options.streamed_refusal()
    if refusal:
        raise SymmergeError(refusal)
    tokenizer = check_tokenizers([(str(model), model), (str(anchor), anchor)], allow_tokenizer_mismatch)
    embedding = check_pipelines([(str(model), model)])  # sentence-transformers; the stream's frame never streams
    if not options.recommended:  # an explicit symmetry that cannot stream: refused before anything is read
        recommended(options, streamed=True)
    return tokenizer, embedding


def _copy_untouched(keys, ckpts, writers, distances, progress: bool, own=frozenset()) -> None:
    """The tensors no group touches (``keys``) of the pair ``ckpts``: one at a time, straight through (their
    distances recorded; those in ``own``, the model's heads the anchor proxy takes, measured against themselves:
    0.0); ``writers``: the output's and the float32 copies' (or None)."""
    from ..progress import bar

    (ckpt_a, ckpt_b), (writer, exact_writer) = ckpts, writers
    for k in bar(keys, desc="copying untouched tensors", unit="tensors", enabled=progress):
        writer.make_room(ckpt_a.nbytes(k))
        ta = ckpt_a.read([k])
        tb = ta if k in own else ckpt_b.read([k])
        d = sq_distance(ta, tb, [k])
        distances.add(k, d, d)
        for name, t in ckpt_a.to_disk(k, ta[k]):
            writer.add(name, t)
            if exact_writer is not None:
                exact_writer.add(name, _float32(t))
        del ta, tb
    writer.flush()


EXACT = ".verify-float32"  # inside the temporary output: the aligned float32 values --verify-forward compares


def _half(ckpt: LazyCheckpoint) -> bool:
    return any(d in HALF for d in ckpt.dtype.values())


def _exact_writer(tmp: Path, max_bytes: int) -> ShardWriter:
    (tmp / EXACT).mkdir()
    return ShardWriter(tmp / EXACT, max_bytes)


def _stored(ckpt: LazyCheckpoint) -> str:
    """The dtype most of a checkpoint's floating-point values are stored in, by name."""
    sizes: dict = defaultdict(int)
    for k, d in ckpt.dtype.items():
        if d.is_floating_point:
            sizes[d] += ckpt.nbytes(k)
    return str(max(sizes, key=sizes.get)).removeprefix("torch.")


def _verify_forward(model, aligned_dir, verify_tol, pair=None) -> dict:
    """Load the original and the aligned folder and compare outputs (needs both in memory). ``pair``: the two
    checkpoints, when ``model`` is stored in half precision: the aligned model's float32 values before their
    rounding (written to ``aligned_dir/.verify-float32``, removed here) are compared with the input's float32
    copy, as the in-memory alignment compares them (:func:`~symmerge.pipeline.verify.working_copies`)."""
    from ..io.reader import load_model
    from .verify import copies_entry, verify_forward

    a = load_model(model)
    if pair is None:
        return verify_forward(a, load_model(aligned_dir), spec_for(a.config.model_type), verify_tol)
    exact = Path(aligned_dir) / EXACT
    config = json.loads((Path(aligned_dir) / "config.json").read_text())
    config.update({k: "float32" for k in ("dtype", "torch_dtype") if k in config} or {"dtype": "float32"})
    (exact / "config.json").write_text(json.dumps(config))
    result = verify_forward(a.float(), load_model(exact), spec_for(a.config.model_type), verify_tol)
    shutil.rmtree(exact)
    return {**result, "working_copies": copies_entry("float32", [_stored(c) for c in pair])}
