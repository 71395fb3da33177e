"""Softmax-temperature calibration (the baseline of Ito et al.; issue 42, item 4): the fitted temperature
against its definition (brute force on a grid, an exactly reachable target), and the ``+temperature``
barrier curve's invariants on real ViTs: T = 1 at the endpoints (their losses unchanged), T ≠ 1 inside, the
same accuracies as the plain curve at every α (a temperature changes no argmax)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from symmerge.errors import SymmergeError
from symmerge.evaluate.temperature import Tempered, fit_temperature
from symmerge.merge.barrier import barrier_study
from symmerge.pipeline.options import AlignOptions


def test_fit_recovers_a_reachable_temperature():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(200, 7, generator=g, dtype=torch.float64) * 3
    for t0 in (0.3, 1.0, 2.5, 11.0):
        assert fit_temperature(logits, torch.softmax(logits / t0, -1)) == pytest.approx(t0, rel=1e-4)


def test_fit_is_the_grid_minimum_for_any_target():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(100, 5, generator=g, dtype=torch.float64) * 2
    target = torch.softmax(torch.randn(100, 5, generator=g, dtype=torch.float64), -1)
    grid = np.exp(np.linspace(math.log(1 / 20), math.log(20), 4001))
    losses = [-(target * torch.log_softmax(logits / t, -1)).sum(-1).mean().item() for t in grid]
    best = grid[int(np.argmin(losses))]
    t = fit_temperature(logits, target)
    assert t == pytest.approx(best, rel=2e-3)
    assert -(target * torch.log_softmax(logits / t, -1)).sum(-1).mean().item() <= min(losses) + 1e-9
    with pytest.raises(SymmergeError, match="one shape"):
        fit_temperature(logits, target[:, :4])


def _vit(seed: int):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    cfg = ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, image_size=8,
                    patch_size=4, num_channels=1, num_labels=3, initializer_range=0.4)
    return ViTForImageClassification(cfg).eval()


def test_tempered_divides_the_logits():
    m = _vit(0)
    x = torch.randn(4, 1, 8, 8)
    with torch.no_grad():
        assert torch.allclose(Tempered(m, 2.0)(pixel_values=x).logits, m(pixel_values=x).logits / 2.0)


def test_tempered_curve_keeps_the_ends_and_the_accuracies(tmp_path):
    rng = np.random.default_rng(1)
    data = tmp_path / "eval.npz"
    np.savez(data, pixel_values=rng.standard_normal((40, 1, 8, 8)).astype(np.float32), labels=rng.integers(0, 3, 40))
    unlabeled = tmp_path / "align.npz"
    np.savez(unlabeled, pixel_values=rng.standard_normal((32, 1, 8, 8)).astype(np.float32))
    res = barrier_study(_vit(0), _vit(1), str(data), aligns=["attn,ffn"], points=5, progress=False, temperature=True,
                        align=AlignOptions(align_data=str(unlabeled)))
    assert set(res["curves"]) == {"none", "none+temperature", "attn,ffn", "attn,ffn+temperature"}
    for v in ("none", "attn,ffn"):
        plain, tempered = res["curves"][v], res["curves"][v + "+temperature"]
        ts = tempered["temperatures"]
        assert len(ts) == 5 and ts[0] == pytest.approx(1.0, abs=1e-4) and ts[-1] == pytest.approx(1.0, abs=1e-4)
        assert any(abs(t - 1.0) > 1e-3 for t in ts[1:-1])  # the path's inside is recalibrated
        assert tempered["accuracy"] == plain["accuracy"]
        for i in (0, -1):
            assert tempered["loss"][i] == pytest.approx(plain["loss"][i], rel=1e-4)
    json.dumps(res)  # the study stays JSON (barrier.json)


def test_temperature_needs_unlabeled_data(tmp_path):
    rng = np.random.default_rng(1)
    data = tmp_path / "eval.npz"
    np.savez(data, pixel_values=rng.standard_normal((8, 1, 8, 8)).astype(np.float32), labels=rng.integers(0, 3, 8))
    with pytest.raises(SymmergeError, match="--align-data"):
        barrier_study(_vit(0), _vit(1), str(data), aligns=["none"], points=3, progress=False, temperature=True)


def test_cli_refuses_temperature_without_unlabeled_data_before_loading(tmp_path, capsys):
    from conftest import run_cli

    out, data = tmp_path / "out", tmp_path / "x.npz"  # the data file is there (a missing one is refused first)
    data.write_bytes(b"")
    assert run_cli("barrier", "nowhere-a", "nowhere-b", "--data", data, "-o", str(out), "--temperature") == 2
    assert "--align-data" in capsys.readouterr().err and not out.exists()
