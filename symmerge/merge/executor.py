"""The streamed executor: a merge plan's :class:`~symmerge.merge.steps.TensorStep` s run tensor by tensor from
safetensors folders into a new folder, never holding a model.

:func:`execute_steps` is the one entry (the streamed wing of ``symmerge merge`` and the config language's
runner both call it); :class:`StreamExecutor` is its reader / merger / writer:

* the inputs' headers give every source tensor's shape and dtype; every step is checked against them (its
  sources exist, agree in shape) before anything is written, and the output shards' headers are planned;
* a method's model-wide quantities (TIES's magnitude threshold, ``scope="model"``) are found first by its
  ``prepare`` hook over mappings that map one tensor at a time (source position ``i`` of every merged step:
  :class:`StepView`);
* then a reader thread reads the next step's source tensors (straight from the files, no memory map) into
  a ring buffer of the read-ahead budget (:func:`default_budget`), the calling thread merges them with
  :func:`~symmerge.merge.base.merge_tensor` into the ring — the very function the in-memory loop runs, so
  both give the same bits — and a writer thread appends each result to the output shard, whose header was
  written first (:class:`~symmerge.io.checkpoint.PlannedWriter`), then frees its part of the ring.

Peak memory ≈ interpreter + the sources of the largest step × a small factor, whatever the model size.
"""

from __future__ import annotations

import json
import math
import queue
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from ..core.parallel import put_until_stopped
from ..errors import SymmergeError
from ..io import direct
from ..io.checkpoint import LazyCheckpoint, PlannedWriter, parse_size
from ..io.model import atomic_dir, copy_side_files, written_dtype
from ..io.output import check_free_space
from ..progress import bar, stage
from .base import merge_tensor
from .distances import SquaredSums
from .in_dtype import mergekit_threads, remember_threads
from .outputs import check_result, refuse_non_finite
from .steps import TensorStep, file_order, step_arguments

DEFAULT_SHARD = "2GB"  # output shards: written as they come, never held, so their size costs no memory


class StepView(Mapping):
    """Source position ``position`` of every merged step (or the steps' base, ``position=None``) as a
    mapping output name → tensor, each mapped from its file when asked for
    (:meth:`~symmerge.io.checkpoint.LazyCheckpoint.map_direct`: a model visited twice is read from the page
    cache in place, not copied twice): what a method's ``prepare`` hook reads."""

    def __init__(self, ckpts, steps, position):
        self.ckpts = ckpts
        self.src = {s.name: (s.base if position is None else s.sources[position]) for s in steps}

    def _at(self, key):
        src = self.src[key]
        return self.ckpts[src.model], src.key

    def __getitem__(self, key):
        c, k = self._at(key)
        return c.map_direct(k, check=False)  # NaN/Inf: refused by the merge loop's reads, before any output

    def numel(self, key) -> int:
        c, k = self._at(key)
        return math.prod(c.shape[k])

    def dtype(self, key):
        c, k = self._at(key)
        return c.dtype[k]

    def read_blocks(self, key, first: int, stride: int, width: int):
        c, k = self._at(key)
        return c.read_blocks(k, first, stride, width)

    def __iter__(self):
        return iter(self.src)

    def __len__(self):
        return len(self.src)


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


class MemorySource:
    """A state dict as one of the executor's sources, with the reads of a
    :class:`~symmerge.io.checkpoint.LazyCheckpoint` (the in-memory merge is the executor with memory sources):
    a read hands the tensor itself — no copy, nothing placed in the read-ahead ring (:meth:`room` is 0)."""

    def __init__(self, tensors: dict, name: str = "model"):
        self.tensors, self.folder = tensors, Path(name)
        self.shape = {k: tuple(t.shape) for k, t in tensors.items()}
        self.dtype = {k: t.dtype for k, t in tensors.items()}
        self.file_of: dict = {}  # no files: no direct I/O

    def keys(self) -> list[str]:
        return list(self.tensors)

    def nbytes(self, key: str) -> int:
        t = self.tensors[key]
        return t.numel() * t.element_size()

    def room(self, key: str) -> int:
        return 0

    def save_name(self, key: str) -> str:
        return key

    def read_direct(self, key: str, check: bool = True, buffer=None):
        return self.tensors[key].detach()

    def map_direct(self, key: str, check: bool = True):
        return self.tensors[key].detach()

    def read_blocks(self, key: str, first: int, stride: int, width: int):
        from ..io.checkpoint import blocks_of

        return blocks_of(self.tensors[key].detach(), first, stride, width)


