"""Dual (shared-frame) learned alignment: the norm split is exactly function-preserving on real HF classes
(fp64, random configs), every dual step moves both models exactly, both written models verify against their
originals, the learned result never ends worse than its start, and the split adds what no one-sided map can."""

from __future__ import annotations

import pytest
import torch

from conftest import make_inputs, output_rel_diff, spy_forwards, with_weights
from factories import RMSNORM, make_model
from symmerge.cli import main
from symmerge.core.apply import apply, canonicalize
from symmerge.errors import SymmergeError
from symmerge.pipeline.align import align_pair, instances_for
from symmerge.pipeline.dual import Interpolation, can_shift, learn_dual, split_norms, stream_folds
from symmerge.pipeline.learn_joint import Mixture
from symmerge.pipeline.options import AlignOptions, LearnSettings
from test_learn import FULL, unlabeled

pytestmark = pytest.mark.usefixtures("single_thread")
FAMILIES = ["vit", "gpt2", "llama", "phi3"]


def canonical(model):
    _, instances = instances_for(model)
    wide = [i for i in instances if not i.kind.per_layer]
    return instances, canonicalize(model.state_dict(), wide)


def random_split(folds, sd, seed: int, spread: float = 0.5):
    g = torch.Generator().manual_seed(seed)
    scales, shifts = [], []
    for f in folds:
        d = sd[f.weight].shape[0]
        scales.append(torch.exp(spread * torch.randn(d, generator=g, dtype=torch.float64)))
        shifts.append(torch.randn(d, generator=g, dtype=torch.float64) if can_shift(f, sd) else None)
    return scales, shifts


@pytest.mark.parametrize("family", FAMILIES)
def test_norm_split_is_exactly_function_preserving(family, request):
    if family in RMSNORM:
        request.getfixturevalue("fp64_rmsnorm")
    a = make_model(family, head=True, seed=0)  # float64, random config of the real transformers class
    instances, ca = canonical(a)
    folds = stream_folds(instances)
    assert folds, f"{family}: no folded norm"
    scales, shifts = random_split(folds, ca, seed=1)
    moved = {**ca, **split_norms(ca, folds, scales, shifts)}
    changed = [k for k in ca if not torch.equal(moved[k], ca[k])]
    assert any(f.weight in changed for f in folds)  # the norms themselves now carry per-coordinate scales
    inputs = make_inputs(a)
    assert output_rel_diff(a, with_weights(a, ca), inputs) <= 1e-10
    assert output_rel_diff(a, with_weights(a, moved), inputs) <= 1e-10
    broken = {**moved, folds[0].weight: moved[folds[0].weight] * 1.5}  # the test can fail: a lone norm change
    assert output_rel_diff(a, with_weights(a, broken), inputs) > 1e-3


def test_a_tied_reader_keeps_its_norm():
    # GPT-2's final norm feeds the LM head, tied to the embeddings: it cannot fold, so it gets no split (with
    # a non-uniform final norm the stream keeps its permutation group and no norm folds at all; --untie frees it)
    tied = make_model("gpt2", head=True, seed=0, tied=True)
    untied = make_model("gpt2", head=True, seed=0, tied=False)
    assert not any(f.weight.startswith("transformer.ln_f") for f in stream_folds(canonical(tied)[0]))
    assert any(f.weight.startswith("transformer.ln_f") for f in stream_folds(canonical(untied)[0]))


@pytest.mark.parametrize("family", ["vit", "gpt2"])
def test_every_dual_step_moves_both_models_exactly(family):
    a, b = make_model(family, head=True, seed=0), make_model(family, head=True, seed=3)
    instances, ca = canonical(a)
    _, cb = canonical(b)
    settings = LearnSettings(steps=5, batch=8, lr=0.05, check_every=2, patience=100)
    options = AlignOptions(symmetries=FULL)
    data = unlabeled(a)
    inputs = make_inputs(a)
    seen = []

    def on_step(step, sides):
        assert len(sides) == 2
        for side, sd, model in zip(sides, (ca, cb), (a, b)):
            moved = side.split.final(apply(sd, instances, side.params.elements()))
            assert any(not torch.equal(moved[k], sd[k]) for k in sd)  # this side moved
            assert output_rel_diff(model, with_weights(model, moved), inputs) <= 1e-9
        seen.append(step)

    sides, info = learn_dual(instances, a, [ca, cb], data, settings, options.solver_options(),
                             {"norm_eps": 1e-5}, on_step=on_step)
    assert seen == list(range(5)) and info["models_moved"] == 2 and info["norm_splits"] > 0
    assert info["held_out_best"] <= info["held_out_start"] + 1e-12


