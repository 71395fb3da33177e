"""A solver's cost that the weights overflowed (finite inputs near float32's range: their products are Inf) is one
error, not torch's "linalg.svd: The algorithm failed to converge" traceback (with MKL's DLASCL message before it) or
scipy's ValueError: an anchor whose up_proj was scaled by 1e37 made ``align``/``merge`` exit 1 with a traceback."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import run_cli
from factories import make_model
from symmerge.core.solvers import joint_scale, match_permutation, procrustes
from symmerge.core.solvers.procrustes import OVERFLOW
from symmerge.errors import SymmergeError


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_each_solver_refuses_a_cost_that_is_not_finite(bad):
    M = torch.randn(3, 4, 4)
    M[1, 2, 3] = bad
    with pytest.raises(SymmergeError, match="overflowed float32"):
        procrustes(M)
    with pytest.raises(SymmergeError, match="overflowed float32"):
        match_permutation(M[1].clone())
    n = torch.ones(3, dtype=torch.float64)
    with pytest.raises(SymmergeError, match="overflowed float32"):
        joint_scale(M.double(), torch.randn(3, 4, 4, dtype=torch.float64), n, n, n, n)


def test_large_finite_costs_are_solved():
    """The check is on Inf/NaN only: costs near float32's largest value (whose float32 sum would overflow) solve."""
    M = torch.randn(64, 64) * 3e37
    perm = match_permutation(M.clone())
    assert sorted(perm.tolist()) == list(range(64))
    R, _ = procrustes(torch.randn(2, 4, 4) * 1e37)
    assert torch.allclose(R @ R.mT, torch.eye(4).expand(2, 4, 4), atol=1e-5)


@pytest.mark.parametrize("command", [["align"], ["merge", "--method", "average"]])
def test_an_anchor_with_values_near_float32_s_range_is_one_error(tmp_path, capsys, command):
    a = make_model("llama", head=True, dtype=torch.float32, seed=0)
    b = make_model("llama", head=True, dtype=torch.float32, seed=1)
    with torch.no_grad():
        b.model.layers[0].mlp.up_proj.weight.mul_(1e37)
    a.save_pretrained(tmp_path / "a")
    b.save_pretrained(tmp_path / "b")
    capsys.readouterr()
    assert run_cli(command[0], tmp_path / "a", tmp_path / "b", *command[1:], "-o", tmp_path / "out", "-q") == 2
    err = capsys.readouterr().err
    assert err == f"symmerge: error: {OVERFLOW}\n"
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*"))


def test_a_solve_that_does_not_converge_is_one_line(tmp_path, capsys, monkeypatch):
    """The net under the costs' check: torch's LinAlgError from any solve is one line (the probe's traceback)."""
    def failing(M):
        raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge because the input matrix is "
                                       "ill-conditioned or has too many repeated singular values")

    monkeypatch.setattr(torch.linalg, "svd", failing)
    for seed, name in ((0, "a"), (1, "b")):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(tmp_path / name)
    capsys.readouterr()
    assert run_cli("align", tmp_path / "a", tmp_path / "b", "-o", tmp_path / "out", "-q") == 2
    err = capsys.readouterr().err
    assert err.startswith("symmerge: error: a linear-algebra solve failed on these weights (linalg.svd did not "
                          "converge)") and err.count("\n") == 1, err
    assert not (tmp_path / "out").exists()
