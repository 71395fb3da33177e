"""symmerge.federated.AlignedFedAvg: the aggregate equals symmerge's own merge of the same client
weights; every bad reply is left out (its node named) and never reaches the global model; too few
clients keep the previous global model byte for byte; a 2-round, 3-client run through Flower's
simulation engine (Ray). Skipped only where Flower is not installed (``pip install 'symmerge[flower]'``)."""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

flwr = pytest.importorskip("flwr")

import transformers as T  # noqa: E402
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, Metadata, MetricRecord, RecordDict  # noqa: E402
from flwr.serverapp.strategy import FedAvg  # noqa: E402

from symmerge import MergeOptions, SymmergeError, merge_models  # noqa: E402
from symmerge.errors import UsageError  # noqa: E402
from symmerge.federated import (LEFT_OUT_KINDS, OUTLIER_RULES, Aggregation, AlignedFedAvg,  # noqa: E402
                                ClientAlignment, OutlierPolicy, aggregate, norm_outliers, update_outliers,
                                update_scores)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "federated"
TRIED: Counter = Counter()  # bad replies tried in this module, by kind (printed by the last test)


def tiny_vit(seed: int = 0, num_labels: int = 3):
    cfg = T.ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, image_size=8,
                      patch_size=4, num_channels=1, num_labels=num_labels, initializer_range=0.3)
    torch.manual_seed(seed)
    return T.ViTForImageClassification(cfg).eval()


def permute_ffn(sd: dict, seed: int) -> dict:
    """The same function with every layer's FFN units permuted (a symmetry the alignment undoes)."""
    g = torch.Generator().manual_seed(seed)
    out = dict(sd)
    for layer in range(2):
        p = f"vit.layers.{layer}."
        perm = torch.randperm(sd[p + "mlp.fc1.weight"].shape[0], generator=g)
        out[p + "mlp.fc1.weight"] = sd[p + "mlp.fc1.weight"][perm]
        out[p + "mlp.fc1.bias"] = sd[p + "mlp.fc1.bias"][perm]
        out[p + "mlp.fc2.weight"] = sd[p + "mlp.fc2.weight"][:, perm]
    return out


def client_sd(global_model, node: int, scale: float = 0.05) -> dict:
    """A client's model: the global model plus a small update, then FFN-permuted."""
    g = torch.Generator().manual_seed(100 + node)
    sd = {k: v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
          for k, v in global_model.state_dict().items()}
    return permute_ffn(sd, node)


def _metadata(node: int) -> Metadata:
    return Metadata(run_id=1, message_id=f"reply-{node}", src_node_id=node, dst_node_id=0, reply_to_message_id="m",
                    group_id="1", created_at=time.time(), ttl=600.0, message_type=MessageType.TRAIN)


def reply(node: int, state_dict: dict | None, num_examples=10, arrays: ArrayRecord | None = None) -> Message:
    records = {"arrays": arrays if arrays is not None else ArrayRecord(state_dict)}
    metrics = {"train_loss": 1.0} if num_examples is None else {"train_loss": 1.0, "num-examples": num_examples}
    records["metrics"] = MetricRecord(metrics)
    return Message(content=RecordDict(records), metadata=_metadata(node))


def error_reply(node: int) -> Message:
    return Message(error=Error(code=1, reason="client crashed: out of memory"), metadata=_metadata(node))


def sha(arrays: ArrayRecord) -> str:
    h = hashlib.sha256()
    for k, a in arrays.items():
        h.update(k.encode())
        h.update(a.data)
    return h.hexdigest()


def strategy(global_model, **kw) -> AlignedFedAvg:
    s = AlignedFedAvg(global_model, fraction_evaluate=0.0, **kw)
    s.global_arrays = ArrayRecord(global_model.state_dict())
    return s


@pytest.fixture(scope="module")
def world():
    g = tiny_vit(0)
    clients = {node: client_sd(g, node) for node in (1, 2, 3)}
    examples = {1: 10, 2: 30, 3: 60}
    return g, clients, examples


@pytest.fixture(scope="module")
def clean_sha(world):
    """The hash of the round with only the three good replies."""
    return sha(strategy(world[0]).aggregate_train(1, good_replies(world))[0])


def good_replies(world, nodes=(1, 2, 3)):
    _, clients, examples = world
    return [reply(n, clients[n], examples[n]) for n in nodes]


def close(a: dict, b: dict, atol=1e-6) -> bool:
    return set(a) == set(b) and all(torch.allclose(a[k].double(), b[k].double(), atol=atol, rtol=0) for k in a)


# ---------------------------------------------------------------- the aggregate


def logits(state_dict: dict) -> torch.Tensor:
    """The tiny ViT's logits with ``state_dict`` on five fixed random images."""
    model = tiny_vit(0)
    model.load_state_dict(state_dict)
    with torch.no_grad():
        return model(pixel_values=torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(0))).logits


def symmerge_merge(world, alignment, **options):
    """symmerge's own N-model merge (``merge_models``, plain weighted average, heads merged) of the clients."""
    _, clients, examples = world
    models = [tiny_vit(0) for _ in clients]
    for m, sd in zip(models, clients.values()):
        m.load_state_dict(sd)
    return merge_models(models, options=MergeOptions(method="average", align=alignment, heads="merge", evaluate=False,
                                                     weights=[examples[n] for n in clients], progress=False, **options))


def test_aggregate_equals_symmerge_merge_aligned_to_the_global_model(world):
    g, clients, examples = world
    s = strategy(g)
    arrays, metrics = s.aggregate_train(1, good_replies(world))
    got = arrays.to_torch_state_dict()
    merged, report = symmerge_merge(world, s.alignment, anchor=g)
    assert close(got, merged.state_dict(), atol=1e-5)
    # alignment did something: plain FedAvg of the same replies is far from it and from the global model
    plain = FedAvg(fraction_evaluate=0.0).aggregate_train(1, good_replies(world))[0].to_torch_state_dict()
    dist = lambda a, b: sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a) ** 0.5  # noqa: E731
    assert dist(got, g.state_dict()) < 0.5 * dist(plain, g.state_dict())
    assert metrics["symmerge-distance-after"] < 0.5 * metrics["symmerge-distance-before"]
    assert metrics["symmerge-clients-aggregated"] == 3 and metrics["symmerge-clients-left-out"] == 0
    assert metrics["train_loss"] == pytest.approx(1.0)  # the clients' own metrics, FedAvg-aggregated
    rec = s.rounds[-1]
    assert rec["accepted"] == [1, 2, 3] and rec["weights"] == [10.0, 30.0, 60.0] and not rec["kept_previous"]


