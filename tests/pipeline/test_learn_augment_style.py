"""``--learn-augment VIEWS`` and ``--learn-augment-style flip-shift|strong|mixup`` (issue 42 item 3, N = 4): how
many transformed views of every unlabeled image the learned alignment adds, and how strongly they differ from it.
The flag, the config key and the API read the same; a bad value is one line. Shown against brute force: the default
views are today's (a flip and a shift of up to 2 pixels, redrawn apart from the same seed); every ``strong`` view is
a flip and a shift of up to 4 pixels of its image with at most one rectangle set to the image's minimum (searched
over every flip and shift), shifts of 3 or 4 pixels and cut-outs both occur; every ``mixup`` view is λ·X_i +
(1 − λ)·X_j of two flip-shift views, λ in [½, 1] (solved for). The pair, the one-sided joint and the dual joint paths
all build their views with the settings' style (spied), and every moved model keeps its function."""

from __future__ import annotations

import pytest
import torch
import yaml

from conftest import make_inputs, output_rel_diff
from factories import make_model
from symmerge.cli import main
from symmerge.commands.config_options import parser
from symmerge.errors import SymmergeError
from symmerge.io.data import Batch
from symmerge.options.build import learn_settings
from symmerge.pipeline import learn
from symmerge.pipeline.joint import align_joint
from symmerge.pipeline.options import AUGMENT_STYLES, AlignOptions, LearnSettings
from test_learn import FULL, unlabeled
from test_learn_dirichlet_uniform import BASE, _from_key

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("style, views", [("strong", 8), ("mixup", 0), ("flip-shift", 2)])
def test_the_flags_the_keys_and_the_api_read_the_same(tmp_path, style, views):
    flags = ["--learn-augment-style", style, "--learn-augment", str(views)]
    from_flag = learn_settings(parser("merge").parse_args(BASE + flags))
    from_key = learn_settings(_from_key(tmp_path, {"learn_augment_style": style, "learn_augment": views}))
    assert from_flag == from_key == LearnSettings(augment_style=style, augment=views)
    assert (from_flag.augment_style, from_flag.augment) == (style, views)
    assert LearnSettings().augment_style == "flip-shift" and LearnSettings().augment == 4  # the defaults unchanged


BAD = [(["--learn-augment-style", "wild"], "argument --learn-augment-style: invalid choice: 'wild'"),
       (["--learn-augment", "-1"], "argument --learn-augment: must be >= 0, got -1"),
       (["--learn-augment", "two"], "argument --learn-augment: invalid int value: 'two'")]


@pytest.mark.parametrize("flags, line", BAD)
def test_a_bad_value_is_one_line_from_a_flag_and_a_key_and_an_error_from_the_api(tmp_path, capsys, flags, line):
    with pytest.raises(SymmergeError, match="augment"):
        LearnSettings(augment_style="wild") if "style" in flags[0] else LearnSettings(augment=-1)
    data = tmp_path / "d.npz"
    data.write_bytes(b"")  # only its existence is checked before the options
    out = tmp_path / "out"
    argv = ["merge", "m1", "m2", "m3", "-o", str(out), "--method", "average", "--match", "learned",
            "--align-data", str(data), *flags]
    if line.startswith("argument"):  # argparse's one error line, exit 2
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert len(err.splitlines()) == 1 and err.startswith("symmerge merge: error: " + line), err
    else:
        assert main(argv) == 2
        assert capsys.readouterr().err == line + "\n"
    assert not out.exists()
    key = flags[0][2:].replace("-", "_")
    value = int(flags[1]) if flags[1].lstrip("-").isdigit() else flags[1]
    cfg = tmp_path / "c.yml"
    cfg.write_text(yaml.safe_dump({"merge_method": "average", "models": ["m1", "m2", "m3"], "match": "learned",
                                   "align_data": str(data), key: value}, sort_keys=False))
    assert main(["run", str(cfg), str(out)]) == 2
    err = capsys.readouterr().err
    last = err.splitlines()[-1]
    assert last.startswith("symmerge: error: ") and key.split("_")[-1] in last and "Traceback" not in err
    assert not out.exists()


def _images(n: int = 48, side: int = 14, seed: int = 0) -> torch.Tensor:
    """Images with a background of -1 and random content in the middle: no two shifts or flips alike."""
    g = torch.Generator().manual_seed(seed)
    x = torch.full((n, 1, side, side), -1.0)
    x[:, :, 3:-3, 3:-3] = torch.rand(n, 1, side - 6, side - 6, generator=g) * 2 - 1
    return x


def _views(x, style: str, views: int = 1, seed: int = 3) -> list[torch.Tensor]:
    batches = [Batch({"pixel_values": x}, None)]
    return [b.inputs["pixel_values"] for b in learn.augmented(batches, views, torch.Generator().manual_seed(seed),
                                                              style)]


def _moves(xi: torch.Tensor, reach: int):
    for flip in (False, True):
        base = xi.flip(-1) if flip else xi
        for dy in range(-reach, reach + 1):
            for dx in range(-reach, reach + 1):
                yield (flip, dy, dx), torch.roll(base, (dy, dx), dims=(-2, -1))


