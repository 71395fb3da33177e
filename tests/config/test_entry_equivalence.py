"""One merge, one result from every entry (benchmarks/entryeq_audit.py, docs/results/entryeq_audit.md): what the
audit found a mergekit config's run saying otherwise than ``symmerge merge`` and ``symmerge.merge()`` for the same
merge, each shown to fail before its fix.

* a bad value of a method's parameter in a mergekit config is one line naming the key and its line, with the
  command's words (``method 'ties': parameter 'density' must be ...``), not a tensor's name: the value is checked
  where it is read, as ``--param`` checks it (the report's ``params``: test_entry_report_params.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from conftest import run_cli


def _llama(folder: Path, seed: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * seed * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def llamas(tmp_path_factory):
    root = tmp_path_factory.mktemp("entryeq")
    return [_llama(root / f"m{i}", i) for i in range(3)]  # m0 the base


def _config(tmp_path, method, models, base, params, weights=(1.0, 1.0)) -> Path:
    cfg = {"merge_method": method,
           "models": [{"model": m, "parameters": {"weight": w}} for m, w in zip(models, weights)],
           **({"base_model": base} if base else {}), **({"parameters": params} if params else {})}
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def _error(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "error:" in ln]
    assert len(lines) == 1, lines
    return lines[0]


BAD = [  # method, parameters, what the command line says after "symmerge: error: "; the last two: two values
    # together (checked per merged tensor: the line names the values, after the tensor's name)
    ("ties", {"density": 1.5}, "method 'ties': parameter 'density' must be a number in [0.0, 1.0], got 1.5"),
    ("ties", {"scope": "layer"},
     "method 'ties': parameter 'scope' must be one of 'model', 'tensor', 'topk', got 'layer'"),
    ("karcher", {"max_iter": -1}, "method 'karcher': parameter 'max_iter' must be an integer >= 0, got -1"),
    ("ties", {"density": [0.5, 1.5]}, "method 'ties': parameter 'density' must be a number in [0.0, 1.0], got 1.5"),
    ("ties", {"lambda": 0.5, "scale": 0.5}, "method 'ties': give 'scale' or its alias 'lambda', not both"),
    ("della", {"density": 0.9, "epsilon": 0.2},
     "method 'della': epsilon must leave density ± epsilon inside (0, 1), got density 0.9, epsilon 0.2"),
]
TOGETHER = 2


@pytest.mark.parametrize("method, params, words", BAD, ids=[f"{m}-{'-'.join(p)}" for m, p, _ in BAD])
def test_a_bad_value_in_a_mergekit_config_names_its_key_with_the_commands_words(method, params, words, llamas,
                                                                                  tmp_path, capsys):
    base, fts = llamas[0], llamas[1:]
    argv = ["merge", *fts, "--method", method, "--align", "none", "-o", tmp_path / "cli", "--progress", "none"]
    argv += ["--base", base] if method != "karcher" else []
    if all(not isinstance(v, list) for v in params.values()):
        for k, v in params.items():
            argv += ["--param", f"{k}={v}"]
        assert run_cli(*argv) == 2
        assert _error(capsys) == f"symmerge: error: {words}"
    path = _config(tmp_path, method, fts, None if method == "karcher" else base, params)
    assert run_cli("run", path, tmp_path / "run", "--quiet") == 2
    line = _error(capsys)
    assert not (tmp_path / "run").exists()
    if BAD.index((method, params, words)) >= len(BAD) - TOGETHER:
        assert line.endswith(words), line
        return
    key = next(iter(params))
    assert line.startswith(f"symmerge: error: {path} line {path.read_text().splitlines().index('parameters:') + 2}: ")
    assert line.endswith(f"parameters.{key}: {words}") or line.endswith(f": parameters: {words}"), line
    assert ".weight" not in line  # no tensor's name: the value is the config's, not a tensor's
