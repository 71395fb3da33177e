"""A weight the method refuses (NaN, Inf, all zero, a negative one for ``average``) is one error before any model is
read: it was refused by the merge itself, after the models were loaded and aligned (1 min 48 s on a 1024-wide,
8-layer pair)."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from factories import make_model


@pytest.mark.parametrize("method,weights,words", [("average", "nan,1", "finite"), ("average", "inf,1", "finite"),
                                                  ("task_arithmetic", "0,0", "not all zero"),
                                                  ("linear", "1,-1", "sum")])
def test_bad_weights_are_refused_before_any_model_is_read(tmp_path, capsys, monkeypatch, method, weights, words):
    import symmerge.io.reader as reader

    for seed, name in ((0, "a"), (1, "b")):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(tmp_path / name)

    def no_load(*args, **kwargs):
        raise AssertionError("a model was loaded before the weights were checked")

    monkeypatch.setattr(reader, "load_model", no_load)
    base = ["--base", tmp_path / "a"] if method == "task_arithmetic" else []
    capsys.readouterr()
    assert run_cli("merge", tmp_path / "a", tmp_path / "b", *base, "--method", method, "--weights", weights,
                   "--mode", "memory", "-o", tmp_path / "out", "-q") == 2
    err = capsys.readouterr().err
    assert err.startswith("symmerge: error: ") and err.count("\n") == 1 and words in err, err
    assert not (tmp_path / "out").exists()
