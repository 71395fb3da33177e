"""A float16 merge whose arithmetic passes float16's range (task vectors that add up past 65504) is one error that
says so and how to merge in float32; it said only "a parameter or weight out of range", which named no cause here
(every parameter and weight is in range)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_cli
from factories import make_model

KEY = "model.layers.0.mlp.down_proj.weight"


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("half-overflow")
    for name, seed, value in (("base", 0, 0.0), ("a", 1, 40000.0), ("b", 2, 40000.0)):
        make_model("llama", head=True, dtype=torch.float16, seed=seed).save_pretrained(root / name)
        sd = load_file(str(root / name / "model.safetensors"))
        sd[KEY] = torch.full_like(sd[KEY], value)
        save_file(sd, str(root / name / "model.safetensors"), metadata={"format": "pt"})
    return root


@pytest.mark.parametrize("mode", ["memory", "stream"])
def test_float16_overflow_is_one_error_naming_the_cause(folders, tmp_path, capsys, mode):
    out = tmp_path / "o"
    rc = run_cli("merge", folders / "a", folders / "b", "--base", folders / "base", "--method", "task_arithmetic",
                 "--mode", mode, "--progress", "none", "-o", out)
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert "down_proj" in err and "float16's largest value (65504)" in err and "merge in float32" in err, err
    assert not out.exists()
