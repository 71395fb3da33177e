"""Direct I/O (``O_DIRECT``) for the streamed merge: reads and writes that bypass the page cache.

Reading a checkpoint through the page cache costs system CPU for every byte (the kernel allocates
cache pages and copies them to the reader: about 1 s of CPU per 0.5 GB read cold on the benchmark
machine, against 0.02 s with ``O_DIRECT``); writing the output through it costs as much again. On a
large merge that CPU, not the disk, sets the pace. Direct I/O moves the bytes by DMA between the device
and the process's buffer.

``O_DIRECT`` needs the file offset, the length and the buffer's address aligned to the device's block
(:data:`BLOCK` covers every usual one), so a direct read takes the aligned span around the tensor into
a buffer with :data:`SLACK` extra bytes and returns a view; a direct write stages the sequential bytes
in an aligned buffer and pads the last block, then truncates the file to its length.

The choice (``SYMMERGE_DIRECT_IO``: ``auto``, the default; ``on``; ``off``):

* reads: ``auto`` reads a file directly when less than half of it is in the page cache (``mincore``):
  a file just downloaded or just read is read from the cache instead;
* writes: ``auto`` writes directly when the output is at least :data:`WRITE_MIN_BYTES`;
* a file system without ``O_DIRECT`` (tmpfs) falls back to buffered I/O, whatever the setting.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from pathlib import Path

from ..errors import SymmergeError

BLOCK = 4096
SLACK = 3 * BLOCK  # an unaligned buffer start, the tensor's unaligned first byte, its unaligned end
WRITE_MIN_BYTES = 256 * 2 ** 20
STAGING_BYTES = 16 * 2 ** 20
MODES = ("auto", "on", "off")

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_lock = threading.Lock()
_supported: dict[str, bool] = {}  # directory -> O_DIRECT opens there
_decided: dict[tuple, bool] = {}  # (file, size, mtime) -> read directly


def mode() -> str:
    value = os.environ.get("SYMMERGE_DIRECT_IO", "auto").strip().lower() or "auto"
    if value not in MODES:
        raise SymmergeError(f"SYMMERGE_DIRECT_IO={value!r}; choose one of {', '.join(MODES)}")
    return value


def supported(path) -> bool:
    """Whether ``path`` (an existing file) opens with ``O_DIRECT`` (cached per directory)."""
    if not _O_DIRECT:
        return False
    key = str(Path(path).parent)
    with _lock:
        if key in _supported:
            return _supported[key]
    try:
        os.close(os.open(path, os.O_RDONLY | _O_DIRECT))
        ok = True
    except OSError:
        ok = False
    with _lock:
        _supported[key] = ok
    return ok


def resident_fraction(path) -> float:
    """The fraction of ``path``'s pages in the page cache (``mincore`` on a mapping of it; 1.0 where
    that cannot be asked)."""
    size = os.path.getsize(path)
    if size == 0:
        return 1.0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_long]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr in (None, ctypes.c_void_p(-1).value):
            return 1.0
        try:
            pages = -(-size // mmap.PAGESIZE)
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(addr, size, vec) != 0:
                return 1.0
            return sum(b & 1 for b in vec.raw) / pages
        finally:
            libc.munmap(addr, size)
    except (OSError, AttributeError):  # pragma: no cover - no libc / no mincore
        return 1.0


def reads_directly(path) -> bool:
    """Whether tensors of ``path`` are read with ``O_DIRECT`` (decided once per file version)."""
    m = mode()
    if m == "off" or not supported(path):
        return False
    if m == "on":
        return True
    st = os.stat(path)
    key = (str(path), st.st_size, st.st_mtime_ns)
    with _lock:
        if key in _decided:
            return _decided[key]
    decision = resident_fraction(path) < 0.5
    with _lock:
        _decided[key] = decision
    return decision


def read_into(path, start: int, end: int, buffer) -> tuple[int, int]:
    """Read bytes ``[start, end)`` of ``path`` with ``O_DIRECT`` into ``buffer`` (a uint8 tensor of at
    least ``end - start + SLACK`` bytes); returns ``(offset, got)``: the bytes are ``buffer[offset:offset
    + end - start]``, ``got`` how many of them the file held (fewer: truncated)."""
    first = start - start % BLOCK
    last = -(-end // BLOCK) * BLOCK
    skip = (-buffer.data_ptr()) % BLOCK
    if buffer.numel() < skip + last - first:
        raise ValueError("direct read: buffer too small")
    view = memoryview(buffer.numpy())[skip:skip + last - first]
    fd = os.open(path, os.O_RDONLY | _O_DIRECT)
    try:
        done = 0
        while done < last - first:
            n = os.preadv(fd, [view[done:]], first + done)
            if n <= 0:
                break
            done += n
            if n % BLOCK:  # end of file
                break
    finally:
        os.close(fd)
    return skip + start - first, max(0, min(done - (start - first), end - start))


class Output:
    """A file written sequentially, directly (``O_DIRECT`` through two aligned staging buffers: one fills
    while a background thread writes the other, so copying and the device's writing overlap) or buffered:
    ``write`` and ``close`` as a file's. ``direct``: whether it writes directly."""

    def __init__(self, path, direct: bool):
        self.path, self.direct, self.size = Path(path), False, 0
        if direct and _O_DIRECT:
            try:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_DIRECT, 0o644)
                self.direct = True
            except OSError:
                pass
        if not self.direct:
            self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            return
        from concurrent.futures import ThreadPoolExecutor

        self.stages = [mmap.mmap(-1, STAGING_BYTES) for _ in range(2)]  # page-aligned
        self.views = [memoryview(m) for m in self.stages]
        self.current, self.used, self.offset, self.pending = 0, 0, 0, None
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="symmerge-direct-write")

    def write(self, data) -> None:
        data = memoryview(data).cast("B")
        self.size += len(data)
        if not self.direct:
            done = 0
            while done < len(data):
                done += os.write(self.fd, data[done:])
            return
        done = 0
        while done < len(data):
            view = self.views[self.current]
            take = min(len(data) - done, STAGING_BYTES - self.used)
            view[self.used:self.used + take] = data[done:done + take]
            self.used += take
            done += take
            if self.used == STAGING_BYTES:
                self._flush(self.used)

    def _write_at(self, view, offset: int) -> None:
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], offset + done)

    def _wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()  # a failed write raises here, in the writing thread

    def _flush(self, n: int) -> None:
        self._wait()  # the other buffer is free again
        self.pending = self.pool.submit(self._write_at, self.views[self.current][:n], self.offset)
        self.offset += n
        self.current, self.used = 1 - self.current, 0

    def close(self) -> None:
        if self.fd < 0:
            return
        try:
            if self.direct:
                if self.used:
                    padded = -(-self.used // BLOCK) * BLOCK
                    self.views[self.current][self.used:padded] = bytes(padded - self.used)
                    self._flush(padded)
                self._wait()
                os.ftruncate(self.fd, self.size)
        finally:
            if self.direct:
                try:
                    self._wait()  # never free the buffers under a running write
                except OSError:
                    pass
                self.pool.shutdown(wait=True)
            os.close(self.fd)
            self.fd = -1
            if self.direct:
                for v, m in zip(self.views, self.stages):
                    v.release()
                    m.close()