def test_dual_alignment_learns_and_both_models_verify():
    a, b = (make_model("vit", head=True, seed=s, dtype=torch.float32) for s in (0, 3))
    data = unlabeled(a, n_batches=6, batch=16)
    learn = LearnSettings(steps=30, batch=16, lr=0.05, check_every=5, patience=100, holdout=0.2, frame="dual")
    result = align_pair(a, b, AlignOptions(symmetries=FULL, match="learned", align_data=data, learn=learn))
    r = result.report
    assert r["frame"] == "dual" and r["match"] == "learned" and r["align_samples_used"] == 96
    assert r["learned"]["held_out_best"] < r["learned"]["held_out_start"]
    assert r["learned"]["learned_instances_anchor"] > 0  # B moved too
    assert r["verify_max_rel_diff"] <= 1e-4 and r["verify_anchor_max_rel_diff"] <= 1e-4
    inputs = make_inputs(a)
    assert output_rel_diff(a, result.model, inputs) <= 1e-4
    assert output_rel_diff(b, result.anchor, inputs) <= 1e-4
    ka = next(k for k in b.state_dict() if k.endswith("layernorm_before.weight"))
    assert not torch.allclose(result.anchor.state_dict()[ka], b.state_dict()[ka])  # B's norm now split


def test_the_split_reaches_a_midpoint_no_one_sided_map_does():
    """With both norms split, the midpoint's folded reader is mean(W_A / s_A) ⊙ mean(s): not a mean of folded
    readers. Checked on the objective: random splits change the midpoint's function (so learning them can
    change the merge), while moving B alone by a linear group element does not change what the one-sided
    midpoint can reach (α·g θ_A + (1 − α)·θ_B up to g_B)."""
    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=3)
    instances, ca = canonical(a)
    _, cb = canonical(b)
    folds = stream_folds(instances)
    data = unlabeled(a, n_batches=1)
    mix = Interpolation(a, [ca, cb], "probabilities")
    batch = data.batches[0]
    p = mix.predictions(batch)
    w = torch.tensor([0.5, 0.5])
    plain = mix.loss(w, [{}, {}], batch, p).item()
    sa, ea = random_split(folds, ca, seed=5)
    sb, eb = random_split(folds, cb, seed=6)
    wa, wb = mix.work  # float32

    def f32(values):
        return [v if v is None else v.float() for v in values]

    split = [split_norms(wa, folds, f32(sa), f32(ea)), split_norms(wb, folds, f32(sb), f32(eb))]
    assert abs(mix.loss(w, split, batch, p).item() - plain) > 1e-4  # the midpoint's function changed
    # the same split on both sides is a split of the midpoint itself: the midpoint's function is unchanged
    same = [split_norms(wa, folds, f32(sa), f32(ea)), split_norms(wb, folds, f32(sa), f32(ea))]
    assert abs(mix.loss(w, same, batch, p).item() - plain) < 1e-5


def test_dual_frame_is_validated_and_refuses_layerwise():
    with pytest.raises(SymmergeError, match="frame"):
        LearnSettings(frame="both")
    a, b = (make_model("vit", head=True, seed=s, dtype=torch.float32) for s in (0, 3))
    learn = LearnSettings(steps=2, frame="dual", layerwise=True)
    with pytest.raises(SymmergeError, match="layer-wise"):
        align_pair(a, b, AlignOptions(symmetries=FULL, match="learned", align_data=unlabeled(a), learn=learn))


def test_cli_learn_frame_needs_match_learned(tmp_path, capsys):
    a, b = (make_model("vit", head=True, seed=s, dtype=torch.float32) for s in (0, 3))
    for m, name in ((a, "a"), (b, "b")):
        m.save_pretrained(tmp_path / name)
    out = tmp_path / "out"
    code = main(["align", str(tmp_path / "a"), str(tmp_path / "b"), "-o", str(out), "--learn-frame", "dual"])
    err = capsys.readouterr().err
    assert code == 2 and "--learn-frame" in err and "symmerge: error:" in err and not out.exists()


