"""Fusion methods checked against their definitions on hand-made tensors and tiny real models."""

from __future__ import annotations

import copy

import pytest
import torch

from symmerge.errors import SymmergeError
from symmerge.fuse import merge_models
from symmerge.merge import METHODS, get_method
from symmerge.merge import average, dare, fisher, regmean, task_arithmetic, ties


def mm_bert(seed: int, num_labels: int = 3):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=24, max_position_embeddings=32, num_labels=num_labels, initializer_range=0.3)
    return BertForSequenceClassification(cfg).eval()


def sd_of(seed: int) -> dict:
    return {k: v.clone() for k, v in mm_bert(seed).state_dict().items()}


# ------------------------------------------------------------------ registry


def test_registry_knows_every_method_and_rejects_unknown_ones():
    assert {"average", "task_arithmetic", "ties", "dare", "fisher", "regmean"} <= set(METHODS)
    with pytest.raises(SymmergeError, match="known methods: .*average.*regmean"):
        get_method("soup")
    with pytest.raises(SymmergeError, match="no parameter 'alpah'"):
        get_method("regmean").check_params({"alpah": 0.5})


# ------------------------------------------------------------------ average / task arithmetic


def test_average_of_identical_models_is_the_model():
    sd = sd_of(0)
    out = average.merge([sd, sd, sd], weights=[0.2, 0.3, 0.5])
    for k in sd:
        assert torch.equal(out[k], sd[k]), k
    model = mm_bert(0)
    merged, report = merge_models([model, copy.deepcopy(model)], "average", progress=False)
    ids = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    assert torch.allclose(merged(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6)
    assert report["head"]["policy"] == "keep" and report["head"]["from_index"] == 0


def test_weighted_average_matches_hand_computation():
    a, b = {"w": torch.tensor([1.0, 2.0])}, {"w": torch.tensor([5.0, -2.0])}
    out = average.merge([a, b], weights=[1.0, 3.0])  # normalised to 0.25, 0.75
    assert torch.allclose(out["w"], torch.tensor([4.0, -1.0]))
    with pytest.raises(SymmergeError, match="weights"):
        average.merge([a, b], weights=[1.0])


def test_task_arithmetic_with_zero_scale_is_the_base_and_follows_its_formula():
    base, m1, m2 = sd_of(0), sd_of(1), sd_of(2)
    out = task_arithmetic.merge([m1, m2], base=base, scale=0.0)
    assert all(torch.equal(out[k], base[k]) for k in base)
    out = task_arithmetic.merge([m1, m2], base=base, scale=0.5, weights=[1.0, 2.0])
    for k in base:
        expect = base[k] + 0.5 * ((m1[k] - base[k]) + 2.0 * (m2[k] - base[k]))
        assert torch.allclose(out[k], expect, atol=1e-6), k
    with pytest.raises(SymmergeError, match="base"):
        task_arithmetic.merge([m1, m2])


# ------------------------------------------------------------------ TIES / DARE


def test_ties_trim_elect_disjoint_mean_on_hand_made_tensors():
    base = {"w": torch.zeros(4)}
    t1 = {"w": torch.tensor([3.0, -1.0, 0.5, -4.0])}
    t2 = {"w": torch.tensor([-2.0, 2.0, 0.1, -1.0])}
    # density 0.5: t1 keeps {3, -4}, t2 keeps {-2, 2}; signs of the sums [1, 2, 0, -4] -> (+, +, 0, -)
    # disjoint means: [3 (t2 disagrees), 2, 0 (nobody), -4]
    out = ties.merge([t1, t2], base=base, density=0.5)
    assert torch.equal(out["w"], torch.tensor([3.0, 2.0, 0.0, -4.0]))
    # agreeing entries are averaged, not summed; scale multiplies the merged task vector
    t3 = {"w": torch.tensor([1.0, 4.0, 0.0, 0.0])}
    out = ties.merge([t1, t3], base={"w": torch.ones(4)}, density=1.0, scale=2.0)
    # τ1 = [2, -2, -0.5, -5], τ3 = [0, 3, -1, -1]: sums [2, 1, -1.5, -6] -> means [2, 3, -0.75, -3]
    assert torch.allclose(out["w"], 1.0 + 2.0 * torch.tensor([2.0, 3.0, -0.75, -3.0]))


def test_ties_trims_over_the_whole_model_or_per_tensor():
    base = {"a": torch.zeros(2), "b": torch.zeros(2)}
    t = {"a": torch.tensor([10.0, 9.0]), "b": torch.tensor([1.0, 2.0])}
    whole = ties.merge([t], base=base, density=0.5)  # top 2 of 4 entries: both of "a"
    assert torch.equal(whole["a"], t["a"]) and torch.equal(whole["b"], torch.zeros(2))
    per = ties.merge([t], base=base, density=0.5, scope="tensor")  # top 1 of each tensor
    assert torch.equal(per["a"], torch.tensor([10.0, 0.0])) and torch.equal(per["b"], torch.tensor([0.0, 2.0]))


def test_dare_drops_with_probability_p_and_rescales_survivors():
    n, p = 20000, 0.7
    base = {"w": torch.full((n,), 0.5, dtype=torch.float64)}
    tau = torch.linspace(1.0, 2.0, n, dtype=torch.float64)
    out = dare.merge([{"w": base["w"] + tau}], base=base, drop=p, seed=3)["w"] - base["w"]
    kept = out != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 0.015
    assert torch.allclose(out[kept], tau[kept] / (1 - p))
    again = dare.merge([{"w": base["w"] + tau}], base=base, drop=p, seed=3)["w"] - base["w"]
    other = dare.merge([{"w": base["w"] + tau}], base=base, drop=p, seed=4)["w"] - base["w"]
    assert torch.equal(out, again) and not torch.equal(out, other)
    # p = 0 is task arithmetic
    m1, m2, b = sd_of(1), sd_of(2), sd_of(0)
    d0, ta = dare.merge([m1, m2], base=b, drop=0.0), task_arithmetic.merge([m1, m2], base=b)
    assert all(torch.allclose(d0[k], ta[k]) for k in b)


# ------------------------------------------------------------------ Fisher


def test_fisher_with_equal_fishers_is_averaging_and_weights_by_fisher():
    m1, m2 = sd_of(1), sd_of(2)
    g = torch.Generator().manual_seed(0)
    f = {k: torch.rand(v.shape, generator=g) + 0.1 for k, v in m1.items()}
    out, avg = fisher.merge([m1, m2], stats=[f, f], weights=[0.3, 0.7]), average.merge([m1, m2], weights=[0.3, 0.7])
    assert all(torch.allclose(out[k], avg[k], atol=1e-6) for k in m1)
    a, b = {"w": torch.tensor([0.0, 0.0])}, {"w": torch.tensor([4.0, 4.0])}
    out = fisher.merge([a, b], stats=[{"w": torch.tensor([1.0, 0.0])}, {"w": torch.tensor([3.0, 1.0])}])
    assert torch.allclose(out["w"], torch.tensor([3.0, 4.0]))
    with pytest.raises(SymmergeError, match="Fisher"):
        fisher.merge([a, b])


# ------------------------------------------------------------------ RegMean


def test_regmean_with_one_model_returns_it():
    sd = sd_of(0)
    g = torch.Generator().manual_seed(0)
    stats = {}
    for k, v in sd.items():
        if v.dim() == 2 and k.endswith("weight") and "embeddings" not in k:
            x = torch.randn(40, v.shape[1], generator=g, dtype=torch.float64)
            stats[k] = x.T @ x
    out = regmean.merge([sd], stats=[stats], alpha=0.7)
    assert all(torch.allclose(out[k], sd[k], atol=1e-5) for k in sd)


def test_regmean_is_the_closed_form_least_squares_solution():
    g = torch.Generator().manual_seed(0)
    d, o = 6, 4
    xs = [torch.randn(n, d, generator=g, dtype=torch.float64) for n in (9, 15)]
    ws = [torch.randn(o, d, generator=g, dtype=torch.float64) for _ in xs]
    bs = [torch.randn(o, generator=g, dtype=torch.float64) for _ in xs]
    sds = [{"lin.weight": w, "lin.bias": b} for w, b in zip(ws, bs)]
    out = regmean.merge(sds, stats=[{"lin.weight": x.T @ x} for x in xs], alpha=1.0)
    # min_W Σ_i ‖X_i Wᵀ − X_i W_iᵀ‖²: stack the regressions and solve by least squares
    lhs = torch.cat(xs)
    rhs = torch.cat([x @ w.T for x, w in zip(xs, ws)])
    expect = torch.linalg.lstsq(lhs, rhs).solution.T
    assert torch.allclose(out["lin.weight"], expect, atol=1e-10)
    assert torch.allclose(out["lin.bias"], (bs[0] + bs[1]) / 2)  # biases are averaged
    # α = 0: each input column is a Gram-diagonal-weighted average of the models' columns
    out0 = regmean.merge(sds, stats=[{"lin.weight": x.T @ x} for x in xs], alpha=0.0)
    dg = [torch.diagonal(x.T @ x) for x in xs]
    expect0 = (dg[0] * ws[0] + dg[1] * ws[1]) / (dg[0] + dg[1])
    assert torch.allclose(out0["lin.weight"], expect0, atol=1e-12)


def test_regmean_differs_from_averaging_unless_grams_are_isotropic():
    m1, m2 = sd_of(1), sd_of(2)
    lin = [k for k, v in m1.items() if v.dim() == 2 and "embeddings" not in k]
    g = torch.Generator().manual_seed(5)
    aniso = []
    for _ in range(2):
        s = {}
        for k in lin:
            x = torch.randn(30, m1[k].shape[1], generator=g, dtype=torch.float64) * torch.linspace(0.1, 3, m1[k].shape[1])
            s[k] = x.T @ x
        aniso.append(s)
    iso = [{k: 2.0 * torch.eye(m1[k].shape[1], dtype=torch.float64) for k in lin}] * 2
    avg = average.merge([m1, m2])
    out_iso = regmean.merge([m1, m2], stats=iso, alpha=1.0)
    out_aniso = regmean.merge([m1, m2], stats=aniso, alpha=0.9)
    assert all(torch.allclose(out_iso[k], avg[k], atol=1e-6) for k in m1)
    for k in lin:
        assert (out_aniso[k] - avg[k]).abs().max() > 1e-3, k
    for k in m1:
        if k not in lin:
            assert torch.allclose(out_aniso[k], avg[k]), k  # non-linear parameters are averaged


def test_tied_lm_decoder_follows_the_merged_embeddings():
    from transformers import BertConfig, BertLMHeadModel

    models = []
    for seed in (3, 4):
        torch.manual_seed(seed)
        models.append(BertLMHeadModel(BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                                                 num_attention_heads=2, intermediate_size=24, is_decoder=True,
                                                 max_position_embeddings=32, initializer_range=0.3)).eval())
    merged, report = merge_models(models, "average", progress=False)
    emb = "bert.embeddings.word_embeddings.weight"
    expect = (models[0].state_dict()[emb] + models[1].state_dict()[emb]) / 2
    assert torch.allclose(merged.state_dict()[emb], expect)
    assert torch.equal(merged.cls.predictions.decoder.weight, merged.state_dict()[emb])
    assert "cls.predictions.decoder.weight" not in report["head"]["keys"]
