"""Smoke test of ``python -m benchmarks.bench_merge --tiny``: a tiny random Llama and three perturbed copies,
the plain average against mergekit (its column skipped with a note when mergekit is not installed) and
TIES / DARE-TIES on three models against their plain average; every figure printed and written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a benchmark run end to end in a child (about 20 s CPU, over 60 s wall under load): .ci/run's slow step
def test_bench_merge_tiny_runs_and_reports_its_figures(tmp_path):
    # one OpenMP thread in the benchmark and its children: no figure checked here depends on it, and on two shared
    # cores the second thread mostly waits (bench_merge --tiny: 16.2 s of CPU on two threads, 13.3 s on one)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    out = tmp_path / "figures.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench_merge", "--tiny", "--repeats", "1", "--dir",
                        str(tmp_path / "bench"), "--mergekit", str(tmp_path / "no-mergekit"), "--json", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    figures = json.loads(out.read_text())
    avg = figures["average"]
    assert avg["symmerge"]["wall_s"] > 0 and avg["symmerge"]["cpu_s"] > 0 and avg["symmerge"]["peak_rss_gb"] > 0
    assert avg["mergekit"].startswith("skipped")
    three = figures["three_models"]
    assert set(three) >= {"average", "ties", "dare_ties", "ties_over_average_wall", "dare_ties_over_average_wall"}
    assert three["ties_over_average_wall"] > 0 and "goal" in three
    assert "average:" in p.stdout and "three_models:" in p.stdout
    assert not any((tmp_path / "bench" / "tiny").glob("out-*"))  # the merged outputs are cleaned up
