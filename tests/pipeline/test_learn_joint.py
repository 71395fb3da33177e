"""Learned joint alignment of N models (symmerge.pipeline.learn_joint): disguised copies come back into
one frame, every model's result is an exact element of its groups (its function kept, fp64), N = 2
is the pairwise objective at w = (α, 1 − α), and the matcher runs through the registry (merge and the
CLI default to it for more than two models)."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import make_inputs, output_rel_diff, spy_forwards, sq_dist, with_weights
from factories import RMSNORM, disguised, make_model
from test_learn import unlabeled
from symmerge.core.apply import apply, canonicalize
from symmerge.errors import SymmergeError
from symmerge.pipeline.align import instances_for
from symmerge.pipeline.joint import JOINT_MATCHES, align_joint
from symmerge.pipeline.learn_joint import Mixture, check_points, learn_mixture
from symmerge.pipeline.matchers import MATCHERS
from symmerge.pipeline.options import AlignOptions, LearnSettings

pytestmark = pytest.mark.usefixtures("single_thread")
FULL = "heads,attn,ffn,rescale,residual"


def _params(model) -> list[str]:
    return [k for k, _ in model.named_parameters()]


def _settings(**kw) -> LearnSettings:
    return LearnSettings(**{"steps": 8, "batch": 8, "lr": 0.05, "check_every": 4, "patience": 100, "augment": 0,
                            **kw})


def test_learned_is_a_joint_matcher_of_the_registry():
    assert "learned" in MATCHERS and "learned" in JOINT_MATCHES


def test_disguised_copies_come_back_into_one_frame():
    anchor = make_model("vit", head=True)
    copies = [disguised(anchor, ("heads", "attn", "ffn", "rescale", "residual"), seed=10 + s, noise=0.01)
              for s in range(3)]
    models, noise = [c[0] for c in copies], [c[1] for c in copies]
    options = AlignOptions(symmetries=FULL, match="learned", align_data=unlabeled(anchor), learn=_settings())
    result = align_joint(models, options, inputs=make_inputs(anchor))
    report = result.report
    assert report["match"] == "learned" and report["learned"]["models_learned"] == 2
    assert report["learned"]["held_out_best"] <= report["learned"]["held_out_start"] + 1e-12
    for i, j in itertools.combinations(range(3), 2):
        d = sq_dist(result.models[i].state_dict(), result.models[j].state_dict(), _params(result.models[i])) ** 0.5
        d0 = sq_dist(models[i].state_dict(), models[j].state_dict(), _params(models[i])) ** 0.5
        assert d <= 1.5 * (noise[i] ** 2 + noise[j] ** 2) ** 0.5, (i, j, d)
        assert d0 > 10 * d
    inputs = make_inputs(anchor)
    for x, y in zip(models, result.models):
        assert output_rel_diff(x, y, inputs) <= 1e-9
    assert all(m["verify_max_rel_diff"] <= 1e-9 for m in report["models"])


@pytest.mark.parametrize("family", ["vit", "llama", "gpt2"])
def test_every_learned_element_is_exact_per_model(family, request):
    """Unrelated models (something to learn): at every step each model's learned deltas alone, rounded
    to group elements in float64, keep its function; the frame model learns nothing."""
    if family in RMSNORM:
        request.getfixturevalue("fp64_rmsnorm")
    models = [make_model(family, head=True, seed=s) for s in range(3)]
    _, instances = instances_for(models[0])
    inputs = make_inputs(models[0])
    wide = [i for i in instances if not i.kind.per_layer]
    sds = [canonicalize(m.state_dict(), wide) for m in models]  # norms folded: the stream's group acts there
    checked = []

    def on_step(step, params):
        assert params[1] is None
        for i in (0, 2):
            learned = params[i].elements()
            assert learned
            moved = apply(sds[i], instances, learned)
            assert any(not torch.equal(moved[k], sds[i][k]) for k in sds[i])
            assert output_rel_diff(models[i], with_weights(models[i], moved), inputs) <= 1e-10
        checked.append(step)

    options = AlignOptions(symmetries=FULL)
    elements, info = learn_mixture(instances, models[1], sds, 1, unlabeled(models[0]), _settings(steps=4, check_every=2),
                                   options.solver_options(), {"norm_eps": 1e-5}, on_step=on_step)
    assert checked == [0, 1, 2, 3] and elements[1] == {} and elements[0] and elements[2]
    assert info["held_out_best"] <= info["held_out_start"] + 1e-12
    for i in (0, 2):
        final = with_weights(models[i], apply(sds[i], instances, elements[i]))
        assert output_rel_diff(models[i], final, inputs) <= 1e-10


def test_the_learned_joint_alignment_lowers_its_objective_and_verifies_fp32():
    models = [make_model("vit", head=True, seed=s, dtype=torch.float32) for s in range(3)]
    data = unlabeled(models[0], n_batches=6, batch=16)
    options = AlignOptions(symmetries=FULL, match="learned", align_data=data,
                           learn=_settings(steps=30, batch=16, check_every=5, holdout=0.2))
    result = align_joint(models, options, anchor=2)
    learned = result.report["learned"]
    assert learned["held_out_best"] < learned["held_out_start"] and learned["history"]["held_out"]
    assert result.report["anchor_index"] == 2 and result.report["align_samples_used"] == 96
    assert all(m["verify_max_rel_diff"] <= 1e-4 for m in result.report["models"])
    assert torch.equal(result.models[2].state_dict()["classifier.weight"],
                       align_joint(models, options.with_(match="activations"), anchor=2).models[2]
                       .state_dict()["classifier.weight"])  # the frame model is the closed form's


def test_two_models_are_the_pairwise_objective():
    """N = 2 at w = (α, 1 − α): the loss of α·θ_A + (1 − α)·θ_B against the normalised geometric mean
    softmax(α·log p_A + (1 − α)·log p_B) (or the mixed probabilities), computed here independently."""
    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=1)
    batch = unlabeled(a, n_batches=1, batch=8).batches[0]
    for target in ("log-probabilities", "probabilities"):
        mix = Mixture(a, [a.state_dict(), b.state_dict()], 1, target)
        predictions = mix.predictions(batch)
        for alpha in (0.2, 0.5, 0.9):
            got = mix.loss(torch.tensor([alpha, 1 - alpha]), [{}, {}], batch, predictions).item()
            sd = {k: alpha * v.float() + (1 - alpha) * b.state_dict()[k].float() if v.is_floating_point() else v
                  for k, v in a.state_dict().items()}
            with torch.no_grad():
                logp = torch.log_softmax(with_weights(a.float(), sd)(**batch.inputs).logits.float(), -1)
                la = torch.log_softmax(a.float()(**batch.inputs).logits, -1)
                lb = torch.log_softmax(b.float()(**batch.inputs).logits, -1)
            t = (torch.softmax(alpha * la + (1 - alpha) * lb, -1) if target == "log-probabilities"
                 else alpha * la.exp() + (1 - alpha) * lb.exp())
            assert got == pytest.approx(-(t * logp).sum(-1).mean().item(), rel=1e-5)
    w = check_points(2)
    assert [x.tolist() for x in w] == [[0.5, 0.5], [0.75, 0.25], [0.25, 0.75]]  # pairwise's α = ½, ¾, ¼


def test_two_models_learn_like_the_pairwise_alignment():
    """N = 2 jointly learned and pairwise learned from the same closed form: both lower the same kind
    of objective; the joint result's average is as close to its endpoints as the pairwise one's."""
    from symmerge.pipeline.align import align_pair

    a, b = (make_model("vit", head=True, seed=s, dtype=torch.float32) for s in (0, 3))
    data = unlabeled(a, n_batches=6, batch=16)
    options = AlignOptions(symmetries=FULL, match="learned", align_data=data,
                           learn=_settings(steps=40, batch=16, check_every=5))
    pair = align_pair(a, b, options)
    joint = align_joint([a, b], options, anchor=1, max_rounds=0)  # the star: the pairwise closed form
    pl, jl = pair.report["learned"], joint.report["learned"]
    assert pl["held_out_best"] < pl["held_out_start"] and jl["held_out_best"] < jl["held_out_start"]
    assert jl["held_out_start"] == pytest.approx(pl["held_out_start"], rel=1e-5)  # the same start and checks
    assert jl["held_out_best"] <= pl["held_out_best"] * 1.1


def test_merge_defaults_to_the_learned_joint_alignment_for_more_than_two_models(tmp_path):
    from symmerge.merge.fuse import merge_models

    models = [make_model("vit", head=True, seed=s, dtype=torch.float32) for s in range(3)]
    align = AlignOptions(symmetries="recommended", match="learned", align_data=unlabeled(models[0]),
                         learn=_settings(steps=4))
    _, report = merge_models(models, "average", align=align, progress=False, evaluate_result=False)
    joint = report["alignment"]["joint"]
    assert joint["match"] == "learned" and joint["learned"]["steps"] == 4
    _, star = merge_models(models, "average", align=align, progress=False, evaluate_result=False, joint=False)
    assert "joint" not in star["alignment"] and star["alignment"]["models"][0]["match"] == "learned"


def test_bad_learned_joint_calls_are_refused():
    models = [make_model("vit", head=True, seed=s) for s in range(3)]
    data = unlabeled(models[0])
    from symmerge.pipeline.learn_joint import align_joint_learned

    with pytest.raises(SymmergeError, match="concentration"):
        align_joint_learned(models, AlignOptions(symmetries=FULL, match="learned", align_data=data), concentration=0,
                            closed_form=align_joint)



def test_merge_cli_runs_the_learned_joint_alignment(tmp_path, capsys):
    """`merge M1 M2 M3 --match learned`: joint by default (the learned report in `alignment.joint`, every
    model verified); `--star` keeps the pairwise learned alignment to one anchor."""
    import json

    from conftest import npz_file, run_cli, vit_folder

    vits = [str(vit_folder(tmp_path / f"vit{s}", s)) for s in (0, 1, 2)]
    data = npz_file(tmp_path / "unlabeled.npz", n=24)
    common = ("--method", "average", "--align", "attn,ffn,rescale", "--match", "learned", "--align-data", data,
              "--learn-steps", "3")
    assert run_cli("merge", *vits, *common, "-o", tmp_path / "joint") == 0
    assert "learned joint alignment: 3 step(s)" in capsys.readouterr().out
    report = json.loads((tmp_path / "joint" / "symmerge_report.json").read_text())["alignment"]
    assert report["joint"]["match"] == "learned" and report["joint"]["learned"]["models_learned"] == 2
    assert all(m["verify_max_rel_diff"] <= 1e-4 for m in report["models"])
    assert run_cli("merge", *vits, *common, "--star", "-o", tmp_path / "star") == 0
    star = json.loads((tmp_path / "star" / "symmerge_report.json").read_text())["alignment"]
    assert "joint" not in star and [m["learned"]["steps"] for m in star["models"] if not m["anchor"]] == [3, 3]
    card = (tmp_path / "joint" / "README.md").read_text()
    assert "joint alignment into one frame" in card and "then learned (3 steps on 24 unlabeled examples" in card


def test_barrier_of_three_models_runs_the_learned_joint_alignment(tmp_path):
    """`barrier M1 M2 M3 --match learned`: the N-way average in the learned joint frame, every model
    verified (the variant's `joint` holds the learned report)."""
    import json

    from conftest import npz_file, run_cli, vit_folder

    vits = [str(vit_folder(tmp_path / f"vit{s}", s)) for s in (0, 1, 2)]
    data, unlabeled_file = npz_file(tmp_path / "eval.npz", n=24), npz_file(tmp_path / "u.npz", n=24, seed=1)
    assert run_cli("barrier", *vits, "--data", data, "--align", "attn,ffn,rescale", "--match", "learned",
                   "--align-data", unlabeled_file, "--learn-steps", "2", "--points", "3", "-o", tmp_path / "b") == 0
    variant = json.loads((tmp_path / "b" / "barrier.json").read_text())["variants"]["attn,ffn,rescale"]
    assert variant["joint"]["match"] == "learned" and variant["joint"]["learned"]["steps"] == 2
    assert variant["verify_max_rel_diff"] <= 1e-4 and len(variant["barrier_matrix"]) == 3


def test_the_dirichlet_concentration_comes_from_the_settings_and_the_cli():
    from symmerge.cli import build_parser
    from symmerge.commands.alignment_args import learn_settings

    args = build_parser().parse_args(["merge", "a", "b", "c", "-o", "out", "--method", "average", "--match", "learned",
                                      "--align-data", "x.npz", "--learn-dirichlet", "3"])
    assert learn_settings(args).dirichlet == 3.0
    assert LearnSettings().dirichlet == "auto"
    with pytest.raises(SymmergeError, match="Dirichlet concentration must be > 0"):
        LearnSettings(dirichlet=0)
    models = [make_model("vit", head=True, seed=s, dtype=torch.float32) for s in range(3)]
    data = unlabeled(models[0])
    options = AlignOptions(symmetries=FULL, match="learned", align_data=data,
                           learn=_settings(steps=2, dirichlet=3.0))
    result = align_joint(models, options)
    assert result.report["learned"]["dirichlet"] == 3.0


# ---------------------------------------------------------------- --learn-dirichlet auto: the held-out choice


def test_uniform_score_is_comparable_across_alignments():
    """The choice's criterion: N copies of one model score exactly the entropy of its predictions (the
    uniform average is the model; KL 0); disguised copies (the same function each, other frames) score
    higher unaligned, since their plain average is another function, and the same once aligned back."""
    from symmerge.pipeline.learn_joint import uniform_score

    anchor = make_model("vit", head=True, dtype=torch.float32)
    data = unlabeled(anchor)
    sd = anchor.state_dict()
    same = uniform_score(anchor, [sd, sd, sd], 0, "log-probabilities", data.batches)
    with torch.no_grad():
        p = [torch.softmax(anchor(**b.inputs).logits.float(), -1) for b in data.batches]
    entropy = sum(float(-(q * q.log()).sum(-1).mean()) for q in p) / len(p)
    assert same == pytest.approx(entropy, rel=1e-5)
    copies = [disguised(anchor, ("heads", "attn", "ffn", "rescale"), seed=20 + s)[0].float() for s in range(2)]
    mixed = uniform_score(anchor, [sd] + [c.state_dict() for c in copies], 0, "log-probabilities", data.batches)
    assert mixed > same + 1e-3


def test_auto_concentration_is_chosen_on_held_out_data_only(monkeypatch):
    """`dirichlet="auto"`: every candidate learns on the first batches only, the scores come from the
    held-out last batches, the lowest score wins, the final learning runs on all the data at the chosen
    concentration, and the whole choice is deterministic."""
    from symmerge.pipeline import learn_joint

    models = [make_model("vit", head=True, seed=s, dtype=torch.float32) for s in range(3)]
    data = unlabeled(models[0], n_batches=5)
    held = {id(b) for b in data.batches[-1:]}  # 20 % of 5 batches
    calls, scored = [], []
    real_learn, real_score = learn_joint.learn_mixture, learn_joint.uniform_score

    def spy_learn(*args, concentration, **kw):
        calls.append(([id(b) for b in args[4].batches], args[5].steps, concentration))
        return real_learn(*args, concentration=concentration, **kw)

    def spy_score(skeleton, sds, frame, target, batches):
        scored.append({id(b) for b in batches})
        return real_score(skeleton, sds, frame, target, batches)

    monkeypatch.setattr(learn_joint, "learn_mixture", spy_learn)
    monkeypatch.setattr(learn_joint, "uniform_score", spy_score)
    options = AlignOptions(symmetries="attn,ffn,rescale", match="learned", align_data=data,
                           learn=_settings(steps=6, dirichlet="auto", dirichlet_grid=(1.0, 30.0)))
    result = align_joint(models, options)
    choice = result.report["learned"]["dirichlet_choice"]
    assert [c[2] for c in calls] == [1.0, 30.0, choice["chosen"]] and [c[1] for c in calls] == [3, 3, 6]
    for ids, _, _ in calls[:2]:
        assert not held & set(ids) and len(ids) == 4
    assert calls[2][0] == [id(b) for b in data.batches]
    assert scored and all(s == held for s in scored)
    assert choice["fit_examples"] == 32 and choice["held_out_examples"] == 8 and choice["candidate_steps"] == 3
    scores = choice["held_out_uniform"]
    assert len(scores) == 2 and choice["chosen"] == (1.0, 30.0)[min(range(2), key=lambda i: (scores[i], i))]
    assert result.report["learned"]["dirichlet"] == choice["chosen"]
    again = align_joint(models, options).report["learned"]["dirichlet_choice"]
    assert again["held_out_uniform"] == scores and again["chosen"] == choice["chosen"]
    for x, y in zip(models, result.models):  # every model keeps its function
        assert output_rel_diff(x, y, make_inputs(models[0])) <= 1e-4


def test_auto_concentration_settings_and_flag():
    from symmerge.cli import build_parser
    from symmerge.commands.alignment_args import learn_settings

    args = build_parser().parse_args(["merge", "a", "b", "c", "-o", "out", "--method", "average", "--match", "learned",
                                      "--align-data", "x.npz", "--learn-dirichlet", "auto"])
    assert learn_settings(args).dirichlet == "auto"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["merge", "a", "b", "-o", "out", "--learn-dirichlet", "often"])
    for bad in ({"dirichlet": "often"}, {"dirichlet_grid": ()}, {"dirichlet_grid": (1.0, -2.0)},
                {"dirichlet_holdout": 0.0}, {"dirichlet_steps": -1}):
        with pytest.raises(SymmergeError):
            LearnSettings(**bad)
    models = [make_model("vit", head=True, seed=s, dtype=torch.float32) for s in range(3)]
    one_batch = unlabeled(models[0], n_batches=1)  # 8 images: the last 2 held out
    result = align_joint(models, AlignOptions(symmetries="attn,ffn,rescale", match="learned", align_data=one_batch,
                                              learn=_settings(steps=2)))  # auto is the default
    choice = result.report["learned"]["dirichlet_choice"]
    assert (choice["fit_examples"], choice["held_out_examples"]) == (6, 2) and choice["chosen"] in choice["grid"]
    with pytest.raises(SymmergeError, match="at least 2 examples"):
        align_joint(models, AlignOptions(symmetries="attn,ffn,rescale", match="learned",
                                         align_data=unlabeled(models[0], n_batches=1, batch=1),
                                         learn=_settings(steps=2, dirichlet="auto")))


