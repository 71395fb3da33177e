"""An aligned config run with ``mode: memory`` and ``mode: stream`` reports the same inputs aligned and the same
side files (benchmarks/streameq_audit.py). In memory the anchor was written as an "aligned" copy although nothing
moved it (``aligned: {anchor: true}``; streamed ``false``: it is read from its own folder), and streamed the side
files were those of the aligned temporary copy, whose ``symmerge_report.json`` the report listed as left out."""

from __future__ import annotations

import json

import pytest
import torch

from factories import make_model
from symmerge.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("keys", ["mergekit", "own"])
def test_an_aligned_config_reports_the_same_in_memory_and_streamed(tmp_path, keys):
    for name, seed in (("a", 0), ("b", 1)):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(tmp_path / name)
    a, b = tmp_path / "a", tmp_path / "b"
    reports, tensors = {}, {}
    for mode in ("memory", "stream"):
        cfg = tmp_path / f"{mode}.yml"
        if keys == "mergekit":
            cfg.write_text(f"merge_method: linear\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.5}}\n"
                           f"  - model: {b}\n    parameters: {{weight: 0.5}}\nalign: heads,attn,ffn,rescale\n"
                           f"mode: {mode}\n")
        else:
            cfg.write_text(f"method: average\nmodels:\n  - {a}\n  - {b}\nalign: heads,attn,ffn,rescale\nmode: {mode}\n"
                           "progress: none\n")
        out = tmp_path / f"out-{mode}"
        assert main(["run", str(cfg), "-o", str(out)]) == 0
        reports[mode] = json.loads((out / "symmerge_report.json").read_text())
        tensors[mode] = (out / "model.safetensors").read_bytes()
    assert tensors["memory"] == tensors["stream"]
    assert reports["memory"].get("aligned") == reports["stream"].get("aligned")
    assert reports["memory"]["side_files"] == reports["stream"]["side_files"]
    assert "symmerge_report.json" not in reports["stream"]["side_files"]["left_out"]
