"""The barrier study's figures recomputed independently (the definitions of docs/merge.md, written here
again), and its outputs at their edges: the printed table, non-finite losses, the plot."""

from __future__ import annotations

import json

import pytest

from conftest import npz_file, run_cli, vit_folder


@pytest.mark.parametrize("points", [2, 4, 11])
def test_the_printed_table_names_the_alpha_of_its_midpoint_loss(tmp_path, capsys, points):
    # θ(α) = α·A + (1−α)·B on points α = i/(points−1): with an even count there is no α = 0.5, and the row
    # must not call another α's loss "loss(0.5)"
    npz = npz_file(tmp_path / "eval.npz", n=12)
    a, b = (str(vit_folder(tmp_path / f"v{s}", s)) for s in range(2))
    assert run_cli("barrier", a, b, "--data", npz, "--align", "none", "--points", points, "--progress", "none",
                   "-o", tmp_path / "out") == 0
    row = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("none "))
    result = json.loads((tmp_path / "out" / "barrier.json").read_text())
    alphas, loss = result["alphas"], result["curves"]["none"]["loss"]
    k = min(range(points), key=lambda i: (abs(alphas[i] - 0.5), alphas[i]))
    label = "loss(0.5)" if alphas[k] == 0.5 else f"loss({alphas[k]:.3g})"
    assert f"{label} {loss[k]:.4f}" in row, row
    if points == 2:
        assert "loss(0.5)" not in row  # its two points are the endpoints
