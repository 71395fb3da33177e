"""RegMean's Gram matrices and OT fusion's activations use no labels: ``merge --method regmean --data FILE`` takes a
file without them (it was refused, "missing array 'labels'"), with the same statistics, so the same merged model, as
the same inputs with labels. The Fisher uses labels: still refused. Without ``--eval-data``, an unlabeled ``--data``
cannot score the result: not scored, with the reason in the report and a warning line (not an error)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from conftest import run_cli, vit_folder

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("unlabeled")
    a, b = vit_folder(root / "a", 0), vit_folder(root / "b", 1)
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((20, 1, 8, 8)).astype(np.float32), rng.integers(0, 3, 20)
    np.savez(root / "unlabeled.npz", pixel_values=x)
    np.savez(root / "labelled.npz", pixel_values=x, labels=y)
    return root, a, b


def _merge(world, out, data, *extra):
    root, a, b = world
    return run_cli("merge", a, b, "--method", "regmean", "--data", root / data, "-o", out, "--progress", "none",
                   *extra)


def test_regmean_takes_unlabeled_statistics_data(world, tmp_path, capsys):
    root = world[0]
    assert _merge(world, tmp_path / "u", "unlabeled.npz", "--eval-data", root / "labelled.npz") == 0
    assert _merge(world, tmp_path / "l", "labelled.npz", "--eval-data", root / "labelled.npz") == 0
    u, lab = load_file(str(tmp_path / "u" / "model.safetensors")), load_file(str(tmp_path / "l" / "model.safetensors"))
    assert u.keys() == lab.keys() and all(torch.equal(u[k], lab[k]) for k in u)  # the same statistics
    report = json.loads((tmp_path / "u" / "symmerge_report.json").read_text())
    assert report["evaluation"]["merged"] and report["evaluation"]["data_role"] == "--eval-data"


def test_without_eval_data_an_unlabeled_file_is_not_scored_with_the_reason(world, tmp_path, capsys):
    capsys.readouterr()
    assert _merge(world, tmp_path / "u", "unlabeled.npz") == 0
    err = capsys.readouterr().err
    assert "warning: no --eval-data given and --data has no labels" in err, err
    evaluation = json.loads((tmp_path / "u" / "symmerge_report.json").read_text())["evaluation"]
    assert evaluation["merged"] == [] and "not scored" in evaluation["note"]


def test_the_fisher_still_needs_labels(world, tmp_path, capsys):
    root, a, b = world
    capsys.readouterr()
    assert run_cli("merge", a, b, "--method", "fisher", "--data", root / "unlabeled.npz", "--eval-data",
                   root / "labelled.npz", "-o", tmp_path / "f", "--progress", "none") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing array 'labels'" in err[0], err
    assert not (tmp_path / "f").exists()
