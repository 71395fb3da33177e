"""The temporary merge cache of BASE+ADAPTER inputs (no ``--lora-merge-cache``): one folder per process, named with
its id and removed at its exit; a process killed before its exit left its folder (whole merged models) in the temp
folder for good (27 of them after a day of test runs). The next process that makes one removes those of processes
that are gone."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from symmerge.io import lora


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_the_caches_of_gone_processes_are_removed_others_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setitem(lora._cache, "temp", None)
    dead = tmp_path / f"{lora.TEMP_PREFIX}{_dead_pid()}-abc"
    (dead / "L0+adapter-1234").mkdir(parents=True)
    (dead / "L0+adapter-1234" / "model.safetensors").write_bytes(b"x" * 100)
    live = tmp_path / f"{lora.TEMP_PREFIX}{os.getppid()}-def"  # a running process's (the test runner's parent)
    unnamed = tmp_path / f"{lora.TEMP_PREFIX}k2j4x9"  # an earlier version's, without a process id: not ours to judge
    other = tmp_path / "symmerge-other-1-x"
    for p in (live, unnamed, other):
        p.mkdir()
    made = lora._temp_cache()
    try:
        assert made.name.startswith(f"{lora.TEMP_PREFIX}{os.getpid()}-") and made.is_dir()
        assert not dead.exists() and live.exists() and unnamed.exists() and other.exists()
        assert lora.remove_stale_temp_caches() == []  # this process's own cache is never removed
        assert made.exists()
    finally:
        lora._cache["temp"] = None
