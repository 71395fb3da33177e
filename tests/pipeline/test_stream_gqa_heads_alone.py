"""GQA heads aligned without the attention groups (``--symmetries heads``, ``heads,ffn``): in memory the heads kind
pairs each KV group's query heads on the attention groups' tensors (bound, not aligned); streamed, a part held only
the aligned instances, so the query heads kept their order (an identity on a Llama whose in-memory alignment
permuted them). The streamed part now sees the bound instances of its layer that read only its tensors: both modes
write the same tensors, bit for bit, in ``align`` and in a streamed merge."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import folder_tensors, run_cli, save_folder
from factories import DEC_HEADS, DEC_KV, make_model

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    assert DEC_HEADS > DEC_KV  # grouped-query attention
    root = tmp_path_factory.mktemp("gqa")
    return [save_folder(make_model("llama", head=True, seed=s), root / f"m{s}") for s in (0, 1)]


@pytest.mark.parametrize("symmetries", ["heads", "heads,ffn"])
def test_align_streamed_is_the_in_memory_alignment(pair, tmp_path, symmetries):
    outs = {}
    for mode, flags in (("memory", ()), ("stream", ("--stream",))):
        outs[mode] = tmp_path / mode
        assert run_cli("align", *pair, "--symmetries", symmetries, *flags, "--progress", "none",
                       "-o", outs[mode]) == 0
    a, b = folder_tensors(outs["memory"]), folder_tensors(outs["stream"])
    assert set(a) == set(b) and [k for k in a if not torch.equal(a[k], b[k])] == []
    report = json.loads((outs["stream"] / "symmerge_report.json").read_text())
    assert report["distance_after"] < report["distance_before"]  # the query heads moved


def test_a_streamed_merge_is_the_in_memory_merge(pair, tmp_path):
    outs = {}
    for mode in ("memory", "stream"):
        outs[mode] = tmp_path / mode
        assert run_cli("merge", *pair, "--method", "average", "--align", "heads,ffn", "--mode", mode,
                       "--progress", "none", "-o", outs[mode]) == 0
    a, b = folder_tensors(outs["memory"]), folder_tensors(outs["stream"])
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
