"""Smoke test of ``python -m benchmarks.bench_startup``: one published config, one measured run of each
command, this checkout's symmerge against itself as ``--before`` and against mergekit-yaml; every row's
figures printed and written. Needs mergekit's ``mergekit-yaml`` (``/tmp/symmerge-mergekit``, built by
``.ci/run``): skipped without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MERGEKIT_BIN = Path("/tmp/symmerge-mergekit/bin")


@pytest.mark.slow  # 17 commands in fresh processes (torch imported each time): 1-3 minutes under load
@pytest.mark.skipif(not (MERGEKIT_BIN / "mergekit-yaml").is_file(), reason="mergekit-yaml is not installed")
def test_bench_startup_one_config(tmp_path):
    symmerge = Path(sys.executable).parent / "symmerge"
    if not symmerge.is_file():
        pytest.skip(f"no symmerge command beside {sys.executable}")
    out = tmp_path / "startup.json"
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench_startup", "--configs", "absa-slerp-v-shape",
                        "--repeat", "1", "--before", str(symmerge), "--work", str(tmp_path), "--json", str(out)],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = {r["row"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["python -c pass", "import torch", "run --help", "run absa-slerp-v-shape"]
    for name in ("run --help", "run absa-slerp-v-shape"):
        tools = rows[name]["tools"]
        assert list(tools) == ["symmerge", "before", "mergekit"]
        for s in tools.values():
            assert s["rc"] == 0 and s["n"] == 1 and s["cpu_median"] > 0 and s["rss_mb_median"] > 100
        assert rows[name]["ratios"]["cpu symmerge/mergekit"] == pytest.approx(
            tools["symmerge"]["cpu_median"] / tools["mergekit"]["cpu_median"])
    assert "run absa-slerp-v-shape" in p.stdout and "cpu symmerge/before" in p.stdout
    assert not [f for f in tmp_path.iterdir() if f.name != "startup.json"]  # the stand-ins and outputs removed
