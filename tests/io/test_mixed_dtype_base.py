"""bfloat16 fine-tunes with a float32 base. The result of a method with a base is held in the base's dtype (the
executor's reference, as in mergekit: its task arithmetic of such inputs writes float32). The streamed merge wrote
float32; the merge in memory loaded the same float32 results into the bfloat16 ``--head-from`` model, so it wrote
them rounded to bfloat16. Both now write the same tensors, bit for bit, under a config naming float32."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import folder_tensors, run_cli
from factories import make_model


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    base = make_model("llama", head=True, dtype=torch.float32, seed=0)
    base.save_pretrained(root / "base")
    for i in (1, 2):
        ft = make_model("llama", head=True, dtype=torch.float32, seed=0)
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in ft.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=gen))
        ft.to(torch.bfloat16).save_pretrained(root / f"ft{i}")
    return root


@pytest.mark.parametrize("method", ["task_arithmetic", "ties"])
def test_memory_and_stream_write_the_base_dtype_bit_for_bit(family, tmp_path, method):
    outs = {}
    for mode in ("memory", "stream"):
        outs[mode] = tmp_path / mode
        assert run_cli("merge", family / "ft1", family / "ft2", "--base", family / "base", "--method", method,
                       "--mode", mode, "--progress", "none", "-o", outs[mode]) == 0
        assert {t.dtype for t in folder_tensors(outs[mode]).values()} == {torch.float32}, mode
        assert json.loads((outs[mode] / "config.json").read_text())["dtype"] == "float32", mode
    a, b = folder_tensors(outs["memory"]), folder_tensors(outs["stream"])
    assert set(a) == set(b)
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    # not the bfloat16 rounding of it: some merged entries are no bfloat16 value
    assert any(not torch.equal(t, t.to(torch.bfloat16).float()) for t in a.values())


def test_in_result_dtype_leaves_the_holder_untouched():
    from symmerge.merge.fuse import in_result_dtype

    holder = make_model("llama", head=True, dtype=torch.bfloat16, seed=0)
    merged = {k: v.float() for k, v in holder.state_dict().items()}
    cast = in_result_dtype(holder, merged)
    assert cast is not holder and cast.dtype == torch.float32 and holder.dtype == torch.bfloat16
    assert in_result_dtype(holder, {k: v for k, v in holder.state_dict().items()}) is holder


def test_an_aligned_merge_measures_against_the_base_as_stored_in_both_modes(family, tmp_path):
    """The in-memory anchor proxy (the model carrying the base's body) had the model's dtype, so the float32 base
    was aligned to and measured against as rounded to bfloat16: alignment.models' distances differed from the
    streamed merge's, which reads the base as stored."""
    reports, tensors = {}, {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        assert run_cli("merge", family / "ft1", family / "ft2", "--base", family / "base", "--method",
                       "task_arithmetic", "--align", "heads,ffn", "--mode", mode, "--progress", "none", "-o", out) == 0
        reports[mode] = json.loads((out / "symmerge_report.json").read_text())["alignment"]["models"]
        tensors[mode] = folder_tensors(out)
    moved = [(m, s) for m, s in zip(reports["memory"], reports["stream"]) if not m["anchor"]]
    assert len(moved) == 2
    for m, s in moved:
        assert (m["distance_before"], m["distance_after"]) == (s["distance_before"], s["distance_after"])
    assert [k for k in tensors["memory"] if not torch.equal(tensors["memory"][k], tensors["stream"][k])] == []
