"""An integer weight is one refusal, in memory and streamed.

A checkpoint whose ``down_proj`` weight is stored as int32 (its config makes it a float weight: a quantized or
corrupt file) was read two ways: transformers cast it to float32 when loading (``align`` and ``merge --mode memory``
wrote a float32 tensor), the files' reader kept it (``--stream`` / ``--mode stream`` wrote int32, or averaged the
integers). The headers' one check (:func:`symmerge.io.shapes.check_dtypes`) now refuses it for both."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from factories import make_model
from symmerge.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")

KEY = "model.layers.1.mlp.down_proj.weight"


def _line(capsys, argv) -> tuple:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    return rc, err[-1] if err else ""


@pytest.mark.parametrize("command", ["align", "merge", "merge-aligned"])
def test_an_integer_weight_is_refused_with_one_line_both_ways(tmp_path, capsys, command):
    for name, seed in (("a", 0), ("b", 1)):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(tmp_path / name)
    sd = load_file(str(tmp_path / "a" / "model.safetensors"))
    sd[KEY] = sd[KEY].to(torch.int32)
    save_file(sd, str(tmp_path / "a" / "model.safetensors"), metadata={"format": "pt"})
    a, b = tmp_path / "a", tmp_path / "b"
    if command == "align":
        runs = {m: ["align", a, b, "--symmetries", "heads,attn,ffn,rescale", *flag]
                for m, flag in (("memory", []), ("stream", ["--stream"]))}
    else:
        align = "none" if command == "merge" else "heads,attn,ffn,rescale"
        runs = {m: ["merge", a, b, "--method", "average", "--align", align, "--mode", m] for m in ("memory", "stream")}
    got = {m: _line(capsys, [*argv, "--progress", "none", "-o", tmp_path / m]) for m, argv in runs.items()}
    assert got["memory"] == got["stream"]
    assert got["memory"] == (2, f"symmerge: error: {a}: tensor {KEY!r} is stored as int32, but its config.json "
                                "(LlamaForCausalLM) makes it a floating-point weight: a quantized or corrupt checkpoint "
                                "(symmerge reads floating-point weights)")
    assert not (tmp_path / "memory").exists() and not (tmp_path / "stream").exists()
