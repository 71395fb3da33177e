"""``benchmarks.datafree_probes`` on two tiny random ViT classifiers: the priors' values on known inputs, the
probes (class-balanced, in the pixel range, more probable for their target after generation than the noise they
start from), and one learned alignment on them verified function-preserving. Seconds."""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

from benchmarks import datafree_probes as dp
from factories import make_model

pytestmark = pytest.mark.usefixtures("single_thread")


def _cfg(**kw):
    base = dict(probes=12, gen_batch=6, steps=60, lr=0.3, tv=0.0, l2=0.0, jitter=0, flip=False, target_prob=1.0,
                psaq=0.0, psaq_bandwidth=0.05, seed=0)
    return argparse.Namespace(**{**base, **kw})


@pytest.fixture(scope="module")
def pair():
    return tuple(make_model("vit", head=True, seed=s, dtype=torch.float32) for s in (0, 1))


def test_total_variation_is_zero_on_a_constant_image_and_counts_each_edge():
    x = torch.zeros(2, 1, 4, 4)
    assert torch.equal(dp.total_variation(x), torch.zeros(2))
    x[1, 0, :, 2:] = 1.0  # one vertical edge of height 4 in a 4x4 image: 4 of the 12 horizontal pairs differ
    assert dp.total_variation(x)[1].item() == pytest.approx(4 / 12)


def test_similarity_entropy_is_lower_when_every_patch_is_alike():
    g = torch.Generator().manual_seed(0)
    varied = torch.randn(3, 17, 16, generator=g)
    alike = torch.randn(3, 1, 16, generator=g).expand(3, 17, 16) + 0.01 * torch.randn(3, 17, 16, generator=g)
    assert (dp.similarity_entropy(alike, 0.05) < dp.similarity_entropy(varied, 0.05) - 1).all()


@pytest.mark.parametrize("extra", [{}, {"psaq": 0.1, "tv": 0.01, "l2": 0.001, "target_prob": 0.9}])
def test_probes_are_balanced_in_range_and_pushed_toward_their_class(pair, extra):
    a, b = pair
    cfg = _cfg(**extra)
    x, targets, rep = dp.generate([a, b], cfg, log=lambda *_: None)
    assert x.shape == (12, a.config.num_channels, a.config.image_size, a.config.image_size)
    assert torch.equal(torch.bincount(targets), torch.full((3,), 4))
    assert x.min() >= dp.LOW and x.max() <= dp.HIGH
    g = torch.Generator().manual_seed(cfg.seed)  # the same noise the generation started from
    noise = (torch.rand(x.shape, generator=g) - dp.PIXEL_MEAN) / dp.PIXEL_STD
    before = dp.quality([a, b], noise, targets)
    for name in "AB":
        assert rep[f"target_probability_{name}"] > before[f"target_probability_{name}"] + 0.05
    assert 0 <= rep["target_fraction_both"] <= min(rep["target_fraction_A"], rep["target_fraction_B"])
    assert rep["seconds"] > 0


def test_learned_alignment_on_the_probes_keeps_a_function(pair, tmp_path):
    from symmerge.demo.datasets import write_npz
    from symmerge.io.data import load_data

    a, b = pair
    x, _, _ = dp.generate([make_model("vit", head=True, seed=s, dtype=torch.float32) for s in (0, 1)],
                          _cfg(steps=3), log=lambda *_: None)
    path = write_npz(tmp_path / "probes.npz", x.numpy(), None)
    rng = np.random.default_rng(0)
    curve = load_data(write_npz(tmp_path / "curve.npz", rng.normal(size=(16, *x.shape[1:])).astype(np.float32),
                                rng.integers(0, 3, size=16)), a, batch_size=8)
    for start in ("activations", "weights:10"):
        row, moved = dp.align_on(a, b, str(path), len(x), start, curve, [0.0, 0.5, 1.0], log=lambda *_: None)
        assert row["verify_max_rel_diff"] <= 1e-5
        assert row["probes_used"] == len(x)
        assert np.isfinite(row["barrier"]) and len(row["loss"]) == 3
        assert moved is not a and type(moved) is type(a)


def test_shifted_views_are_rolls_within_the_jitter_or_their_mirror():
    x = torch.arange(2 * 25, dtype=torch.float32).reshape(2, 1, 5, 5)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(dp.shifted(x, 0, False, g), x)
    allowed = [torch.roll(x, (dy, dx), (-2, -1)) for dy in range(-1, 2) for dx in range(-1, 2)]
    allowed += [v.flip(-1) for v in allowed]
    seen = set()
    for _ in range(40):
        v = dp.shifted(x, 1, True, g)
        hits = [i for i, w in enumerate(allowed) if torch.equal(v, w)]
        assert hits
        seen.add(hits[0])
    assert len(seen) > 4  # the shifts and flips vary


def test_midpoint_at_one_is_the_moved_model(pair):
    a, b = pair
    x = torch.randn(4, a.config.num_channels, a.config.image_size, a.config.image_size)
    with torch.no_grad():
        assert torch.allclose(dp.midpoint(a, b, 1.0)(pixel_values=x).logits, a(pixel_values=x).logits, atol=1e-6)
        assert torch.allclose(dp.midpoint(a, b, 0.0)(pixel_values=x).logits, b(pixel_values=x).logits, atol=1e-6)


def test_adversarial_probes_raise_the_midpoints_departure(pair):
    a, b = pair
    g = torch.Generator().manual_seed(3)
    x0 = (torch.rand(12, a.config.num_channels, a.config.image_size, a.config.image_size, generator=g) - 0.5) / 0.5
    cfg = _cfg(adv_steps=40, adv_ce=0.0, gen_batch=12, tv=0.0)
    x, rep = dp.adversarial(a, b, x0, torch.arange(12) % 3, cfg, log=lambda *_: None)
    assert x.shape == x0.shape and x.min() >= dp.LOW and x.max() <= dp.HIGH
    assert rep["midpoint_kl_after"] > 1.5 * rep["midpoint_kl_before"]


def test_script_end_to_end_tiny_with_a_round(tmp_path):
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "benchmarks.datafree_probes", "--tiny", "--out", str(out), "--rounds", "1",
                        "--starts", "activations,weights:10", "--points", "3", "--references", "data-free"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads((out / "results.json").read_text())
    assert [row["start"] for row in r["alignments"]] == ["activations", "weights:10"]
    assert all(row["verify_max_rel_diff"] <= 1e-5 for row in r["alignments"] + r["rounds"])
    assert [row["reference"] for row in r["references"]] == ["data-free weights, depth decay 1",
                                                             "data-free weights, depth decay 10"]
    assert all(row["verify_max_rel_diff"] <= 1e-5 for row in r["references"])
    assert r["rounds"][0]["composed_verify_max_rel_diff"] <= 1e-5 and r["rounds"][0]["probes_used"] == 80
    # the refusal of a used --out, in this process (SystemExit with the message: exit status 1, the message on
    # stderr, as the run above shows the script's process itself)
    with pytest.raises(SystemExit, match="not empty"):
        dp.main(["--tiny", "--out", str(out)])
