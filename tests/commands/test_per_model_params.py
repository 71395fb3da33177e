"""A per-model parameter (``density``, ``gamma``, ``epsilon``, DARE's ``drop``, passthrough's ``scale``) takes one value
per model from every entry: ``--param density=0.7,0.4``, ``parameters: {density: [0.7, 0.4]}`` in a config of
symmerge's own keys, each model's ``parameters: {density: ...}`` in a mergekit config and
``symmerge.merge(..., params={"density": [0.7, 0.4]})`` merge alike, bit for bit (benchmarks/entryeq_audit.py: before,
only the last two could say it; ``--param density=0.7,0.4`` was "must be a number ..., got '0.7,0.4'"). A list for a
parameter that takes one value, or of another length than the models, is the method's own one-line refusal. Shown to
fail before the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

import symmerge
from conftest import run_cli
from symmerge.merge.fuse import MergeOptions


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("permodel")
    out = []
    for i in range(3):
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                             num_attention_heads=2, num_key_value_heads=1))
        g = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.02 * i * torch.randn(p.shape, generator=g))
        model.save_pretrained(root / f"m{i}")
        out.append(str(root / f"m{i}"))
    return out  # m0 the base


def _tensors(folder: Path) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("method, name, values", [("ties", "density", (0.7, 0.4)),
                                                  ("breadcrumbs", "gamma", (0.02, 0.05)),
                                                  ("della", "epsilon", (0.05, 0.1)), ("dare_ties", "drop", (0.2, 0.5))])
def test_one_value_per_model_from_every_entry(method, name, values, llamas, tmp_path, capsys):
    # gamma and epsilon change nothing at density 1 (everything kept): density 0.5 with them, in every entry
    extra = {"density": 0.5} if name in ("gamma", "epsilon") else {}
    base, fts = llamas[0], llamas[1:]
    text = ",".join(str(v) for v in values)
    argv = ["merge", *fts, "--base", base, "--method", method, "--align", "none", "--weights", "1,1", "--progress",
            "none", *[x for k, v in extra.items() for x in ("--param", f"{k}={v}")], "--param", f"{name}={text}",
            "-o", tmp_path / "cli"]
    assert run_cli(*argv) == 0, capsys.readouterr().err
    own = tmp_path / "own.yml"
    own.write_text(yaml.safe_dump({"method": method, "align": "none", "base_model": base,
                                   "models": [{"model": m, "parameters": {"weight": 1}} for m in fts],
                                   "parameters": {**extra, name: list(values)}}))
    assert run_cli("run", own, tmp_path / "own", "--quiet") == 0, capsys.readouterr().err
    mk = tmp_path / "mk.yml"
    mk.write_text(yaml.safe_dump({"merge_method": method, "base_model": base,
                                  "models": [{"model": m, "parameters": {"weight": 1, name: v}}
                                             for m, v in zip(fts, values)],
                                  **({"parameters": extra} if extra else {})}))
    assert run_cli("run", mk, tmp_path / "mk", "--quiet") == 0
    symmerge.merge(fts, tmp_path / "api", MergeOptions(method=method, base=base, weights=[1, 1], align="none",
                                                       params={**extra, name: list(values)}, progress=False))
    cli = _tensors(tmp_path / "cli")
    for other in ("own", "mk", "api"):
        theirs = _tensors(tmp_path / other)
        assert set(theirs) == set(cli)
        for k in cli:
            assert torch.equal(cli[k], theirs[k]), (other, k)
    same = tmp_path / "same"
    assert run_cli(*argv[:-2], "--param", f"{name}={values[0]}", "-o", same) == 0
    assert any(not torch.equal(cli[k], v) for k, v in _tensors(same).items())  # the second value was used


@pytest.mark.parametrize("param, words", [
    ("scale=0.5,0.6", "method 'ties': parameter 'scale' takes one value, not one per model"),
    ("density=0.7,0.4,0.1", "method 'ties': parameter 'density' has 3 values for 2 models"),
    ("density=0.7,1.5", "method 'ties': parameter 'density' must be a number in [0.0, 1.0], got 1.5"),
])
def test_a_list_where_one_value_or_another_count_is_one_line(param, words, llamas, tmp_path, capsys):
    base, fts = llamas[0], llamas[1:]
    rc = run_cli("merge", *fts, "--base", base, "--method", "ties", "--align", "none", "--param", param, "-o",
                 tmp_path / "o")
    err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert rc == 2 and err == [f"symmerge: error: {words}"]
    assert not (tmp_path / "o").exists()


def test_a_comma_list_of_words_stays_one_value():
    """OT fusion's ``units=ffn,attn`` is one value, as before: only a list of numbers is one value per model."""
    from symmerge.options.parse import parse_params

    assert parse_params(["units=ffn,attn", "density=0.7,0.4", "t=0.5", "x=1,a"]) == \
        {"units": "ffn,attn", "density": [0.7, 0.4], "t": 0.5, "x": "1,a"}
