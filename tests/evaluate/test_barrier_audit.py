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


def test_a_nan_loss_makes_the_barrier_nan_never_the_maximum_of_the_other_points():
    from symmerge.evaluate.metrics import barrier

    nan, inf = float("nan"), float("inf")
    assert barrier([0.0, 0.5, 1.0], [1.0, nan, 1.0]) != barrier([0.0, 0.5, 1.0], [1.0, nan, 1.0])  # NaN, not 0.0
    assert barrier([0.0, 0.5, 1.0], [nan, 2.0, 1.0]) != barrier([0.0, 0.5, 1.0], [nan, 2.0, 1.0])
    assert barrier([0.0, 0.5, 1.0], [1.0, inf, 1.0]) == inf  # a finite path's end, an infinite middle
    assert barrier([0.0, 0.5, 1.0], [inf, 2.0, 1.0]) != barrier([0.0, 0.5, 1.0], [inf, 2.0, 1.0])  # inf − inf


def test_a_model_with_nan_weights_gives_nan_figures_and_theta_0_is_b_exactly(tmp_path):
    # (the command refuses NaN weights when it loads a folder; the Python API takes the model as it is)
    import copy

    import torch

    from conftest import npz_eval
    from symmerge.io.model import load_model
    from symmerge.merge.barrier import barrier_study

    npz = npz_file(tmp_path / "eval.npz", n=12)
    a, b = (load_model(str(vit_folder(tmp_path / f"v{s}", s)), spec=False) for s in range(2))
    with torch.no_grad():
        a.classifier.weight[0, 0] = float("nan")
    res = barrier_study(a, copy.deepcopy(b), npz, aligns=["none"], points=3, progress=False)
    curve = res["curves"]["none"]
    loss_b, acc_b = npz_eval(b, npz)
    assert curve["loss"][0] == pytest.approx(loss_b, abs=1e-5) and curve["accuracy"][0] == pytest.approx(acc_b)
    assert all(x != x for x in curve["loss"][1:] + curve["accuracy"][1:])  # NaN, not an argmax of NaN logits
    assert curve["barrier"] != curve["barrier"] and "not finite at α = 0.5" in curve["note"]
    assert res["endpoints"]["A"]["undefined"] == 12


def test_logits_overflowing_to_inf_are_one_warning_line_and_null_figures(tmp_path, capsys):
    # finite weights (the command loads them) whose logits overflow float32 at α = 1 (A): A's figures and the
    # barrier are undefined, and one warning line says where
    from safetensors.torch import load_file, save_file

    npz = npz_file(tmp_path / "eval.npz", n=12)
    a, b = (vit_folder(tmp_path / f"v{s}", s) for s in range(2))
    sd = load_file(str(a / "model.safetensors"))
    sd["vit.layernorm.bias"].fill_(1.0)  # the head reads ≈ 1 + N(0, 1) per coordinate
    sd["classifier.weight"][0].fill_(3e37)  # ≈ 16 · 3e37 > float32's largest, 3.4e38
    save_file(sd, str(a / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    assert run_cli("barrier", a, b, "--data", npz, "--align", "none", "--points", "3", "--progress", "none",
                   "-o", out) == 0
    err = capsys.readouterr().err
    result = json.loads((out / "barrier.json").read_text())
    curve = result["curves"]["none"]
    assert curve["barrier"] is None and curve["loss"][2] is None and curve["accuracy"][2] is None
    assert result["endpoints"]["A"]["loss"] is None and result["endpoints"]["A"]["undefined"] > 0
    lines = [x for x in err.splitlines() if x.startswith("warning: none:")]
    assert len(lines) == 1 and "not finite at α = 1" in lines[0] and "null in barrier.json" in lines[0], err


def _saved_figures(monkeypatch) -> list:
    """Every figure saved from now on, as (axes' x labels, y labels, legend texts, suptitle)."""
    from matplotlib.figure import Figure

    seen, save = [], Figure.savefig

    def record(fig, *args, **kwargs):
        legend = [t.get_text() for lg in fig.legends for t in lg.get_texts()]
        seen.append(([ax.get_xlabel() for ax in fig.axes], [ax.get_ylabel() for ax in fig.axes], legend,
                     fig._suptitle.get_text() if fig._suptitle else ""))
        return save(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return seen


def test_the_plot_names_each_curve_as_the_report_does_with_units_and_no_warning(tmp_path, monkeypatch):
    import warnings

    from symmerge.io.model import load_model
    from symmerge.merge.barrier import barrier_study, write_study

    seen = _saved_figures(monkeypatch)
    npz = npz_file(tmp_path / "eval.npz", n=12)
    a, b = (load_model(str(vit_folder(tmp_path / f"v{s}", s)), spec=False) for s in range(2))
    res = barrier_study(a, b, npz, aligns=["attn,ffn"], points=3, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no matplotlib warning without a display
        write_study(res, tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["barrier.json", "barrier.png"]
    (xlabels, ylabels, legend, title), = seen
    assert xlabels == ["α (0 = B, 1 = A)"] * 2  # θ(α) = α·θ_A + (1−α)·θ_B
    assert ylabels == ["loss (cross-entropy, nats)", "accuracy (fraction correct)"]
    assert [x.split(": barrier ")[0] for x in legend] == list(res["curves"])
    assert "on eval.npz (12 examples)" in title and "θ(α) = α·θ_A + (1−α)·θ_B" in title
