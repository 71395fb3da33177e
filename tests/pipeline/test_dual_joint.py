"""The dual (shared-frame) learned alignment of N models (issue 42 item 3): every model, the frame model too, moves
by exact maps into one shared frame, each with its own norm splits, and the merge is their mean there. Shown: at
every step every model's moved form is its original's function (float64, real ``transformers`` classes), and a
lone change breaks it (the check can fail); the joint alignment verifies every model in float32 and moves the
frame model; ``merge`` runs it jointly and refuses it for the star in one line, from the CLI and the API."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import make_inputs, npz_file, output_rel_diff, vit_folder, with_weights
from factories import make_model
from symmerge.cli import main
from symmerge.core.apply import apply
from symmerge.errors import SymmergeError
from symmerge.pipeline.dual import learn_dual, stream_folds
from symmerge.pipeline.joint import align_joint
from symmerge.pipeline.options import AlignOptions, LearnSettings
from test_dual import canonical
from test_learn import FULL, unlabeled

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("family", ["vit", "gpt2"])
def test_every_step_moves_every_one_of_n_models_exactly(family):
    models = [make_model(family, head=True, seed=s) for s in (0, 3, 5)]  # float64
    instances = canonical(models[0])[0]
    sds = [canonical(m)[1] for m in models]
    settings = LearnSettings(steps=3, batch=8, lr=0.05, check_every=2, patience=100, frame="dual", dirichlet=3.0)
    inputs = make_inputs(models[0])
    seen = []

    def on_step(step, sides):
        assert len(sides) == 3
        for side, sd, model in zip(sides, sds, models):
            moved = side.split.final(apply(sd, instances, side.params.elements()))
            assert any(not torch.equal(moved[k], sd[k]) for k in sd)  # this model moved, the frame model too
            assert output_rel_diff(model, with_weights(model, moved), inputs) <= 1e-9
        seen.append(step)

    sides, info = learn_dual(instances, models[0], sds, unlabeled(models[0]), settings,
                             AlignOptions(symmetries=FULL).solver_options(), {"norm_eps": 1e-5}, on_step=on_step)
    assert seen == list(range(3)) and info["models_moved"] == 3 and info["dirichlet"] == 3.0
    assert info["norm_splits"] == len(stream_folds(instances)) > 0
    # the check can fail: one model's norm moved without its readers is another function
    fold = stream_folds(instances)[0]
    moved = sides[1].split.final(apply(sds[1], instances, sides[1].params.elements()))
    broken = {**moved, fold.weight: moved[fold.weight] * 1.5}
    assert output_rel_diff(models[1], with_weights(models[1], broken), inputs) > 1e-3


def test_the_joint_dual_alignment_moves_every_model_and_verifies_fp32():
    models = [make_model("vit", head=True, seed=s, dtype=torch.float32) for s in range(3)]
    data = unlabeled(models[0], n_batches=6, batch=16)
    learn = LearnSettings(steps=30, batch=16, check_every=5, patience=100, holdout=0.2, frame="dual",
                          dirichlet="auto", dirichlet_grid=(1.0, 10.0), dirichlet_steps=3)
    options = AlignOptions(symmetries=FULL, match="learned", align_data=data, learn=learn)
    result = align_joint(models, options, anchor=2)
    learned = result.report["learned"]
    assert learned["frame"] == "dual" and learned["models_moved"] == 3
    assert learned["held_out_best"] < learned["held_out_start"]
    assert learned["dirichlet_choice"]["chosen"] == learned["dirichlet"]  # auto: chosen, then learned with it
    assert all(m["verify_max_rel_diff"] <= 1e-5 for m in result.report["models"])
    inputs = make_inputs(models[0])
    assert all(output_rel_diff(m, x, inputs) <= 1e-5 for m, x in zip(models, result.models))
    closed = align_joint(models, options.with_(match="activations"), anchor=2).models[2].state_dict()
    key = next(k for k in closed if k.endswith("layernorm_before.weight"))
    assert not torch.allclose(result.models[2].state_dict()[key], closed[key])  # the frame model moved too


def test_merge_runs_the_dual_frame_jointly_and_refuses_it_for_the_star(tmp_path, capsys):
    from symmerge.merge.fuse import merge_models

    folders = [str(vit_folder(tmp_path / f"m{i}", seed=i)) for i in range(3)]
    data = npz_file(tmp_path / "x.npz", n=20)
    common = ["--method", "linear", "--match", "learned", "--learn-frame", "dual", "--align-data", data,
              "--learn-steps", "3", "--learn-dirichlet", "1", "--progress", "none"]
    out = tmp_path / "out"
    assert main(["merge", *folders, "-o", str(out), *common]) == 0
    joint = json.loads((out / "symmerge_report.json").read_text())["alignment"]["joint"]
    assert joint["learned"]["frame"] == "dual" and joint["learned"]["models_moved"] == 3
    capsys.readouterr()
    star = tmp_path / "star"
    assert main(["merge", *folders, "-o", str(star), *common, "--star"]) == 2
    assert capsys.readouterr().err == ("symmerge: error: --learn-frame dual moves all 3 models into one shared frame, "
                                       "learned jointly; --star aligns each model to one model's frame (leave out "
                                       "--learn-frame or --star)\n")
    assert not star.exists()
    models = [make_model("vit", head=True, seed=s, dtype=torch.float32) for s in range(3)]
    align = AlignOptions(symmetries="recommended", match="learned", align_data=unlabeled(models[0]),
                         learn=LearnSettings(steps=2, frame="dual"))
    with pytest.raises(SymmergeError, match="runs jointly"):
        merge_models(models, "average", align=align, progress=False, evaluate_result=False, joint=False)