def test_joint_aggregate_is_symmerges_joint_merge_in_the_global_frame(world):
    """``joint=True``: the clients aligned jointly (not each to the global model) and averaged compute the
    function of ``merge_models(..., joint=True)`` of the same weights; the aggregate is then expressed in the
    global model's frame (closer to it than in the joint frame, the same function)."""
    g, clients, examples = world
    s = strategy(g, alignment=ClientAlignment(joint=True))
    got = s.aggregate_train(1, good_replies(world))[0].to_torch_state_dict()
    merged, report = symmerge_merge(world, s.alignment, joint=True)
    assert "joint" in report["alignment"]
    a, b = logits(got), logits(merged.state_dict())
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    rec = s.rounds[-1]["joint"]
    assert rec["mode"] == "joint" and rec["distance_to_global_after"] <= rec["distance_to_global_before"] + 1e-9
    # negative control: the star's aggregate (each client aligned to the global model) is another model
    star = strategy(g).aggregate_train(1, good_replies(world))[0].to_torch_state_dict()
    assert not close(star, got, atol=1e-6)
    with pytest.raises(SymmergeError, match="joint"):
        ClientAlignment("none", joint=True)
    with pytest.raises(SymmergeError, match="joint_rounds"):
        ClientAlignment(joint=True, joint_rounds=-1)


def test_joint_learned_aggregate_is_symmerges_learned_joint_merge(world, tmp_path):
    """``joint=True`` with ``match="learned"`` (unlabeled server images): the strategy's aggregate computes the
    function of ``merge_models(..., joint=True)`` with the learned joint alignment (Dirichlet mixtures)."""
    from symmerge.demo.datasets import write_npz
    from symmerge.pipeline.options import AlignOptions, LearnSettings

    g = world[0]
    images = np.random.default_rng(0).random((24, 8, 8)).astype(np.float32)
    server = write_npz(tmp_path / "server.npz", images, np.zeros(24, np.int64))
    learned = AlignOptions(symmetries="heads,attn,ffn,rescale", match="learned", align_data=server, align_samples=24,
                           learn=LearnSettings(steps=4, batch=8, augment=1, start="weights"))
    s = strategy(g, alignment=ClientAlignment(learned, joint=True))
    got = s.aggregate_train(1, good_replies(world))[0].to_torch_state_dict()
    rec = s.rounds[-1]["joint"]
    assert rec["match"] == "learned" and rec["learned"]["steps"] >= 1
    merged, _ = symmerge_merge(world, learned, joint=True)
    a, b = logits(got), logits(merged.state_dict())
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    # negative control: the learning moved the aggregate away from its closed-form (data-free joint) start
    start = strategy(g, alignment=ClientAlignment(learned.with_(match="weights"), joint=True)).aggregate_train(1, good_replies(world))[0]
    assert not torch.allclose(logits(start.to_torch_state_dict()), a, atol=1e-5, rtol=1e-5)


def test_without_alignment_it_is_flowers_fedavg(world):
    g, _, _ = world
    s = strategy(g, alignment="none")
    got = s.aggregate_train(1, good_replies(world))[0].to_torch_state_dict()
    ref = FedAvg(fraction_evaluate=0.0).aggregate_train(1, good_replies(world))[0].to_torch_state_dict()
    assert close(got, ref, atol=1e-6)


def outputs(sd: dict) -> torch.Tensor:
    m = tiny_vit(0)
    m.load_state_dict(sd)
    with torch.no_grad():
        return m(pixel_values=torch.randn(6, 1, 8, 8, generator=torch.Generator().manual_seed(5))).logits


def test_clients_in_one_orbit_aggregate_to_that_function(world):
    """Clients that are differently permuted copies of one model all align to the same point of its
    orbit: the aggregate computes that model's function (plain averaging does not)."""
    g, _, _ = world
    gen = torch.Generator().manual_seed(3)
    sd = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in g.state_dict().items()}
    replies = [reply(n, permute_ffn(sd, n), 10 * n) for n in (1, 2, 3)]
    s = strategy(g)
    got = s.aggregate_train(1, replies)[0].to_torch_state_dict()
    assert torch.allclose(outputs(got), outputs(sd), atol=1e-4)
    after = s.rounds[-1]["distance_after"]
    assert max(after) - min(after) < 1e-6 * max(after)
    plain = FedAvg(fraction_evaluate=0.0).aggregate_train(1, replies)[0].to_torch_state_dict()
    assert not torch.allclose(outputs(plain), outputs(sd), atol=1e-2)


def test_min_align_gain_keeps_near_identity_clients_unaligned(world):
    """``min_align_gain``: clients that trained from the global model without being moved in their orbits
    (a small update, no permutation) gain little from alignment: they enter the aggregate as sent, so the
    round is exactly FedAvg's (without the guard alignment moves them and the aggregate differs); clients
    whose alignment undoes a permutation (a large gain) keep it, and the aggregate is the aligned one."""
    g, clients, examples = world
    gen = torch.Generator().manual_seed(7)
    near = {n: {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in g.state_dict().items()} for n in (1, 2, 3)}
    replies = [reply(n, near[n], examples[n]) for n in (1, 2, 3)]
    fedavg = FedAvg(fraction_evaluate=0.0).aggregate_train(1, replies)[0].to_torch_state_dict()
    guarded = strategy(g)  # the default: 0.05
    assert guarded.client_alignment.min_align_gain == 0.05
    got, metrics = guarded.aggregate_train(1, replies)
    rec = guarded.rounds[-1]
    assert [u["node"] for u in rec["unaligned"]] == [1, 2, 3] and all(0 <= u["gain"] < 0.05 for u in rec["unaligned"])
    assert metrics["symmerge-clients-unaligned"] == 3
    assert close(got.to_torch_state_dict(), fedavg, atol=1e-6)
    assert rec["distance_after"] == pytest.approx(rec["distance_before"], rel=1e-9)
    unguarded = strategy(g, alignment=ClientAlignment(min_align_gain=0.0)).aggregate_train(1, replies)[0].to_torch_state_dict()
    assert not close(unguarded, fedavg, atol=1e-6)  # negative control: alignment alone moves them
    permuted = strategy(g, alignment=ClientAlignment(min_align_gain=0.05))
    got, metrics = permuted.aggregate_train(1, good_replies(world))
    assert not permuted.rounds[-1]["unaligned"] and metrics["symmerge-clients-unaligned"] == 0
    assert close(got.to_torch_state_dict(), strategy(g).aggregate_train(1, good_replies(world))[0].to_torch_state_dict(),
                 atol=1e-9)
    for bad in (-0.1, 1.0, True, "5%"):
        with pytest.raises(SymmergeError, match="min_align_gain"):
            ClientAlignment(min_align_gain=bad)


