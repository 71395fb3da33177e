"""A config's ``dtype`` wider than the inputs' (bfloat16 checkpoints merged at ``dtype: float32``): the result is
held in ``dtype`` until it is written in ``out_dtype`` (else ``dtype``), as docs/merge.md's config table says and
mergekit does. It was held in the inputs' dtype (``merge_tensor`` put every result back in its inputs' dtype), so
0 of the float32 output's entries lay off the bfloat16 grid: the float32 merge rounded to bfloat16 in silence."""

from __future__ import annotations

import pytest
import torch
import yaml

import mergekit_oracle as mo
from conftest import run_cli


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    return mo.family(tmp_path_factory.mktemp("bf16"), dtype="bfloat16", n=2, layers=2, noise=0.01)


def _config(path, base, fts, method, dtype, out_dtype=None):
    doc = {"merge_method": method, **({} if method == "linear" else {"base_model": str(base)}), "dtype": dtype,
           "models": [{"model": str(f), "parameters": {"weight": w, **({"density": 0.6} if method == "ties" else {})}}
                      for f, w in zip(fts, (0.3, 0.9))]}
    if out_dtype:
        doc["out_dtype"] = out_dtype
    path.write_text(yaml.safe_dump(doc))
    return path


def _off_grid(t: torch.Tensor) -> int:
    return int((t.float() != t.float().to(torch.bfloat16).float()).sum())


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "linear"])
def test_bfloat16_inputs_merged_at_float32_are_held_in_float32(bf16, tmp_path, method):
    base, fts = bf16
    config = _config(tmp_path / "c.yml", base, fts, method, "float32")
    assert run_cli("run", config, tmp_path / "out", "--progress", "none") == 0
    ours = mo.tensors(tmp_path / "out")
    key = "model.layers.0.mlp.up_proj.weight"
    assert ours[key].dtype == torch.float32 and _off_grid(ours[key]) > ours[key].numel() // 20, _off_grid(ours[key])
    if method == "task_arithmetic":  # by hand, in float32 from the bfloat16 values read
        b, a, c = (mo.tensors(p)[key].float() for p in (base, *fts))
        expected = b + 0.3 * (a - b) + 0.9 * (c - b)
        assert torch.allclose(ours[key], expected, rtol=1e-6, atol=1e-7)
    if mo.available():
        theirs = mo.tensors(mo.run_mergekit(config.read_text(), tmp_path / "mergekit"))
        assert mo.relative_gap(ours, theirs, mo.tensors(base)) < 5e-5


def test_out_dtype_narrows_the_float32_result_once(bf16, tmp_path):
    """``dtype: float32, out_dtype: float16``: the float32 merge rounded once to float16 (it was the bfloat16-rounded
    merge cast to float16)."""
    base, fts = bf16
    assert run_cli("run", _config(tmp_path / "c.yml", base, fts, "task_arithmetic", "float32"), tmp_path / "f32",
                   "--progress", "none") == 0
    assert run_cli("run", _config(tmp_path / "d.yml", base, fts, "task_arithmetic", "float32", "float16"),
                   tmp_path / "f16", "--progress", "none") == 0
    wide, narrow = mo.tensors(tmp_path / "f32"), mo.tensors(tmp_path / "f16")
    assert all(narrow[k].dtype == torch.float16 and torch.equal(narrow[k], wide[k].to(torch.float16))
               for k in wide if wide[k].is_floating_point())
    key = "model.layers.0.mlp.up_proj.weight"  # against the float32 merge by hand, rounded once to float16
    b, a, c = (mo.tensors(p)[key].float() for p in (base, *fts))
    by_hand = (b + 0.3 * (a - b) + 0.9 * (c - b)).to(torch.float16)
    assert int((narrow[key] != by_hand).sum()) <= narrow[key].numel() // 200  # a float32 ulp may flip a rounding


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "linear"])
def test_dtype_float64_is_taken_as_mergekit_takes_it(bf16, tmp_path, method):
    """``dtype: float64`` was refused ("'dtype' is one of float32, float16, bfloat16"); mergekit 0.1.5 writes a
    float64 model (linear: the same bits as symmerge's)."""
    base, fts = bf16
    config = _config(tmp_path / "c.yml", base, fts, method, "float64")
    assert run_cli("run", config, tmp_path / "out", "--progress", "none") == 0
    ours = mo.tensors(tmp_path / "out")
    assert {t.dtype for t in ours.values()} == {torch.float64}
    key = "model.layers.0.mlp.up_proj.weight"
    if method == "task_arithmetic":  # by hand, in float64 from the bfloat16 values read
        b, a, c = (mo.tensors(p)[key].double() for p in (base, *fts))
        assert torch.allclose(ours[key], b + 0.3 * (a - b) + 0.9 * (c - b), rtol=1e-12, atol=1e-15)
    if mo.available():
        theirs = mo.tensors(mo.run_mergekit(config.read_text(), tmp_path / "mergekit"))
        assert {t.dtype for t in theirs.values()} == {torch.float64}
        assert mo.relative_gap(ours, theirs, mo.tensors(base)) < 1e-12
