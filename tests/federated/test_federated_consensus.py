"""The ``consensus`` outlier rule of AlignedFedAvg (symmerge.federated.consensus): the prior correction
undoes a shift of the class prior and not a relabelling; on tiny ViTs trained on label-skewed synthetic
shards (benchmarks/federated_consensus.py's federation), a client trained on flipped labels is left out
(its node named) while an honest client holding mostly a class the others hardly hold is kept, and the
round equals the round without the flipped client; honest clients whose class prior is shifted are kept;
clear errors for a rule without data or without a classifier. Skipped where Flower is not installed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")

import transformers as T  # noqa: E402
from flwr.app import ArrayRecord  # noqa: E402
import test_federated  # noqa: E402
from test_federated import reply, sha  # noqa: E402

from benchmarks.federated_consensus import CLASSES as C  # noqa: E402
from benchmarks.federated_consensus import synthetic, synthetic_clients, tiny_vit  # noqa: E402

from symmerge import SymmergeError  # noqa: E402
from symmerge.demo.datasets import write_npz  # noqa: E402
from symmerge.federated import AlignedFedAvg, OutlierPolicy, update_outliers  # noqa: E402
from symmerge.federated.aggregate import CONSENSUS_MIN_SPREAD  # noqa: E402
from symmerge.federated.consensus import consensus_scores, prior_corrected, server_data  # noqa: E402
from symmerge.io.data import Batch, Data  # noqa: E402

example_on_path = test_federated.example_on_path  # the fixture that puts the example app on the path

# ---------------------------------------------------------------- the scores, on probabilities


def softmax_world(m: int = 400, n_honest: int = 6, seed: int = 0):
    """Honest clients: one set of logits + small noise; ``skewed``: the same with a shifted class prior
    (label skew); ``flipped``: its classes relabelled (the logits' columns permuted)."""
    g = torch.Generator().manual_seed(seed)
    base = 3.0 * torch.randn(m, C, generator=g, dtype=torch.float64)
    honest = [(base + 0.3 * torch.randn(m, C, generator=g, dtype=torch.float64)).softmax(1) for _ in range(n_honest)]
    skewed = (base + torch.tensor([2.5, 0.0, -1.0, 0.0], dtype=torch.float64)).softmax(1)
    flipped = base[:, [3, 2, 1, 0]].softmax(1)
    return honest, skewed, flipped


def test_prior_corrected_undoes_a_prior_shift_not_a_relabelling():
    g = torch.Generator().manual_seed(1)
    p = (2.0 * torch.randn(300, C, generator=g, dtype=torch.float64)).softmax(1)
    shifted = p * torch.tensor([6.0, 1.0, 0.2, 1.0], dtype=torch.float64)
    shifted = shifted / shifted.sum(1, keepdim=True)
    got = prior_corrected(shifted, p.mean(0))
    assert torch.allclose(got, p, atol=1e-8)
    assert torch.allclose(got.mean(0), p.mean(0), atol=1e-9)  # its class marginal is the target's
    relabelled = prior_corrected(p[:, [1, 0, 3, 2]], p.mean(0))
    assert (relabelled - p).abs().sum(1).mean() > 0.5  # no class prior undoes a permutation


def test_consensus_scores_separate_a_relabelled_client_from_a_prior_shift():
    honest, skewed, flipped = softmax_world()
    scores = consensus_scores(honest + [skewed, flipped])
    assert max(scores[:-1]) < 0.5 * scores[-1]
    flags = update_outliers(scores, 3.5, "consensus", CONSENSUS_MIN_SPREAD)
    assert [r is not None for _, r in flags] == [False] * 7 + [True]
    assert "disagree with the other clients' consensus" in flags[-1][1]
    # negative control: without the prior correction the skewed client is left out too
    probs = honest + [skewed, flipped]
    raw = [float(0.5 * (p - (sum(probs) - p) / (len(probs) - 1)).abs().sum(1).mean()) for p in probs]
    assert raw[-2] > 1.8 * max(raw[:-2])
    assert [r is not None for _, r in update_outliers(raw, 3.5, "consensus", CONSENSUS_MIN_SPREAD)][-2:] == [True] * 2


def test_consensus_scores_small_cases():
    p = torch.full((5, C), 1.0 / C, dtype=torch.float64)
    assert consensus_scores([p]) == [0.0]
    assert consensus_scores([p, p, p]) == pytest.approx([0.0] * 3, abs=1e-12)


def test_min_spread_floors_the_mad():
    scores = [1.0, 1.01, 0.99, 1.0, 1.02, 1.3]  # tightly clustered, one 30 % above: an outlier by MAD alone
    assert update_outliers(scores, 3.5)[-1][1] is not None
    assert update_outliers(scores, 3.5, min_spread=0.1)[-1][1] is None  # not beyond 1.52 x the median
    assert update_outliers(scores[:-1] + [1.7], 3.5, min_spread=0.1)[-1][1] is not None


# ---------------------------------------------------------------- the strategy, on trained tiny ViTs


SKEWED, FLIPPED = 5, 9  # nodes


@pytest.fixture(scope="module")
def federation():
    return make_federation()


def make_federation():
    """A global model trained a little on balanced data; 4 honest clients with label-skewed shards, an
    honest client ``SKEWED`` that holds mostly class 3 (which the others hardly hold) and a client
    ``FLIPPED`` trained on flipped labels (3 - y), each 25 local steps from the global model."""
    mixes = {1: [0.5, 0.3, 0.15, 0.05], 2: [0.2, 0.5, 0.25, 0.05], 3: [0.3, 0.2, 0.45, 0.05],
             4: [0.4, 0.4, 0.15, 0.05], SKEWED: [0.05, 0.05, 0.05, 0.85], FLIPPED: [0.35, 0.3, 0.3, 0.05]}
    g, clients = synthetic_clients(mixes, FLIPPED, global_steps=20, local_steps=25)
    replies = {node: reply(node, sd, 300) for node, sd in clients.items()}
    server_x, _ = synthetic(200, 99)  # the server's unlabeled images
    return g, replies, Data("server images", "image", [Batch({"pixel_values": server_x[:128]}, None),
                                                         Batch({"pixel_values": server_x[128:]}, None)], 200, False)


def strategy(g, **kw) -> AlignedFedAvg:
    s = AlignedFedAvg(g, fraction_evaluate=0.0, **kw)
    s.global_arrays = ArrayRecord(g.state_dict())
    return s


def test_consensus_rule_leaves_out_the_flipped_client_and_keeps_the_skewed_one(federation, caplog):
    g, replies, data = federation
    s = strategy(g, outliers=OutlierPolicy(rule="consensus", data=data))
    arrays, metrics = s.aggregate_train(1, list(replies.values()))
    rec = s.rounds[-1]
    assert [(x["node"], x["kind"]) for x in rec["left_out"]] == [(FLIPPED, "outlier")]
    assert SKEWED in rec["accepted"] and metrics["symmerge-left-out-outlier"] == 1
    assert rec["outlier_z"][FLIPPED] > 3.5 and max(z for n, z in rec["outlier_z"].items() if n != FLIPPED) < 3.5
    assert any(f"node {FLIPPED}" in r.getMessage() and "consensus" in r.getMessage() for r in caplog.records)
    # the round aggregates exactly the others
    honest = [m for n, m in replies.items() if n != FLIPPED]
    assert sha(arrays) == sha(strategy(g).aggregate_train(1, honest)[0])


def with_prior_shift(sd: dict, shift: list[float]) -> dict:
    """The same model with its class prior shifted: ``shift`` added to the classifier's bias (what label
    skew does to a classifier first)."""
    out = dict(sd)
    out["classifier.bias"] = sd["classifier.bias"] + torch.tensor(shift)
    return out


def test_consensus_rule_keeps_clients_that_differ_by_their_class_prior(federation):
    """A clean round of honest clients, two of them with a strongly shifted class prior (a large bias on
    one class, as a client holding mostly that class): nobody is left out, and the aggregate is the
    round's without the rule."""
    g, replies, data = federation
    honest = [replies[n] for n in (1, 2, 3, 4)]
    shifted = [reply(n, with_prior_shift(replies[1].content["arrays"].to_torch_state_dict(), shift), 300)
               for n, shift in ((6, [0.0, 0.0, 0.0, 4.0]), (7, [3.0, -2.0, 0.0, 0.0]))]
    s = strategy(g, outliers=OutlierPolicy(rule="consensus", data=data))
    arrays, _ = s.aggregate_train(1, honest + shifted)
    assert not s.rounds[-1]["left_out"] and max(s.rounds[-1]["outlier_z"].values()) < 3.5
    assert sha(arrays) == sha(strategy(g).aggregate_train(1, honest + shifted)[0])
    # negative control: the same clients with their classes relabelled instead are left out
    relabelled = dict(replies[1].content["arrays"].to_torch_state_dict())
    perm = torch.tensor([3, 2, 1, 0])
    relabelled["classifier.weight"], relabelled["classifier.bias"] = (relabelled["classifier.weight"][perm],
                                                                      relabelled["classifier.bias"][perm])
    s = strategy(g, outliers=OutlierPolicy(rule="consensus", data=data))
    s.aggregate_train(1, honest + shifted[:1] + [reply(8, relabelled, 300)])
    assert [x["node"] for x in s.rounds[-1]["left_out"]] == [8]


def test_consensus_rule_reads_a_data_file(federation, tmp_path):
    g, replies, data = federation
    x = torch.cat([b.inputs["pixel_values"] for b in data.batches]).numpy()
    path = write_npz(tmp_path / "server.npz", x, np.zeros(len(x), np.int64))
    s = strategy(g, outliers=OutlierPolicy(rule="consensus", data=path, samples=150))
    assert s.outlier_data.n == 150
    s.aggregate_train(1, list(replies.values()))
    assert [x["node"] for x in s.rounds[-1]["left_out"]] == [FLIPPED]


def test_consensus_rule_errors(federation):
    g, _, data = federation
    with pytest.raises(SymmergeError, match="needs unlabeled data held by the server"):
        AlignedFedAvg(g, outliers=OutlierPolicy(rule="consensus"))
    with pytest.raises(SymmergeError, match="samples must be a whole number"):
        AlignedFedAvg(g, outliers=OutlierPolicy(rule="consensus", data=data, samples=0))
    with pytest.raises(SymmergeError, match="classification model"):
        server_data(data, T.ViTModel(tiny_vit(0).config), 10)
    with pytest.raises(SymmergeError, match=r"unknown OutlierPolicy rule 'consensu' \(did you mean 'consensus'\?\)"):
        OutlierPolicy(rule="consensu", data=data)
    assert AlignedFedAvg(g, outliers=OutlierPolicy(rule="krum")).outlier_data is None  # data only for the consensus rule


@pytest.mark.usefixtures("example_on_path")
def test_the_example_app_holds_server_images_for_the_consensus_rule():
    """fedvit with outlier-rule="consensus": the server's unlabeled images (server-images of them) reach
    the strategy as outlier_data; no data without that rule."""
    from fedvit import server_app, task

    cfg = task.settings({"dataset": "synthetic", "hidden": 16, "layers": 1, "heads": 2, "outlier-rule": "consensus",
                         "server-images": 300})
    strategy = AlignedFedAvg(template=task.load_model(cfg), **server_app.strategy_options(cfg))
    assert strategy.outliers.rule == "consensus" and strategy.outlier_data.n == 300
    assert not strategy.outlier_data.labeled and all(b.labels is None for b in strategy.outlier_data.batches)
    assert "outlier_data" not in server_app.strategy_options(task.settings({"dataset": "synthetic"}))


def test_consensus_rule_leaves_out_a_client_whose_predictions_cannot_be_had(federation, monkeypatch, caplog):
    """A client whose model gives non-finite probabilities (or fails) on the server's data is left out, its
    node named, and does not enter the others' consensus; the round goes on."""
    from symmerge.federated import consensus, strategy as strategy_module

    g, replies, data = federation
    broken = dict(replies[1].content["arrays"].to_torch_state_dict())
    broken["classifier.weight"] = torch.full_like(broken["classifier.weight"], 3e38)  # finite, logits overflow
    probs = consensus.client_probabilities(g, [broken, g.state_dict()], data)
    assert isinstance(probs[0], str) and "not finite" in probs[0] and isinstance(probs[1], torch.Tensor)
    real = strategy_module.client_probabilities

    def one_fails(model, state_dicts, data):
        out = real(model, state_dicts, data)
        out[4] = "its model fails on the server's data: RuntimeError: boom"  # the fifth client scored: SKEWED
        return out

    monkeypatch.setattr(strategy_module, "client_probabilities", one_fails)
    s = strategy(g, outliers=OutlierPolicy(rule="consensus", data=data))
    s.aggregate_train(1, list(replies.values()))
    rec = s.rounds[-1]
    assert sorted((x["node"], x["kind"]) for x in rec["left_out"]) == [(SKEWED, "outlier"), (FLIPPED, "outlier")]
    assert any(f"node {SKEWED}" in r.getMessage() and "boom" in r.getMessage() for r in caplog.records)
    assert SKEWED not in rec["outlier_z"] and len(rec["outlier_z"]) == len(replies) - 1
