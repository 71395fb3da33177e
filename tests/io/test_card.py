"""Every folder align and merge write gets its own model card (README.md): the inputs with what their
cards declare, the method, the alignment, what was measured and the symmerge version; the inputs'
cards are never copied (issue 20 item 5, issue 23 item 3)."""

from __future__ import annotations

import json

import pytest

import symmerge
from conftest import npz_file, run_cli, vit_folder
from symmerge.io.card import input_card

pytestmark = pytest.mark.usefixtures("single_thread")

INPUT_CARD = """---
license: mit
model_name: tiny-vit-{seed}
tags: [vision]
---

# A stale card that must not survive

Trained on something else entirely.
"""


@pytest.fixture
def vits(tmp_path):
    folders = [vit_folder(tmp_path / f"vit{s}", s) for s in (0, 1)]
    for s, f in enumerate(folders):
        (f / "README.md").write_text(INPUT_CARD.format(seed=s))
    return folders


def test_input_cards_are_quoted_not_copied(tmp_path):
    f = tmp_path / "m"
    f.mkdir()
    (f / "README.md").write_text(INPUT_CARD.format(seed=7))
    assert input_card(f) == {"name": "tiny-vit-7", "license": "mit"}
    (f / "README.md").write_text("# Just a heading\n\nno front matter\n")
    assert input_card(f) == {"name": "Just a heading", "license": None}
    (f / "README.md").write_text("---\n: : bad yaml [\n---\n# Title\n")
    assert input_card(f) == {"name": "Title", "license": None}
    assert input_card(tmp_path / "nothing") is None


def test_merge_card_states_inputs_method_alignment_and_measurements(vits, tmp_path):
    out = tmp_path / "merged"
    data = npz_file(tmp_path / "eval.npz")
    assert run_cli("merge", *vits, "--method", "average", "--eval-data", data, "-o", out, "--progress", "none") == 0
    card = (out / "README.md").read_text()
    report = json.loads((out / "symmerge_report.json").read_text())
    assert "stale card" not in card and card.startswith("---\nlibrary_name: transformers\nlicense: mit\n")
    assert f"symmerge {symmerge.__version__}" in card
    for folder, seed in zip(vits, (0, 1)):
        assert f"`{folder}`" in card and f"tiny-vit-{seed}" in card
    assert "`symmerge merge --method average`" in card
    assert f"`{','.join(report['alignment']['symmetries'])}` (requested: `recommended`)" in card
    aligned = next(m for m in report["alignment"]["models"] if not m["anchor"])
    assert f"{aligned['distance_before']:.4f} | {aligned['distance_after']:.4f}" in card
    merged = report["evaluation"]["merged"][0]
    assert f"| merged | {data} | {merged['loss']:.4f} | {merged['accuracy']:.4f} |" in card
    assert "Tokenizer check: `not_compared`" in card  # tiny ViTs have no tokenizer


def test_align_card_and_differing_licences(vits, tmp_path):
    (vits[1] / "README.md").write_text(INPUT_CARD.format(seed=1).replace("license: mit", "license: apache-2.0"))
    out = tmp_path / "aligned"
    assert run_cli("align", *vits, "-o", out, "--progress", "none") == 0
    card = (out / "README.md").read_text()
    report = json.loads((out / "symmerge_report.json").read_text())
    assert "license:" not in card.split("---")[1]  # the inputs disagree: no licence claimed for the output
    assert "declare different licences" in card and "| mit |" in card and "| apache-2.0 |" in card
    assert "`symmerge align`" in card and "It computes the same function as the input model." in card
    assert f"| L2 distance to the anchor, after | {report['distance_after']:.4f} |" in card
    assert "README.md" not in report["side_files"]["copied"] + report["side_files"]["left_out"]
