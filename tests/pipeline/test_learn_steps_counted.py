"""``learned.steps`` counts the optimisation steps taken: a budget spent stopped the loop before a step and the
report still counted that step (``--learn-budget 0``: 1 step reported, none taken; 3 taken, 4 reported)."""

from __future__ import annotations

import pytest

from conftest import npz_file, vit_folder

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("budget, steps", [(0, 0), (None, 3)])
def test_the_report_counts_the_steps_taken(tmp_path, budget, steps):
    import symmerge

    a, b = (vit_folder(tmp_path / f"v{s}", s) for s in range(2))
    data = npz_file(tmp_path / "d.npz", n=16)
    learn = symmerge.LearnSettings(steps=3, batch=8, budget=budget, check_every=1)
    _, report = symmerge.align(a, b, match="learned", align_data=data, learn=learn, progress=False)
    assert report["learned"]["steps"] == steps
    assert len(report["learned"]["history"]["train"]) <= steps


def test_a_layer_named_twice_is_one_error(tmp_path, capsys):
    """``align --layers 0,0`` bound every layer-0 instance twice: solved twice over, the distance barely moved
    (21.757 → 21.743 where ``--layers 0`` gives 20.886) and the descent's objective rose."""
    from conftest import run_cli

    a, b = (vit_folder(tmp_path / f"v{s}", s) for s in range(2))
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:  # a flag's value: argparse's own line and exit
        run_cli("align", a, b, "--layers", "0,0", "-o", tmp_path / "o")
    assert e.value.code == 2
    assert "layer 0 is named twice" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_the_budget_counts_the_learning_not_the_closed_form_start(tmp_path, monkeypatch):
    """The pair learned from a weight start counted the closed-form search in ``--learn-budget`` (an activation
    start, the file path, the joint and the dual learning did not): a search slower than the budget left no step."""
    import time

    import symmerge
    import symmerge.pipeline.learn as learn_module

    real = learn_module.search

    def slow_search(*args, **kwargs):
        time.sleep(1.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(learn_module, "search", slow_search)
    a, b = (vit_folder(tmp_path / f"v{s}", s) for s in range(2))
    data = npz_file(tmp_path / "d.npz", n=16)
    learn = symmerge.LearnSettings(steps=2, batch=8, budget=1.0, start="weights", check_every=1)
    _, report = symmerge.align(a, b, match="learned", align_data=data, learn=learn, progress=False)
    assert report["learned"]["closed_form_seconds"] >= 1.5
    assert report["learned"]["steps"] == 2  # the tiny learning fits in its budget
