"""Where a command writes: checked before any heavy work, temporary folders a later run recognises, and the
permissions the user's umask gives.

* :func:`check_writable` — the output location can take a new folder (its nearest existing ancestor is a
  directory in which a probe folder can be created and removed): a read-only file system, a file where a
  folder should be, or a permission problem is one :class:`~symmerge.errors.SymmergeError`, before
  anything is loaded.
* :func:`temp_prefix` — temporary output folders are ``.<name>.symmerge-tmp-<pid>-XXXX`` beside ``<name>``;
  :func:`clean_stale` (run by every writer, :func:`symmerge.io.model.atomic_dir`) removes those whose
  process is gone (a run killed with SIGKILL cannot clean up after itself) and says so in one line, and
  names, without touching them, those of a process still running.
* :func:`apply_umask` — every folder ``0o777 & ~umask``, every file ``0o666 & ~umask``, whatever wrote it
  (``tempfile.mkdtemp`` makes folders 0700, safetensors' writer files 0600).
* :func:`claim_output` — the output is claimed at the start, atomically (``flock`` on
  ``.<name>.symmerge-lock`` beside it, removed when the run ends): a second run writing the same folder
  fails at once, in one line, instead of after all its work. :func:`output_claim` is the same around a
  block (the library's writing entries).
* :func:`check_free_space` — the file system has room for the output's planned size, before the work.
* :func:`os_fault` / :func:`output_fault` — an operating-system failure (a full disk, a file-size limit, a
  read-only file system, a permission), raised by Python or by safetensors' writer, as one
  :class:`~symmerge.errors.OutputError` line.
* :func:`memory_fault` — the allocators' refusal (Python's ``MemoryError``, numpy's, torch's CPU and CUDA
  allocators') as the words of one line; the command adds its way out (:class:`~symmerge.errors.OutOfMemory`).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from ..errors import OutputError, SymmergeError, UsageError
from .locks import try_lock

TAG = ".symmerge-tmp-"


def side_name(out) -> str:
    """``out``'s name as it begins the names of what symmerge makes beside it (its temporary folders, its lock, the
    probe of :func:`check_writable`): the name itself, or for a name too long to take their suffixes within a file
    system's 255 bytes (a legal output name of 240 characters was 'file name too long'), its first 160 bytes and
    a digest of the whole name."""
    import hashlib

    name = Path(out).name
    raw = os.fsencode(name)  # the bytes the file system holds (a name that is no UTF-8 too)
    if len(raw) <= 180:
        return name
    return f"{os.fsdecode(raw[:160])}~{hashlib.sha256(raw).hexdigest()[:12]}"


def temp_prefix(out, kind: str = "") -> str:
    """The name prefix of a temporary folder for ``out`` made by this process (``kind``: a second kind of
    temporary folder beside the same output, e.g. ``aligned``)."""
    return f".{side_name(out)}{TAG}{os.getpid()}-" + (f"{kind}-" if kind else "")


def _pattern(out: Path):
    return re.compile(r"^\." + re.escape(side_name(out)) + re.escape(TAG) + r"(\d+)-")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs: it exists and is no zombie (ended, its parent not having waited for it yet: a
    sweep's driver that polls its children now and then; what it left is stale)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return not _zombie(pid)
    except OSError:
        return False
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """Whether ``pid`` has ended and waits for its parent to collect it (Linux's /proc; elsewhere: never said)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] == b"Z"
    except (OSError, IndexError):
        return False


def stale_temps(out) -> tuple[list[Path], list[tuple[Path, int]]]:
    """(temporary folders for ``out`` left by processes that are gone, (folder, pid) of those whose process
    still runs); this process's own are in neither."""
    out = Path(out)
    parent = out.parent
    dead, live = [], []
    if not parent.is_dir():
        return dead, live
    pattern = _pattern(out)
    try:
        entries = sorted(parent.iterdir())
    except OSError:
        return dead, live
    for p in entries:
        m = pattern.match(p.name)
        if not m:
            continue
        pid = int(m.group(1))
        if pid == os.getpid():
            continue
        (live.append((p, pid)) if pid_alive(pid) else dead.append(p))
    return dead, live


def clean_stale(out, say=None) -> list[str]:
    """Remove the temporary folders for ``out`` of processes that are gone, one line each on stderr (or
    ``say``); name those of running processes. Returns the lines said."""
    say = say or (lambda text: print(text, file=sys.stderr))
    dead, live = stale_temps(out)
    lines = []
    for p in dead:
        shutil.rmtree(p, ignore_errors=True)
        if p.exists():
            lines.append(f"note: could not remove the stale temporary folder {p}")
        else:
            lines.append(f"note: removed {p}, a temporary folder left by an interrupted earlier run")
    for p, pid in live:
        lines.append(f"note: {p} belongs to process {pid}, still running (another symmerge writing to "
                     f"{Path(out).name}?); left alone")
    for text in lines:
        say(text)
    return lines


def clean_stale_in(folder, say=None) -> list[str]:
    """Remove the temporary folders (:func:`temp_prefix`) of processes that are gone for *every* output in ``folder``
    (a cache of entries: a writer killed while building one entry leaves its temporary folder, which
    :func:`clean_stale` removes only when that same entry is written again), each under the rule of
    :func:`clean_stale`: judged while holding the claim on its output's name, left alone when another process holds
    that claim (it writes that entry now) or the claim cannot be had. Returns the lines said."""
    folder = Path(folder)
    try:
        names = sorted({m.group(1) for p in folder.iterdir() if (m := _ANY.match(p.name)) and p.is_dir()})
    except OSError:
        return []
    lines = []
    for name in names:
        out = folder / name  # the side name itself: its temporary folders' and its lock's names are the output's
        try:
            claimed = claim_output(out)
        except (OutputError, OSError):  # another process writes it now, or nothing can be claimed here
            continue
        try:
            lines += clean_stale(out, say)
        finally:
            if claimed:
                release_output(out)
    return lines


_ANY = re.compile(r"^\.(.+)" + re.escape(TAG) + r"\d+-")  # any output's temporary folder: its side name

_REASONS = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied", errno.EPERM: "permission denied",
            errno.ENOTDIR: "not a directory", errno.ENOSPC: "no space left on the device",
            errno.EFBIG: "file too large (the file-size limit, ulimit -f, or the file system's)",
            errno.EDQUOT: "disk quota exceeded", errno.EIO: "input/output error",
            errno.ENAMETOOLONG: "file name too long", errno.EMFILE: "too many open files"}


