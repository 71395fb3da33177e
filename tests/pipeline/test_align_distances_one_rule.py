"""``symmerge align`` and ``symmerge align --stream`` report one alignment's distances bit for bit equal.

Both wings record each tensor's squared distance to the anchor with one function
(:func:`symmerge.core.distance.sq_distance`: float64 differences, so a half tensor and its float32 working copy give
the same value; after the alignment: the written model's, every tensor rounded once to the stored dtype) over the same
tensors (the stored ones; a tied alias once), and sum them exactly (:class:`symmerge.pipeline.report.Distances`,
``math.fsum``): the whole model, ``per_layer`` and ``per_module`` are the same floats whatever order the tensors
come in. Task models (a head outside the base model) included; the symmetries are those that stream."""

from __future__ import annotations

import json

import pytest
import torch

from factories import make_model
from symmerge.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

CASES = [("llama", torch.float32, False), ("llama", torch.bfloat16, False), ("llama", torch.float32, True),
         ("gpt2", torch.float32, True), ("bert", torch.float32, False), ("bert", torch.bfloat16, True)]


@pytest.mark.parametrize("family,dtype,head", CASES)
def test_align_distances_loaded_and_streamed_are_equal(tmp_path, family, dtype, head):
    for name, seed in (("a", 0), ("b", 1)):
        make_model(family, head=head, dtype=torch.float32, seed=seed).to(dtype).save_pretrained(tmp_path / name)
    reports = {}
    for mode, extra in (("memory", []), ("stream", ["--stream"])):
        out = tmp_path / mode
        assert main(["align", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out), "--symmetries",
                     "heads,attn,ffn,rescale", "--progress", "none", *extra]) == 0
        reports[mode] = json.loads((out / "symmerge_report.json").read_text())
    mem, streamed = reports["memory"], reports["stream"]
    assert mem["streamed"] is False and streamed["streamed"] is True
    assert mem["distance_after"] < mem["distance_before"]
    assert len(mem["per_module"]) >= 8 and set(mem["per_layer"]) == {"0", "1"}
    for field in ("distance_before", "distance_after", "per_layer", "per_module"):
        assert mem[field] == streamed[field], field
