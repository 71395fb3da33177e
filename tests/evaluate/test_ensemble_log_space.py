"""The ensemble's loss (the cross-entropy of the members' mean probabilities) is computed in log space: exact where
the probabilities underflow float64 (it was floored at 1e-300, 690.8 nats, whatever the members said), and equal to
the probability-space mean where they do not."""

from __future__ import annotations

import math

import torch
from symmerge.evaluate.metrics import mean_log_probs


def _exact(logit_rows, target) -> float:
    """−log((1/M) Σ_m softmax(x_m)[target]) by hand, each term's log first (no underflow)."""
    terms = [row[target] - max(row) - math.log(sum(math.exp(v - max(row)) for v in row)) for row in logit_rows]
    top = max(terms)
    return -(top + math.log(sum(math.exp(t - top) for t in terms)) - math.log(len(terms)))


def test_a_target_far_below_the_others_scores_its_own_loss():
    members = [torch.tensor([[0.0, -1000.0]]), torch.tensor([[0.0, -1200.0]])]
    got = -mean_log_probs(members)[0, 1].item()
    assert abs(got - _exact([[0.0, -1000.0], [0.0, -1200.0]], 1)) < 1e-9
    assert abs(got - (1000 + math.log(2))) < 1e-9  # not 690.8, the old floor of the probabilities at 1e-300


def test_the_log_space_mean_is_the_mean_of_the_probabilities_where_nothing_underflows():
    g = torch.Generator().manual_seed(0)
    members = [torch.randn(7, 5, generator=g, dtype=torch.float64) * 3 for _ in range(4)]
    want = torch.stack([torch.softmax(x, -1) for x in members]).mean(0).log()
    torch.testing.assert_close(mean_log_probs(members), want, rtol=1e-12, atol=1e-12)


def test_nan_or_positive_infinite_logits_make_their_row_nan():
    members = [torch.tensor([[0.0, 1.0], [0.0, 1.0]]), torch.tensor([[float("nan"), 1.0], [float("inf"), 0.0]])]
    out = mean_log_probs(members)
    assert out.isnan().any(-1).tolist() == [True, True]
