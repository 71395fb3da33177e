"""``symmerge.align`` (the Python entry that returns the aligned model and its report, nothing written) reports as
``symmerge align`` does: it plans first (``plan_align``) and builds the report from the plan (``plan_report``), so the
report has the command's fields — ``plan``, ``model``, ``anchor`` — and the same plan, on folders and on models in
memory. Before, it called ``align_pair`` without a plan and its report had none of the three."""

from __future__ import annotations

import json

import pytest
import torch

from factories import make_model
from symmerge import AlignOptions, align, align_to_folder
from symmerge.cli import main

WRITTEN_ONLY = {"symmerge_version", "command_line", "side_files"}  # a written folder's provenance and side files
TIMED = {"seconds", "match_seconds"}


@pytest.fixture
def folders(tmp_path):
    for seed, name in ((0, "a"), (1, "b")):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(str(tmp_path / name))
    return tmp_path / "a", tmp_path / "b"


@pytest.mark.parametrize("symmetries", ["recommended", "attn,ffn,rescale"])
def test_align_reports_as_the_command(folders, tmp_path, symmetries):
    a, b = folders
    _, report = align(str(a), str(b), symmetries=symmetries)
    assert main(["align", str(a), str(b), "-o", str(tmp_path / "cli"), "--symmetries", symmetries, "-q"]) == 0
    cli = json.loads((tmp_path / "cli" / "symmerge_report.json").read_text())
    assert set(report) == set(cli) - WRITTEN_ONLY
    assert report["plan"] == cli["plan"] and (report["model"], report["anchor"]) == (str(a), str(b))
    for k in set(report) - TIMED - {"tokenizer", "solver"}:
        assert report[k] == cli[k], k
    if "solver" in report:  # the residual's data-free search: the same starts and objectives, timed apart
        untimed = lambda s: [{k: v for k, v in x.items() if k != "seconds"} for x in s["starts"]]  # noqa: E731
        assert untimed(report["solver"]) == untimed(cli["solver"])
    assert report["symmetries_requested"] == symmetries


def test_align_in_memory_reports_as_align_to_folder(folders, tmp_path):
    from symmerge.io.model import load_model

    a, b = (load_model(x) for x in folders)
    _, report = align(a, b, symmetries="recommended")
    written = align_to_folder(a, b, tmp_path / "out", AlignOptions(symmetries="recommended"), progress=False)
    assert set(report) == set(written) - WRITTEN_ONLY
    assert report["plan"] == written["plan"] and report["model"] == "model" and report["anchor"] == "anchor"
    assert report["distance_after"] == written["distance_after"] < report["distance_before"]


@pytest.mark.parametrize("bad", [{"inputs": {"input_ids": [1, 2]}}, {"progress": "yes"},
                                 {"allow_tokenizer_mismatch": "no"}])
def test_align_checks_its_arguments_before_the_plan_reads(folders, monkeypatch, bad):
    """A bad argument is one UsageError before the plan reads a header or loads a model."""
    from symmerge.errors import UsageError
    from symmerge.pipeline import align_plan

    def planned(*args, **kwargs):
        raise AssertionError("planned before the arguments were checked")

    monkeypatch.setattr(align_plan, "plan_align", planned)
    with pytest.raises(UsageError):
        align(str(folders[0]), str(folders[1]), **bad)


def test_every_entry_aligns_by_default_as_the_command(folders, tmp_path):
    """No symmetries named: ``symmerge.align``, ``align_to_folder`` (options None), ``AlignOptions()`` and
    ``symmerge align`` (no ``--symmetries``) align with 'recommended' alike. Before 2026-12-01 the first three took the
    paper's attn,ffn,rescale and ``symmerge.align(a, b)`` gave another model than ``symmerge align a b``."""
    from mergekit_oracle import tensors

    a, b = folders
    assert AlignOptions().requested == "recommended" and AlignOptions(symmetries="paper").requested != "recommended"
    assert main(["align", str(a), str(b), "-o", str(tmp_path / "cli"), "-q"]) == 0
    cli = json.loads((tmp_path / "cli" / "symmerge_report.json").read_text())
    moved, report = align(str(a), str(b))
    written = align_to_folder(a, b, tmp_path / "api", progress=False)
    assert cli["symmetries_requested"] == report["symmetries_requested"] == written["symmetries_requested"]
    assert cli["symmetries"] == report["symmetries"] == written["symmetries"] and "residual" in cli["symmetries"]
    expected, api = tensors(tmp_path / "cli"), tensors(tmp_path / "api")
    assert expected.keys() == api.keys() and all(torch.equal(expected[k], api[k]) for k in expected)
    state = moved.state_dict()
    assert all(torch.equal(state[k], expected[k]) for k in expected)