def describe_fault(e: OSError) -> str:
    return _REASONS.get(e.errno) or e.strerror or str(e)


def os_fault(e: BaseException) -> OSError | None:
    """The operating-system failure behind ``e``: ``e`` itself when it is an ``OSError``, or the one
    safetensors' writer reports in its message (``... (os error 28)``); None for anything else."""
    if isinstance(e, OSError):
        return e
    if type(e).__name__ == "SafetensorError":
        m = re.search(r"os error (\d+)", str(e))
        if m:
            code = int(m.group(1))
            return OSError(code, os.strerror(code))
    return None


_ASKED = re.compile(r"(?:you tried to allocate|tried to allocate|unable to allocate|unable to mmap) "
                    r"([0-9.]+ ?(?:bytes|[KMGTPE]i?B))", re.IGNORECASE)
_ALLOCATOR = ("DefaultCPUAllocator", "CUDA out of memory", "can't allocate memory", "not enough memory",
              "Cannot allocate memory")
_MAPPED = re.compile(r"unable to mmap \d+ bytes from file <([^>]*)>")
_UNMAPPED = re.compile(r"([^\s:]+): failed to map segment from shared object")


def memory_fault(e: BaseException) -> str | None:
    """The allocators' refusal behind ``e``, as the words of one line: ``out of memory (an allocation of 68.7 GB
    failed)``; None for anything else. Recognised: Python's ``MemoryError`` (numpy's ``_ArrayMemoryError`` is one:
    "Unable to allocate 64.0 GiB for an array ..."), torch's ``RuntimeError`` of its CPU allocator ("[enforce fail at
    alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes") and its CUDA
    ``OutOfMemoryError`` ("CUDA out of memory. Tried to allocate 2.00 GiB"), the system's ENOMEM (an ``OSError``,
    safetensors' "os error 12", torch's "unable to mmap N bytes from file <F>: Cannot allocate memory (12)" when an
    input's weights are mapped), the loader's "LIB.so: failed to map segment from shared object" (a library, at
    start-up); also when ``e`` was raised while one of them was handled, or from one (a library's wrapping error).
    A kernel's OOM kill (SIGKILL) reaches no handler."""
    seen = set()
    while e is not None and id(e) not in seen and len(seen) < 16:
        seen.add(id(e))
        text = str(e)
        fault = None if isinstance(e, MemoryError) else os_fault(e)
        if fault is not None and fault.errno == errno.ENOMEM:  # a mapping refused (safetensors' mmap of an input)
            return "out of memory (a file could not be mapped into memory)"
        library = _UNMAPPED.search(text)  # the loader's ENOMEM for a library (an ImportError, at start-up)
        if library:
            return f"out of memory (a library could not be mapped: {library.group(1)})"
        if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError" or (
                isinstance(e, RuntimeError) and any(a in text for a in _ALLOCATOR)):
            asked = _ASKED.search(text)
            if not asked:
                return "out of memory"
            size = asked.group(1)
            if size.endswith("bytes"):
                size = _size(int(float(size.split()[0])))
            mapped = _MAPPED.search(text)
            if mapped:  # address space, not RAM: only a limit (ulimit -v / -d) refuses it
                return (f"out of memory (mapping {size} of {mapped.group(1)} failed: the memory limit, ulimit -v or "
                        "ulimit -d, counts a mapped input whole)")
            return f"out of memory (an allocation of {size} failed)"
        e = e.__cause__ or e.__context__
    return None


