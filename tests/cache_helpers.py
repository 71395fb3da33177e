"""A second process that holds a cache entry's build lock (``symmerge.io.cache.build_lock``) while it publishes the
entry, for the tests of every cache that waits for another process's build."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_HOLDER = """
import os, shutil, sys, time
from pathlib import Path
from symmerge.io.cache import build_lock
src, out = Path(sys.argv[1]), Path(sys.argv[2])
with build_lock(out):
    print("locked", flush=True)
    time.sleep(2)
    shutil.copytree(src, out.parent / ".building")
    os.rename(out.parent / ".building", out)
"""


def hold_and_publish(src: Path, out: Path) -> subprocess.Popen:
    """A process that takes ``out``'s build lock, waits 2 s, then publishes a copy of ``src`` as ``out``; returned
    once it holds the lock."""
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(src), str(out)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder
