"""``benchmarks.read_offsets`` end to end on a tiny setting: both versions read every layer's tensors and the JSON
holds every time (``--before HEAD``: this checkout's committed checkpoint.py as 'before')."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("single_thread")


def test_read_offsets_runs_and_records(tmp_path, capsys):
    from benchmarks import read_offsets

    argv = ["--before", "HEAD", "--hidden", "64", "--layers", "2", "--shard", "1MB", "--repeat", "2",
            "--json", str(tmp_path / "r.json")]
    result = read_offsets.main(argv)
    assert result["shards"] > 1 and result["reads"] == 3  # two layers, then the rest
    saved = json.loads((tmp_path / "r.json").read_text())
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in saved["seconds"].values()), saved["seconds"]
    assert "after/before (medians)" in capsys.readouterr().out