def output_fault(out, e: OSError) -> OutputError:
    """One line for an operating-system failure while ``out`` was being written: the reason, and the file
    when it is not inside the temporary folder (an input, for instance)."""
    name = getattr(e, "filename", None)
    if name and TAG not in str(name) and not str(name).startswith(str(Path(out).parent / f".{side_name(out)}")) \
            and Path(str(name)) != Path(out):
        from ..errors import InputReadError

        return InputReadError(f"{name}: {describe_fault(e)}; nothing was written")  # not the output's: an input's
    return OutputError(f"{out}: cannot write the output: {describe_fault(e)}; nothing was written")


def check_free_space(out, nbytes: int) -> None:
    """The file system that will hold ``out`` has at least ``nbytes`` free (the plan's output size), else one
    error before any work. Where the free space cannot be read, nothing is checked."""
    out = Path(out)
    parent = out.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    try:
        free = shutil.disk_usage(parent).free
    except OSError:
        return
    if nbytes > free:
        raise OutputError(f"{out}: not enough free space: the output needs about {_size(nbytes)}, "
                          f"{_size(free)} free in {parent}")


def _size(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def refuse_output_in_inputs(out, inputs, flag: str = "output", what: str = "the output", itself: bool = False) -> None:
    """One error for an output inside the folder of one of ``inputs`` (paths, or ``BASE+ADAPTER`` specs: both
    folders; a model object is no folder): writing it, and its claim's lock file beside it, would change an input,
    which symmerge never does. ``itself``: the input's folder itself refused too (a folder written into, such as
    ``--lora-merge-cache``, not one written in its place)."""
    target = Path(out).resolve()
    for spec in inputs:
        if not isinstance(spec, (str, Path)) or not str(spec).strip():
            continue
        for folder in {str(spec), *str(spec).split("+")}:
            folder = Path(folder.strip()).expanduser()
            inside = folder.is_dir() and folder.resolve() in target.parents
            if inside or (itself and folder.is_dir() and folder.resolve() == target):
                raise OutputError(f"{flag} {target}: {what} is {'inside ' if inside else ''}the input folder "
                                  f"{folder.resolve()}; writing it would change an input: give a folder outside it")


# ---------------------------------------------------------------- the output claimed for one run at a time

LOCK = ".symmerge-lock"
_claims: dict[str, tuple[int, Path]] = {}


def lock_path(out) -> Path:
    out = Path(out)
    return out.parent / f".{side_name(out)}{LOCK}"


def _key(out) -> str:
    return os.path.abspath(out)


def claim_output(out) -> bool:
    """Claim ``out`` for this process (an exclusive ``flock`` on :func:`lock_path`, which holds the pid);
    True if claimed now, False if this process held it already or its parent folder cannot be made (then
    :func:`symmerge.io.model.atomic_dir` fails where it writes). A parent folder that does not exist yet is made
    for the lock file (the run makes it anyway), and removed again with the claim if it is then still empty (the
    output was not written): a second run given the same output in a new folder fails at once too. Another
    process's claim is one :class:`~symmerge.errors.OutputError` at once. A claim left by a killed process is no
    claim: the lock goes with the process."""
    key = _key(out)
    if key in _claims:
        return False
    path = lock_path(out)
    made = []
    for _ in range(10):
        try:
            made += _make_folders(path.parent)
        except OSError:
            return False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:  # the folder just made removed again by another run's release: make it again
            continue
        except OSError as e:
            raise OutputError(f"{out}: cannot write the output in {path.parent} ({describe_fault(e)})") from None
        taken = try_lock(fd)
        if not taken:
            if taken is None:  # no locks on this file system
                os.close(fd)
                _unlink_quietly(path)
                _remove_empty(made)
                return False
            holder = _read_pid(fd)
            os.close(fd)
            _remove_empty(made)
            who = f"process {holder}" if holder else "another process"
            raise OutputError(f"{out}: another symmerge run ({who}) is writing this output; wait for it to end or "
                              "choose another output folder") from None
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except OSError:
            same = False
        if not same:  # the holder removed the lock file between our open and our lock: take the new one
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _claims[key] = (fd, path, made)
        return True
    _remove_empty(made)
    raise OutputError(f"{out}: could not claim the output (its lock file {path} keeps changing)")


def _make_folders(folder: Path) -> list[Path]:
    """Make ``folder`` and its missing parents; those this call made, deepest first."""
    missing = []
    while not folder.is_dir() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    made = []
    for f in reversed(missing):
        try:
            f.mkdir()
            made.insert(0, f)
        except FileExistsError:  # another run made it meanwhile: theirs too
            if not f.is_dir():
                raise
    return made


def _remove_empty(folders: list[Path]) -> None:
    """Remove ``folders`` that are empty, deepest first; a folder holding anything (another run's lock, output) is
    kept, and so are its parents."""
    for f in sorted(set(folders), key=lambda f: len(f.parts), reverse=True):
        try:
            f.rmdir()
        except OSError:
            return


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).decode().strip() or 0) or None
    except (OSError, ValueError):
        return None


