"""A process that has ended but that its parent has not waited for yet (a zombie: a sweep's driver that polls its
children now and then) is gone: its temporary folders are stale. It was taken for a running process: a merge that
waited on a killed process's lock on a ``--lora-merge-cache`` entry built the entry, and left the killed one's
temporary folder (a whole merged model) in the cache for good, "belongs to process N, still running"
(docs/results/concur_audit.md)."""

from __future__ import annotations

import os

from symmerge.io.output import clean_stale, pid_alive


def _zombie() -> int:
    """A child process that has ended and is not waited for yet (the caller reaps it)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    while True:  # until the kernel has made it a zombie (its exit done): a state, not a time
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return pid


def test_an_ended_process_not_waited_for_is_gone(tmp_path):
    pid = _zombie()
    try:
        assert not pid_alive(pid)
        assert pid_alive(os.getpid())
        left = tmp_path / f".out.symmerge-tmp-{pid}-abcd"
        (left / "x").mkdir(parents=True)
        lines = clean_stale(tmp_path / "out", say=lambda text: None)
        assert not left.exists() and len(lines) == 1 and lines[0].startswith("note: removed")
    finally:
        os.waitpid(pid, 0)
