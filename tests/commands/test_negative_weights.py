"""``symmerge merge --weights -0.5,1.5``: a weight list whose first number is negative (``linear`` extrapolates with
it, docs/merge.md) is the value of ``--weights``, as ``weight: -0.5`` is in a config and ``weights=[-0.5, 1.5]`` in
``symmerge.merge()`` (benchmarks/entryeq_audit.py). Before, argparse read ``-0.5,1.5`` as an unknown flag — "expected
one argument", then a hint about paths beginning with '-' — so only ``--weights=-0.5,1.5`` worked. Shown to fail
before the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from conftest import run_cli


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("negw")
    out = []
    for i in range(2):
        torch.manual_seed(i)
        LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1)).save_pretrained(root / f"m{i}")
        out.append(str(root / f"m{i}"))
    return out


def _tensors(folder: Path) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("text", ["-0.5,1.5", "-1,2", "-.5,1.5", "-5e-1,1.5"])
def test_a_negative_first_weight_is_the_weights_value(text, llamas, tmp_path, capsys):
    common = [*llamas, "--method", "linear", "--align", "none", "--progress", "none"]
    try:
        assert run_cli("merge", *common, "--weights", text, "-o", tmp_path / "spaced") == 0
    except SystemExit:  # argparse's refusal (before the fix: "expected one argument")
        pytest.fail(capsys.readouterr().err)
    assert run_cli("merge", *common, f"--weights={text}", "-o", tmp_path / "joined") == 0
    weights = [float(x) for x in text.split(",")]
    cfg = tmp_path / "c.yml"
    cfg.write_text(yaml.safe_dump({"merge_method": "linear", "models": [{"model": m, "parameters": {"weight": w}}
                                                                        for m, w in zip(llamas, weights)]}))
    assert run_cli("run", cfg, tmp_path / "config", "--quiet") == 0
    spaced, joined, config = (_tensors(tmp_path / n) for n in ("spaced", "joined", "config"))
    assert set(spaced) == set(joined) == set(config)
    for k in spaced:
        assert torch.equal(spaced[k], joined[k]) and torch.equal(spaced[k], config[k]), k


def test_a_path_that_begins_with_a_dash_is_still_a_flag_to_argparse(llamas, tmp_path, capsys):
    """Only number lists are taken as values: ``-o -out`` and a model ``-m`` keep argparse's reading (and the hint)."""
    with pytest.raises(SystemExit) as e:
        run_cli("merge", *llamas, "-x1", "--method", "linear", "-o", tmp_path / "o")
    assert e.value.code == 2 and "unrecognized arguments: -x1" in capsys.readouterr().err
