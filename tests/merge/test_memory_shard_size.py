"""``merge --shard-size`` bounds the output's largest shard in both modes: an in-memory merge (``--mode memory``,
or ``auto`` loading the models to align them) wrote its output with ``save_pretrained``'s own default (50GB in
transformers 5) whatever the flag said. Several shards and an index, loadable by transformers, tensor for tensor the
unsharded output; a bad size refused before anything is merged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from conftest import run_cli, save_folder
from factories import make_model

LIMIT = 10_000  # bytes: "10KB" (a tiny llama is about 66 KB in float32)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    root = tmp_path_factory.mktemp("shards")
    return [save_folder(make_model("llama", head=True, seed=s), root / f"m{s}") for s in range(2)]


def tensors(folder) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def shard_sizes(folder) -> list[tuple[int, int]]:
    """(bytes of its tensors, how many) of each shard."""
    sizes = []
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            ts = [h.get_tensor(k) for k in h.keys()]
        sizes.append((sum(t.numel() * t.element_size() for t in ts), len(ts)))
    return sizes


@pytest.mark.parametrize("flags, mode", [(["--align", "none", "--mode", "memory"], "in memory"),
                                         (["--mode", "auto"], "in memory"),  # aligned: auto loads the models
                                         (["--align", "none", "--mode", "stream"], "streamed")])
def test_the_largest_shard_is_bounded_in_both_modes(two, tmp_path, capsys, flags, mode):
    whole, sharded = tmp_path / "whole", tmp_path / "sharded"
    base = ["merge", *two, "--method", "average", *flags, "--progress", "none"]
    assert run_cli(*base, "-o", whole) == 0
    capsys.readouterr()
    assert run_cli(*base, "-o", sharded, "--shard-size", "10KB") == 0
    assert f"{mode} (" in capsys.readouterr().out
    assert [p.name for p in whole.glob("*.safetensors")] == ["model.safetensors"]
    sizes = shard_sizes(sharded)
    assert len(sizes) > 2 and all(size <= LIMIT or count == 1 for size, count in sizes), sizes
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in sharded.glob("*.safetensors")}
    a, b = tensors(whole), tensors(sharded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loaded = AutoModelForCausalLM.from_pretrained(str(sharded))  # transformers reads the shards by the index
    reference = AutoModelForCausalLM.from_pretrained(str(whole))
    ids = torch.tensor([[1, 5, 9, 2]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_a_bad_size_is_refused_before_the_merge(two, tmp_path, capsys):
    out = tmp_path / "out"
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:  # read by the flag: argparse's line, naming the command and the flag
        run_cli("merge", *two, "-o", out, "--method", "average", "--mode", "memory", "--shard-size", "big",
                "--progress", "none")
    captured = capsys.readouterr()
    assert refused.value.code == 2 and captured.err == (
        "symmerge merge: error: argument --shard-size: cannot read size 'big'; use e.g. 500MB or 2GB "
        "(see symmerge merge --help)\n"), captured.err
    assert "merged" not in captured.out and not out.exists()