def test_median_and_trimmed_mean_against_numpy():
    rng = np.random.default_rng(0)
    sds = [{"w": torch.from_numpy(rng.normal(size=(4, 5))), "b": torch.tensor([i])} for i in range(5)]
    stack = np.stack([sd["w"].numpy() for sd in sds])
    base = {"w": torch.zeros(4, 5, dtype=torch.float64), "b": torch.tensor([7])}
    med = aggregate(sds, [1] * 5, ["w"], base, "median")
    assert np.allclose(med["w"].numpy(), np.median(stack, axis=0)) and med["b"].item() == 7
    even = aggregate(sds[:4], [1] * 4, ["w"], base, "median")
    assert np.allclose(even["w"].numpy(), np.median(stack[:4], axis=0))
    trimmed = aggregate(sds, [1] * 5, ["w"], base, "trimmed_mean", trim=0.2)
    assert np.allclose(trimmed["w"].numpy(), np.sort(stack, axis=0)[1:4].mean(axis=0))
    mean = aggregate(sds, [1, 2, 3, 4, 0], ["w"], base, "mean")
    assert np.allclose(mean["w"].numpy(), np.tensordot([0.1, 0.2, 0.3, 0.4, 0.0], stack, axes=1))
    with pytest.raises(SymmergeError):
        aggregate(sds, [1] * 5, ["w"], base, "mode")


def test_norm_rule():
    assert norm_outliers([1.0, 1.2, 0.9, 50.0], 10.0) == [None, None, None, norm_outliers([1.0, 1.2, 0.9, 50.0], 10.0)[3]]
    assert "beyond norm_factor 10" in norm_outliers([1.0, 1.2, 0.9, 50.0], 10.0)[3]
    assert norm_outliers([1.0, 3.0, 9.0], 10.0) == [None] * 3  # honest spread is kept
    assert norm_outliers([1.0, 500.0], None) == [None, None]


def test_median_aggregation_resists_a_scaled_client_without_the_norm_rule(world):
    g, clients, _ = world
    bad = {k: g.state_dict()[k] + 100 * (v - g.state_dict()[k]) for k, v in clients[3].items()}
    replies = good_replies(world, (1, 2)) + [reply(3, bad, 60), reply(4, clients[1], 10)]
    s = strategy(g, aggregation="median", outliers=OutlierPolicy(norm_factor=None))
    got = s.aggregate_train(1, replies)[0].to_torch_state_dict()
    mean = strategy(g, outliers=OutlierPolicy(norm_factor=None)).aggregate_train(1, replies)[0].to_torch_state_dict()
    d = lambda a: sum(((a[k] - g.state_dict()[k]) ** 2).sum() for k in a) ** 0.5  # noqa: E731
    honest = [x for n, x in zip(s.rounds[-1]["accepted"], s.rounds[-1]["distance_after"]) if n != 3]
    assert d(got) < 1.5 * max(honest) and d(got) < 0.05 * d(mean)


# ---------------------------------------------------------------- the outlier rule on aligned updates


def _flat_updates(sds: list[dict], base: dict) -> np.ndarray:
    return np.stack([np.concatenate([(sd[k].double() - base[k].double()).reshape(-1).numpy() for k in base])
                     for sd in sds])


@pytest.mark.parametrize("n", [3, 4, 7])
def test_update_scores_against_numpy(n):
    gen = torch.Generator().manual_seed(n)
    base = {"a": torch.randn(3, 4, generator=gen), "b": torch.randn(5, generator=gen)}
    sds = [{k: v + torch.randn(v.shape, generator=gen) * (1 + i) for k, v in base.items()} for i in range(n)]
    u = _flat_updates(sds, base)
    s = np.sort(u, axis=0)
    med = s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
    np.testing.assert_allclose(update_scores(sds, base, base, "distance"), np.linalg.norm(u - med, axis=1), rtol=1e-10)
    cos = u @ med / (np.linalg.norm(u, axis=1) * np.linalg.norm(med))
    np.testing.assert_allclose(update_scores(sds, base, base, "cosine"), 1 - cos, rtol=1e-10)
    d = ((u[:, None, :] - u[None, :, :]) ** 2).sum(-1)
    m = n - (n - 3) // 2 - 2  # Krum's n - f - 2 nearest, f = (n - 3) // 2
    krum = [np.sort(np.delete(d[i], i))[:m].sum() for i in range(n)]
    np.testing.assert_allclose(update_scores(sds, base, base, "krum"), krum, rtol=1e-9)


def test_update_outliers_robust_z():
    scores = [1.0, 1.1, 0.9, 1.05, 0.95, 3.0]
    flags = update_outliers(scores, 3.5, "krum")
    med, mad = 1.025, 0.075  # the median, and the median of |s - med|
    assert flags[5][0] == pytest.approx(0.6745 * (3.0 - med) / mad) and "outlier_threshold 3.5" in flags[5][1]
    assert [r for _, r in flags[:5]] == [None] * 5  # low scores are never flagged
    assert update_outliers(scores, 30.0)[5][1] is None  # a higher threshold keeps it
    assert update_outliers([1.0, 50.0], 3.5) == [(0.0, None)] * 2  # fewer than 3: no rule
    assert update_outliers([2.0, 2.0, 2.0, 7.0], 3.5)[3][0] == float("inf")  # MAD 0: the odd one out
    assert [r for _, r in update_outliers([2.0, 2.0, 2.0], 3.5)] == [None] * 3


def flipped_world(n_honest: int = 5, flipped: int = 9):
    """Honest clients: the global model + a shared direction + noise; client ``flipped``: the same
    norm, the opposite direction (what training on flipped labels does); every client FFN-permuted,
    so that only after alignment the updates compare coordinate by coordinate."""
    g = tiny_vit(0)
    base = g.state_dict()
    gen = torch.Generator().manual_seed(7)
    direction = {k: 0.05 * torch.randn(v.shape, generator=gen) for k, v in base.items()}

    def client(node, sign):
        ng = torch.Generator().manual_seed(200 + node)
        sd = {k: v + sign * direction[k] + 0.02 * torch.randn(v.shape, generator=ng) for k, v in base.items()}
        return permute_ffn(sd, node)

    replies = [reply(n, client(n, 1.0), 10 + n) for n in range(1, n_honest + 1)]
    return g, replies, reply(flipped, client(flipped, -1.0), 20)


