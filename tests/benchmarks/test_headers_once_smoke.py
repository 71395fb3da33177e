"""``benchmarks.headers_once`` end to end on a tiny setting: both versions open the checkpoint and read a tensor, and
the JSON holds every time (``--before HEAD``: this checkout's own file as 'before', so no other commit is needed)."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.usefixtures("single_thread")


def test_headers_once_runs_and_records(tmp_path, capsys):
    from benchmarks import headers_once

    argv = ["--before", "HEAD", "--layers", "2", "--repeat", "2", "--json", str(tmp_path / "r.json")]
    result = headers_once.main(argv)
    assert result["shards"] > 10  # about one tensor a shard
    saved = json.loads((tmp_path / "r.json").read_text())
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in saved["seconds"].values()), saved["seconds"]
    assert "after/before (medians)" in capsys.readouterr().out
