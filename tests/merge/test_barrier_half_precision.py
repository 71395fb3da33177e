"""``barrier`` of bfloat16 (or float16) models: the interpolated weights and every forward pass were rounded to the
half dtype, so the barrier of two fine-tunes (a few thousandths of a nat) sat at that rounding's level. The study
now interpolates and evaluates float32 copies (the stored weights exactly) and says so in ``working_copies``; the
models given to the API are left as they are. Float32 models are studied as before, with no entry."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import npz_file, run_cli, vit_folder

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import ViTForImageClassification

    root = tmp_path_factory.mktemp("half")
    out = []
    for seed in (0, 1):
        folder = vit_folder(root / f"f{seed}", seed)
        model = ViTForImageClassification.from_pretrained(str(folder))
        model.to(torch.bfloat16).save_pretrained(root / f"h{seed}")
        out.append(root / f"h{seed}")
    return root, out, npz_file(root / "d.npz", n=24)


def _float32_curve(folders, data, alphas):
    from symmerge.evaluate.metrics import interpolation_curve
    from symmerge.io.data import load_data
    from symmerge.io.model import load_model

    a, b = (load_model(f, spec=False).float() for f in folders)
    return interpolation_curve(a, b, load_data(data, a), alphas, progress=False)["loss"]


def test_half_models_are_studied_in_float32_and_the_report_says_so(pair, tmp_path):
    root, (a, b), data = pair
    out = tmp_path / "out"
    assert run_cli("barrier", a, b, "--data", data, "--align", "none", "--points", "5", "--progress", "none",
                   "-o", out) == 0
    report = json.loads((out / "barrier.json").read_text())
    assert report["working_copies"]["dtype"] == "float32"
    assert report["working_copies"]["stored"] == ["bfloat16", "bfloat16"]
    expected = _float32_curve((a, b), data, report["alphas"])
    assert report["curves"]["none"]["loss"] == pytest.approx(expected, rel=1e-6, abs=1e-7)


def test_the_api_leaves_the_given_models_in_their_dtype(pair):
    from symmerge.io.model import load_model
    from symmerge.merge.barrier import barrier_study

    root, (a, b), data = pair
    ma, mb = load_model(a, spec=False), load_model(b, spec=False)
    result = barrier_study(ma, mb, data, aligns=("none",), points=3, progress=False)
    assert result["working_copies"]["stored"] == ["bfloat16", "bfloat16"]
    assert ma.dtype == mb.dtype == torch.bfloat16


def test_three_half_models_too_and_float32_models_get_no_entry(pair, tmp_path):
    from symmerge.merge.barrier import barrier_many, barrier_study

    root, (a, b), data = pair
    many = barrier_many([a, b, a], data, aligns=("none",), points=3, progress=False)
    assert many["working_copies"]["stored"] == ["bfloat16"] * 3
    plain = barrier_study(root / "f0", root / "f1", data, aligns=("none",), points=3, progress=False)
    assert "working_copies" not in plain