@pytest.mark.parametrize("rule", OUTLIER_RULES)
def test_outlier_rule_leaves_out_a_flipped_client_and_names_it(rule, caplog):
    g, honest, bad = flipped_world()
    TRIED["flipped"] += 1
    # the norm rule alone lets it through: its update norm is ordinary
    s = strategy(g)
    s.aggregate_train(1, honest + [bad])
    assert not s.rounds[-1]["left_out"]
    s = strategy(g, outliers=OutlierPolicy(rule=rule))
    arrays, metrics = s.aggregate_train(1, honest + [bad])
    rec = s.rounds[-1]
    assert [(x["node"], x["kind"]) for x in rec["left_out"]] == [(9, "outlier")]
    assert rec["accepted"] == [1, 2, 3, 4, 5] and metrics["symmerge-left-out-outlier"] == 1
    assert rec["outlier_z"][9] > 3.5 and max(z for n, z in rec["outlier_z"].items() if n != 9) < 3.5
    assert any("node 9" in r.getMessage() and "outlier" in r.getMessage() for r in caplog.records)
    # the round aggregates exactly the honest clients
    assert sha(arrays) == sha(strategy(g, outliers=OutlierPolicy(rule=rule)).aggregate_train(1, honest)[0])


@pytest.mark.parametrize("rule", OUTLIER_RULES)
def test_outlier_rule_keeps_every_clean_client(rule):
    g, honest, _ = flipped_world(n_honest=6)
    s = strategy(g, outliers=OutlierPolicy(rule=rule))
    arrays, metrics = s.aggregate_train(1, honest)
    assert s.rounds[-1]["accepted"] == [1, 2, 3, 4, 5, 6] and not s.rounds[-1]["left_out"]
    assert sha(arrays) == sha(strategy(g).aggregate_train(1, honest)[0])  # the rule off: the same round


def test_outlier_rule_needs_the_alignment():
    """Negative control: without alignment the permuted honest clients differ by their permutations, and
    the flipped client no longer stands out (its z is far lower than after alignment)."""
    g, honest, bad = flipped_world()
    aligned = strategy(g, outliers=OutlierPolicy(rule="distance"))
    aligned.aggregate_train(1, honest + [bad])
    plain = strategy(g, alignment="none", outliers=OutlierPolicy(rule="distance"))
    plain.aggregate_train(1, honest + [bad])
    assert plain.rounds[-1]["outlier_z"][9] < 0.25 * aligned.rounds[-1]["outlier_z"][9]


@pytest.mark.parametrize("rule", OUTLIER_RULES)
def test_outlier_rule_with_two_clients_says_it_was_not_applied(world, rule, caplog):
    """With 2 clients the rule cannot compare a client with the others: the round aggregates both, and the log
    says the rule asked for was not applied (not silence)."""
    g, _, _ = world
    s = strategy(g, outliers=OutlierPolicy(rule=rule))
    _, metrics = s.aggregate_train(1, good_replies(world, (1, 2)))
    assert metrics["symmerge-clients-aggregated"] == 2 and s.rounds[-1]["outlier_z"] == {}
    assert any(f"the outlier rule {rule!r} needs at least 3 clients, 2 remain" in r.getMessage() for r in caplog.records)


def test_outlier_rule_with_too_few_left_keeps_the_previous_global_model():
    g, honest, bad = flipped_world(n_honest=3)
    s = strategy(g, outliers=OutlierPolicy(rule="krum"), aggregation=Aggregation(min_clients=4))
    before = sha(s.global_arrays)
    TRIED["too_few_rounds"] += 1
    arrays, metrics = s.aggregate_train(1, honest + [bad])
    assert arrays is s.global_arrays and sha(arrays) == before
    assert metrics["symmerge-kept-previous"] == 1 and metrics["symmerge-left-out-outlier"] == 1


def test_norm_clip_keeps_a_scaled_client_at_an_ordinary_norm(world, caplog):
    """With norm_clip, a x100-scaled update is kept: its update scaled down to the others' median norm
    (before alignment: the huge update would steer the alignment), then aligned; the aggregate stays
    near the global model."""
    g, clients, _ = world
    base = g.state_dict()
    bad = {k: base[k] + 100 * (v - base[k]) for k, v in clients[3].items()}
    s = strategy(g, outliers=OutlierPolicy(norm_clip=True))
    arrays, metrics = s.aggregate_train(1, good_replies(world, (1, 2)) + [reply(3, bad, 60)])
    rec = s.rounds[-1]
    assert not rec["left_out"] and [c["node"] for c in rec["clipped"]] == [3]
    assert metrics["symmerge-clients-clipped"] == 1
    # its raw update scaled to the others' median norm, then aligned (which can only shorten it)
    assert rec["accepted"] == [1, 2, 3]
    assert 0.5 * (rec["distance_after"][0] + rec["distance_after"][1]) * 0.8 < rec["distance_after"][2] <= 0.5 * (
        rec["distance_after"][0] + rec["distance_after"][1]) * (1 + 1e-9)
    assert any("clipped node 3" in r.getMessage() for r in caplog.records)
    assert 0 < rec["clipped"][0]["scale"] < 0.1
    got = arrays.to_torch_state_dict()
    assert all(torch.isfinite(v).all() for v in got.values())
    d = lambda a: sum(((a[k].double() - base[k].double()) ** 2).sum() for k in a) ** 0.5  # noqa: E731
    assert d(got) < 2 * max(rec["distance_after"])


# ---------------------------------------------------------------- bad clients


UNPICKLED: list = []  # what _Unpickled's unpickling ran (it must never run on the server)


class _Unpickled:
    def __reduce__(self):
        return (UNPICKLED.append, ("code ran on the server",))


