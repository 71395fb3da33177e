"""The folder view of a single ``.safetensors`` input (:func:`symmerge.io.single.as_folder`, in the temporary folder
for the life of the process) is named so that no other process's cleaning takes it for a gone process's temporary
LoRA merge cache: a file named ``lora-16.safetensors`` gave ``symmerge-lora-16-*``, which the next merge of an
adapter in another process removed while the first still read it (process 16 being gone;
docs/results/concur_audit.md)."""

from __future__ import annotations

import json
import tempfile

import torch
from safetensors.torch import save_file

from symmerge.io import lora, output, single


def test_a_single_file_view_is_never_taken_for_a_lora_temp_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    file = tmp_path / "m" / "lora-16.safetensors"
    save_file({"w": torch.zeros(2)}, str(file))
    monkeypatch.setattr(single, "_VIEWS", {})
    view = single.as_folder(file)
    assert view.is_dir() and (view / "model.safetensors").is_file()
    monkeypatch.setattr(output, "pid_alive", lambda pid: False)  # process 16 gone
    assert lora.remove_stale_temp_caches() == []
    assert view.is_dir()
