"""Streamed alignment of mixtures of experts (``align --stream``): the experts fused in memory
(``mlp.experts.gate_up_proj`` (E, 2I, d), ``down_proj`` (E, d, I)) are read as virtual tensors stacked
from the checkpoint's per-expert tensors and written back split, under the checkpoint's own names.

Streamed equals in memory (the same solvers on the same tensors: the same elements, the tensors bit
for bit), the output loads with ``from_pretrained`` and computes the model's function, a fused
on-disk layout stays fused, and a checkpoint missing an expert's tensor gets one clear error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest import add_noise, make_inputs, output_rel_diff, with_weights
from factories import make_model
from symmerge.core.apply import apply, random_elements
from symmerge.errors import SymmergeError
from symmerge.io.checkpoint import LazyCheckpoint
from symmerge.io.fused import fused_parts
from symmerge.io.hf import disk_to_memory
from symmerge.pipeline.align import align, instances_for
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.stream import align_streaming

pytestmark = pytest.mark.usefixtures("single_thread")

SYMS = ("attn", "ffn", "rescale", "experts")


def _pair(family, tmp_path, dtype=torch.float32):
    anchor = make_model(family, head=True, dtype=dtype, seed=0)
    _, insts = instances_for(anchor)
    local = [i for i in insts if i.group.symmetry in SYMS and i.kind.per_layer]
    sd = apply(anchor.state_dict(), local, random_elements(local, torch.Generator().manual_seed(3)))
    model = with_weights(anchor, add_noise(sd, 0.01, seed=4)[0])
    model.save_pretrained(tmp_path / "model", max_shard_size="20KB")
    anchor.save_pretrained(tmp_path / "anchor", max_shard_size="20KB")
    return tmp_path / "model", tmp_path / "anchor", model, anchor


def _stored_names(folder):
    names = set()
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    return names


@pytest.mark.parametrize("family,pipeline", [("mixtral", False), ("mixtral", True), ("qwen3_moe", False),
                                             ("qwen2_moe", False), ("olmoe", False)])
def test_streamed_moe_alignment_equals_in_memory(family, pipeline, tmp_path):
    model_dir, anchor_dir, model, anchor = _pair(family, tmp_path)
    expected, rep_mem = align(model, anchor, SYMS)
    report = align_streaming(model_dir, anchor_dir, tmp_path / "out", AlignOptions(symmetries=SYMS), shard_size="30KB",
                             progress=False, pipeline=pipeline)
    out = tmp_path / "out"
    assert "experts" in report["symmetries"]
    # laid out like the input: the same per-expert names (Mixtral: block_sparse_moe.experts.{e}.w1/w2/w3)
    assert _stored_names(out) == _stored_names(model_dir)
    assert any(".experts.3." in n for n in _stored_names(out))
    got = LazyCheckpoint(out, fused=True)
    want = expected.state_dict()
    assert set(got.keys()) == set(want)
    for k, t in got.read(got.keys()).items():  # the same elements on the same tensors: bit for bit
        assert torch.equal(t, want[k]), k
    assert report["distance_after"] == pytest.approx(rep_mem["distance_after"], rel=1e-6)
    assert report["distance_after"] < 0.1 * report["distance_before"]
    reloaded = type(model).from_pretrained(out).eval()  # transformers fuses the per-expert tensors again
    assert output_rel_diff(model, reloaded, make_inputs(model)) < 1e-5


def test_fused_tensors_split_as_save_pretrained_writes_them():
    """The boxes found by tracing transformers' reverse conversion split a real model's fused tensors into
    exactly the tensors ``save_pretrained`` writes, and stack back bit for bit."""
    from transformers.core_model_loading import revert_weight_conversion

    for family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        model = make_model(family, head=True, dtype=torch.float32)
        sd = model.state_dict()
        parts = fused_parts(model, disk_to_memory(model).values())
        assert sorted(parts) == sorted(k for k in sd if ".mlp.experts." in k)
        stored = revert_weight_conversion(model, dict(sd))
        for key, fz in parts.items():
            split = fz.split(sd[key])
            assert len(split) == (8 if key.endswith("gate_up_proj") else 4)
            for name, t in split:
                assert torch.equal(stored[name], t)
            assert torch.equal(fz.stack(dict(split), sd[key].dtype), sd[key])


def test_fused_on_disk_layout_streams_and_stays_fused(tmp_path):
    """A checkpoint storing the experts fused (the in-memory names) streams too, and is written fused."""
    model_dir, anchor_dir, model, anchor = _pair("qwen3_moe", tmp_path)
    for folder, m in ((tmp_path / "model_fused", model), (tmp_path / "anchor_fused", anchor)):
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(folder / "model.safetensors"),
                  metadata={"format": "pt"})
        (folder / "config.json").write_text((model_dir / "config.json").read_text())
    expected, _ = align(model, anchor, SYMS)
    align_streaming(tmp_path / "model_fused", tmp_path / "anchor_fused", tmp_path / "out", AlignOptions(symmetries=SYMS),
                    progress=False)
    names = _stored_names(tmp_path / "out")
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(".experts.0." in n for n in names)
    got = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    for k, t in expected.state_dict().items():
        torch.testing.assert_close(got[k], t, rtol=1e-5, atol=1e-6)
    # and a fused model aligned to a per-expert anchor: the model's own layout is kept
    align_streaming(tmp_path / "model_fused", anchor_dir, tmp_path / "out2", AlignOptions(symmetries=SYMS), progress=False)
    assert "model.layers.1.mlp.experts.down_proj" in _stored_names(tmp_path / "out2")


def test_checkpoint_missing_an_experts_tensor_is_refused(tmp_path):
    model_dir, anchor_dir, model, _ = _pair("mixtral", tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    sd = {k: v for f in model_dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    del sd["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    (bad / "config.json").write_text((model_dir / "config.json").read_text())
    with pytest.raises(SymmergeError, match=r"lacks 1 tensor\(s\) its config.json \(MixtralForCausalLM\) has: "
                                            r"'model.layers.1.block_sparse_moe.experts.2.w3.weight'"):
        align_streaming(bad, anchor_dir, tmp_path / "out", AlignOptions(symmetries=SYMS), progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))
    # one expert of another size
    sd["model.layers.1.block_sparse_moe.experts.2.w3.weight"] = torch.zeros(3, 32)
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SymmergeError, match=r"experts.2.w3.weight' is \(3, 32\), \(16, 32\) expected"):
        align_streaming(bad, anchor_dir, tmp_path / "out", AlignOptions(symmetries=SYMS), progress=False)
    assert not (tmp_path / "out").exists()


def test_streamed_moe_through_the_cli(tmp_path):
    from conftest import run_cli

    model_dir, anchor_dir, model, _ = _pair("qwen3_moe", tmp_path)
    assert run_cli("align", model_dir, anchor_dir, "--stream", "-o", tmp_path / "out") == 0
    report = json.loads((tmp_path / "out" / "symmerge_report.json").read_text())
    assert report["streamed"] is True and "experts" in report["symmetries"]
    assert report["distance_after"] < 0.1 * report["distance_before"]
    reloaded = type(model).from_pretrained(tmp_path / "out").eval()
    assert output_rel_diff(model, reloaded, make_inputs(model)) < 1e-5


def test_streamed_aligned_merge_of_moe_models_equals_in_memory(tmp_path):
    """``merge --mode stream`` aligns each model as ``align --stream`` does (experts included), then merges
    the per-expert tensors one by one: the same checkpoint as the in-memory aligned merge."""
    from conftest import run_cli

    model_dir, anchor_dir, _, _ = _pair("mixtral", tmp_path)
    result = {}
    for mode in ("memory", "stream"):
        out = tmp_path / mode
        assert run_cli("merge", model_dir, anchor_dir, "--method", "average", "--align", "attn,ffn,experts",
                       "--mode", mode, "--progress", "none", "-o", out) == 0
        report = json.loads((out / "symmerge_report.json").read_text())
        assert report["mode"] == mode and "experts" in report["alignment"]["symmetries"]
        result[mode] = {k: v for f in out.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert set(result["stream"]) == set(result["memory"]) == _stored_names(model_dir)
    for k, t in result["memory"].items():
        torch.testing.assert_close(result["stream"][k], t, rtol=0, atol=1e-6, msg=k)


def test_experts_untouched_are_copied_through_split(tmp_path):
    """Without ``experts``/``ffn`` the fused tensors pass through: stacked on read, split on write, bit for bit."""
    model_dir, anchor_dir, model, _ = _pair("mixtral", tmp_path)
    align_streaming(model_dir, anchor_dir, tmp_path / "out", AlignOptions(symmetries="attn"), progress=False)
    got = {k: v for f in (tmp_path / "out").glob("*.safetensors") for k, v in load_file(str(f)).items()}
    stored = {k: v for f in model_dir.glob("*.safetensors") for k, v in load_file(str(f)).items()}
    assert set(got) == set(stored)
    assert all(torch.equal(got[k], stored[k]) for k in stored if ".experts." in k)
    reloaded = type(model).from_pretrained(tmp_path / "out").eval()
    assert output_rel_diff(model, reloaded, make_inputs(model)) < 1e-5