def _bad(kind: str, g, good: dict):
    """(message, expected left-out kind) for one bad reply from node 9."""
    sd = dict(good)
    key = "vit.layers.0.attention.q_proj.weight"
    if kind == "nan":
        sd[key] = sd[key].clone()
        sd[key][0, 0] = float("nan")
        return reply(9, sd), "non_finite"
    if kind == "inf":
        sd[key] = sd[key].clone()
        sd[key][1, 2] = float("-inf")
        return reply(9, sd), "non_finite"
    if kind == "missing_key":
        del sd[key]
        return reply(9, sd), "keys"
    if kind == "extra_key":
        sd["vit.layers.2.mlp.fc2.weight"] = sd[key]
        return reply(9, sd), "keys"
    if kind == "other_architecture":
        bert = T.BertForSequenceClassification(T.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2,
                                                            num_attention_heads=2, intermediate_size=32))
        return reply(9, bert.state_dict()), "keys"
    if kind == "wrong_shape":
        sd[key] = sd[key][:, :8]
        return reply(9, sd), "shapes"
    if kind == "other_head_size":  # same names, another number of labels
        return reply(9, tiny_vit(0, num_labels=5).state_dict()), "shapes"
    if kind == "wrong_dtype":
        sd[key] = sd[key].double()
        return reply(9, sd), "shapes"
    if kind == "scaled_x100":
        base = g.state_dict()
        return reply(9, {k: base[k] + 100 * (v - base[k]) for k, v in good.items()}), "norm"
    if kind == "error":
        return error_reply(9), "error"
    if kind == "no_num_examples":
        return reply(9, sd, num_examples=None), "malformed"
    if kind == "zero_examples":
        return reply(9, sd, num_examples=0), "malformed"
    if kind == "nan_examples":
        return reply(9, sd, num_examples=float("nan")), "malformed"
    if kind == "pickled":  # a pickle among the arrays (an object that would run code when unpickled)
        arrays = ArrayRecord(sd)
        arrays[key] = Array(dtype="object", shape=(1,), stype="numpy.ndarray", data=pickle.dumps(_Unpickled()))
        return reply(9, None, arrays=arrays), "malformed"
    if kind == "not_float_array":
        arrays = ArrayRecord(sd)
        arrays[key] = Array(np.array(["a", "b"]))
        return reply(9, None, arrays=arrays), "malformed"
    raise AssertionError(kind)


BAD = ("nan", "inf", "missing_key", "extra_key", "other_architecture", "wrong_shape", "other_head_size", "wrong_dtype",
       "scaled_x100", "error", "no_num_examples", "zero_examples", "nan_examples", "not_float_array", "pickled")


@pytest.mark.parametrize("kind", BAD)
def test_a_bad_reply_is_left_out_and_never_reaches_the_global_model(world, clean_sha, kind, caplog):
    g, clients, _ = world
    msg, expected = _bad(kind, g, clients[3])
    TRIED[kind] += 1
    s = strategy(g)
    arrays, metrics = s.aggregate_train(1, good_replies(world) + [msg])
    rec = s.rounds[-1]
    assert [x["node"] for x in rec["left_out"]] == [9] and rec["left_out"][0]["kind"] == expected
    assert metrics[f"symmerge-left-out-{expected.replace('_', '-')}"] == 1 and metrics["symmerge-clients-aggregated"] == 3
    assert sha(arrays) == clean_sha  # exactly the round without the bad reply
    assert any("node 9" in r.getMessage() for r in caplog.records)  # the logged reason names the node
    assert not UNPICKLED


@pytest.mark.parametrize("scale", [1e30, 3e38])
def test_huge_finite_weights_are_left_out(world, clean_sha, scale):
    """Finite values that overflow the solvers or the distances: left out, the round goes on."""
    g, clients, _ = world
    TRIED["huge_values"] += 1
    s = strategy(g)
    arrays, _ = s.aggregate_train(1, good_replies(world) + [reply(9, {k: v * scale for k, v in clients[3].items()})])
    assert [x["node"] for x in s.rounds[-1]["left_out"]] == [9]
    assert s.rounds[-1]["left_out"][0]["kind"] in ("alignment", "non_finite", "norm")
    assert sha(arrays) == clean_sha


def test_a_non_finite_aggregate_keeps_the_previous_model(world, monkeypatch, caplog):
    """The last safety net (the mean of finite values stays finite, so a rule gone wrong is simulated)."""
    import symmerge.federated.strategy as strategy_module

    g, _, _ = world
    real = strategy_module.aggregate

    def broken(*a, **kw):
        out = real(*a, **kw)
        return {k: v * float("inf") if v.is_floating_point() else v for k, v in out.items()}

    monkeypatch.setattr(strategy_module, "aggregate", broken)
    s = strategy(g, alignment="none")
    before = sha(s.global_arrays)
    arrays, metrics = s.aggregate_train(1, good_replies(world))
    assert sha(arrays) == before and metrics["symmerge-kept-previous"] == 1
    # the log says why (not "0 client(s) accepted", as it did: three were)
    assert any("round 1 keeps the previous global model: the aggregate was not finite" in r.getMessage()
               for r in caplog.records)
    assert not any("0 client(s) accepted" in r.getMessage() for r in caplog.records)


def test_joint_with_one_client_aggregates_it_in_the_global_frame(world):
    """joint=True with min_clients=1 and one accepted client: no joint alignment to run (it needs 2 models); the
    round aggregates that client aligned to the global model, as the star round does (it kept the previous model,
    logged as a failed joint alignment)."""
    g, clients, _ = world
    one = good_replies(world, (1,))
    s = strategy(g, alignment=ClientAlignment(joint=True), aggregation=Aggregation(min_clients=1))
    arrays, metrics = s.aggregate_train(1, one)
    assert metrics["symmerge-kept-previous"] == 0 and s.rounds[-1]["accepted"] == [1] and "note" not in s.rounds[-1]
    star = strategy(g, alignment=ClientAlignment(min_align_gain=0.0), aggregation=Aggregation(min_clients=1))
    assert sha(arrays) == sha(star.aggregate_train(1, one)[0])
    assert torch.allclose(logits(arrays.to_torch_state_dict()), logits(clients[1]), atol=1e-4)


@pytest.mark.parametrize("alignment", ["none", None])
def test_a_reply_whose_tied_tensors_differ_is_left_out(alignment, caplog):
    """A template with tied weights (GPT-2: lm_head.weight is transformer.wte.weight): a reply whose two differ
    cannot be loaded into it without dropping one (an untied model): left out as malformed, both names given,
    even where the difference is small (without alignment it was aggregated, one of the two values dropped)."""
    torch.manual_seed(0)
    g = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=50, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0)).eval()
    gen = torch.Generator().manual_seed(1)
    sds = []
    for _ in range(4):
        m = T.GPT2LMHeadModel(g.config).eval()
        m.load_state_dict(g.state_dict())
        with torch.no_grad():
            for p in m.parameters():
                p.add_(0.02 * torch.randn(p.shape, generator=gen))
        sds.append(m.state_dict())
    untied = dict(sds[3])
    untied["lm_head.weight"] = untied["lm_head.weight"] + 0.001
    s = strategy(g, alignment=alignment)
    arrays, _ = s.aggregate_train(1, [reply(n, sds[n], 10) for n in range(3)] + [reply(9, untied)])
    rec = s.rounds[-1]
    assert [(x["node"], x["kind"]) for x in rec["left_out"]] == [(9, "malformed")]
    assert "'lm_head.weight' differs from 'transformer.wte.weight'" in rec["left_out"][0]["reason"]
    clean = strategy(g, alignment=alignment).aggregate_train(1, [reply(n, sds[n], 10) for n in range(3)])[0]
    assert sha(arrays) == sha(clean)
    # untie=True would make the global model untied, which the clients' tied models cannot load: refused when made
    # (the aggregate's lm_head and wte differed, and a client loading it silently kept one of them)
    with pytest.raises(SymmergeError, match="untie=True would send the clients an untied global model"):
        AlignedFedAvg(template=g, alignment=__import__("symmerge").AlignOptions(
            symmetries="heads,attn,ffn,rescale,residual", untie=True))


