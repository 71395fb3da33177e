"""``align --stream`` of float16/bfloat16 files solves on the same precision as ``align`` in memory.

In memory, half-precision models are solved on float32 working copies, so the head blocks are solved in float64
(:func:`symmerge.core.slots.precise_dtype`). Streamed, the parts were solved on the stored bfloat16 tensors, hence
in float32: 2 of 16 tiny bfloat16 Llama pairs (these two) differed from the in-memory folder by one bfloat16 step of
one ``o_proj`` element. Streamed, the solve now reads float32 copies (:class:`symmerge.pipeline.stream.Lifted`); the
distances are the written (rounded) model's, in float64, in both wings (in memory they were the float32 solution's,
streamed the rounded model's in float32 arithmetic), and both reports carry the ``working_copies`` entry."""

from __future__ import annotations

import json

import pytest
import torch

from factories import make_model
from learned_pair import tensors
from symmerge.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("seeds", [(6, 7), (14, 15)])
def test_streamed_half_alignment_is_the_in_memory_one_bit_for_bit(tmp_path, seeds, dtype):
    for name, seed in zip("ab", seeds):
        make_model("llama", dtype=torch.float32, seed=seed).to(dtype).save_pretrained(tmp_path / name)
    reports, written = {}, {}
    for mode, extra in (("memory", []), ("stream", ["--stream"])):
        out = tmp_path / mode
        assert main(["align", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out), "--symmetries", "paper",
                     "--progress", "none", *extra]) == 0
        written[mode], reports[mode] = tensors(out), json.loads((out / "symmerge_report.json").read_text())
    assert written["memory"].keys() == written["stream"].keys()
    assert [k for k, t in written["memory"].items() if not torch.equal(t, written["stream"][k])] == []
    assert all(t.dtype == dtype for t in written["stream"].values())
    for field in ("distance_before", "distance_after", "per_module", "per_layer", "working_copies"):
        assert reports["memory"][field] == reports["stream"][field], field


def test_the_lifted_view_reads_half_tensors_as_float32_copies():
    from symmerge.pipeline.stream import Lifted

    sd = {"h": torch.tensor([1.5, -2.0], dtype=torch.bfloat16), "f": torch.tensor([0.1]), "i": torch.tensor([3])}
    lifted = Lifted(sd)
    assert list(lifted) == ["h", "f", "i"] and len(lifted) == 3
    assert lifted["h"].dtype == torch.float32 and torch.equal(lifted["h"], sd["h"].float())
    assert lifted["f"] is sd["f"] and lifted["i"] is sd["i"]
    assert sd["h"].dtype == torch.bfloat16  # the stored tensor is left as it is
