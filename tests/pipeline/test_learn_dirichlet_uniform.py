"""``--learn-dirichlet uniform`` (issue 42 item 3, the N-model analogue of ``--learn-alpha-low 0.5
--learn-alpha-high 0.5``): every step of the joint learned alignment of N models trains the plain average, each
model weighted exactly 1/N, one-sided and dual, and the objective is checked there alone. ``inf`` reads the same
(Dirichlet(C)'s limit as C grows), from a flag, a config key and the API; a bad value is one line. Shown: the weights
every step sees (spied, exact), the first step's loss equal to the uniform score of :mod:`learn_joint` computed
apart, the learned result equal to Dirichlet(C) with a huge C to rounding (the limit), every model still its
original's function, and the defaults unchanged."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from conftest import make_inputs, output_rel_diff
from factories import make_model
from symmerge.cli import main
from symmerge.commands.config_options import parser
from symmerge.config.command import SymmergeConfig
from symmerge.config.schema import values
from symmerge.config.source import read_documents
from symmerge.errors import SymmergeError
from symmerge.options.build import learn_settings
from symmerge.pipeline import dual, learn_joint
from symmerge.pipeline.joint import align_joint
from symmerge.pipeline.mixture import check_points
from symmerge.pipeline.options import DIRICHLET_UNIFORM, AlignOptions, LearnSettings
from test_learn import FULL, unlabeled

pytestmark = pytest.mark.usefixtures("single_thread")
BASE = ["m1", "m2", "m3", "-o", "out", "--method", "average", "--match", "learned", "--align-data", "d.npz"]
KEYS = {"output": "out", "method": "average", "match": "learned"}


def _from_key(tmp_path, keys: dict):
    path = tmp_path / "c.yml"
    path.write_text(yaml.safe_dump({**KEYS, **keys}, sort_keys=False))
    doc = read_documents(path)[0]
    return values(SymmergeConfig("merge", ["m1", "m2", "m3"], None, {}, {**KEYS, **keys}, doc))


@pytest.mark.parametrize("flag, key", [("uniform", "uniform"), ("inf", float("inf")), ("uniform", float("inf"))])
def test_the_flag_the_key_and_the_api_read_uniform_the_same(tmp_path, flag, key):
    from_flag = learn_settings(parser("merge").parse_args(BASE + ["--learn-dirichlet", flag]))
    from_key = learn_settings(_from_key(tmp_path, {"learn_dirichlet": key}))
    assert from_flag == from_key == LearnSettings(dirichlet=math.inf) == LearnSettings(dirichlet=DIRICHLET_UNIFORM)
    assert from_flag.dirichlet == "uniform"
    assert LearnSettings().dirichlet == "auto" and LearnSettings(dirichlet=3).dirichlet == 3  # the others unchanged


BAD = [("0", "symmerge: error: the Dirichlet concentration must be > 0 (or 'auto', or 'uniform'), got 0.0"),
       ("-inf", "symmerge: error: the Dirichlet concentration must be > 0 (or 'auto', or 'uniform'), got -inf"),
       ("nan", "symmerge: error: the Dirichlet concentration must be > 0 (or 'auto', or 'uniform'), got nan"),
       ("flat", "symmerge: error: argument --learn-dirichlet: expected a number, 'auto' or 'uniform', got 'flat'")]


@pytest.mark.parametrize("text, line", BAD)
def test_a_bad_value_is_one_line_from_a_flag_and_a_key_and_an_error_from_the_api(tmp_path, capsys, text, line):
    if text != "flat":
        with pytest.raises(SymmergeError, match="Dirichlet concentration must be > 0"):
            LearnSettings(dirichlet=float(text))
    else:
        with pytest.raises(SymmergeError):
            LearnSettings(dirichlet=text)
    data = tmp_path / "d.npz"
    data.write_bytes(b"")  # only its existence is checked before the options
    out = tmp_path / "out"
    argv = ["merge", "m1", "m2", "m3", "-o", str(out), "--method", "average", "--match", "learned",
            "--align-data", str(data), f"--learn-dirichlet={text}"]
    if text == "flat":  # not a value of the flag's form: argparse's one error line, exit 2
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        assert capsys.readouterr().err == line.replace("symmerge:", "symmerge merge:") + " (see symmerge merge --help)\n"
    else:  # a number out of range: the settings' one line
        assert main(argv) == 2
        assert capsys.readouterr().err == line + "\n"
    assert not out.exists()
    cfg = tmp_path / "c.yml"
    cfg.write_text(yaml.safe_dump({"merge_method": "average", "models": ["m1", "m2", "m3"], "match": "learned",
                                   "align_data": str(data), "learn_dirichlet": text}, sort_keys=False))
    assert main(["run", str(cfg), str(out)]) == 2
    err = capsys.readouterr().err  # run echoes the command line it stands for, then the one error line
    last = err.splitlines()[-1]
    assert last.startswith("symmerge: error: ") and last.endswith(line.split("error: ")[1]) and "Traceback" not in err
    assert not out.exists()


def test_the_checks_are_the_uniform_mixture_alone():
    assert [w.tolist() for w in check_points(4, DIRICHLET_UNIFORM)] == [[0.25] * 4]
    assert len(check_points(4, 3.0)) == 5 and len(check_points(4)) == 5  # the other concentrations: as before


def _spy(monkeypatch, cls):
    """Every mixture weight vector ``cls.loss`` is called with (training steps and checks)."""
    seen = []
    real = cls.loss

    def loss(self, w, *args):
        seen.append(w.detach().clone())
        return real(self, w, *args)

    monkeypatch.setattr(cls, "loss", loss)
    return seen


@pytest.mark.parametrize("frame, cls", [("one-sided", learn_joint.Mixture), ("dual", dual.Interpolation)])
def test_every_step_trains_the_plain_average_and_every_model_keeps_its_function(monkeypatch, frame, cls):
    models = [make_model("vit", head=True, seed=s, dtype=torch.float32) for s in range(4)]
    data = unlabeled(models[0], n_batches=2)
    seen = _spy(monkeypatch, cls)
    learn = LearnSettings(steps=5, batch=8, lr=0.01, check_every=100, patience=100, augment=0, frame=frame,
                          dirichlet="uniform")
    result = align_joint(models, AlignOptions(symmetries=FULL, match="learned", align_data=data, learn=learn))
    learned = result.report["learned"]
    assert learned["dirichlet"] == "uniform" and learned["steps"] == 5
    assert len(seen) == 5 + 2 * len(data.batches)  # 5 steps; the start's and the end's checks, every batch
    assert all(torch.equal(w, torch.full((4,), 0.25)) for w in seen)  # exactly 1/N, never a draw
    if frame == "one-sided":
        assert learned["weights_checked"] == 1
    assert learned["held_out_best"] < learned["held_out_start"]
    inputs = make_inputs(models[0])
    assert all(output_rel_diff(m, x, inputs) <= 1e-5 for m, x in zip(models, result.models))
    assert all(m["verify_max_rel_diff"] <= 1e-5 for m in result.report["models"])


def test_the_uniform_objective_is_the_uniform_score_and_the_limit_of_a_large_concentration(monkeypatch):
    """The first step's loss is :func:`learn_joint.uniform_score` of the start on that batch (computed apart, no
    learning involved), and the learning equals Dirichlet(C = 1e12), whose draws are 1/N to ~1e-6, to rounding;
    Dirichlet(1) learns something else (the comparison can fail)."""
    models = [make_model("vit", head=True, seed=s, dtype=torch.float32) for s in range(3)]
    data = unlabeled(models[0], n_batches=1)
    batch = data.batches[0]
    losses = []
    real = learn_joint.Mixture.loss

    def loss(self, w, changed, b, p):
        value = real(self, w, changed, b, p)
        if torch.is_grad_enabled():
            losses.append(value.item())
        return value

    monkeypatch.setattr(learn_joint.Mixture, "loss", loss)
    common = dict(symmetries=FULL, match="learned", align_data=data)
    settings = dict(steps=4, batch=8, lr=0.05, check_every=100, patience=100, augment=0)
    start = align_joint(models, AlignOptions(**common, learn=LearnSettings(**settings, dirichlet=1.0)).with_(
        match="activations"))
    skeleton = start.models[0]
    expected = learn_joint.uniform_score(skeleton, [m.state_dict() for m in start.models], 0, "log-probabilities",
                                         [batch])
    runs = {c: align_joint(models, AlignOptions(**common, learn=LearnSettings(**settings, dirichlet=c)))
            for c in ("uniform", 1e12, 1.0)}
    assert losses[0] == pytest.approx(expected, rel=1e-5)
    keys = [k for k, v in runs["uniform"].models[1].state_dict().items() if v.is_floating_point()]

    def gap(a, b) -> float:
        return max(float((runs[a].models[i].state_dict()[k] - runs[b].models[i].state_dict()[k]).abs().max())
                   for i in (1, 2) for k in keys)

    assert gap("uniform", 1e12) <= 1e-4 < gap("uniform", 1.0)


def test_merge_runs_it_from_the_command_line_and_reports_it(tmp_path):
    import json

    from conftest import npz_file, vit_folder

    folders = [str(vit_folder(tmp_path / f"m{i}", seed=i)) for i in range(3)]
    out = tmp_path / "out"
    assert main(["merge", *folders, "-o", str(out), "--method", "average", "--match", "learned", "--align-data",
                 npz_file(tmp_path / "x.npz", n=20), "--learn-steps", "2", "--learn-dirichlet", "inf",
                 "--progress", "none"]) == 0
    learned = json.loads((out / "symmerge_report.json").read_text())["alignment"]["joint"]["learned"]
    assert learned["dirichlet"] == "uniform" and learned["weights_checked"] == 1 and learned["steps"] == 2
