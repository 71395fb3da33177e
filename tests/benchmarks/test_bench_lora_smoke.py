"""Smoke test of ``python -m benchmarks.bench_lora --tiny``: a tiny Llama, its fine-tune and a PEFT adapter; symmerge's
extract-lora (full and randomized SVD) and a config with a base+adapter input timed (mergekit's columns skipped with a
note when it is not given); every figure printed and written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_lora_tiny_runs_and_reports_its_figures(tmp_path):
    pytest.importorskip("peft")
    # one OpenMP thread in the benchmark and its children: no figure checked here depends on it, and on two shared
    # cores the second thread mostly waits (bench_merge --tiny: 16.2 s of CPU on two threads, 13.3 s on one)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "figures.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench_lora", "--tiny", "--rank", "4", "--dir",
                        str(tmp_path / "bench"), "--mergekit-bin", str(tmp_path / "no-mergekit"), "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert set(figures["rows"]) == {"extract", "extract-lowrank", "lora-input"}
    for row in figures["rows"].values():
        assert row["symmerge_wall_s"] > 0 and row["symmerge_peak_rss_gb"] > 0 and "wall_ratio" not in row
    assert "mergekit not found" in p.stdout and "extract-lowrank" in p.stdout
