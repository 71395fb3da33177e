"""A config whose only model is its base: a method that adds any number of task vectors to the base (TIES, task
arithmetic, DARE, DELLA, SCE, RAM, ...: ``Method.base_alone_is_base``) writes the base unchanged, with a warning
that says so, as mergekit 0.1.5 writes it; symmerge refused it ("merges at least 1 models besides the base model,
got 0"). A method that needs other models (model_stock: at least 2; slerp, nearswap: exactly 1; nuslerp,
multislerp, which only take a base) is still refused, as mergekit refuses it."""

from __future__ import annotations

import pytest
import torch
import yaml

import mergekit_oracle as mo
from conftest import run_cli


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    folder, _ = mo.family(tmp_path_factory.mktemp("bo"), dtype="bfloat16", n=1, layers=2)
    return folder


def _config(path, base, method, params=None):
    doc = {"merge_method": method, "base_model": str(base), "models": [{"model": str(base)}], "dtype": "bfloat16",
           **({"parameters": params} if params else {})}
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("method,params", [("ties", {"density": 0.5, "weight": 1.0}), ("task_arithmetic", None),
                                           ("dare_ties", {"density": 0.5, "weight": 1.0}), ("ram", None)])
def test_only_the_base_is_written_unchanged(base, tmp_path, capsys, method, params):
    config = _config(tmp_path / "c.yml", base, method, params)
    assert run_cli("run", config, tmp_path / "out") == 0
    assert "only the base model is listed" in capsys.readouterr().err
    ours, expected = mo.tensors(tmp_path / "out"), mo.tensors(base)
    assert sorted(ours) == sorted(expected) and all(torch.equal(ours[k], expected[k]) for k in ours)
    if mo.available():
        theirs = mo.tensors(mo.run_mergekit(config.read_text(), tmp_path / "mergekit"))
        assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("method,params", [("model_stock", None), ("slerp", {"t": 0.5}), ("nearswap", {"t": 0.5}),
                                           ("nuslerp", None), ("multislerp", None)])
def test_a_method_that_needs_other_models_still_refuses_the_base_alone(base, tmp_path, capsys, method, params):
    assert run_cli("run", _config(tmp_path / "c.yml", base, method, params), tmp_path / "out") == 2
    err = capsys.readouterr().err
    assert "besides the base model, got 0" in err and err.count("error:") == 1
    assert not (tmp_path / "out").exists()
