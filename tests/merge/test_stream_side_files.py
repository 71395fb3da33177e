"""What a merge writes besides the weights, and what its report says of it, is the same in memory and streamed.

Three differences the memory/disk audit found (benchmarks/streameq_audit.py): the in-memory output's
``generation_config.json`` was transformers' rewrite of the input's (another file when the input's was written by
another transformers or by hand), the streamed one the input's own, and only the streamed report listed it as
copied; a streamed aligned merge took its side files from the aligned temporary copy, so its report listed that
copy's ``symmerge_report.json`` as left out; and with the base as the anchor the in-memory report's
``alignment.models`` had the base's anchor row, the streamed one had none."""

from __future__ import annotations

import json

import pytest
import torch

from factories import make_model
from symmerge.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

GENERATION = '{\n  "bos_token_id": 1,\n  "eos_token_id": 2,\n  "temperature": 0.7,\n  "do_sample": true\n}\n'


def _inputs(tmp_path):
    for name, seed in (("base", 0), ("m1", 1), ("m2", 2)):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(tmp_path / name)
        (tmp_path / name / "generation_config.json").write_text(GENERATION)  # not as transformers writes it
    return tmp_path / "base", tmp_path / "m1", tmp_path / "m2"


@pytest.mark.parametrize("align", ["none", "heads,attn,ffn,rescale"])
def test_side_files_and_their_report_are_the_same_in_memory_and_streamed(tmp_path, align):
    base, m1, m2 = _inputs(tmp_path)
    reports = {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        assert main(["merge", str(m1), str(m2), "--method", "ties", "--param", "density=0.5", "--base", str(base),
                     "--align", align, "--mode", mode, "--progress", "none", "-o", str(out)]) == 0
        assert (out / "generation_config.json").read_text() == GENERATION  # the input's own file
        reports[mode] = json.loads((out / "symmerge_report.json").read_text())
    assert reports["memory"]["side_files"] == reports["stream"]["side_files"] == {
        "copied": ["generation_config.json"], "left_out": []}
    if align != "none":
        rows = {m: [(r["model"], r["anchor"]) for r in reports[m]["alignment"]["models"]] for m in reports}
        assert rows["memory"] == rows["stream"] == [(str(m1), False), (str(m2), False), (str(base), True)]
