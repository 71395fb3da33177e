"""An aligned merge reports the same distance tables in memory and streamed.

``alignment.models[].distances`` has ``whole``, ``per_layer`` and ``per_module`` before and after. In memory the
tables were built over every bound group instance (``residual`` included when it was not aligned) and every tensor
of a layer (its norms too), streamed they are the align report's: the instances aligned, a layer's distance over
its instances' tensors (README). In memory they are now the align report's too, and every sum is exact
(``math.fsum``): the two wings' tables agree to the last bit. ``whole`` (and the rows' ``distance_before`` /
``distance_after``) did not: the streamed row took the anchor's own head out of the whole model's distance
(sqrt(d² − head²): a rounding apart, 1 unit in the last place; 4 of the 6 cases below failed on it), where the in-memory
row measures the anchor proxy (the anchor's body with the model's heads: each head 0.0). The streamed alignment
now measures that proxy too (``align_streaming(model_heads=...)``), so every value is the sum of the same per-tensor
values, bit for bit. In bfloat16 the tables are the written (rounded) models' in both wings, computed in float64
(the streamed rows were the float32 solution's: 0.5566 against 0.5584 per_layer on a tiny
Llama)."""

from __future__ import annotations

import json

import pytest
import torch

from factories import make_model
from symmerge.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gpt2", "bert"])
def test_aligned_merge_tables_are_the_same_in_memory_and_streamed(tmp_path, family, dtype):
    for name, seed in (("a", 0), ("b", 1)):
        make_model(family, head=True, dtype=torch.float32, seed=seed).to(dtype).save_pretrained(tmp_path / name)
    rows = {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        assert main(["merge", str(tmp_path / "a"), str(tmp_path / "b"), "--method", "average", "--align",
                     "heads,attn,ffn,rescale", "--mode", mode, "--progress", "none", "-o", str(out)]) == 0
        rows[mode] = json.loads((out / "symmerge_report.json").read_text())["alignment"]["models"]
    (mem,), (streamed,) = ([r for r in rows[m] if not r["anchor"]] for m in ("memory", "stream"))
    assert "residual" not in mem["distances"]["before"]["per_module"]  # not aligned: not a row of the table
    for side in ("before", "after"):
        for table in ("per_layer", "per_module"):
            assert mem["distances"][side][table] == streamed["distances"][side][table], (side, table)
        assert mem["distances"][side]["whole"] == streamed["distances"][side]["whole"], side
        assert mem[f"distance_{side}"] == streamed[f"distance_{side}"], side