def test_unusable_alignment_data_is_one_error_when_the_strategy_is_made(world, tmp_path):
    """match="activations" with an align_data file that is missing, or that does not fit the template (text for
    a ViT): one error when the strategy is made (every client was left out as "alignment" in every round, the
    global model never moving); a usable file is read once there."""
    from symmerge import AlignOptions
    from symmerge.io.data import Data

    g, _, _ = world
    np.savez(tmp_path / "text.npz", input_ids=np.zeros((4, 5), dtype=np.int64))
    for path, match in ((tmp_path / "missing.npz", "data file not found"), (tmp_path / "text.npz", "pixel_values")):
        with pytest.raises(SymmergeError, match=match):
            AlignedFedAvg(template=g, alignment=AlignOptions(symmetries="heads,attn,ffn,rescale", match="activations",
                                                             align_data=str(path)))
    np.savez(tmp_path / "images.npz", pixel_values=np.random.default_rng(0).normal(size=(6, 1, 8, 8)).astype(np.float32))
    s = strategy(g, alignment=AlignOptions(symmetries="heads,attn,ffn,rescale", match="activations",
                                           align_data=str(tmp_path / "images.npz")))
    assert isinstance(s.alignment.align_data, Data) and s.alignment.align_data.n == 6
    _, metrics = s.aggregate_train(1, good_replies(world))
    assert metrics["symmerge-clients-aggregated"] == 3
    # the consensus rule's default data (the alignment's file) still takes its own samples, not align_samples
    s = strategy(g, alignment=AlignOptions(symmetries="heads,attn,ffn,rescale", match="activations", align_samples=2,
                                           align_data=str(tmp_path / "images.npz")),
                 outliers=OutlierPolicy(rule="consensus", samples=5))
    assert s.alignment.align_data.n == 2 and s.outlier_data.n == 5


def test_a_missing_reply_is_counted(world):
    g, _, _ = world
    s = strategy(g)
    s.sampled_nodes = [1, 2, 3, 9]
    TRIED["missing"] += 1
    _, metrics = s.aggregate_train(1, good_replies(world))
    assert metrics["symmerge-left-out-missing"] == 1 and s.rounds[-1]["left_out"][0]["node"] == 9


def test_every_bad_kind_in_one_round(world, clean_sha):
    """All the bad replies at once beside three good ones: the round aggregates exactly the good three."""
    g, clients, _ = world
    replies = good_replies(world)
    expected = Counter()
    for i, kind in enumerate(BAD):
        msg, exp = _bad(kind, g, clients[3])
        msg.metadata._src_node_id = 100 + i  # noqa: SLF001 - a node of its own per bad reply
        replies.append(msg)
        expected[exp] += 1
        TRIED[kind] += 1
    s = strategy(g)
    arrays, metrics = s.aggregate_train(1, replies)
    assert Counter(x["kind"] for x in s.rounds[-1]["left_out"]) == expected
    assert sha(arrays) == clean_sha
    for kind in LEFT_OUT_KINDS:
        assert metrics[f"symmerge-left-out-{kind.replace('_', '-')}"] == expected.get(kind, 0)


@pytest.mark.parametrize("kind", ["nan", "scaled_x100", "error"])
def test_too_few_clients_keep_the_previous_global_model(world, kind):
    g, clients, _ = world
    s = strategy(g, aggregation=Aggregation(min_clients=2))
    before = sha(s.global_arrays)
    msg, _ = _bad(kind, g, clients[3])
    TRIED[kind] += 1
    TRIED["too_few_rounds"] += 1
    arrays, metrics = s.aggregate_train(1, good_replies(world, (1,)) + [msg])
    assert arrays is s.global_arrays and sha(arrays) == before
    assert metrics["symmerge-kept-previous"] == 1 and s.rounds[-1]["kept_previous"]


def test_no_replies_at_all_keep_the_previous_global_model(world):
    g, _, _ = world
    s = strategy(g)
    s.sampled_nodes = [1, 2]
    before = sha(s.global_arrays)
    arrays, metrics = s.aggregate_train(1, [])
    TRIED["too_few_rounds"] += 1
    assert sha(arrays) == before and metrics["symmerge-left-out-missing"] == 2


def test_bad_options_are_one_clear_error(world):
    g, _, _ = world
    for make in (lambda: Aggregation("mode"), lambda: Aggregation(trim=0.6), lambda: Aggregation(min_clients=0),
                 lambda: OutlierPolicy(norm_factor=0.5), lambda: ClientAlignment("spin"),
                 lambda: OutlierPolicy(rule="zscore"), lambda: OutlierPolicy(rule="krum", threshold=0),
                 lambda: OutlierPolicy(rule="krum", threshold=float("nan")), lambda: AlignedFedAvg(g, aggregation="mode"),
                 lambda: AlignedFedAvg(g, alignment="spin"), lambda: AlignedFedAvg(g, outliers="krum")):
        with pytest.raises(SymmergeError):
            make()
    # the options named as the objects take them (they named the former flat keywords), a close name offered
    for make, match in ((lambda: Aggregation("medain"), r"unknown Aggregation rule 'medain' \(did you mean 'median'\?\)"),
                        (lambda: OutlierPolicy(rule="krm"), r"unknown OutlierPolicy rule 'krm' \(did you mean 'krum'\?\)"),
                        (lambda: OutlierPolicy(rule="krum", threshold=0), "OutlierPolicy threshold must be a number > 0")):
        with pytest.raises(SymmergeError, match=match):
            make()
    # a keyword of the former flat signature names the options object that holds it now
    with pytest.raises(SymmergeError, match=r"norm_factor -> OutlierPolicy\(norm_factor=...\)"):
        AlignedFedAvg(g, norm_factor=None)
    s = AlignedFedAvg(g)
    with pytest.raises(SymmergeError, match="configure_train"):
        s.aggregate_train(1, good_replies(world))


