"""One model without a base or an anchor of its own, with an explicit ``--align`` list: nothing to align it to, so
nothing is aligned, in memory and streamed alike, with the same report (``alignment.symmetries`` empty, a note, frame
``none``), as a mergekit config with ``--align`` reports it ("one model: nothing to align"). Before, the in-memory
merge aligned the model against itself — ``--align residual`` folded its norms: 16 of a tiny Llama's 21 tensors
changed — while the streamed one copied it, and the two reports differed in ``alignment.symmetries``,
``alignment.streamed`` and ``distances_between_inputs.before_alignment`` (docs/results/streameq_audit.md left it as
report-only; it was not). ``recommended`` did this already (``plan.ONE_MODEL_NOTE``). Shown to fail before the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import run_cli

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def one(tmp_path_factory):
    import torch

    from factories import make_model

    folder = tmp_path_factory.mktemp("onealign") / "m1"
    make_model("llama", head=True, dtype=torch.float32, seed=1).save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("align", ["residual", "attn,ffn", "heads,attn,ffn,rescale,residual"])
def test_one_model_with_an_explicit_list_is_aligned_nowhere_and_reported_alike(one, tmp_path, align):
    source = load_file(Path(one) / "model.safetensors")
    reports = {}
    for mode in ("memory", "stream"):
        assert run_cli("merge", one, "--method", "passthrough", "--align", align, "--mode", mode,
                       "-o", tmp_path / mode, "--progress", "none") == 0
        written = load_file(tmp_path / mode / "model.safetensors")
        assert written.keys() == source.keys() and all(written[k].equal(source[k]) for k in source), mode
        reports[mode] = json.loads((tmp_path / mode / "symmerge_report.json").read_text())
    for mode, r in reports.items():
        assert r["alignment"]["symmetries"] == [] and r["alignment"]["requested"] == align, mode
        assert "nothing to align" in r["alignment"]["note"], mode
        assert r["plan"]["frame"] == "none" and r["plan"]["anchor_rule"] is None, mode
    assert reports["memory"]["alignment"] == reports["stream"]["alignment"]
    assert reports["memory"]["distances_between_inputs"] == reports["stream"]["distances_between_inputs"] == \
        {"before_alignment": {}, "after_alignment": {}}


def test_a_list_the_family_does_not_declare_is_still_refused(one, tmp_path, capsys):
    """The list is checked before it is found to have nothing to align: ``experts`` on a dense Llama, one line."""
    assert run_cli("merge", one, "--method", "passthrough", "--align", "experts", "-o", tmp_path / "o",
                   "--progress", "none") == 2
    assert "experts" in capsys.readouterr().err
