"""Single ``.safetensors`` files as inputs of ``run``, ``merge`` and ``align`` (symmerge/io/single.py, as
mergekit-pytorch takes them): the file's tensors under the config.json beside it, else the base model's (the
anchor's); the same output as the folders they came from, the files left as they were."""

from __future__ import annotations

import hashlib
import shutil

import pytest
import torch

import mergekit_oracle as mo
from conftest import run_cli


@pytest.fixture(scope="module")
def fam(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    base, fts = mo.family(root, "llama", "float32", n=2, layers=2)
    flat = root / "flat"  # both fine-tunes as files in one folder, with one config.json
    flat.mkdir()
    bare = root / "bare"  # the same files with no config.json anywhere near
    bare.mkdir()
    for i, f in enumerate(fts):
        shutil.copyfile(f / "model.safetensors", flat / f"ft{i + 1}.safetensors")
        shutil.copyfile(f / "model.safetensors", bare / f"ft{i + 1}.safetensors")
    shutil.copyfile(fts[0] / "config.json", flat / "config.json")
    return base, fts, flat, bare


def _same(a, b):
    ta, tb = mo.tensors(a), mo.tensors(b)
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)


def _digest(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_merge_takes_single_files(fam, tmp_path):
    base, fts, flat, bare = fam
    before = _digest(flat)
    folders, files = tmp_path / "folders", tmp_path / "files"
    assert run_cli("merge", *fts, "--method", "average", "--align", "none", "-o", folders, "--progress", "none") == 0
    assert run_cli("merge", flat / "ft1.safetensors", flat / "ft2.safetensors", "--method", "average", "--align",
                   "none", "-o", files, "--progress", "none") == 0
    _same(folders, files)
    assert _digest(flat) == before


def test_merge_takes_the_config_from_the_base(fam, tmp_path):
    base, fts, flat, bare = fam
    folders, files = tmp_path / "folders", tmp_path / "files"
    common = ["--method", "task_arithmetic", "--base", str(base), "--align", "none", "--progress", "none"]
    assert run_cli("merge", *fts, *common, "-o", folders) == 0
    assert run_cli("merge", bare / "ft1.safetensors", bare / "ft2.safetensors", *common, "-o", files) == 0
    _same(folders, files)


def test_a_file_without_a_config_is_one_error(fam, tmp_path, capsys):
    base, fts, flat, bare = fam
    assert run_cli("merge", bare / "ft1.safetensors", bare / "ft2.safetensors", "--method", "average", "-o",
                   tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert "a single .safetensors file needs a config.json beside it" in err and err.count("\n") == 1
    assert not (tmp_path / "o").exists()


def test_align_takes_a_single_file(fam, tmp_path):
    base, fts, flat, bare = fam
    folders, files = tmp_path / "folders", tmp_path / "files"
    assert run_cli("align", fts[0], fts[1], "-o", folders, "--progress", "none") == 0
    assert run_cli("align", bare / "ft1.safetensors", fts[1], "-o", files, "--progress", "none") == 0
    _same(folders, files)


def test_run_takes_single_files(fam, tmp_path):
    base, fts, flat, bare = fam
    text = ("merge_method: task_arithmetic\nbase_model: {base}\nmodels:\n  - model: {a}\n    parameters: {{weight: 0.7}}\n"
            "  - model: {b}\n    parameters: {{weight: 0.4}}\ndtype: bfloat16\n")
    outs = []
    for name, (a, b) in (("folders", fts), ("files", (bare / "ft1.safetensors", bare / "ft2.safetensors"))):
        cfg = tmp_path / f"{name}.yml"
        cfg.write_text(text.format(base=base, a=a, b=b))
        assert run_cli("run", cfg, tmp_path / name, "--progress", "none") == 0
        outs.append(tmp_path / name)
    _same(*outs)