class MemoryTarget:
    """Where the executor puts the results of a merge in memory: ``tensors`` {output name: tensor} (the
    results are kept, so the executor gives each its own memory, never the ring's)."""

    keeps = True
    wrote_directly = False

    def __init__(self):
        self.tensors: dict = {}
        self.total_bytes = 0

    def add(self, name: str, tensor) -> None:
        self.tensors[name] = tensor
        self.total_bytes += tensor.numel() * tensor.element_size()

    def abort(self) -> None:
        self.tensors.clear()

    def close(self) -> list:
        return []


def _checkpoint(x):
    return x if isinstance(x, (LazyCheckpoint, MemorySource)) else LazyCheckpoint(x, spec=False)


class StreamExecutor:
    """Runs ``steps`` (:class:`TensorStep`) over the checkpoints ``inputs`` (folders or
    :class:`LazyCheckpoint` s) with ``method``: :meth:`run` writes the shards into a folder and returns the
    measured facts. ``dtype``: the output's floating dtype (None: each tensor's reference input's — the base's
    when the step has one, else its first source's). ``naming``: index of the input whose on-disk tensor names
    the output takes (``save_pretrained``'s names). Everything is checked on construction, before any read."""

    def __init__(self, inputs, steps, method, dtype=None, naming: int = 0, shard_size=DEFAULT_SHARD, budget=None,
                 progress: bool = True, distances: bool = True, keep: bool = False):
        """``distances``: measure the report's distances over every merged step (True), over the steps of these
        output names (a collection: the body, as the in-memory merge measures it; a copy named there is measured
        against its one source, :func:`symmerge.merge.steps.measured_steps`), or not (False: a caller that measures
        its own); ``keep``: the results are kept (:class:`MemoryTarget`), so none is placed in
        the ring."""
        if method.needs or method.needs_model:
            raise SymmergeError(f"method {method.name!r} needs the models in memory; it cannot run streamed")
        self.ckpts = [_checkpoint(x) for x in inputs]
        self.steps = [s if isinstance(s, TensorStep) else TensorStep(**s) for s in steps]
        self.method, self.dtype, self.progress = method, dtype, progress
        self.naming = self.ckpts[naming]
        self.measured = None if isinstance(distances, bool) else frozenset(distances)
        self.measure = bool(distances)
        self.max_bytes = parse_size(shard_size)
        self._check()
        # run and written in safetensors' own layout (by dtype, then the name written), whatever order the plan
        # came in (the inputs' files, a config's layers): one output file for one merge, however it was asked for
        self.steps = file_order(self.steps, self.out_dtype, lambda st: self.save_name(st.name))
        self.sizes = [sum(_aligned(self.ckpts[s.model].room(s.key)) for s in self.reads(st)) +
                      (0 if keep else _aligned(max(self.out_bytes(st), self.ref_bytes(st)))) for st in self.steps]
        self.limit = int(budget if budget is not None else default_budget(self.sizes))
        self.largest = max((max(self.ckpts[s.model].nbytes(s.key) for s in self.reads(st)) for st in self.steps),
                           default=0)

    def measures(self, name: str) -> bool:
        """Whether the report's distances sum the merged step ``name``."""
        return self.measure and (self.measured is None or name in self.measured)

    # ------------------------------------------------ the plan, checked against the headers
    @staticmethod
    def reads(step: TensorStep) -> list:
        """The source tensors a step reads, in order: its sources (then its base) when merged, else the one
        it copies."""
        if not step.merge:
            return [step.sources[0]]
        return list(step.sources) + ([step.base] if step.base is not None else [])

    def _ref(self, step: TensorStep):
        s = step.base if (step.merge and step.base is not None) else step.sources[0]
        return self.ckpts[s.model], s.key

    def promoted(self, step: TensorStep):
        """The dtype torch's promotion gives the tensors a step reads (its sources, then its base): mergekit's
        arithmetic on inputs of several dtypes, and the dtype it writes the result in (float32 ties of a float32
        and a bfloat16 fine-tune on a float16 base writes float32; bfloat16 with float16 promotes to float32 too).
        One dtype: that dtype."""
        from .base import promoted_dtype

        return promoted_dtype([self.ckpts[s.model].dtype[s.key] for s in self.reads(step)])

    def out_dtype(self, step: TensorStep):
        dt = self.promoted(step)
        return self.dtype if self.dtype is not None and dt.is_floating_point else dt

    def ref_bytes(self, step: TensorStep) -> int:
        c, k = self._ref(step)
        return c.nbytes(k)

    def out_bytes(self, step: TensorStep) -> int:
        c, k = self._ref(step)
        return math.prod(c.shape[k]) * self.out_dtype(step).itemsize

    def save_name(self, name: str) -> str:
        return self.naming.save_name(name)

    def _check(self) -> None:
        seen = set()
        for st in self.steps:
            if st.name in seen:
                raise SymmergeError(f"output tensor {st.name!r} is planned twice")
            seen.add(st.name)
            if not st.sources:
                raise SymmergeError(f"output tensor {st.name!r} has no source")
            if st.merge and self.method.needs_base and st.base is None:
                raise SymmergeError(f"method {self.method.name!r} needs a base model (the common pre-trained "
                                    f"model): output tensor {st.name!r} has none")
            if st.merge and st.base is not None and not (self.method.needs_base or self.method.accepts_base):
                raise SymmergeError(f"method {self.method.name!r} does not use a base model")
            shape = None
            for s in self.reads(st):
                if not 0 <= s.model < len(self.ckpts):
                    raise SymmergeError(f"output tensor {st.name!r}: source model {s.model} out of range for "
                                        f"{len(self.ckpts)} inputs")
                c = self.ckpts[s.model]
                if s.key not in c.shape:
                    raise SymmergeError(f"output tensor {st.name!r}: {c.folder} has no tensor {s.key!r}")
                if shape is None:
                    shape = c.shape[s.key]
                elif tuple(c.shape[s.key]) != tuple(shape):
                    raise SymmergeError(f"shapes differ for {st.name}: {c.folder}'s {s.key} has "
                                        f"{tuple(c.shape[s.key])}, the first source has {tuple(shape)}")

    def plan(self) -> list:
        """(save name, dtype, shape) of every output tensor, in order: the shards' headers."""
        return [(self.save_name(st.name), self.out_dtype(st), tuple(self._ref(st)[0].shape[self._ref(st)[1]]))
                for st in self.steps]

    # ------------------------------------------------ model-wide quantities
    def prepare(self):
        """The method's ``prepare`` context over the merged steps (the first merged step's weights and
        parameters), or None."""
        m = self.method
        merged = [st for st in self.steps if st.merge]
        if m.prepare is None or not merged:
            return None
        n = len(merged[0].sources)
        if any(len(st.sources) != n for st in merged):
            raise SymmergeError(f"method {m.name!r} finds model-wide quantities: every merged tensor needs the "
                                "same number of sources")
        weights, params = step_arguments(m, merged[0], n)
        views = [StepView(self.ckpts, merged, i) for i in range(n)]
        base = StepView(self.ckpts, merged, None) if merged[0].base is not None else None
        with stage(f"{m.name}: model-wide quantities (one read of every model)", enabled=self.progress), \
                mergekit_threads(self.computes_in(merged[0]), m.half_reductions):
            return m.prepare(views, base, weights, params)

    def computes_in(self, step: TensorStep):
        """The dtype a merged step's arithmetic is in: a config's ``dtype`` (the method's ``computes_in``), else its
        inputs' (:meth:`promoted`: inputs of several dtypes promoted, as mergekit's arithmetic is)."""
        if self.method.computes_in is not None:
            return self.method.computes_in
        return self.promoted(step)

    # ------------------------------------------------ read ahead, merge, write behind
    def run(self, folder=None, target=None) -> dict:
        """Write the output shards into ``folder`` (or hand every result to ``target``, a
        :class:`MemoryTarget`); the measured facts: ``shards``, ``bytes_written``,
        ``largest_tensor_bytes``, the read-ahead ring's budget and peak, direct I/O, the threads' seconds,
        ``seconds`` (prepare, merge), the squared distances summed over the measured steps between source
        positions (``pairwise_sq``: {(i, j): …}) and from the result to each (``result_sq``: {i: …}; the rule of the
        in-memory report, :mod:`symmerge.merge.distances`), and
        ``result_warnings`` (:func:`symmerge.merge.outputs.check_result`: a non-finite result is an error)."""
        import torch

        threads = torch.get_num_threads()
        remember_threads(threads)  # mergekit's arithmetic in the half dtype runs with this count (in_dtype)
        torch.set_num_threads(1)  # parallel work: the reader, merging and writer threads (chunks single-threaded)
        try:
            return self._run(folder, target)
        finally:
            torch.set_num_threads(threads)

    def _run(self, folder, target) -> dict:
        t = time.perf_counter()
        context = self.prepare()
        seconds = {"prepare": time.perf_counter() - t}
        run = _Pass(self, context)
        if target is None:
            target = PlannedWriter(Path(folder), self.plan(), self.max_bytes)
        t = time.perf_counter()
        run.execute(target)
        seconds["merge"] = time.perf_counter() - t
        t = time.perf_counter()
        pair_sq, result_sq = run.sums.totals()  # each summed exactly, once (merge/distances.py)
        run.clock["distances"] += time.perf_counter() - t
        files = target.close()
        return {"shards": files, "bytes_written": target.total_bytes, "largest_tensor_bytes": self.largest,
                "read_ahead_budget_bytes": self.limit, "read_ahead_peak_bytes": run.gate.peak,
                "direct_io": {"reads": sum(any(direct.reads_directly(f) for f in set(c.file_of.values()))
                                           for c in _unique(self.ckpts)),
                              "writes": target.wrote_directly},
                "thread_seconds": {k: round(v, 4) for k, v in run.clock.items()},
                "seconds": seconds, "tensors": len(self.steps), "pairwise_sq": pair_sq,
                "result_sq": result_sq, "result_warnings": run.warnings}


