"""``--head-from I`` is an index into the models by the one rule of ``--anchor``
(:func:`symmerge.option_ranges.model_index`): 0..N-1, a negative one refused, not counted from the end
(``--head-from -1`` was the last model while ``--anchor -1`` was refused). The same line from the flag, a config
of symmerge's keys (``head_from:``), ``MergeOptions.check``, ``symmerge.merge`` and ``merge_models``; exit 2 and
nothing written on the command line."""

from __future__ import annotations

import pytest

import symmerge
from symmerge.errors import SymmergeError
from symmerge.merge.fuse import MergeOptions, merge_models
from conftest import run_cli, save_folder
from factories import make_model


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("head_from")
    return [save_folder(make_model("llama", seed=s), root / f"m{s}") for s in range(2)]


def line(index) -> str:
    return f"--head-from index {index} out of range for 2 models: give 0..1 (0-based)"


@pytest.mark.parametrize("index", ["-1", "-2", "2"])
def test_the_flag_refuses_an_index_outside_the_models_as_anchor_does(two, tmp_path, capsys, index):
    out = tmp_path / "out"
    capsys.readouterr()
    assert run_cli("merge", *two, "-o", out, "--method", "average", "--align", "none", f"--head-from={index}",
                   "--progress", "none") == 2
    captured = capsys.readouterr()
    assert captured.err == f"symmerge: error: {line(index)}\n" and captured.out == "" and not out.exists()
    assert run_cli("merge", *two, "-o", out, "--method", "average", f"--anchor={index}",
                   "--progress", "none") == 2  # the same shape as --anchor's line (checked before any alignment)
    assert capsys.readouterr().err == f"symmerge: error: {line(index).replace('--head-from', 'anchor')}\n"


def test_a_configs_head_from_key_refuses_the_same(two, tmp_path, capsys):
    cfg = tmp_path / "c.yml"
    cfg.write_text(f"merge_method: average\nmodels: [{two[0]}, {two[1]}]\nalign: none\nhead_from: -1\n")
    capsys.readouterr()
    assert run_cli("run", cfg, tmp_path / "out", "--progress", "none") == 2
    err = capsys.readouterr().err
    assert err.endswith(f"symmerge: error: {line(-1)}\n") and not (tmp_path / "out").exists(), err


@pytest.mark.parametrize("index", [-1, 2])
def test_the_library_refuses_the_same(two, tmp_path, index):
    refused = line(index).replace(".", r"\.").replace("(", r"\(").replace(")", r"\)")
    with pytest.raises(SymmergeError, match=refused):
        MergeOptions(method="average", head_from=index).check(2)
    with pytest.raises(SymmergeError, match=refused):
        symmerge.merge(two, tmp_path / "out", MergeOptions(method="average", head_from=index, progress=False))
    assert not (tmp_path / "out").exists()
    models = [make_model("llama", seed=s) for s in range(2)]
    with pytest.raises(SymmergeError, match=refused):
        merge_models(models, "average", head_from=index, progress=False)


def test_an_index_in_range_is_kept_as_given():
    assert [MergeOptions(method="average", head_from=i).check(2).head_from for i in (0, 1)] == [0, 1]
