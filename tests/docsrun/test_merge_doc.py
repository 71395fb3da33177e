"""Commands of docs/merge.md run as written that did not do what the page says, each test the page's promise on
tiny real ViT checkpoints (written as strict xfails when found, turned on with their fixes)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import npz_file, run_cli, vit_folder, write_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread")


def _swap_two_tokens(folder: Path) -> None:
    """The folder's tokenizer with the ids of its last two tokens swapped (a tokenizer that differs)."""
    path = folder / "tokenizer.json"
    doc = json.loads(path.read_text())
    vocab = doc["model"]["vocab"]
    x, y = sorted(vocab, key=vocab.get)[-2:]
    vocab[x], vocab[y] = vocab[y], vocab[x]
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("n", [2, 3])
def test_barrier_refuses_differing_tokenizers(tmp_path, capsys, n):
    # docs/merge.md, Tokenizers: "Before anything is loaded, align, merge and barrier ... compare the tokenizers
    # of every input given as a folder ... A difference is one error naming the first differing tokens"
    models = [vit_folder(tmp_path / f"m{seed}", seed) for seed in range(n)]
    for m in models:
        write_tokenizer(m)
    _swap_two_tokens(models[1])
    data = npz_file(tmp_path / "d.npz")
    capsys.readouterr()
    code = run_cli("barrier", *models, "--data", data, "--align", "none", "--points", "2",
                   "--progress", "none", "-o", tmp_path / "out")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and not (tmp_path / "out").exists()
    assert len(err) == 1 and "tokenizers of" in err[0] and "--allow-tokenizer-mismatch" in err[0], err


def test_merge_stream_residual_refusal_names_merges_own_flag(tmp_path, capsys):
    a, b = vit_folder(tmp_path / "a", 0), vit_folder(tmp_path / "b", 1)
    capsys.readouterr()
    code = run_cli("merge", a, b, "--method", "average", "--align", "attn,residual", "--mode", "stream",
                   "--progress", "none", "-o", tmp_path / "out")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "residual" in err[0], err
    assert "merge --mode memory" in err[0], err  # merge's own flag (it named only align's --stream)


@pytest.mark.parametrize("mode", ["stream", "memory"])
def test_della_merges_a_vit(tmp_path, capsys, mode):
    # docs/merge.md: DELLA on tensors of more than two dimensions runs the torch code, its rows along dim 1
    base, a, b = (vit_folder(tmp_path / name, seed) for seed, name in enumerate(("base", "a", "b")))
    code = run_cli("merge", a, b, "--method", "della", "--base", base, "--param", "density=0.5", "--align", "none",
                   "--mode", mode, "--progress", "none", "-o", tmp_path / "out")
    assert code == 0 and (tmp_path / "out" / "model.safetensors").exists(), capsys.readouterr().err[-500:]