def test_residual_group_that_folds_norms_keeps_the_global_model_folded(world):
    """With the residual group of a pre-LN ViT (LayerNorm, folded), the aggregate is in the folded
    parameterisation and still computes what the clients compute when they all agree."""
    g, _, _ = world
    s = strategy(g, alignment="heads,attn,ffn,rescale,residual")
    assert s.folds
    gen = torch.Generator().manual_seed(4)
    sd = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in g.state_dict().items()}
    arrays, _ = s.aggregate_train(1, [reply(n, permute_ffn(sd, n), 10) for n in (1, 2, 3)])
    assert torch.allclose(outputs(arrays.to_torch_state_dict()), outputs(sd), atol=1e-4)
    assert not strategy(g, alignment=__import__("symmerge").AlignOptions(
        symmetries="heads,attn,ffn,rescale,residual", residual="permutation")).folds


def test_bad_option_types_are_one_clear_error(world):
    """A wrong type is one clear error, never a comparison's TypeError from deep inside, nor read as true (a
    string "false" for a flag); the consensus rule's server data given without that rule is refused, not
    ignored; OutlierPolicy.samples is checked when the policy is made."""
    g, _, _ = world
    for make, match in ((lambda: Aggregation(trim="0.2"), "Aggregation trim must be a number"),
                        (lambda: Aggregation(trim=None), "Aggregation trim must be a number"),
                        (lambda: OutlierPolicy(norm_clip="false"), r"norm_clip must be True or False, got 'false'"),
                        (lambda: ClientAlignment(joint="no"), r"joint must be True or False, got 'no'"),
                        (lambda: ClientAlignment("none", joint=1), "joint must be True or False, got 1"),
                        (lambda: OutlierPolicy(samples=0), "samples must be a whole number >= 1"),
                        (lambda: OutlierPolicy(rule="krum", samples="all"), "samples must be a whole number >= 1"),
                        (lambda: OutlierPolicy(data="server.jsonl"), "data .* needs rule='consensus'"),
                        (lambda: OutlierPolicy(rule="krum", data="server.jsonl"), "needs rule='consensus'")):
        with pytest.raises(SymmergeError, match=match):
            make()
    assert OutlierPolicy(norm_clip=True).norm_clip is True and ClientAlignment(joint=False).joint is False


def test_a_misspelt_or_wrong_argument_of_the_strategy_is_one_clear_error(world):
    """A keyword neither AlignedFedAvg nor FedAvg takes names the closest (a keyword of the former flat
    signature: its options object); a template that is not a model names the argument."""
    g, _, _ = world
    for kw, match in (({"fraction_evalute": 0.0}, r"'fraction_evalute' \(did you mean 'fraction_evaluate'\?\)"),
                      ({"aligment": "none"}, r"'aligment' \(did you mean 'alignment'\?\)"),
                      ({"min_client": 2}, r"'min_client' \(did you mean Aggregation\(min_clients=...\)\?\)"),
                      ({"spam": 1}, r"unexpected keyword argument 'spam'$")):
        with pytest.raises(UsageError, match=match):
            AlignedFedAvg(template=g, **kw)
    for template, match in ((None, "template must be .* got NoneType"), (g.state_dict(), r"template must be .* \(a state dict")):
        with pytest.raises(UsageError, match=match):
            AlignedFedAvg(template=template)


def test_the_callers_template_is_left_as_it_came(world):
    """The strategy holds its own copy of the template: the caller's model keeps its train mode and its
    tensors, and what the caller does to it afterwards does not reach the strategy."""
    model = tiny_vit(0).train()
    tensors = {k: v for k, v in model.state_dict(keep_vars=True).items()}
    values = {k: v.detach().clone() for k, v in tensors.items()}
    s = AlignedFedAvg(template=model, fraction_evaluate=0.0)
    assert model.training and all(m.training for m in model.modules())
    assert all(model.state_dict(keep_vars=True)[k] is t and torch.equal(t.detach(), values[k]) for k, t in tensors.items())
    assert s.template is not model and not s.template.training
    model.half()  # the caller's model changed afterwards: the strategy's contract is unchanged
    s.global_arrays = ArrayRecord(world[0].state_dict())
    _, metrics = s.aggregate_train(1, good_replies(world))
    assert metrics["symmerge-clients-aggregated"] == 3


def test_example_counts_whose_sum_overflows_do_not_break_the_round(world):
    """Two clients claiming 1.7e308 examples each (finite, positive): their sum overflows, the round still
    aggregates (FedAvg's weighting: those two dominate), never an exception out of aggregate_train."""
    g, clients, _ = world
    huge = [reply(8, clients[1], 1.7e308), reply(9, clients[2], 1.7e308)]
    s = strategy(g)
    arrays, metrics = s.aggregate_train(1, good_replies(world) + huge)
    assert metrics["symmerge-clients-aggregated"] == 5 and not s.rounds[-1]["kept_previous"]
    alone = strategy(g).aggregate_train(1, [reply(8, clients[1], 1), reply(9, clients[2], 1)])[0]
    assert close(arrays.to_torch_state_dict(), alone.to_torch_state_dict(), atol=1e-6)


def test_a_global_model_of_another_architecture_is_refused_before_clients_train(world):
    """initial_arrays that do not match the template (or hold NaN): one error from configure_train (before any
    client trains) naming the tensor, the template's shape named as the template's."""
    g, _, _ = world
    s = AlignedFedAvg(template=g, fraction_evaluate=0.0)
    with pytest.raises(SymmergeError, match=r"does not match the template: 'classifier.weight' has shape \(5, 16\), "
                                            r"the template's is \(3, 16\)"):
        s.configure_train(1, ArrayRecord(tiny_vit(0, num_labels=5).state_dict()), ConfigRecord(), grid=None)
    nan = {k: v * float("nan") for k, v in g.state_dict().items()}
    with pytest.raises(SymmergeError, match=r"the global model .* is not finite: '.*' holds \d+ NaN"):
        s.configure_train(1, ArrayRecord(nan), ConfigRecord(), grid=None)


def test_the_round_counts_only_the_aggregated_clients_as_unaligned(world):
    """symmerge-clients-unaligned counts the clients that entered the aggregate unaligned: a client the guard
    kept unaligned and the norm rule then left out is not one of them (the round's record still lists it)."""
    g, clients, _ = world
    msg, _ = _bad("scaled_x100", g, clients[3])
    s = strategy(g, alignment=ClientAlignment(min_align_gain=0.99))  # every client unaligned
    _, metrics = s.aggregate_train(1, good_replies(world) + [msg])
    rec = s.rounds[-1]
    assert [x["kind"] for x in rec["left_out"]] == ["norm"] and 9 in {u["node"] for u in rec["unaligned"]}
    assert metrics["symmerge-clients-aggregated"] == 3 and metrics["symmerge-clients-unaligned"] == 3


