"""``merge --align none`` with alignment options given is one error: ``--workers``, ``--no-verify``, ``--anchor``,
``--star``, ``--joint-rounds``, ``--residual``, ``--untie``, ``--match`` ... were accepted and dropped in silence
(``moe`` without ``--align`` already refused them). The same rule reads a config of symmerge's keys."""

from __future__ import annotations

import pytest
import torch

from conftest import run_cli
from factories import make_model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("align-none")
    for name, seed in (("a", 0), ("b", 1)):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(root / name)
    return root


@pytest.mark.parametrize("flags,named", [
    (["--workers", "2"], "--workers"), (["--no-verify"], "--no-verify"), (["--anchor", "1"], "--anchor"),
    (["--star"], "--star"), (["--joint-rounds", "3"], "--joint-rounds"), (["--residual", "permutation"], "--residual"),
    (["--untie"], "--untie"), (["--rescale", "none"], "--rescale"), (["--match", "activations"], "--match"),
    (["--max-sweeps", "3", "--solver-seed", "4"], "--max-sweeps, --solver-seed"),
])
@pytest.mark.parametrize("mode", ["stream", "memory"])
def test_alignment_options_with_align_none_are_one_error(pair, tmp_path, capsys, flags, named, mode):
    argv = ["merge", pair / "a", pair / "b", "--method", "average", "--align", "none", "--mode", mode]
    rc = run_cli(*argv, *flags, "-o", tmp_path / "o")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"symmerge: error: {named}: ") and "--align none aligns nothing" in err, err
    assert not (tmp_path / "o").exists()


def test_without_them_and_with_the_input_switch_it_merges(pair, tmp_path):
    """--allow-tokenizer-mismatch is about the inputs (read by every merge): accepted with --align none."""
    argv = ["merge", pair / "a", pair / "b", "--method", "average", "--align", "none", "--progress", "none"]
    assert run_cli(*argv, "-o", tmp_path / "o") == 0
    assert run_cli(*argv, "--allow-tokenizer-mismatch", "-o", tmp_path / "p") == 0


def test_a_config_of_symmerge_keys_is_read_by_the_same_rule(pair, tmp_path, capsys):
    config = tmp_path / "c.yml"
    config.write_text(f"merge_method: average\nmodels:\n  - {pair / 'a'}\n  - {pair / 'b'}\nalign: none\n"
                      f"joint_rounds: 3\noutput: {tmp_path / 'o'}\n")
    rc = run_cli("run", config)
    err = capsys.readouterr().err
    assert rc == 2 and "--joint-rounds" in err and "--align none aligns nothing" in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("reader", [["--repair"], ["--distill", "2"]])
def test_repair_and_distillation_read_align_data_without_alignment(tmp_path, capsys, reader):
    """``--align none --repair --align-data D`` was refused as 'nothing would read it' (and without --align-data,
    REPAIR asked for it): neither order ran, where ``barrier --align none --repair`` does. --align-data alone with
    --align none is still refused."""
    from conftest import npz_file, vit_folder

    a, b = (vit_folder(tmp_path / f"v{s}", s) for s in range(2))
    data = npz_file(tmp_path / "d.npz", n=8)
    argv = ["merge", a, b, "--method", "average", "--align", "none", "--align-data", data, "--progress", "none"]
    assert run_cli(*argv, *reader, "-o", tmp_path / "o") == 0
    capsys.readouterr()
    assert run_cli(*argv, "-o", tmp_path / "p") == 2
    assert "--align-data: an alignment option" in capsys.readouterr().err
