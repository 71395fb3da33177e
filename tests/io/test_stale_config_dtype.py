"""A config.json whose ``dtype`` is stale (the tensors stored in bfloat16 under ``float32``, or in float32 under
``bfloat16``). transformers' ``dtype="auto"`` cast every tensor to the config's dtype, so a merge in memory wrote
float32 (or rounded float32 weights to bfloat16) where the streamed merge, which reads the tensors as stored, wrote
them as stored under a config that named another dtype. Now every path loads the tensors as stored and the written
config.json names the dtype written: merge in memory and streamed agree bit for bit, align and align --stream too."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import folder_tensors, run_cli
from factories import make_model


def _stale(folder, stored, config_says):
    sd = load_file(str(folder / "model.safetensors"))
    save_file({k: v.to(stored) for k, v in sd.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = config_says
    (folder / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module", params=[(torch.bfloat16, "float32"), (torch.float32, "bfloat16")],
                ids=["bf16-under-float32", "fp32-under-bfloat16"])
def stale(tmp_path_factory, request):
    stored, says = request.param
    root = tmp_path_factory.mktemp("stale")
    for name, seed in (("a", 0), ("b", 1)):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(root / name)
        _stale(root / name, stored, says)
    return root, stored


def test_merge_in_memory_and_streamed_write_the_stored_dtype_and_say_so(stale, tmp_path):
    root, stored = stale
    outs = {}
    for mode in ("memory", "stream"):
        outs[mode] = tmp_path / mode
        assert run_cli("merge", root / "a", root / "b", "--method", "average", "--align", "none", "--mode", mode,
                       "--progress", "none", "-o", outs[mode]) == 0
        tensors = folder_tensors(outs[mode])
        assert {t.dtype for t in tensors.values()} == {stored}, mode
        assert json.loads((outs[mode] / "config.json").read_text())["dtype"] == str(stored).removeprefix("torch.")
    a, b = folder_tensors(outs["memory"]), folder_tensors(outs["stream"])
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_align_and_align_stream_write_the_stored_dtype_and_say_so(stale, tmp_path):
    root, stored = stale
    for flags in ((), ("--stream",)):
        out = tmp_path / ("stream" if flags else "memory")
        assert run_cli("align", root / "a", root / "b", *flags, "--progress", "none", "-o", out) == 0
        assert {t.dtype for t in folder_tensors(out).values()} == {stored}, flags
        assert json.loads((out / "config.json").read_text())["dtype"] == str(stored).removeprefix("torch.")


def test_a_model_loads_in_the_dtype_it_is_stored_in(stale):
    from symmerge.io.model import load_model

    root, stored = stale
    model = load_model(root / "a", spec=False)
    assert {p.dtype for p in model.parameters()} == {stored}
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"],
                       load_file(str(root / "a" / "model.safetensors"))["model.embed_tokens.weight"])
