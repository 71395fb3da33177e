"""``benchmarks.report_distances`` end to end on a tiny setting: both versions merge (``--before HEAD``: this
checkout's committed package as 'before'), the JSON holds every run, and both report the same distances."""

from __future__ import annotations

import json

import pytest


@pytest.mark.slow  # four child merges (each imports torch and transformers): about a minute
def test_report_distances_runs_and_records(tmp_path, capsys):
    from benchmarks import report_distances

    argv = ["--before", "HEAD", "--hidden", "64", "--layers", "1", "--repeat", "1", "--settings", "float32x2",
            "--dir", str(tmp_path / "inputs"), "--json", str(tmp_path / "r.json")]
    result = report_distances.main(argv)
    setting = json.loads((tmp_path / "r.json").read_text())["settings"]["float32x2"]
    assert setting == result["settings"]["float32x2"]
    runs = setting["runs"]
    assert all(len(runs[v]) == 1 and runs[v][0]["distances_s"] >= 0 for v in ("before", "after"))
    assert runs["before"][0]["distances"] == runs["after"][0]["distances"] and len(runs["after"][0]["distances"]) == 2
    assert "float32x2: distances" in capsys.readouterr().out


def test_report_distances_in_process_runs(tmp_path, capsys):
    from benchmarks import report_distances

    argv = ["--before", "HEAD", "--in-process", "--hidden", "64", "--layers", "1", "--repeat", "2", "--settings",
            "bfloat16x2", "--json", str(tmp_path / "r.json")]
    result = report_distances.main(argv)
    entry = json.loads((tmp_path / "r.json").read_text())["in_process"]["bfloat16x2"]
    assert entry == result["in_process"]["bfloat16x2"]
    assert all(len(v) == 2 and all(t > 0 for t in v) for v in entry["seconds"].values()) and entry["ratio"] > 0
    assert "bfloat16x2 (in process)" in capsys.readouterr().out