def test_the_default_views_are_todays_flips_and_shifts_of_up_to_two_pixels():
    x = _images()
    got = _views(x, "flip-shift", views=2)
    g = torch.Generator().manual_seed(3)
    for view in got:  # today's rule, written apart: the same draws in the same order
        flip = torch.rand(len(x), generator=g) < 0.5
        shifts = torch.randint(-2, 3, (len(x), 2), generator=g)
        for i in range(len(x)):
            xi = x[i].flip(-1) if flip[i] else x[i]
            assert torch.equal(view[i], torch.roll(xi, tuple(int(s) for s in shifts[i]), dims=(-2, -1)))
    assert torch.equal(got[0], _views(x, "flip-shift")[0])  # the default style is flip-shift
    batches = [Batch({"pixel_values": x}, None)]
    assert torch.equal(learn.augmented(batches, 1, torch.Generator().manual_seed(3))[0].inputs["pixel_values"],
                       got[0])


def test_strong_views_shift_by_up_to_four_pixels_and_cut_out_one_rectangle_of_background():
    x = _images()
    (view,) = _views(x, "strong")
    reaches, cut = [], 0
    for i in range(len(x)):
        found = None
        for (flip, dy, dx), moved in _moves(x[i], 4):
            off = view[i] != moved
            if not off.any():
                found = (max(abs(dy), abs(dx)), False)
                break
            rows, cols = off[0].any(1).nonzero().flatten(), off[0].any(0).nonzero().flatten()
            box = view[i][:, rows.min():rows.max() + 1, cols.min():cols.max() + 1]
            if torch.all(box == x[i].min()) and box.shape[-1] <= 14 // 3 and box.shape[-2] <= 14 // 3:
                found = (max(abs(dy), abs(dx)), True)
                break
        assert found is not None, f"view {i} is no flip, shift and cut-out of its image"
        reaches.append(found[0])
        cut += found[1]
    assert max(reaches) >= 3 and 0 < cut < len(x)  # larger shifts than flip-shift's, and cut-outs, on ~½ the images
    plain = _views(x, "flip-shift")[0]
    assert not torch.equal(plain, view)


def test_mixup_views_mix_each_flip_shift_view_with_another_image_of_the_batch():
    x = _images()
    (view,) = _views(x, "mixup")
    plain = _views(x, "flip-shift")[0]  # the same draws first: the views before mixing
    partners, lams = [], []
    for i in range(len(x)):
        best = None
        for j in range(len(x)):
            d = plain[i] - plain[j]
            if j == i:
                residual, lam = float((view[i] - plain[i]).abs().max()), 1.0
            else:
                lam = float(((view[i] - plain[j]) * d).sum() / (d * d).sum())
                residual = float((view[i] - plain[j] - lam * d).abs().max())
            if best is None or residual < best[0]:
                best = (residual, j, lam)
        assert best[0] <= 1e-5 and 0.5 - 1e-6 <= best[2] <= 1 + 1e-6
        partners.append(best[1])
        lams.append(best[2])
    assert sorted(partners) == list(range(len(x)))  # a permutation of the batch
    assert max(lams) - min(lams) > 0.2 and (view - plain).abs().max() > 0.1  # really mixed, λ drawn


def _spy(monkeypatch, module) -> list:
    seen = []
    real = learn.augmented

    def spy(batches, views, generator, style="flip-shift"):
        seen.append((views, style))
        return real(batches, views, generator, style)

    monkeypatch.setattr(module, "augmented", spy)
    return seen


@pytest.mark.parametrize("frame", ["one-sided", "dual"])
def test_the_joint_paths_learn_on_the_styled_views_and_every_model_keeps_its_function(monkeypatch, frame):
    models = [make_model("vit", head=True, seed=s, dtype=torch.float32) for s in range(3)]
    data = unlabeled(models[0], n_batches=1)
    seen = _spy(monkeypatch, learn)  # both joint paths draw their views through learn.prepared_batches
    settings = dict(steps=3, batch=8, lr=0.01, check_every=100, patience=100, frame=frame, dirichlet="uniform")
    runs = {style: align_joint(models, AlignOptions(symmetries=FULL, match="learned", align_data=data,
                                                    learn=LearnSettings(**settings, augment=2, augment_style=style)))
            for style in ("strong", "flip-shift")}
    assert seen == [(2, "strong"), (2, "flip-shift")]
    inputs = make_inputs(models[0])
    for result in runs.values():
        assert all(output_rel_diff(m, x, inputs) <= 1e-5 for m, x in zip(models, result.models))
        assert all(m["verify_max_rel_diff"] <= 1e-5 for m in result.report["models"])
    keys = [k for k, v in models[1].state_dict().items() if v.is_floating_point()]
    gap = max(float((runs["strong"].models[1].state_dict()[k] - runs["flip-shift"].models[1].state_dict()[k])
                    .abs().max()) for k in keys)
    assert gap > 1e-6  # other views, other elements


def test_the_pair_path_builds_its_views_with_the_style_too(monkeypatch):
    from symmerge.pipeline.align import align_pair

    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=3)
    seen = _spy(monkeypatch, learn)
    settings = LearnSettings(steps=2, batch=8, check_every=100, augment=1, augment_style="mixup")
    align_pair(a, b, AlignOptions(symmetries=FULL, match="learned", align_data=unlabeled(a, n_batches=1),
                                  learn=settings))
    assert seen == [(1, "mixup")]
    assert set(AUGMENT_STYLES) == {"flip-shift", "strong", "mixup"}