def release_output(out) -> None:
    """End this process's claim on ``out`` (its lock file removed, and the folders the claim made if they are empty);
    nothing if it holds none."""
    claim = _claims.pop(_key(out), None)
    if claim is None:
        return
    fd, path, made = claim
    try:
        os.unlink(path)
    except OSError:
        pass
    finally:
        os.close(fd)
    _remove_empty(made)


def release_claims() -> None:
    """End every claim of this process (the command's end, the interpreter's exit)."""
    for key in list(_claims):
        release_output(key)


atexit.register(release_claims)


def writes_output(function):
    """For the library's entries that write a folder (their ``out`` argument): a claim the call made on
    ``out`` ends with the call (succeeded or not: :func:`claim_output`), and an operating-system failure
    that escaped is one :class:`~symmerge.errors.SymmergeError` (:class:`~symmerge.errors.OutputError`)."""
    import functools
    import inspect

    signature = inspect.signature(function)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            out = signature.bind(*args, **kwargs).arguments.get("out")
        except TypeError:
            out = None
        if out is not None and not isinstance(out, (str, os.PathLike)):  # symmerge.merge(models, 5)
            raise UsageError(f"{function.__name__}(): out is the output folder, a str or a Path, got {out!r}")
        held = out is not None and _key(out) in _claims
        try:
            return function(*args, **kwargs)
        except Exception as e:
            fault = os_fault(e)
            if fault is None or isinstance(e, SymmergeError) or out is None:
                raise
            raise output_fault(out, fault) from None
        finally:
            if out is not None and not held:
                release_output(out)

    return wrapper


def check_writable(out) -> None:
    """``out`` can be written: its parent (or, not there yet, the parent's nearest existing ancestor) is a
    directory where a folder can be created (a probe folder, created and removed at once: the temporary
    output is made and renamed there). Else one error naming the place and the reason."""
    out = Path(out)
    if out.is_symlink():
        raise OutputError(f"{out}: the output is a symbolic link (to {os.readlink(out)}); give the folder itself "
                          "(symmerge writes a new folder in its place and never replaces a link)")
    if out.exists() and not out.is_dir():
        raise OutputError(f"{out}: output exists and is not a directory")
    parent = out.parent  # where the temporary folder is made and renamed
    while not parent.exists():
        if parent.is_symlink():  # a dangling link: mkdir would fail on it
            raise OutputError(f"{out}: cannot write the output ({parent} is a broken link)")
        parent = parent.parent
    if not parent.is_dir():
        raise OutputError(f"{out}: cannot write the output ({parent} is not a directory)")
    try:
        probe = tempfile.mkdtemp(prefix=f".{side_name(out)}.symmerge-probe-", dir=parent)
    except OSError as e:
        raise OutputError(f"{out}: cannot write the output in {parent} ({describe_fault(e)})") from None
    try:
        os.rmdir(probe)
    except OSError:
        pass


def current_umask() -> int:
    """The process's umask (read from /proc where it can be, so that no other thread ever runs under a
    changed one)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(folder) -> None:
    """Give ``folder`` and everything in it the permissions a new file or folder gets under the current
    umask (folders ``0o777 & ~umask``, files ``0o666 & ~umask``); links are left alone."""
    mask = current_umask()
    folder = Path(folder)
    for root, dirs, files in os.walk(folder):
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, 0o666 & ~mask)
        for name in dirs:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, 0o777 & ~mask)
    os.chmod(folder, 0o777 & ~mask)
