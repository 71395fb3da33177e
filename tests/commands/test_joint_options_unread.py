"""``--joint-rounds`` / ``--joint-refine`` are read by the joint alignment only (more than two models in one frame,
merged in memory, no ``--anchor``, ``--base`` or ``--star``). Given to a merge that aligns in another frame they
were accepted and dropped in silence; now one error, before anything is read or written. ``barrier`` of two
models (a pair, no joint frame) reads them by the same rule."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli
from factories import make_model


@pytest.fixture(scope="module")
def trio(tmp_path_factory):
    root = tmp_path_factory.mktemp("joint-unread")
    for name, seed in (("a", 0), ("b", 1), ("c", 2)):
        make_model("llama", head=True, dtype=torch.float32, seed=seed).save_pretrained(root / name)
    return root


@pytest.mark.parametrize("models,flags,frame", [
    ("ab", ["--joint-rounds", "3"], "a pair"),
    ("abc", ["--joint-refine", "discrete", "--star"], "every model to one anchor"),
    ("abc", ["--joint-rounds", "2", "--anchor", "1"], "every model to one anchor"),
    ("abc", ["--joint-rounds", "2", "--mode", "stream"], "every model to one anchor"),
    ("ab", ["--joint-rounds", "2", "--base", "{c}"], "every model to the base"),
])
def test_joint_options_outside_a_joint_frame_are_one_error(trio, tmp_path, capsys, models, flags, frame):
    flags = [f.format(c=trio / "c") for f in flags]
    method = "task_arithmetic" if "--base" in flags else "average"
    argv = ["merge", *(trio / m for m in models), "--method", method, "--align", "attn", "--progress", "none"]
    rc = run_cli(*argv, *flags, "-o", tmp_path / "o")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith("symmerge: error: --joint-") and "the joint alignment's options" in err, err
    assert frame in err, err
    assert not (tmp_path / "o").exists()


def test_in_a_joint_frame_they_are_read(trio, tmp_path):
    argv = ["merge", *(trio / m for m in "abc"), "--method", "average", "--align", "attn", "--progress", "none"]
    assert run_cli(*argv, "--joint-rounds", "1", "--mode", "memory", "-o", tmp_path / "o") == 0
    joint = json.loads((tmp_path / "o" / "symmerge_report.json").read_text())["alignment"]["joint"]
    assert joint["mode"] == "joint" and joint["rounds"] == 1 and len(joint["moved_per_round"]) == 1, joint


@pytest.mark.parametrize("flags", [("--joint-rounds", "3"), ("--joint-refine", "discrete")])
def test_barrier_of_two_models_refuses_them(tmp_path, capsys, flags):
    """``--joint-refine`` reached the study as None for two models (the command dropped it), so it was accepted."""
    from conftest import npz_file, vit_folder

    a, b = (vit_folder(tmp_path / f"v{s}", s) for s in range(2))
    npz = npz_file(tmp_path / "eval.npz", n=8)
    capsys.readouterr()  # the folders' writing
    rc = run_cli("barrier", a, b, "--data", npz, *flags, "--progress", "none", "-o", tmp_path / "o")
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "the joint alignment's options" in err and "a pair" in err, err
    assert flags[0] in err and not (tmp_path / "o").exists()


def test_the_python_api_reads_the_same_rule(trio):
    from symmerge.errors import SymmergeError
    from symmerge.merge.fuse import merge_models

    with pytest.raises(SymmergeError, match="the joint alignment's options.*a pair"):
        merge_models([str(trio / "a"), str(trio / "b")], align="attn", joint_rounds=3)
