"""Independent per-layer problems on a thread pool: one torch thread per problem, results in order and
bit-identical whatever the pool size."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch


def pool_size(workers: int | None) -> int:
    """Threads for ``workers`` (None: one per core this process may use)."""
    if workers:
        return int(workers)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@contextmanager
def threads_kept():
    """The block may set torch's intra-op threads (a command's ``--num-threads``); the count it found is back after
    it, so that a command run in a caller's process (``symmerge.cli.main([...])``) leaves the caller's."""
    threads = torch.get_num_threads()
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


@contextmanager
def torch_threads(n: int | None):
    """Run the block with ``n`` torch intra-op threads in this thread (None: unchanged), then restore."""
    if n is None:
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def layer_map(fn, items, workers: int | None = None) -> list:
    """``[fn(x) for x in items]``, the calls on a pool of ``workers`` threads (None: one per core; 1: one
    after another in the calling thread). With more than one item every call runs with one torch thread
    (its OpenMP/MKL threads; the caller's setting is restored afterwards): the cores go to the problems
    instead of OpenMP teams, which wait for each other on a shared machine, and each result is computed
    the same way whatever ``workers`` is, hence bit-identical. A single item keeps torch's intra-op
    threads (a streamed layer's GEMMs use every core). GEMMs, SVDs and the exact assignments release
    the GIL."""
    items = list(items)
    if len(items) <= 1:
        return [fn(x) for x in items]
    workers = min(pool_size(workers), len(items))
    threads = torch.get_num_threads()

    def run(x):
        torch.set_num_threads(1)  # this thread's intra-op threads
        return fn(x)

    try:
        if workers == 1:
            return [run(x) for x in items]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            return list(pool.map(run, items))
    finally:
        torch.set_num_threads(threads)


def put_until_stopped(q, item, stop) -> bool:
    """Put ``item`` on the bounded queue ``q``, waiting for room unless the event ``stop`` is set (then the
    item is dropped: the consumer is going away); whether it was put."""
    import queue

    while not stop.is_set():
        try:
            q.put(item, timeout=0.2)
            return True
        except queue.Full:
            continue
    return False
