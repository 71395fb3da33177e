"""benchmarks/factor_cost.py: the activation start's factorisation (``activations.factor``, eigh in float64) and the
two cheaper ones measured beside it reproduce the Gram (``L Lᵀ``), the pivoted Cholesky at the Gram's rank."""

from __future__ import annotations

import pytest

from benchmarks import factor_cost

pytestmark = pytest.mark.usefixtures("single_thread")


def test_every_factorisation_reproduces_the_gram_and_the_pivoted_one_finds_its_rank():
    row = factor_cost.row(48, tokens=20)
    assert row["n"] == 96 and row["pivoted_rank"] == 20  # rank = the activations the Gram was built from
    assert row["eigh_float64_err"] < 1e-12 and row["pivoted_cholesky_err"] < 1e-12
    assert row["eigh_float32_err"] < 1e-5  # float32's rounding, not float64's
    assert min(row["eigh_float64_s"], row["eigh_float32_s"], row["pivoted_cholesky_s"]) > 0
