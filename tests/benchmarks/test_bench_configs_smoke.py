"""Smoke test of ``python -m benchmarks.bench_configs --sizes tiny --configs ...``: two published configs (a
one-document TIES merge and a three-document file run by ``mergekit-multi``) on tiny stand-ins, symmerge and
mergekit as child processes; every row's figures printed and written. Needs mergekit's ``mergekit-yaml``
(``/tmp/symmerge-mergekit``, built by ``.ci/run``): skipped without it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MERGEKIT_BIN = Path("/tmp/symmerge-mergekit/bin")


@pytest.mark.slow  # four merges in fresh processes (torch imported each time): 60–120 s under load
@pytest.mark.skipif(not (MERGEKIT_BIN / "mergekit-yaml").is_file(), reason="mergekit-yaml is not installed")
def test_bench_configs_tiny_two_configs(tmp_path):
    out = tmp_path / "rows.json"
    symmerge = Path(sys.executable).parent / "symmerge"
    if not symmerge.is_file():
        pytest.skip(f"no symmerge command beside {sys.executable}")
    p = subprocess.run([sys.executable, "-m", "benchmarks.bench_configs", "--sizes", "tiny", "--configs",
                        "absa-ties-lambda,eggs-multi-document", "--work", str(tmp_path), "--json", str(out),
                        "--spread"],
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                       timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["config"], r["size"]) for r in rows] == [("absa-ties-lambda", "tiny"), ("eggs-multi-document", "tiny")]
    assert [r["order"][0] for r in rows] == ["symmerge", "mergekit"]  # alternating
    for r in rows:
        for tool in ("symmerge", "mergekit"):
            assert r[tool]["rc"] == 0 and r[tool]["wall_s"] > 0 and 0 < r[tool]["cpu_s"]
            # a fresh Python with torch holds well over 100 MB, and the measuring parent (~10 MB) is not counted in
            assert 100_000 < r[tool]["peak_rss_kb"] < 4_000_000
        assert r["wall_ratio"] == pytest.approx(r["symmerge"]["wall_s"] / r["mergekit"]["wall_s"])
        assert r["rss_ratio"] == pytest.approx(r["symmerge"]["peak_rss_kb"] / r["mergekit"]["peak_rss_kb"])
        assert r["cpu_ratio"] == pytest.approx(r["symmerge"]["cpu_s"] / r["mergekit"]["cpu_s"])
        assert r["params"] > 0 and r["hidden"] == 64
    assert rows[0]["gap"] < 1e-3  # TIES is deterministic: symmerge's result is mergekit's
    # --spread: mergekit run twice; TIES gives the same bits both times, and every row records the second run
    assert rows[0]["mergekit_spread"] == 0.0
    assert all(r["mergekit_again"]["rc"] == 0 and r["mergekit_spread"] >= 0 for r in rows)
    assert "mergekit's own spread" in p.stdout
    assert "absa-ties-lambda" in p.stdout and "rows over the goal" in p.stdout
    assert not [f for f in tmp_path.iterdir() if f.name != "rows.json"]  # the stand-ins and outputs are removed