# ---------------------------------------------------------------- --learn-precision / --learn-check-batches


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_joint_steps_honour_precision_and_check_batches(precision, monkeypatch):
    """``--learn-precision`` and ``--learn-check-batches`` in the one-sided joint path, as in the pair and dual
    paths: with bfloat16 every step's forward and the models' predictions run under bf16 autocast, the checks in
    float32; the checks run on the first ``check_batches`` batches only; every moved model still computes what it
    did. (Before, the joint path ignored both settings: float32 steps, every batch checked.)"""
    models = [make_model("vit", head=True, seed=s, dtype=torch.float32) for s in range(3)]
    data = unlabeled(models[0], n_batches=4, batch=8)
    calls = spy_forwards(monkeypatch, Mixture, "forward")  # (gradient on, autocast on) of every forward
    settings = _settings(steps=5, check_every=100, precision=precision, check_batches=1, dirichlet=1.0)
    result = align_joint(models, AlignOptions(symmetries=FULL, match="learned", align_data=data, learn=settings))
    fast = precision == "bfloat16"
    points = len(check_points(3, 1.0))
    steps = [c for c in calls if c[0]]
    predictions, checks = calls[:4 * 3], [c for c in calls[4 * 3:] if not c[0]]  # 4 batches × 3 models, then checks
    assert len(steps) == 5 and all(auto == fast for _, auto in steps)
    assert all(auto == fast and not grad for grad, auto in predictions)
    assert len(checks) == points * 1 * 2 and not any(auto for _, auto in checks)  # points × 1 batch × start, end
    learned = result.report["learned"]
    assert learned["precision"] == precision and learned["checked_on"].endswith("its first 1 batches")
    assert learned["held_out_best"] <= learned["held_out_start"]
    assert all(m["verify_max_rel_diff"] <= 1e-4 for m in result.report["models"])
    inputs = make_inputs(models[0])
    assert all(output_rel_diff(m, r, inputs) <= 1e-4 for m, r in zip(models, result.models))


def test_joint_float32_default_is_unchanged_by_the_shared_batches():
    """The one-sided joint path and the dual frame build their batches with one function
    (:func:`~symmerge.pipeline.learn.prepared_batches`); at the defaults (float32, every batch checked) the joint
    path's check set is the unaugmented training batches, named as before."""
    models = [make_model("vit", head=True, seed=s, dtype=torch.float32) for s in range(3)]
    data = unlabeled(models[0], n_batches=3, batch=8)
    result = align_joint(models, AlignOptions(symmetries=FULL, match="learned", align_data=data,
                                              learn=_settings(steps=2, dirichlet=1.0)))
    learned = result.report["learned"]
    assert learned["precision"] == "float32"
    assert learned["checked_on"] == "training images (no held-out part: start and end only)"
