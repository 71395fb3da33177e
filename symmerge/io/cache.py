"""What symmerge keeps between runs: where (one root, ``$SYMMERGE_CACHE``, else ``~/.cache/symmerge``), one lock per
entry being built, and a check of an entry's weights files before they are reused.

Every entry is built in a temporary folder and published by one rename (a killed run leaves no half entry); while a
process builds an entry it holds :func:`build_lock` on it, so a second process that wants the same entry waits and
then reuses it instead of building it again or failing. A built folder records the size and sha256 of its weights
files (or of every file: a tokenizer) in :data:`DIGESTS` (:func:`record_digests`); :func:`damage` finds a file that
no longer reads or no longer matches, and the caller builds the entry again or refuses in one line naming the file.
What is kept where, and how to clear it: docs/cache.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

from ..errors import SymmergeError
from .locks import try_lock

ENV = "SYMMERGE_CACHE"
DIGESTS = ".symmerge-digests.json"  # {file name: {"size": bytes, "sha256": hex}} of a built folder's files
LOCK = ".symmerge-build.lock"


def cache_root() -> Path:
    """The cache's root: ``$SYMMERGE_CACHE`` if set, else ``~/.cache/symmerge``. One :class:`SymmergeError` saying to
    set the variable when there is no home folder (``HOME`` unset and no password entry, or ``HOME`` empty or
    relative: ``~`` would be ``/`` or the current folder) or the root is a file."""
    root = os.environ.get(ENV, "").strip()
    if root:
        path = Path(root).expanduser()
    else:
        home = os.environ.get("HOME")
        if home is not None and not os.path.isabs(home):
            raise SymmergeError(f"HOME is {home!r}, no folder to keep symmerge's cache in (~/.cache/symmerge): set "
                                f"{ENV} to a writable folder")
        try:
            path = Path.home() / ".cache" / "symmerge"
        except (RuntimeError, KeyError):  # HOME unset and no entry in the password database
            raise SymmergeError(f"no home folder to keep symmerge's cache in (~/.cache/symmerge): set {ENV} to a "
                                "writable folder") from None
    if path.exists() and not path.is_dir():
        raise SymmergeError(f"{path}: symmerge's cache is a file, not a folder; set {ENV} to a folder")
    return path


def remove_entry(out, what: str = "cached folder", remedy: str = f"set {ENV} to a writable folder") -> None:
    """Remove the cache entry ``out`` about to be built again (incomplete, damaged, or not to be reused); one
    :class:`SymmergeError` naming it, ``what`` it is and ``remedy``, when it cannot be removed."""
    out = Path(out)
    if not out.exists():
        return
    try:
        shutil.rmtree(out)
    except OSError as e:
        raise SymmergeError(f"{out}: cannot replace this {what} ({e.strerror}); delete the folder, or {remedy}"
                            ) from None


def lock_file(out) -> Path:
    """The file :func:`build_lock` locks for the entry ``out``: ``.<name>.symmerge-build.lock`` beside it."""
    out = Path(out)
    return out.parent / f".{out.name}{LOCK}"


@contextlib.contextmanager
def build_lock(out, say=None):
    """Hold an exclusive lock on building the cache entry ``out`` for the block (a ``flock`` on a file beside it,
    released when the process ends however it ends; the file removed when the block ends). Another process holding
    it: one note on stderr (or ``say``), then wait. A folder that cannot hold the lock file (read-only, missing) or a
    file system without locks: no lock (reading an entry that is there still works; building one fails where it
    writes)."""
    say = say or (lambda text: print(text, file=sys.stderr))
    fd = _locked(lock_file(out), lambda: say(f"note: another process is building {out}; waiting for it"))
    try:
        yield
    finally:
        if fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(lock_file(out))  # while still held: a process waiting on this file retries on a new one
            os.close(fd)


def _locked(path: Path, waiting) -> int | None:
    """An open descriptor of ``path`` holding its exclusive ``flock`` (``waiting()`` called once before blocking);
    None when it cannot be had. Retried when the file was removed or replaced while this process waited for it."""
    import fcntl

    told = False
    while True:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError:
            return None
        taken = try_lock(fd)
        if taken is None:  # no locks on this file system
            os.close(fd)
            return None
        if not taken:
            if not told:
                waiting()
                told = True
            fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except OSError:
            same = False
        if same:
            return fd
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


HASHED = 2 << 30  # weights up to this many bytes in all are hashed at every reuse; larger ones: sizes and headers


def record_digests(folder, pattern: str = "*.safetensors") -> bool:
    """Write ``folder``'s :data:`DIGESTS` (the size and, up to :data:`HASHED` bytes in all, the sha256 of each file
    ``pattern`` matches; temp file and rename); False when the folder cannot be written (the entry is then checked
    only for readable headers)."""
    folder = Path(folder)
    files = [p for p in sorted(folder.glob(pattern)) if p.is_file() and p.name != DIGESTS]
    hashed = sum(p.stat().st_size for p in files) <= HASHED  # above: sizes only (as damage() checks them)
    digests = {p.name: {"size": p.stat().st_size, **({"sha256": _sha256(p)} if hashed else {})} for p in files}
    tmp = folder / f"{DIGESTS}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(digests, indent=1) + "\n")
        os.replace(tmp, folder / DIGESTS)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False
    return True


def damage(folder, hashed: int = HASHED) -> str | None:
    """None when every ``.safetensors`` file of ``folder`` reads (its header) and every file recorded in its
    :data:`DIGESTS` matches the size and, when those files hold at most ``hashed`` bytes in all, the sha256 recorded
    when it was built (a folder built before digests were recorded: the headers only); else what is wrong, naming the
    file."""
    from safetensors import safe_open

    folder = Path(folder)
    recorded = {}
    if (folder / DIGESTS).is_file():
        try:
            recorded = json.loads((folder / DIGESTS).read_text())
            if not isinstance(recorded, dict) or not all(isinstance(v, dict) for v in recorded.values()):
                raise ValueError("not the digests symmerge writes")
        except (OSError, ValueError) as e:
            return f"{folder / DIGESTS}: unreadable ({e})"
    for name in recorded:
        if not (folder / name).is_file():
            return f"{folder / name}: missing"
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt") as handle:
                handle.keys()
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header
            return f"{path}: unreadable safetensors file ({e})"
    small = sum((folder / name).stat().st_size for name in recorded) <= hashed
    for name, want in recorded.items():
        path = folder / name
        if want.get("size") != path.stat().st_size or (small and "sha256" in want and want["sha256"] != _sha256(path)):
            return f"{path}: its bytes differ from those written when it was built (damaged)"
    return None
