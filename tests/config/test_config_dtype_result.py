"""A config's ``dtype`` is the dtype the merge's result is held in before ``out_dtype`` (mergekit's order: the
inputs rounded to ``dtype``, the rule, its result in ``dtype``, then cast to ``out_dtype``). Found by
benchmarks/methodedge_audit.py: float32 files with ``dtype: bfloat16, out_dtype: float32`` gave a linear merge
whose values were not bfloat16 values (symmerge's float64 result written as float32: 3.6 % of the merge's
change apart from mergekit's, against 1.1e-4 — bfloat16 double rounding — once rounded)."""

from __future__ import annotations

import pytest
import torch
import yaml

import mergekit_oracle as mo
from conftest import run_cli


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    return mo.family(tmp_path_factory.mktemp("dtype-result"), "llama", "float32", n=2, layers=1, hidden=32)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("method", ["linear", "passthrough"])
def test_the_result_is_rounded_to_dtype_before_out_dtype(fam, tmp_path, dtype, method):
    base, fts = fam
    if method == "passthrough":
        models = [{"model": str(fts[0]), "parameters": {"scale": 0.3}}]
    else:
        models = [{"model": str(f), "parameters": {"weight": w}} for f, w in zip(fts, (0.3, 0.7))]
    cfg = {"merge_method": method, "models": models, "dtype": dtype, "out_dtype": "float32"}
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump(cfg))
    assert run_cli("run", path, tmp_path / "out", "--progress", "none") == 0
    got = mo.tensors(tmp_path / "out")
    half = mo.DTYPES[dtype]
    floats = [k for k, v in got.items() if v.is_floating_point()]
    assert floats and all(got[k].dtype == torch.float32 for k in floats)
    for k in floats:  # every value a value of ``dtype``
        assert torch.equal(got[k], got[k].to(half).float()), k
