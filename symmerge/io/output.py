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
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

from ..errors import SymmergeError

TAG = ".symmerge-tmp-"


def temp_prefix(out, kind: str = "") -> str:
    """The name prefix of a temporary folder for ``out`` made by this process (``kind``: a second kind of
    temporary folder beside the same output, e.g. ``aligned``)."""
    out = Path(out)
    return f".{out.name}{TAG}{os.getpid()}-" + (f"{kind}-" if kind else "")


def _pattern(out: Path):
    return re.compile(r"^\." + re.escape(out.name) + re.escape(TAG) + r"(\d+)-")


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    except OSError:
        return False
    return True


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


def _describe(e: OSError) -> str:
    if e.errno == errno.EROFS:
        return "read-only file system"
    if e.errno in (errno.EACCES, errno.EPERM):
        return "permission denied"
    if e.errno == errno.ENOTDIR:
        return "not a directory"
    if e.errno == errno.ENOSPC:
        return "no space left on the device"
    return e.strerror or str(e)


def check_writable(out) -> None:
    """``out`` can be written: its parent (or, not there yet, the parent's nearest existing ancestor) is a
    directory where a folder can be created (a probe folder, created and removed at once: the temporary
    output is made and renamed there). Else one error naming the place and the reason."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise SymmergeError(f"{out}: output exists and is not a directory")
    parent = out.parent  # where the temporary folder is made and renamed
    while not parent.exists():
        if parent.is_symlink():  # a dangling link: mkdir would fail on it
            raise SymmergeError(f"{out}: cannot write the output ({parent} is a broken link)")
        parent = parent.parent
    if not parent.is_dir():
        raise SymmergeError(f"{out}: cannot write the output ({parent} is not a directory)")
    try:
        probe = tempfile.mkdtemp(prefix=f".{out.name}.symmerge-probe-", dir=parent)
    except OSError as e:
        raise SymmergeError(f"{out}: cannot write the output in {parent} ({_describe(e)})") from None
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
