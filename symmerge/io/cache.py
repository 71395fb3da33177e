"""What symmerge keeps between runs: where (one root, ``$SYMMERGE_CACHE``, else ``~/.cache/symmerge``), one lock per
entry being built, and a check of an entry's weights files before they are reused.

Every entry is built in a temporary folder and published by one rename (a killed run leaves no half entry); while a
process builds an entry it holds :func:`build_lock` on it, so a second process that wants the same entry waits and
then reuses it instead of building it again or failing. A built folder of weights records the sha256 of each of its
``.safetensors`` files (:func:`record_digests`); :func:`damage` finds a file that no longer reads or no longer
matches, and the caller builds the entry again or refuses in one line naming the file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import sys
from pathlib import Path

from ..errors import SymmergeError

ENV = "SYMMERGE_CACHE"
DIGESTS = ".symmerge-digests.json"  # {file name: sha256} of a built folder's weights files
LOCK = ".symmerge-build.lock"


def cache_root() -> Path:
    """The cache's root: ``$SYMMERGE_CACHE`` if set, else ``~/.cache/symmerge``; without either (no home folder)
    one :class:`SymmergeError` saying to set the variable."""
    root = os.environ.get(ENV, "").strip()
    if root:
        return Path(root).expanduser()
    try:
        return Path.home() / ".cache" / "symmerge"
    except (RuntimeError, KeyError):  # HOME unset and no entry in the password database
        raise SymmergeError(f"no home folder to keep symmerge's cache in (~/.cache/symmerge): set {ENV} to a "
                            "writable folder") from None


def lock_file(out) -> Path:
    out = Path(out)
    return out.parent / f".{out.name}{LOCK}"


@contextlib.contextmanager
def build_lock(out, say=None):
    """Hold an exclusive lock on building the cache entry ``out`` for the block (a ``flock`` on a file beside it,
    released when the process ends however it ends). Another process holding it: one note on stderr (or ``say``),
    then wait. A folder that cannot hold the lock file (read-only, missing) or a file system without locks: no lock
    (reading an entry that is there still works; building one fails where it writes)."""
    import fcntl

    say = say or (lambda text: print(text, file=sys.stderr))
    fd = None
    try:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_file(out), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    except OSError:
        fd = None
    if fd is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                say(f"note: another process is building {out}; waiting for it")
                fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def record_digests(folder) -> bool:
    """Write ``folder``'s :data:`DIGESTS` (temp file and rename); False when the folder cannot be written (the entry
    is then checked only for readable headers)."""
    folder = Path(folder)
    digests = {p.name: _sha256(p) for p in sorted(folder.glob("*.safetensors"))}
    tmp = folder / f"{DIGESTS}.{os.getpid()}.tmp"
    try:
        tmp.write_text(json.dumps(digests, indent=1) + "\n")
        os.replace(tmp, folder / DIGESTS)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        return False
    return True


def damage(folder) -> str | None:
    """None when every ``.safetensors`` file of ``folder`` reads (its header) and matches the sha256 recorded when
    it was built (a folder built before digests were recorded: the headers only); else what is wrong, naming the
    file."""
    from safetensors import safe_open

    folder = Path(folder)
    recorded = None
    if (folder / DIGESTS).is_file():
        try:
            recorded = json.loads((folder / DIGESTS).read_text())
            if not isinstance(recorded, dict):
                raise ValueError("not an object")
        except (OSError, ValueError) as e:
            return f"{folder / DIGESTS}: unreadable ({e})"
    for path in sorted(folder.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt") as handle:
                handle.keys()
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header
            return f"{path}: unreadable safetensors file ({e})"
        if recorded is not None and recorded.get(path.name) != _sha256(path):
            return f"{path}: its bytes differ from those written when it was built (damaged)"
    if recorded is not None and any(not (folder / name).is_file() for name in recorded):
        missing = next(name for name in recorded if not (folder / name).is_file())
        return f"{folder / missing}: missing"
    return None
