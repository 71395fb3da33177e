"""The streamed merge's distances where the executor measures them tensor by tensor (a one-input method such as
``slerp``; every float16 merge) are taken in float64, as the in-memory merge takes them: in float32 they were
1e-9 (slerp, float32) to 1e-8 (float16 average) relative apart from memory's (benchmarks/streameq_audit.py), then a
rounding apart (other blocks and order); now equal (one per-tensor function, the values summed exactly:
symmerge/merge/distances.py)."""

from __future__ import annotations

import json

import pytest
import torch

from factories import make_model
from symmerge.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("method,dtype", [("slerp", torch.float32), ("average", torch.float16)])
def test_executor_distances_are_the_in_memory_ones(tmp_path, method, dtype):
    for name, seed in (("base", 0), ("m1", 1), ("m2", 2)):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).to(dtype).save_pretrained(tmp_path / name)
    models = ["m1"] if method == "slerp" else ["m1", "m2"]
    extra = ["--param", "t=0.3", "--base", str(tmp_path / "base")] if method == "slerp" else []
    reports = {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        assert main(["merge", *[str(tmp_path / m) for m in models], "--method", method, *extra, "--align", "none",
                     "--mode", mode, "--progress", "none", "-o", str(out)]) == 0
        reports[mode] = json.loads((out / "symmerge_report.json").read_text())
    mem, streamed = (reports[m]["distance_result_to_inputs"] for m in ("memory", "stream"))
    assert mem.keys() == streamed.keys()
    assert mem == streamed
