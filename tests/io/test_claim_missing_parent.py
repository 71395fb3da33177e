"""An output in a folder that does not exist yet (``-o sweep/run1/merged``, the usual way a sweep names its outputs)
is claimed at the start as any other: its parent folders are made for the claim's lock file, and removed again when
the run ends without writing the output. Before, the claim was left to the end (no folder to hold its lock file): two
runs given the same such output both did all their work, and the second was refused only then
(docs/results/concur_audit.md)."""

from __future__ import annotations

import pytest

from forked import holder
from symmerge.errors import OutputError
from symmerge.io.model import ensure_output_dir
from symmerge.io.output import claim_output, lock_path, release_output


def _holder(out):
    """A process that claims ``out`` as a run does at its start; returns a function that ends it (the claim ended as
    a run ends it)."""

    def start():
        ensure_output_dir(out)
        return 1

    return holder(start, stop=lambda: release_output(out))[1]


def test_a_second_writer_of_an_output_in_a_missing_folder_is_refused_at_once(tmp_path):
    out = tmp_path / "sweep" / "run1" / "merged"
    end = _holder(out)
    try:
        with pytest.raises(OutputError, match="another symmerge run"):
            ensure_output_dir(out)
    finally:
        end()
    assert not (tmp_path / "sweep").exists()  # the first ended without writing: the folders it made are gone
    ensure_output_dir(out)  # free again
    release_output(out)


def test_the_folders_a_claim_made_are_removed_when_no_output_was_written(tmp_path):
    (tmp_path / "kept").mkdir()
    out = tmp_path / "kept" / "a" / "b" / "merged"
    assert claim_output(out) and lock_path(out).is_file()
    release_output(out)
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "a").exists()
    assert claim_output(out)
    (out.parent / "other").mkdir()  # something else put there meanwhile: kept, with its folder
    release_output(out)
    assert (out.parent / "other").is_dir() and not lock_path(out).exists()
