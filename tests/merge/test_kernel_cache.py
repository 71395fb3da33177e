"""numba's on-disk cache of symmerge's kernels (``symmerge.merge.kernels``) as a user meets it: damaged cache files
(junk or empty ``.nbi``/``.nbc``) are compiled over, not a traceback; where numba finds no folder to cache in (a
read-only install and home) the kernels run uncached, with one note. Each case runs in a fresh interpreter with its own
``NUMBA_CACHE_DIR``, so the package's own ``__pycache__`` is never touched."""

from __future__ import annotations

import os
import subprocess
import sys

_RUN = """
import sys
import torch
if sys.argv[1] == "no-locator":  # as where the package folder and the home folder are read-only
    from numba.core import caching
    caching.CacheImpl._locator_classes = []
from symmerge.merge import kernels
a, b = torch.randn(1000, generator=torch.Generator().manual_seed(0)), torch.ones(1000)
out = torch.empty(1000)
assert kernels.average_into([a, b], [0.25, 0.75], out)
assert torch.equal(out, (0.25 * a.double() + 0.75 * b.double()).float())
print("ok")
"""


def _run(tmp_path, mode="cached"):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    return subprocess.run([sys.executable, "-c", _RUN, mode], capture_output=True, text=True, env=env, timeout=600)


def test_damaged_kernel_cache_files_are_compiled_over(tmp_path):
    first = _run(tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    files = [p for p in (tmp_path / "numba").rglob("*") if p.suffix in (".nbi", ".nbc")]
    assert any(p.suffix == ".nbi" for p in files) and any(p.suffix == ".nbc" for p in files)
    for damage in (b"\xd2junk" * 20, b""):
        for p in files:
            p.write_bytes(damage)
        again = _run(tmp_path)
        assert again.returncode == 0 and again.stdout.strip() == "ok", again.stderr[-2000:]
    assert all(p.stat().st_size > 0 for p in files if p.suffix == ".nbi")  # the index written anew


def test_no_folder_to_cache_in_is_one_note_and_uncached_kernels(tmp_path):
    got = _run(tmp_path, "no-locator")
    assert got.returncode == 0 and got.stdout.strip() == "ok", got.stderr[-2000:]
    notes = [line for line in got.stderr.splitlines() if "numba cannot cache" in line]
    assert len(notes) == 1 and "NUMBA_CACHE_DIR" in notes[0]
    assert not (tmp_path / "numba").exists()
