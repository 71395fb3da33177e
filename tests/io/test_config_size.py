"""A config.json far larger than any model's config is one error before it is read: a 300 MB config.json was read
whole and parsed (70 s) by every command."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from factories import make_model
from symmerge.io import model as io_model


@pytest.mark.parametrize("command", [["merge", "--method", "average"], ["align"]])
def test_an_oversized_config_is_one_error(tmp_path, capsys, monkeypatch, command):
    for seed, name in ((0, "a"), (1, "b")):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(tmp_path / name)
    config = json.loads((tmp_path / "b" / "config.json").read_text())
    config["id2label"] = {str(i): f"label {i}" for i in range(3000)}  # a real config's kind of bulk, ~60 KB
    (tmp_path / "b" / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(io_model, "CONFIG_LIMIT", 32 << 10)  # 32 KiB here, as 16 MiB by default
    capsys.readouterr()
    assert run_cli(command[0], tmp_path / "a", tmp_path / "b", *command[1:], "-o", tmp_path / "out", "-q") == 2
    err = capsys.readouterr().err
    assert err.startswith(f"symmerge: error: {tmp_path / 'b' / 'config.json'}: ") and "not a model's config" in err
    assert err.count("\n") == 1 and not (tmp_path / "out").exists()


def test_the_limit_holds_the_largest_real_configs():
    assert io_model.CONFIG_LIMIT >= 8 << 20  # ImageNet-21k's id2label (21 843 names) is under 1 MiB
