"""benchmarks/repro_audit.py: its comparison sees a changed tensor, a changed byte layout and a changed report field
(timings aside), and a small run of it finds the same bytes where docs/results/repro_audit.md says it does."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from benchmarks import repro_audit

pytestmark = pytest.mark.usefixtures("single_thread")


def folder(path, tensors, report, metadata=None):
    path.mkdir()
    save_file(tensors, str(path / "model.safetensors"), metadata=metadata)
    (path / "symmerge_report.json").write_text(json.dumps({**report, "command_line": ["symmerge", "-o", str(path)]}))
    return path


def test_compare_sees_tensors_bytes_and_report_fields(tmp_path):
    t = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    base = folder(tmp_path / "x", t, {"timings": {"merge": 1.0}, "distance": 2.0})
    same = folder(tmp_path / "y", t, {"timings": {"merge": 9.0}, "distance": 2.0})
    r = repro_audit.compare(base, same, [])
    assert r["sha_equal"] and r["differ"] == 0 and r["report_diff"] == []  # timings and the output path aside
    other_layout = folder(tmp_path / "z", t, {"distance": 2.5, "timings": {}}, metadata={"format": "pt"})
    r = repro_audit.compare(base, other_layout, [])
    assert not r["sha_equal"] and r["differ"] == 0 and repro_audit.verdict(r) == "tensors (not bytes)"
    assert r["report_diff"] == ["distance"] and r["report_max_rel"] == pytest.approx(0.2)
    changed = folder(tmp_path / "w", {**t, "b": torch.ones(4) * 1.5}, {"distance": 2.0})
    r = repro_audit.compare(base, changed, [])
    assert r["differ"] == 1 and r["tensors"] == ["b"] and r["max_abs"] == pytest.approx(0.5)
    assert repro_audit.verdict(r).startswith("DIFF 1 t")


def test_a_small_audit_finds_the_same_bytes(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("REPRO_TMP", str(tmp_path))
    out = tmp_path / "rows.json"
    assert repro_audit.main(["--families", "llama", "--dtypes", "float32", "--methods", "ties", "--json",
                             str(out)]) == 0
    rows = {r["check"]: r for r in json.loads(out.read_text())}
    for check in ("twice", "threads 1/2", "mem/stream", "sharded", "yaml mergekit", "yaml own keys", "order"):
        assert repro_audit.verdict(rows[check]) == "bytes", (check, rows[check])
    assert "| llama | float32 | ties | twice | bytes |" in capsys.readouterr().out
    assert not [p for p in tmp_path.iterdir() if p != out]  # its folders removed