class _Pass:
    """One run of a :class:`StreamExecutor`'s steps: a reader thread reads each step's sources into the read-ahead
    ring (:meth:`reader`), the calling thread merges them (:meth:`merge_all`), a writer thread writes the results
    (:meth:`writer`); what the three share — the ring's gate, the queues, the clocks, the distances, the warnings,
    a failure — is here."""

    def __init__(self, ex: StreamExecutor, context):
        self.ex, self.context = ex, context
        self.gate, self.stop = _Budget(ex.limit), threading.Event()
        self.read_q: queue.Queue = queue.Queue(maxsize=4)
        self.write_q: queue.Queue = queue.Queue(maxsize=4)
        self.clock = {"read": 0.0, "write": 0.0, "distances": 0.0, "waiting_for_reads": 0.0}
        self.sums = SquaredSums()
        self.arg_cache: dict = {}
        self.warnings: list = []
        self.failures: list = []
        # one read per model at once: a deeper I/O queue
        self.pool = ThreadPoolExecutor(max_workers=max(1, len(ex.ckpts)))
        # the distances run in the merging thread: the kernels make the merge cheap (the writer's O_DIRECT writes
        # set the pace)
        self.distances_in_writer = False

    def execute(self, target) -> None:
        """Every step read, merged and handed to ``target``; on any failure the threads are stopped, the target
        aborted, and the failure raised."""
        workers = [threading.Thread(target=self.reader, daemon=True),
                   threading.Thread(target=self.writer, args=(target,), daemon=True)]
        for th in workers:
            th.start()
        pbar = bar(total=len(self.ex.steps), desc=f"merging tensors ({self.ex.method.name})", unit="tensors",
                   enabled=self.ex.progress)
        try:
            self.merge_all(pbar)
            self.write_q.put(None)
            workers[1].join()
            if self.failures:
                raise self.failures[0]
        except BaseException:
            self.stop.set()
            _unblock(self.write_q)
            for th in workers:  # nothing more written into the temporary folder once it is removed
                th.join(timeout=5)
            target.abort()
            raise
        finally:
            pbar.close()
            self.pool.shutdown(wait=False)

    def reader(self) -> None:
        ex, stop = self.ex, self.stop
        try:
            for idx, st in enumerate(ex.steps):
                region = self.gate.take(ex.sizes[idx], stop)  # the inputs' bytes, then the merged output's
                if region is None:
                    return
                places, at = [], 0
                for s in ex.reads(st):
                    c = ex.ckpts[s.model]
                    places.append((c, s.key, region[at:at + c.room(s.key)]))
                    at += _aligned(c.room(s.key))
                t1 = time.perf_counter()
                tensors = list(self.pool.map(lambda p: p[0].read_direct(p[1], buffer=p[2]), places))
                self.clock["read"] += time.perf_counter() - t1
                put_until_stopped(self.read_q, (idx, tensors, region[at:]), stop)
                del region, places
            put_until_stopped(self.read_q, None, stop)
        except BaseException as e:  # raised in the calling thread
            put_until_stopped(self.read_q, _Failure(e), stop)

    def distances(self, idx, tensor, inputs) -> None:
        """The report's distances of one step (:class:`~symmerge.merge.distances.SquaredSums`: the in-memory report's
        rule); a distance that is not finite is a result that is not (the inputs were checked when read): refused
        before it is written."""
        t1 = time.perf_counter()
        st = self.ex.steps[idx]
        to_result = self.sums.add(inputs, tensor)
        if not all(math.isfinite(d) for d in to_result):
            refuse_non_finite(st.name, tensor, self.ex.method, st.params, st.weights)
        self.clock["distances"] += time.perf_counter() - t1

    def writer(self, target: PlannedWriter) -> None:
        try:
            while True:
                item = self.write_q.get()
                if item is None or self.stop.is_set():
                    return
                idx, tensor, inputs = item
                if inputs is not None:
                    self.distances(idx, tensor, inputs)
                t1 = time.perf_counter()
                target.add(self.ex.save_name(self.ex.steps[idx].name), tensor)
                self.clock["write"] += time.perf_counter() - t1
                del tensor, item, inputs
                self.gate.give(self.ex.sizes[idx])
        except BaseException as e:
            self.failures.append(e)
            self.stop.set()

    def merge_all(self, pbar) -> None:
        """The calling thread's loop: every step read is merged (:meth:`merged`) and handed to the writer."""
        while True:
            item = self.next_read()
            if item is None:
                return
            idx, value, inputs = self.merged(item)
            del item
            # inputs: held (within the budget) until written
            put_until_stopped(self.write_q, (idx, value, inputs), self.stop)
            del value, inputs
            pbar.update(1)

    def next_read(self):
        """The next step's read tensors from the reader (None: all read); a failure of either thread raised."""
        while True:
            t1 = time.perf_counter()
            try:  # a failed writer stops the reader, which then sends nothing more: look at failures too
                item = self.read_q.get(timeout=0.2)
            except queue.Empty:
                self.clock["waiting_for_reads"] += time.perf_counter() - t1
                if self.failures:
                    raise self.failures[0]
                continue
            self.clock["waiting_for_reads"] += time.perf_counter() - t1
            if item is None:
                return None
            if isinstance(item, _Failure):
                raise item.exc
            if self.failures:
                raise self.failures[0]
            return item

    def merged(self, item) -> tuple:
        """(the step's index, its result in the output's dtype, the inputs the writer measures distances on or
        None) of one read step: merged (and checked) or copied."""
        ex, m = self.ex, self.ex.method
        idx, tensors, room = item
        st = ex.steps[idx]
        inputs = None
        if st.merge:
            n = len(st.sources)
            inputs, b = tensors[:n], (tensors[n] if st.base is not None else None)
            weights, params = step_arguments(m, st, n, self.arg_cache)
            with mergekit_threads(ex.computes_in(st), m.half_reductions):  # the one place (in_dtype)
                value = merge_tensor(m, st.name, inputs, weights, None, b, params, self.context, out=room)
            # checked before it is written: degenerate warned about; non-finite refused (here when no
            # distances are measured, else by the distances, which a non-finite result makes non-finite)
            measured = ex.measures(st.name) and value.is_floating_point()
            warning = check_result(st.name, value, inputs + [b], m, st.params, st.weights, full=not measured)
            if warning is not None:
                self.warnings.append(warning)
            if not measured:
                inputs = None
            del b
        else:
            value = tensors[0]
            if ex.measured is not None and st.name in ex.measured and value.is_floating_point():
                inputs = [value]  # a copy the caller measures (a one-model passthrough): its distance to its source
        want = ex.out_dtype(st)
        if value.dtype != want:
            value = value.to(want)
        del tensors, room
        if inputs is not None and not self.distances_in_writer:
            self.distances(idx, value, inputs)
            inputs = None
        return idx, value, inputs


