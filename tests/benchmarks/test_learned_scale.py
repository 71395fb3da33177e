"""benchmarks/learned_scale.py (issue 42, item 6): one size measured end to end on the CPU — a real
``LlamaForCausalLM`` pair aligned by the learned matcher, the steps counted, the alignment verified, the
memory figures consistent — and the extrapolation arithmetic."""

from __future__ import annotations

import pytest

from benchmarks import learned_scale

pytestmark = pytest.mark.usefixtures("single_thread")


def test_one_size_is_measured_and_verified():
    row = learned_scale.one("tiny", "cpu", steps=2, texts=8, length=32, batch=4, precision="float32")
    assert row["parameters"] == 106816 and row["steps"] == 2
    assert row["verify_max_rel_diff"] < 1e-5  # the learned elements stay function-preserving
    assert row["seconds_per_step"] > 0 and row["closed_form_seconds"] >= 0
    assert row["peak_rss_gb"] >= row["models_rss_gb"] > 0 and row["cuda_peak_gb"] is None


def test_extrapolation_replaces_the_measured_steps():
    row = {"align_seconds": 100.0, "seconds_per_step": 2.0, "steps": 10}
    assert learned_scale.extrapolated(row, 200) == pytest.approx(100 - 20 + 400)
    assert "failed" in learned_scale.table([{"size": "1b", "device": "cpu", "error": "killed"}], 200)
