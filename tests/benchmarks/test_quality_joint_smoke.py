"""``python -m benchmarks.quality_joint`` (issue 42 item 3, N models) end to end on four tiny random ViTs and
random images: one row per frame with the settings given (``dirichlet=uniform``: the N-model analogue of the
pair's α = ½), the endpoints' accuracies equal to ``transformers``' own evaluation of each folder, every aligned
model verified, the objective not above its start, the wall and CPU seconds recorded, the table written."""

from __future__ import annotations

import json

import pytest

from conftest import hf_load, npz_eval, npz_file, vit_folder

pytestmark = pytest.mark.usefixtures("single_thread")


def test_quality_joint_tiny_end_to_end(tmp_path):
    from benchmarks import quality_joint

    data = tmp_path / "data"
    data.mkdir()
    npz_file(data / "test.npz", n=30, seed=1)
    npz_file(data / "stats.npz", n=24, seed=2)
    models = [str(vit_folder(tmp_path / f"m{i}", seed=i)) for i in range(4)]
    out = tmp_path / "out"
    assert quality_joint.main(["--models", *models, "--data", str(data), "--align-samples", "24", "--learn",
                               "steps=3", "--learn", "batch=8", "--learn", "dirichlet=uniform", "--learn", "augment=0",
                               "--out", str(out)]) == 0
    r = json.loads((out / "results.json").read_text())
    assert [x["frame"] for x in r["rows"]] == ["one-sided", "dual"]
    for e, folder in zip(r["endpoints"], models):
        assert e["accuracy"] == pytest.approx(npz_eval(hf_load(folder), data / "test.npz")[1])
    mean = sum(e["accuracy"] for e in r["endpoints"]) / 4
    assert r["endpoints_mean_accuracy"] == pytest.approx(mean)
    for x in r["rows"]:
        assert x["dirichlet"] == "uniform" and x["steps"] == 3
        assert x["accuracy_vs_endpoints"] == pytest.approx(x["accuracy"] / mean)
        assert x["verify_max_rel_diff"] <= 1e-5 and x["objective"][1] <= x["objective"][0]
        assert x["seconds"] > 0 and x["cpu_seconds"] > 0
        assert x["align_samples_used"] == 24  # every unlabeled image, each once
    assert "| dual | steps=3 batch=8 dirichlet=uniform augment=0 |" in (out / "tables.md").read_text()
