"""The temporary merge cache of a process that still runs is never removed, and one of a process that is gone is,
whatever its process id says: the id alone is no proof of life. A process in another PID namespace (a container
sharing the temporary folder, another host with TMPDIR on a shared file system) sees no process of that id and
removed a live process's cache, whose merge then failed reading its merged model
(docs/results/concur_audit.md); the folder of a killed process whose id a new process took was kept for good."""

from __future__ import annotations

import tempfile
from pathlib import Path

from forked import holder
from symmerge.io import lora, output


def _holder(exit_at_once: bool):
    """A process that makes its temporary merge cache: (its folder, a function that ends the process)."""

    def start():
        lora._cache["temp"] = None
        return lora._temp_cache()

    said, end = holder(start, wait=not exit_at_once)
    return Path(said), end


def test_a_live_process_cache_is_kept_where_its_id_cannot_be_seen(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder, end = _holder(exit_at_once=False)
    try:
        assert folder.is_dir() and folder.name.startswith(lora.TEMP_PREFIX)
        monkeypatch.setattr(output, "pid_alive", lambda pid: False)  # as from another PID namespace
        assert lora.remove_stale_temp_caches() == []
        assert folder.is_dir()
    finally:
        end()


def test_a_gone_process_cache_is_removed_though_its_id_was_taken_again(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    folder, _ = _holder(exit_at_once=True)
    assert folder.is_dir()  # left: the process ended without its cleanup
    monkeypatch.setattr(output, "pid_alive", lambda pid: True)  # its id now another process's
    assert lora.remove_stale_temp_caches() == [folder]
    assert not folder.exists()