def _unblock(q: queue.Queue) -> None:
    """Wake a writer waiting on ``q`` (the end marker; nothing if the queue is full: it is not waiting)."""
    try:
        q.put_nowait(None)
    except queue.Full:
        pass


def _unique(ckpts) -> list:
    out, seen = [], set()
    for c in ckpts:
        if id(c) not in seen:
            seen.add(id(c))
            out.append(c)
    return out


def config_text(ckpt: LazyCheckpoint) -> str:
    """A checkpoint's config.json as written, with the inferred ``architectures`` written in when it had none."""
    text = (ckpt.folder / "config.json").read_text()
    config = json.loads(text)
    if not config.get("architectures") and ckpt.config.get("architectures"):
        config["architectures"] = ckpt.config["architectures"]
        return json.dumps(config, indent=2, sort_keys=True) + "\n"
    return text


@dataclass(frozen=True)
class OutputFolder:
    """How :func:`execute_steps` writes its folder (every field optional).

    ``config``: the output's config.json — a dict (written sorted, indented), a string (written as is), or
    None (the config of ``side_files_from``, else of the naming input). ``dtype``: the output's floating dtype
    (a ``torch.dtype``; None: the inputs'). ``side_files_from``: the folder whose side files (tokenizer,
    generation config, a sentence-transformers pipeline...) are copied (None: none); ``side_report``: the
    merge report the pipeline's module weights are merged by (its ``method``, ``models``, ``weights``...).
    ``naming``: the input whose on-disk names the output's tensors take (default: the input that is
    ``side_files_from``, else 0). ``shard_size``: the largest output shard. ``finish(tmp, facts)``, if given,
    runs on the finished temporary folder before it is renamed (the report, the model card)."""

    config: object = None
    dtype: object = None
    side_files_from: object = None
    side_report: dict | None = None
    naming: int | None = None
    shard_size: object = DEFAULT_SHARD
    finish: object = None


