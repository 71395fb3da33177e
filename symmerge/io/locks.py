"""One spelling of the non-blocking exclusive ``flock`` that the output claims, the cache entries' build locks and
the temporary LoRA caches' liveness files share (:func:`try_lock`)."""

from __future__ import annotations

import errno


def try_lock(fd: int) -> bool | None:
    """Take the exclusive ``flock`` of the open descriptor ``fd`` without waiting: True when taken, False when
    another open file holds it (``EWOULDBLOCK``/``EAGAIN``, or ``EACCES`` where the lock is emulated), None when the
    file system has no such locks (any other fault)."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        return False if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES) else None
    return True
