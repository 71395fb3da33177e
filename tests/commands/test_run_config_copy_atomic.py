"""``run`` of a config of symmerge's own keys copies the config into the output (``symmerge_config.yml``) as part of
the output: in the temporary folder, before the rename that publishes it. Before, the copy was written into the
published folder afterwards: a process reading the output as soon as it appeared (the next step of a sweep) saw it
without the copy, then had it changed under it, and a run killed between the two left no copy
(docs/results/concur_audit.md)."""

from __future__ import annotations

import json

import torch

import symmerge.io.model as model
from symmerge.cli import main


def _llama(path, seed):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_the_config_copy_is_in_the_output_when_it_appears(tmp_path, monkeypatch):
    a, b = _llama(tmp_path / "a", 0), _llama(tmp_path / "b", 1)
    out = tmp_path / "out"
    cfg = tmp_path / "m.yml"
    cfg.write_text(f"models: [{a}, {b}]\nmerge_method: average\nalign: none\nprogress: none\n")
    seen = []
    umask = model.apply_umask

    def before_rename(folder):  # the temporary folder, complete, just before it becomes the output
        seen.append(sorted(p.name for p in folder.iterdir()))
        return umask(folder)

    monkeypatch.setattr(model, "apply_umask", before_rename)
    assert main(["run", str(cfg), str(out)]) == 0
    assert len(seen) == 1 and "symmerge_config.yml" in seen[0], seen
    assert (out / "symmerge_config.yml").read_text() == cfg.read_text()
    assert sorted(p.name for p in out.iterdir()) == seen[0]
    assert json.loads((out / "symmerge_report.json").read_text())
