"""A process killed while it makes its temporary LoRA merge cache leaves nothing a later run does not remove. The cache
is made under a hidden name (``.symmerge-lora-PID-*``), locked, then renamed (``io.lora._locked_temp_folder``); a
kill between the ``mkdtemp`` and the rename left the hidden folder for good: the later runs' clean-up
(``remove_stale_temp_caches``) looked at the visible names only. Now it judges the hidden ones too — by their lock,
held while it removes them — and a process whose hidden folder was removed before it locked or renamed it starts
again. Shown to fail before the fix (the two kills)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from forked import holder
from symmerge.io import lora


def _ours(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if lora.TEMP_PREFIX in p.name)


def _killed_at(point: str):
    """A child that makes its temporary merge cache and is killed (``os._exit``: no clean-up) at ``point``: ``open``
    (right after the ``mkdtemp``, before its lock file exists) or ``rename`` (locked, not yet renamed)."""

    def start():
        lora._cache["temp"] = None
        if point == "open":
            os.open = lambda *a, **k: os._exit(0)
        else:
            os.rename = lambda *a, **k: os._exit(0)
        return lora._locked_temp_folder()

    holder(start, wait=False)


@pytest.mark.parametrize("point", ["open", "rename"])
def test_a_kill_before_the_rename_leaves_what_the_next_run_removes(tmp_path, monkeypatch, point):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    _killed_at(point)
    left = _ours(tmp_path)
    assert len(left) == 1 and left[0].startswith("." + lora.TEMP_PREFIX), left  # the hidden folder, left
    removed = lora.remove_stale_temp_caches()
    assert [p.name for p in removed] == left
    assert _ours(tmp_path) == []


def test_a_hidden_folder_still_being_made_is_kept(tmp_path, monkeypatch):
    """A live process's hidden folder, locked and not yet renamed, is not removed; once it is gone, it is."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    class Paused(Exception):
        pass

    def start():
        def pause(src, dst):
            raise Paused(str(src))

        os.rename = pause
        try:
            lora._locked_temp_folder()
        except Paused as e:
            return str(e)  # the lock file's descriptor stays open (io.lora._live): the lock is held

    said, end = holder(start)
    try:
        hidden = Path(said)
        assert hidden.is_dir() and hidden.name.startswith("." + lora.TEMP_PREFIX)
        assert lora.remove_stale_temp_caches() == []
        assert hidden.is_dir() and (hidden / lora.LIVE).is_file()
    finally:
        end()
    assert lora.remove_stale_temp_caches() == [hidden]


def test_a_folder_removed_before_its_rename_is_made_again(tmp_path, monkeypatch):
    """Another process's clean-up removed the hidden folder before this one renamed it (a process it could not see,
    in another PID namespace): this one makes a new one, locked, rather than failing."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rename, calls = os.rename, []

    def removed_first(src, dst):
        calls.append(src)
        if len(calls) == 1:
            import shutil

            shutil.rmtree(src)
        return rename(src, dst)

    monkeypatch.setattr(os, "rename", removed_first)
    monkeypatch.setattr(lora, "_live", [])
    folder = lora._locked_temp_folder()
    try:
        assert len(calls) == 2 and folder.is_dir() and (folder / lora.LIVE).is_file()
        assert lora._lock_released(folder / lora.LIVE) is False  # held by this process
        assert _ours(tmp_path) == [folder.name]
    finally:
        for fd in lora._live:
            os.close(fd)