def test_cli_merge_in_the_dual_frame(tmp_path):
    """symmerge merge --learn-frame dual merges both moved models, not A with the unmoved anchor. The check:
    the midpoint's loss depends on a norm's shifts only through α·e_A + (1 − α)·e_B in the norm and
    −(α·W_A e_A + (1 − α)·W_B e_B) in its readers' biases, so the gradients of e_A and e_B are opposite and
    Adam keeps e_B = −e_A from zero: the merged norm bias is ½(e_A + e_B) ≈ 0 with both moved, ½·e_A with the
    anchor left as it was."""
    import json

    from conftest import npz_file, vit_folder
    from transformers import ViTForImageClassification

    a, b = vit_folder(tmp_path / "a", seed=0), vit_folder(tmp_path / "b", seed=1)
    data = npz_file(tmp_path / "x.npz", n=40)
    out = tmp_path / "out"
    code = main(["merge", str(a), str(b), "-o", str(out), "--method", "linear", "--match", "learned", "--learn-frame",
                 "dual", "--align-data", data, "--learn-steps", "40", "--learn-batch", "10", "--progress", "none"])
    assert code == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    learned = next(m["learned"] for m in report["alignment"]["models"] if "learned" in m)
    assert learned["frame"] == "dual" and learned["held_out_best"] < learned["held_out_start"]
    assert learned["norm_split_b"]["scale_max"] > 1.001  # B's norms were split
    merged = ViTForImageClassification.from_pretrained(out).state_dict()
    folded = ViTForImageClassification.from_pretrained(a).state_dict()
    norms = [k for k in merged if k.endswith(("layernorm_before.bias", "layernorm_after.bias"))]
    assert norms and all(merged[k].abs().max() < 1e-5 for k in norms)
    assert any(merged[k.replace("bias", "weight")].sub(1).abs().max() > 1e-3 for k in norms)
    assert all(not torch.equal(merged[k], folded[k]) for k in norms)


def test_the_star_refuses_the_dual_frame(tmp_path):
    # more than two models: the dual frame runs jointly (tests/pipeline/test_dual_joint.py); the star would move
    # the anchor once per pair
    from conftest import npz_file, vit_folder

    folders = [str(vit_folder(tmp_path / f"m{i}", seed=i)) for i in range(3)]
    data = npz_file(tmp_path / "x.npz", n=20)
    out = tmp_path / "out"
    code = main(["merge", *folders, "-o", str(out), "--method", "linear", "--match", "learned", "--learn-frame", "dual",
                 "--align-data", data, "--learn-steps", "2", "--progress", "none", "--anchor", "0"])
    assert code == 2 and not out.exists()


def test_align_refuses_the_dual_frame(tmp_path, capsys):
    from conftest import npz_file, vit_folder

    a, b = vit_folder(tmp_path / "a", seed=0), vit_folder(tmp_path / "b", seed=1)
    out = tmp_path / "out"
    code = main(["align", str(a), str(b), "-o", str(out), "--match", "learned", "--learn-frame", "dual",
                 "--align-data", npz_file(tmp_path / "x.npz"), "--progress", "none"])
    err = capsys.readouterr().err
    assert code == 2 and "symmerge: error: --learn-frame dual moves the anchor too" in err and not out.exists()


@pytest.mark.parametrize("target", ["probabilities", "log-probabilities"])
def test_interpolation_agrees_with_the_joint_mixture(target):
    # dual.Interpolation is its own small copy of learn_joint.Mixture (an import cycle forbids the reuse): the
    # same loss for the same models, weights, changes and batch, and the same check points
    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=3)
    instances, ca = canonical(a)
    _, cb = canonical(b)
    batch = unlabeled(a, n_batches=1).batches[0]
    ours, theirs = Interpolation(a, [ca, cb], target), Mixture(a, [ca, cb], 0, target)
    key = next(k for k in ca if k.endswith("layernorm_before.weight"))
    changed = [{key: ours.work[0][key] * 1.3}, {}]
    for w in (torch.tensor([0.5, 0.5]), torch.tensor([0.8, 0.2])):
        p = ours.predictions(batch)
        torch.testing.assert_close(p, theirs.predictions(batch))
        assert ours.loss(w, changed, batch, p).item() == pytest.approx(theirs.loss(w, changed, batch, p).item(),
                                                                       rel=1e-6)
    from symmerge.pipeline import dual, mixture

    # one name for one function: the dual loop's check points are the mixture's, under the mixture's name
    assert dual.check_points is mixture.check_points and not hasattr(dual, "check_weights")


