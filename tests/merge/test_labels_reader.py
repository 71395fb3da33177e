"""A data file without labels where labels are read names what reads them: ``merge --method fisher --data
unlabeled.npz`` said only "missing array 'labels'", which read as a fault of the file, not of the method (RegMean and
OT fusion take the same file unlabeled); the evaluation's and the barrier's files likewise."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import run_cli, vit_folder


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("labels")
    vit_folder(root / "a", 0)
    vit_folder(root / "b", 1)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 1, 8, 8)).astype("float32")
    np.savez(root / "unlabeled.npz", pixel_values=x)
    np.savez(root / "labeled.npz", pixel_values=x, labels=rng.integers(0, 3, 8))
    return root


@pytest.mark.parametrize("argv,reader", [
    (["merge", "A", "B", "--method", "fisher", "--data", "unlabeled.npz"], "--method fisher's statistics"),
    (["merge", "A", "B", "--method", "average", "--eval-data", "unlabeled.npz"], "the evaluation"),
    (["merge", "A", "B", "--method", "fisher", "--data", "labeled.npz", "--eval-data", "unlabeled.npz"],
     "the evaluation"),
    (["barrier", "A", "B", "--data", "unlabeled.npz"], "the barrier"),
])
def test_missing_labels_name_their_reader(root, tmp_path, capsys, argv, reader):
    argv = [root / x.lower() if x in ("A", "B") else root / x if x.endswith(".npz") else x for x in argv]
    assert run_cli(*argv, "-o", tmp_path / "out", "-q") == 2
    err = capsys.readouterr().err
    assert err.startswith("symmerge: error: ") and err.count("\n") == 1, err
    assert "missing array 'labels'" in err and f"labels are read by {reader}" in err, err
    assert not (tmp_path / "out").exists()


def test_a_method_that_takes_unlabeled_statistics_reads_the_same_file(root, tmp_path):
    assert run_cli("merge", root / "a", root / "b", "--method", "regmean", "--data", root / "unlabeled.npz",
                   "--eval-data", root / "labeled.npz", "-o", tmp_path / "out", "-q") == 0
