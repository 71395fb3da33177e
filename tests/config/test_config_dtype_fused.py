"""A config's ``dtype`` equal to the files' own dtype rounds nothing, so ``symmerge run`` keeps the method's fused
kernel (symmerge/config/run.py: ``computing_in``): the same bits as the config without ``dtype``, and the kernel is
the one that runs (``dtype: float32`` on float32 files took RAM from 3.5 s to 8.6 s on SmolLM2 through the chunked
torch rule). Where the files are in another dtype the inputs are rounded first and the torch rule runs on them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import mergekit_oracle as mo
from conftest import run_cli
from symmerge.merge import registry

# methods with a fused kernel for float32 inputs, and their parameters
FUSED = {"ram": "", "ramplus_tl": "", "ties": "    parameters: {weight: 0.5, density: 0.6}\n",
         "task_arithmetic": "    parameters: {weight: 0.5}\n", "sce": ""}


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    base, fts = mo.family(tmp_path_factory.mktemp("dtype-fused"), "llama", "float32", n=2, layers=2)
    return str(base), [str(f) for f in fts]


def _config(folder, method, fam, dtype):
    base, fts = fam
    models = "".join(f"  - model: {f}\n{FUSED[method]}" for f in fts)
    text = f"merge_method: {method}\nbase_model: {base}\nmodels:\n{models}" + (f"dtype: {dtype}\n" if dtype else "")
    path = folder / f"{method}-{dtype}.yml"
    path.write_text(text)
    return path


def _spied(monkeypatch, method):
    """The registry's ``method`` with its fused kernel counted: the list of the dtypes it was called on."""
    calls = []
    m = registry.METHODS[method]
    inner = m.fused_into

    def spy(key, tensors, weights, base, params, context, out):
        done = inner(key, tensors, weights, base, params, context, out)
        calls.append((tensors[0].dtype, done))
        return done

    monkeypatch.setitem(registry.METHODS, method, replace(m, fused_into=spy))
    return calls


@pytest.mark.parametrize("method", sorted(FUSED))
def test_dtype_of_the_files_keeps_the_fused_kernel(fam, tmp_path, monkeypatch, method):
    plain, same = tmp_path / "plain", tmp_path / "same"
    assert run_cli("run", _config(tmp_path, method, fam, None), plain, "--progress", "none") == 0
    calls = _spied(monkeypatch, method)
    assert run_cli("run", _config(tmp_path, method, fam, "float32"), same, "--progress", "none") == 0
    a, b = mo.tensors(plain), mo.tensors(same)
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    assert calls and all(dtype == torch.float32 and done for dtype, done in calls)


@pytest.mark.parametrize("method", ["ram", "ties"])
def test_another_dtype_rounds_first_and_skips_the_kernel(fam, tmp_path, monkeypatch, method):
    """float32 files, ``dtype: bfloat16``: the kernel is never handed the unrounded tensors; the result is the
    rule on the inputs rounded to bfloat16 (mergekit's order), as the config run computed it before."""
    calls = _spied(monkeypatch, method)
    out = tmp_path / "bf16"
    assert run_cli("run", _config(tmp_path, method, fam, "bfloat16"), out, "--progress", "none") == 0
    assert not calls  # the wrapper declines before calling it: the rule runs on the rounded inputs
    got = mo.tensors(out)
    assert got and all(t.dtype == torch.bfloat16 for t in got.values() if t.is_floating_point())
