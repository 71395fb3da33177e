"""Inputs of several dtypes without a config ``dtype`` merge as mergekit 0.1.5 merges them: each tensor's inputs (the
base included) cast to torch's promotion of their dtypes, the result held and written in it. symmerge held the
result in the base's (else the first model's) dtype and computed on the inputs as stored: ties of a float32 and a
bfloat16 fine-tune on a float16 base was written in float16, 0.027 of the change off mergekit's float32 result
(which equals mergekit's result with ``dtype: float32``); bfloat16 with float16 linear likewise. Measured against
mergekit 0.1.5: ties 6.9e-9, task_arithmetic and linear 0, slerp 1.6e-6 of the change (float32 arithmetic order)."""

from __future__ import annotations

import pytest
import torch
import yaml

import mergekit_oracle as mo
from conftest import run_cli


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    folders = {}
    for dtype in ("float32", "bfloat16", "float16"):  # one base, its fine-tunes stored in three dtypes
        base, fts = mo.family(root / dtype, dtype=dtype, n=2, layers=2, noise=0.01)
        folders[dtype] = (base, fts)
    return folders


CASES = {  # (base dtype or None, the models' dtypes)
    "ties": ("float16", ("float32", "bfloat16")),
    "task_arithmetic": ("bfloat16", ("float16", "float16")),
    "linear": (None, ("bfloat16", "float16")),
    "slerp": ("bfloat16", ("float32",)),
}


def _config(path, folders, method, dtype=None):
    base_dtype, dtypes = CASES[method]
    models = [folders[d][1][i] for i, d in enumerate(dtypes)]
    doc = {"merge_method": method}
    if base_dtype:
        doc["base_model"] = str(folders[base_dtype][0])
    if method == "slerp":
        doc["models"] = [{"model": doc["base_model"]}, {"model": str(models[0])}]
        doc["parameters"] = {"t": 0.3}
    else:
        params = {"density": 0.6} if method == "ties" else {}
        doc["models"] = [{"model": str(m), "parameters": {"weight": w, **params}} for m, w in zip(models, (0.4, 0.7))]
    if dtype:
        doc["dtype"] = dtype
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize("method", list(CASES))
def test_inputs_of_several_dtypes_merge_in_their_promoted_dtype(mixed, tmp_path, method):
    config = _config(tmp_path / "c.yml", mixed, method)
    assert run_cli("run", config, tmp_path / "out", "-q") == 0
    ours = mo.tensors(tmp_path / "out")
    assert {t.dtype for t in ours.values() if t.is_floating_point()} == {torch.float32}
    # the same bits as the merge of the inputs cast to float32 first (a config's dtype: float32)
    assert run_cli("run", _config(tmp_path / "d.yml", mixed, method, "float32"), tmp_path / "f32", "-q") == 0
    cast = mo.tensors(tmp_path / "f32")
    assert sorted(ours) == sorted(cast) and all(torch.equal(ours[k], cast[k]) for k in ours)
    if mo.available():
        theirs = mo.tensors(mo.run_mergekit(config.read_text(), tmp_path / "mergekit"))
        assert {t.dtype for t in theirs.values() if t.is_floating_point()} == {torch.float32}
        assert mo.relative_gap(ours, theirs, mo.tensors(mixed["float32"][0])) < 1e-5  # float32 arithmetic order


def test_the_merge_command_gives_the_config_s_merge(mixed, tmp_path):
    """``merge --method ties --base`` of the same inputs: the same tensors (one meaning per method)."""
    config = _config(tmp_path / "c.yml", mixed, "ties")
    assert run_cli("run", config, tmp_path / "run", "-q") == 0
    base, (a, b) = mixed["float16"][0], (mixed["float32"][1][0], mixed["bfloat16"][1][1])
    for mode in ("stream", "memory"):
        assert run_cli("merge", a, b, "--base", base, "--method", "ties", "--weights", "0.4,0.7", "--param",
                       "density=0.6", "--mode", mode, "-o", tmp_path / mode, "-q") == 0
        got, expected = mo.tensors(tmp_path / mode), mo.tensors(tmp_path / "run")
        assert sorted(got) == sorted(expected)
        assert all(torch.equal(got[k], expected[k]) for k in got), mode
