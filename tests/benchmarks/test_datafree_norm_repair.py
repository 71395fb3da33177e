"""``benchmarks.datafree_norm_repair``'s transform on two tiny random ViT classifiers: after it, each chosen group of
θ(α) has the interpolated norm of its endpoints' groups (row, head block, tensor), the biases scaled with their rows
when asked, the other tensors untouched; at α = 1 and α = 0 it leaves the endpoints as they are."""

from __future__ import annotations

import copy

import pytest
import torch

from benchmarks import datafree_norm_repair as nr
from factories import make_model
from symmerge.evaluate.metrics import interpolate

GROUPS = nr.VARIANTS["q,k,v per head, fc1 per unit, writers per tensor"]


@pytest.fixture(scope="module")
def pair():
    return tuple(make_model("vit", head=True, seed=s, dtype=torch.float64) for s in (0, 1))


def _at(a, b, alpha):
    probe = copy.deepcopy(b)
    probe.load_state_dict(interpolate(a.state_dict(), b.state_dict(), alpha))
    return probe


@pytest.mark.parametrize("bias", [True, False])
def test_each_group_gets_its_endpoints_interpolated_norm(pair, bias):
    a, b = pair
    heads = b.config.num_attention_heads
    sd_a, sd_b = a.state_dict(), b.state_dict()
    before = _at(a, b, 0.3).state_dict()
    after = nr.norm_repair(sd_a, sd_b, GROUPS, heads, bias)(_at(a, b, 0.3), 0.3).state_dict()
    moved = 0
    for k, w in after.items():
        mode = next((m for part, m in GROUPS.items() if part in k), None)
        if mode is None or not k.endswith(".weight"):
            if not (bias and mode is not None and k.endswith(".bias")):
                assert torch.equal(w, before[k]), k  # untouched
            continue
        norms = {"row": lambda t: t.norm(dim=1), "tensor": lambda t: t.norm().expand(1),
                 "head": lambda t: t.reshape(heads, -1).norm(dim=1)}[mode]
        target = 0.3 * norms(sd_a[k]) + 0.7 * norms(sd_b[k])
        torch.testing.assert_close(norms(w), target, rtol=1e-12, atol=0)
        s = (w.reshape(w.shape[0], -1).norm(dim=1) / before[k].reshape(w.shape[0], -1).norm(dim=1))
        bk = k[:-len("weight")] + "bias"
        expected_bias = before[bk] * s if bias else before[bk]
        torch.testing.assert_close(after[bk], expected_bias, rtol=1e-12, atol=1e-15)
        moved += 1
    assert moved == 6 * b.config.num_hidden_layers  # q, k, v, o, fc1, fc2 of every layer


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_the_endpoints_are_left_as_they_are(pair, alpha):
    a, b = pair
    sd_a, sd_b = a.state_dict(), b.state_dict()
    end = nr.norm_repair(sd_a, sd_b, nr.VARIANTS["every matrix per tensor"], b.config.num_attention_heads)(
        _at(a, b, alpha), alpha).state_dict()
    for k, v in (sd_a if alpha == 1.0 else sd_b).items():
        torch.testing.assert_close(end[k], v, rtol=1e-12, atol=1e-15)
