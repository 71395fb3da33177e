"""benchmarks/factor_cost.py: the activation start's factorisation by both of ``activations.factor``'s paths (eigh
in float64, the pivoted Cholesky) and eigh in float32 reproduce the Gram (``L Lᵀ``), the pivoted one at its rank;
``--eigh-up-to`` leaves eigh out above a size."""

from __future__ import annotations

import json

import pytest

from benchmarks import factor_cost
from symmerge.pipeline import activations

pytestmark = pytest.mark.usefixtures("single_thread")


def test_every_factorisation_reproduces_the_gram_and_the_pivoted_one_finds_its_rank():
    threshold = activations.PIVOTED_FROM
    row = factor_cost.row(48, tokens=20)
    assert activations.PIVOTED_FROM == threshold  # restored
    assert row["n"] == 96 and row["pivoted_rank"] == 20  # rank = the activations the Gram was built from
    assert row["eigh_float64_err"] < 1e-12 and row["pivoted_cholesky_err"] < 1e-12
    assert row["eigh_float32_err"] < 1e-5  # float32's rounding, not float64's
    assert min(row["eigh_float64_s"], row["eigh_float32_s"], row["pivoted_cholesky_s"]) > 0


def test_eigh_left_out_above_the_limit(capsys):
    assert factor_cost.main(["--widths", "16,40", "--tokens", "10", "--eigh-up-to", "32"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["n"] for r in rows] == [32, 80]
    assert "eigh_float64_s" in rows[0] and "eigh_float64_s" not in rows[1]
    assert [r["pivoted_rank"] for r in rows] == [10, 10]


def test_memory_row_gathers_and_factors_one_site(monkeypatch):
    monkeypatch.setattr(activations, "PIVOTED_FROM", 64)
    row = factor_cost.memory_row(40, tokens=30)  # n = 80: the pivoted path, rank ≤ 29 (correlations: centred)
    assert row["path"] == "pivoted" and row["rank"] <= 29 and row["gram_gb"] == 80 * 80 * 8 / 1e9
    assert row["statistics_rise_gb"] >= 0 and row["factored_rise_gb"] >= 0 and row["factored_s"] > 0