@pytest.mark.parametrize("precision", ["bfloat16", "float32"])
def test_dual_steps_honour_precision_and_check_batches(precision, monkeypatch):
    """``--learn-precision`` and ``--learn-check-batches`` in the dual frame, as in the one-sided path: with
    bfloat16 every step's forward and the models' predictions run under bf16 autocast and the checks in float32;
    the checks (α = ½, ¾, ¼ at the start and the end) run on the first ``check_batches`` batches only; the two
    moved models are still exactly A's and B's functions. (Before, the dual loop ignored both settings.)"""
    import symmerge.pipeline.dual as dual

    a, b = (make_model("llama", head=True, seed=s, dtype=torch.float32) for s in (0, 3))
    data = unlabeled(a, n_batches=4, batch=8)
    calls = spy_forwards(monkeypatch, dual, "head_forward")  # (gradient on, autocast on) of every forward
    learn = LearnSettings(steps=5, batch=8, lr=0.05, frame="dual", precision=precision, check_batches=1)
    result = align_pair(a, b, AlignOptions(symmetries=FULL, match="learned", align_data=data, learn=learn))
    fast = precision == "bfloat16"
    steps = [c for c in calls if c[0]]
    predictions, checks = calls[:8], [c for c in calls[8:] if not c[0]]  # 4 batches × 2 models, then the checks
    assert len(steps) == 5 and all(auto == fast for _, auto in steps)
    assert all(auto == fast and not grad for grad, auto in predictions)
    assert len(checks) == 3 * 1 * 2 and not any(auto for _, auto in checks)  # 3 points × 1 batch × start, end
    r = result.report
    assert r["learned"]["precision"] == precision and r["learned"]["checked_on"].endswith("its first 1 batches")
    assert r["learned"]["held_out_best"] <= r["learned"]["held_out_start"]
    assert r["verify_max_rel_diff"] <= 1e-4 and r["verify_anchor_max_rel_diff"] <= 1e-4
    inputs = make_inputs(a)
    assert output_rel_diff(a, result.model, inputs) <= 1e-4 and output_rel_diff(b, result.anchor, inputs) <= 1e-4


def test_a_file_and_the_data_it_reads_to_give_one_dual_alignment(tmp_path):
    """The dual frame's closed-form start takes its statistics on the batches the learning reads (the learned
    ``max_length`` and batch), as the one-sided path does: ``--align-data FILE`` and the Data that file reads to
    (what ``symmerge barrier`` passes) give the same alignment. Before, a file was read again for the start with the
    activation matcher's settings (whole lines, another batch), and the two entry points started apart."""
    from learned_pair import save_pair
    from symmerge.io.model import load_model
    from symmerge.pipeline.data import load_align_data

    _, lines = save_pair(tmp_path, "llama")
    folders = [str(tmp_path / "a"), str(tmp_path / "b")]
    a = load_model(folders[0])
    learn = LearnSettings(steps=3, batch=4, lr=0.05, check_every=1, patience=100, frame="dual", max_length=4)
    options = AlignOptions(symmetries="heads,attn,ffn,rescale,residual", match="learned", align_data=str(lines),
                           align_samples=16, learn=learn)
    from_file = align_pair(*folders, options)
    data = load_align_data(options, a, sources=[a])
    assert max(b.inputs["input_ids"].shape[1] for b in data.batches) <= 4  # the lines are cut for the learning
    from_data = align_pair(*folders, options.with_(align_data=data))
    assert from_file.report["learned"]["held_out_start"] == from_data.report["learned"]["held_out_start"]
    for moved_file, moved_data in ((from_file.model, from_data.model), (from_file.anchor, from_data.anchor)):
        sd_file, sd_data = moved_file.state_dict(), moved_data.state_dict()
        assert all(torch.equal(sd_file[k], sd_data[k]) for k in sd_file)
    assert from_file.report["verify_max_rel_diff"] <= 1e-5