def execute_steps(inputs, steps, method, out, output: OutputFolder = OutputFolder(), *, budget=None,
                  progress: bool = True, distances=True) -> dict:
    """Run ``steps`` (a list of :class:`~symmerge.merge.steps.TensorStep`, sources indexing ``inputs``: model
    folders or :class:`LazyCheckpoint` s) with ``method`` (a :class:`~symmerge.merge.base.Method`) and write
    the folder ``out`` atomically (a temporary folder renamed at the end: an interrupted run leaves none), as
    ``output`` (:class:`OutputFolder`) says. ``budget``: bytes the reader may hold ahead; ``distances``: the
    output names the report's distances are measured over (True: every merged step; :class:`StreamExecutor`).

    Returns the measured facts (:meth:`StreamExecutor.run`, plus ``side_files``)."""
    from .modules import merge_pipeline_modules

    config, side_files_from, naming = output.config, output.side_files_from, output.naming
    ckpts = [_checkpoint(x) for x in inputs]
    if naming is None:
        naming = 0
        if side_files_from is not None:
            naming = next((i for i, c in enumerate(ckpts) if c.folder.resolve() == Path(side_files_from).resolve()), 0)
    ex = StreamExecutor(ckpts, steps, method, dtype=output.dtype, naming=naming, shard_size=output.shard_size,
                        budget=budget, progress=progress, distances=distances)
    check_free_space(out, sum(math.prod(shape) * dt.itemsize for _, dt, shape in ex.plan()))  # before any read
    with atomic_dir(out) as tmp:
        facts = ex.run(tmp)
        if config is None:
            holder = ex.naming if side_files_from is None else next(
                (c for c in ckpts if c.folder.resolve() == Path(side_files_from).resolve()), None)
            text = config_text(holder) if holder is not None else (Path(side_files_from) / "config.json").read_text()
        elif isinstance(config, str):
            text = config
        else:
            text = json.dumps(config, indent=2, sort_keys=True) + "\n"
        (tmp / "config.json").write_text(written_dtype(text, {dt for _, dt, _ in ex.plan()}))
        facts["side_files"] = (copy_side_files(Path(side_files_from), tmp, output.side_report, merge_pipeline_modules)
                               if side_files_from is not None else {"copied": [], "left_out": []})
        if output.finish is not None:
            output.finish(tmp, facts)
    return facts