def eval_reply(node: int, metrics: dict | None, extra: dict | None = None) -> Message:
    records = {} if metrics is None else {"metrics": MetricRecord(metrics)}
    records.update({k: MetricRecord(v) for k, v in (extra or {}).items()})
    return Message(content=RecordDict(records), metadata=_metadata(node))


def test_a_bad_evaluation_reply_is_left_out_and_never_ends_the_run(world, caplog):
    """Evaluation rounds (fraction_evaluate > 0, FedAvg's default): a reply without num-examples, with other
    metric names, with two MetricRecords or none, or an error, is left out with a warning naming its node;
    the metrics are FedAvg's over the good replies (Flower's FedAvg raises on the round and ends the run)."""
    g, _, _ = world
    good = [eval_reply(n, {"eval_loss": 0.5 * n, "num-examples": 10 * n}) for n in (1, 2, 3)]
    bad = [eval_reply(5, {"eval_loss": 9.0}), eval_reply(6, {"loss": 9.0, "num-examples": 10}),
           eval_reply(7, {"eval_loss": 9.0, "num-examples": 10}, {"more": {"eval_loss": 9.0, "num-examples": 10}}),
           eval_reply(8, None), eval_reply(9, {"eval_loss": 9.0, "num-examples": float("nan")}), error_reply(4)]
    expected = FedAvg().aggregate_evaluate(1, good)
    s = AlignedFedAvg(template=g)
    assert dict(s.aggregate_evaluate(1, good)) == dict(expected)
    assert dict(s.aggregate_evaluate(1, good + bad)) == dict(expected)
    for node in (5, 6, 7, 8, 9):
        assert any(f"aggregate_evaluate: left out node {node} (malformed)" in r.getMessage() for r in caplog.records)
    assert s.aggregate_evaluate(1, [bad[0]] + bad[2:]) is None and s.aggregate_evaluate(1, []) is None
    with pytest.raises(Exception, match="MetricRecord"):  # the negative control: Flower's FedAvg ends the run
        FedAvg().aggregate_evaluate(1, good + bad[:2])


# ---------------------------------------------------------------- Flower's simulation engine


@pytest.fixture()
def example_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    path = os.pathsep.join([str(ROOT), str(EXAMPLE), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)  # Ray's workers import the apps' modules
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    for name in [m for m in sys.modules if m == "fedvit" or m.startswith("fedvit.")]:
        monkeypatch.delitem(sys.modules, name)


def test_the_example_app_passes_its_robust_options_to_the_strategy(example_on_path):
    """fedvit's settings (pyproject's [tool.flwr.app.config]) reach AlignedFedAvg: the norm clip and the
    outlier rule, 'none' meaning off; a typo in a setting is an error, not ignored."""
    from fedvit import server_app, task

    model = task.load_model(task.settings({"hidden": 16, "layers": 1, "heads": 2}))
    default = AlignedFedAvg(template=model, **server_app.strategy_options(task.settings()))
    assert default.outliers.norm_clip is False and default.outliers.rule is None
    assert default.client_alignment.min_align_gain == 0.05
    assert AlignedFedAvg(template=model, **server_app.strategy_options(task.settings(
        {"min-align-gain": 0.0}))).client_alignment.min_align_gain == 0.0
    cfg = task.settings({"norm-clip": True, "outlier-rule": "krum", "outlier-threshold": 2.5})
    options = server_app.strategy_options(cfg)
    outliers = options["outliers"]
    assert outliers.norm_clip is True and outliers.rule == "krum" and outliers.threshold == 2.5
    strategy = AlignedFedAvg(template=model, **options)
    assert strategy.outliers.norm_clip is True and strategy.outliers.rule == "krum" and strategy.outliers.threshold == 2.5
    with pytest.raises(KeyError, match="outlier-rules"):
        task.settings({"outlier-rules": "krum"})
    with pytest.raises(SymmergeError, match="norm_clip must be True or False, got 'false'"):  # not read as true
        server_app.strategy_options(task.settings({"norm-clip": "false"}))
    # a value of another kind than its setting's: one line naming the setting (float('x') in the server app before)
    for bad, says in ((("trim", "x"), "'trim' must be a number, got 'x'"),
                      (("num-server-rounds", 2.5), "'num-server-rounds' must be a whole number, got 2.5"),
                      (("min-clients", True), "'min-clients' must be a whole number, got True"),
                      (("align", 3), "'align' must be a string, got 3")):
        with pytest.raises(ValueError, match=says):
            task.settings(dict([bad]))
    assert task.settings({"trim": 1, "num-server-rounds": 4.0})["trim"] == 1  # an int where a float goes, 4.0 rounds


def test_two_rounds_three_clients_through_the_simulation_engine(example_on_path):
    pytest.importorskip("ray")
    from flwr.simulation import run_simulation

    from fedvit import client_app, server_app

    tiny = {"dataset": "synthetic", "hidden": 16, "layers": 2, "heads": 2, "examples-per-client": 200,
            "test-examples": 200, "local-steps": 3, "batch-size": 32, "num-server-rounds": 2,
            "attack-partition": 2, "attack-round": 2}  # partition 2 sends a x100-scaled update in round 2
    server_app.LAST_RUN.clear()
    run_simulation(server_app.make_app(tiny), client_app.make_app(tiny), num_supernodes=3,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}, "init_args": {"num_cpus": 2}})
    if not server_app.LAST_RUN:
        pytest.fail("the ServerApp did not finish (see the simulation's log)")
    TRIED["scaled_x100_simulated"] += 1
    rounds = server_app.LAST_RUN["strategy"].rounds
    assert len(rounds) == 2
    assert len(rounds[0]["accepted"]) == 3 and not rounds[0]["left_out"]
    assert len(rounds[1]["accepted"]) == 2 and [x["kind"] for x in rounds[1]["left_out"]] == ["norm"]
    result = server_app.LAST_RUN["result"]
    final = result.arrays.to_torch_state_dict()
    assert all(torch.isfinite(v).all() for v in final.values())
    assert set(result.evaluate_metrics_serverapp) == {0, 1, 2}


def test_zz_bad_replies_tried():
    """The reliability figure: how many bad replies of each kind the tests above sent (printed)."""
    if not set(BAD) <= set(TRIED):
        pytest.skip("counts the bad replies of the whole module: run it all")
    print("bad replies tried:", dict(sorted(TRIED.items())), "total", sum(TRIED.values()))
    assert all(TRIED[k] >= 2 for k in BAD)  # each alone and all together
