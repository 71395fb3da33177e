"""Fusion methods checked against their definitions on hand-made tensors and tiny real models."""

from __future__ import annotations

import copy

import pytest
import torch

from symmerge.errors import SymmergeError
from symmerge.merge.fuse import merge_models
from symmerge.merge import METHODS, STATISTICS, Method, get_method, merge_state_dicts, register
from symmerge.merge import average, dare, dare_ties, fisher, regmean, task_arithmetic, ties
from symmerge.merge.base import check_layout
from symmerge.merge.parts import dare_keep_mask

# symmerge's own variants of mergekit's methods (before 2026-11-28 the defaults of --method ties / dare / dare_ties;
# now every name means mergekit's method with mergekit's defaults, and these are explicit parameter values)
SYM_TIES = {"scope": "model", "normalize": "count"}
SYM_DARE = {"rescale": "inverse"}
SYM_DARE_TIES = {"rescale": "inverse", "normalize": "count"}


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
    assert "dare_ties" in METHODS and get_method("dare_ties") is dare_ties.METHOD
    m = get_method("dare_ties")
    # mergekit's defaults (one meaning from the command line and a config): nothing dropped, L1 rescale, a sum
    assert {k: m.params[k] for k in ("drop", "scale", "seed")} == {"drop": 0.0, "scale": 1.0, "seed": 0}
    assert m.params["normalize"] is False and m.params["rescale"] is True
    assert get_method("dare").params == get_method("dare_linear").params  # one method, two names
    assert m.needs_base and m.needs is None
    assert m.doc.startswith("DARE-TIES") and "\n" not in m.doc
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
    out = ties.merge([t1, t2], base=base, density=0.5, **SYM_TIES)
    assert torch.equal(out["w"], torch.tensor([3.0, 2.0, 0.0, -4.0]))
    # agreeing entries are averaged, not summed; scale multiplies the merged task vector
    t3 = {"w": torch.tensor([1.0, 4.0, 0.0, 0.0])}
    out = ties.merge([t1, t3], base={"w": torch.ones(4)}, density=1.0, scale=2.0, **SYM_TIES)
    # τ1 = [2, -2, -0.5, -5], τ3 = [0, 3, -1, -1]: sums [2, 1, -1.5, -6] -> means [2, 3, -0.75, -3]
    assert torch.allclose(out["w"], 1.0 + 2.0 * torch.tensor([2.0, 3.0, -0.75, -3.0]))


def test_ties_trims_over_the_whole_model_or_per_tensor():
    base = {"a": torch.zeros(2), "b": torch.zeros(2)}
    t = {"a": torch.tensor([10.0, 9.0]), "b": torch.tensor([1.0, 2.0])}
    whole = ties.merge([t], base=base, density=0.5, **SYM_TIES)  # top 2 of 4 entries: both of "a"
    assert torch.equal(whole["a"], t["a"]) and torch.equal(whole["b"], torch.zeros(2))
    per = ties.merge([t], base=base, density=0.5, scope="tensor", normalize="count")  # top 1 of each tensor
    assert torch.equal(per["a"], torch.tensor([10.0, 0.0])) and torch.equal(per["b"], torch.tensor([0.0, 2.0]))


def test_ties_keeps_the_kth_entry_even_when_float32_rounds_it_up():
    """The k-th largest magnitude v = 1 + 2^-23 - 2^-30 rounds *up* to float32 (1 + 2^-23): compared in
    float64 against that rounded threshold, v itself would be dropped and only k - 1 entries kept."""
    v = 1.0 + 2.0 ** -23 - 2.0 ** -30
    assert torch.tensor(v, dtype=torch.float32).item() > v
    t = {"w": torch.tensor([3.0, v, 0.5, -0.25], dtype=torch.float64)}
    for scope in ("model", "tensor"):  # density 0.5 of 4 entries: keep 3 and v
        out = ties.merge([t], base={"w": torch.zeros(4, dtype=torch.float64)}, density=0.5, scope=scope, normalize="count")
        assert torch.equal(out["w"], torch.tensor([3.0, v, 0.0, 0.0], dtype=torch.float64)), scope


def test_dare_drops_with_probability_p_and_rescales_survivors():
    n, p = 20000, 0.7
    base = {"w": torch.full((n,), 0.5, dtype=torch.float64)}
    tau = torch.linspace(1.0, 2.0, n, dtype=torch.float64)
    out = dare.merge([{"w": base["w"] + tau}], base=base, drop=p, seed=3, **SYM_DARE)["w"] - base["w"]
    kept = out != 0
    assert abs(kept.double().mean().item() - (1 - p)) < 0.015
    assert torch.allclose(out[kept], tau[kept] / (1 - p))
    again = dare.merge([{"w": base["w"] + tau}], base=base, drop=p, seed=3, **SYM_DARE)["w"] - base["w"]
    other = dare.merge([{"w": base["w"] + tau}], base=base, drop=p, seed=4, **SYM_DARE)["w"] - base["w"]
    assert torch.equal(out, again) and not torch.equal(out, other)
    # p = 0 is task arithmetic
    m1, m2, b = sd_of(1), sd_of(2), sd_of(0)
    d0, ta = dare.merge([m1, m2], base=b, drop=0.0, **SYM_DARE), task_arithmetic.merge([m1, m2], base=b)
    assert all(torch.allclose(d0[k], ta[k]) for k in b)


def test_dare_ties_without_drop_is_ties_without_trimming():
    base = {"w": torch.ones(4)}
    t1 = {"w": torch.tensor([3.0, -1.0, 0.5, -4.0])}
    t3 = {"w": torch.tensor([1.0, 4.0, 0.0, 0.0])}
    out = dare_ties.merge([t1, t3], base=base, drop=0.0, scale=2.0, **SYM_DARE_TIES)
    # τ1 = [2, -2, -0.5, -5], τ3 = [0, 3, -1, -1]: elected (+, +, -, -), disjoint means [2, 3, -0.75, -3]
    assert torch.allclose(out["w"], 1.0 + 2.0 * torch.tensor([2.0, 3.0, -0.75, -3.0]))
    assert torch.equal(out["w"], ties.merge([t1, t3], base=base, density=1.0, scale=2.0, **SYM_TIES)["w"])
    m1, m2, b = sd_of(1), sd_of(2), sd_of(0)
    d0 = dare_ties.merge([m1, m2], base=b, drop=0.0, scale=0.5, **SYM_DARE_TIES)
    t0 = ties.merge([m1, m2], base=b, density=1.0, scale=0.5, **SYM_TIES)
    assert all(torch.equal(d0[k], t0[k]) for k in b)


def test_dare_ties_drops_at_rate_p_then_elects_signs_of_the_rescaled_survivors():
    n, p, seed = 20000, 0.6, 5
    base = {"w": torch.zeros(n, dtype=torch.float64)}
    t1 = {"w": torch.ones(n, dtype=torch.float64)}
    t2 = {"w": torch.full((n,), -3.0, dtype=torch.float64)}
    keep1, keep2 = dare_keep_mask((n,), p, seed, 0, "w"), dare_keep_mask((n,), p, seed, 1, "w")
    # each model keeps 1 − p of its entries, independently of the other model
    assert abs(keep1.double().mean().item() - (1 - p)) < 0.015
    assert abs(keep2.double().mean().item() - (1 - p)) < 0.015
    assert abs((keep1 & keep2).double().mean().item() - (1 - p) ** 2) < 0.015
    # weights 2 and 0.5: survivors 2/(1−p) and −1.5/(1−p); where both survive the sum is positive,
    # so γ = + and only model 0's entry is averaged (model 1 disagrees)
    out = dare_ties.merge([t1, t2], base=base, weights=[2.0, 0.5], drop=p, seed=seed, **SYM_DARE_TIES)["w"]
    a, b = 2.0 / (1 - p), -1.5 / (1 - p)
    expect = torch.where(keep1, torch.full((n,), a, dtype=torch.float64),
                         torch.where(keep2, torch.full((n,), b, dtype=torch.float64),
                                     torch.zeros(n, dtype=torch.float64)))
    assert torch.allclose(out, expect, rtol=0, atol=1e-12)
    # the weights flip the election: equal weights make model 1 win where both survive
    out = dare_ties.merge([t1, t2], base=base, drop=p, seed=seed, **SYM_DARE_TIES)["w"]
    expect = torch.where(keep2, torch.full((n,), -3.0 / (1 - p), dtype=torch.float64),
                         torch.where(keep1, torch.full((n,), 1.0 / (1 - p), dtype=torch.float64),
                                     torch.zeros(n, dtype=torch.float64)))
    assert torch.allclose(out, expect, rtol=0, atol=1e-12)
    # an entry is zero only where both models dropped it: rate p²
    assert abs((out == 0).double().mean().item() - p ** 2) < 0.015
    # DARE (sum consensus) with the same masks adds the survivors instead
    summed = dare.merge([t1, t2], base=base, drop=p, seed=seed, **SYM_DARE)["w"]
    assert torch.allclose(summed, (keep1.double() - 3.0 * keep2.double()) / (1 - p), rtol=0, atol=1e-12)


def test_dare_masks_depend_on_seed_model_and_key_not_on_key_order():
    g = torch.Generator().manual_seed(0)
    keys = ["a", "b.weight", "c.bias", "d"]
    base = {k: torch.randn(50, generator=g) for k in keys}
    models = [{k: base[k] + torch.randn(50, generator=g) for k in keys} for _ in range(2)]
    for method in (dare, dare_ties):
        out = method.merge(models, base=base, drop=0.5, seed=7)
        perm = [2, 0, 3, 1]
        shuffled = [{keys[j]: sd[keys[j]] for j in perm} for sd in models]
        out_s = method.merge(shuffled, base={keys[j]: base[keys[j]] for j in perm}, drop=0.5, seed=7)
        assert list(out_s) == [keys[j] for j in perm]
        assert all(torch.equal(out[k], out_s[k]) for k in keys)
        # merging a subset of the tensors draws the same masks for them
        sub = method.merge([{"c.bias": sd["c.bias"]} for sd in models], base={"c.bias": base["c.bias"]},
                           drop=0.5, seed=7)
        assert torch.equal(sub["c.bias"], out["c.bias"])
    # the mask differs between keys, models and seeds
    m = dare_keep_mask((200,), 0.5, 7, 0, "a")
    assert torch.equal(m, dare_keep_mask((200,), 0.5, 7, 0, "a"))
    for other in (dare_keep_mask((200,), 0.5, 7, 0, "b.weight"), dare_keep_mask((200,), 0.5, 7, 1, "a"),
                  dare_keep_mask((200,), 0.5, 8, 0, "a")):
        assert not torch.equal(m, other)
    # the result follows the documented masks: model i's survivors of key k are mask(seed, i, k)
    out = dare.merge(models, base=base, drop=0.5, seed=7, **SYM_DARE)
    for k in keys:
        expect = base[k].double() + sum(dare_keep_mask((50,), 0.5, 7, i, k) * (sd[k].double() - base[k].double())
                                        / 0.5 for i, sd in enumerate(models))
        assert torch.allclose(out[k], expect.float(), atol=1e-6), k


# ------------------------------------------------------------------ the shared loop


def test_loop_copies_non_floating_tensors_from_the_base_else_the_first_model_and_keeps_dtypes():
    ids = [torch.arange(5, dtype=torch.int64) + i for i in range(3)]  # base, model 0, model 1
    base = {"w": torch.zeros(3), "h": torch.zeros(2, dtype=torch.float16), "position_ids": ids[0]}
    m0 = {"w": torch.tensor([1.0, 2.0, 3.0]), "h": torch.tensor([1.0, 2.0], dtype=torch.float16),
          "position_ids": ids[1]}
    m1 = {"w": torch.tensor([3.0, 2.0, 1.0]), "h": torch.tensor([3.0, 4.0], dtype=torch.float16),
          "position_ids": ids[2]}
    for method in (task_arithmetic, ties, dare, dare_ties):
        out = method.merge([m0, m1], base=base)
        assert torch.equal(out["position_ids"], ids[0]) and out["position_ids"].dtype == torch.int64
        assert out["position_ids"] is not base["position_ids"]  # a copy
        assert out["h"].dtype == torch.float16 and out["w"].dtype == torch.float32
    avg = average.merge([m0, m1])
    assert torch.equal(avg["position_ids"], ids[1]) and avg["position_ids"] is not m0["position_ids"]
    assert torch.equal(avg["w"], torch.tensor([2.0, 2.0, 2.0])) and avg["h"].dtype == torch.float16
    assert torch.equal(avg["h"], torch.tensor([2.0, 3.0], dtype=torch.float16))
    ta = task_arithmetic.merge([m0, m1], base=base, weights=[1.0, 0.5])
    assert torch.equal(ta["w"], torch.tensor([2.5, 3.0, 3.5]))


def test_layout_check_rejects_mismatched_keys_shapes_and_base():
    a = {"w": torch.zeros(3), "b": torch.zeros(2)}
    assert check_layout([a, {"w": torch.ones(3), "b": torch.ones(2)}]) == ["w", "b"]
    cases = [
        (lambda: average.merge([a, {"w": torch.zeros(3)}]), "model 1 has different tensors"),
        (lambda: average.merge([a, {"w": torch.zeros(3), "b": torch.zeros(3)}]), "shapes differ for b: model 1"),
        (lambda: average.merge([]), "no models"),
        (lambda: ties.merge([a, a]), "needs a base model"),
        (lambda: dare_ties.merge([a], base={"w": torch.zeros(3)}), "base model lacks tensor 'b'"),
        (lambda: dare.merge([a], base={"w": torch.zeros(3), "b": torch.zeros(1, 2)}), "shapes differ for b: base"),
        (lambda: average.merge([a], base=a), "does not use a base model"),
        (lambda: regmean.merge([a, a], stats=[{}]), "Gram matrices of every model"),
        (lambda: ties.merge([a], base=a, density=-0.1), "density"),  # 0 is mergekit's: the base
        (lambda: ties.merge([a], base=a, scope="layer"), "scope"),
        (lambda: dare_ties.merge([a], base=a, drop=1.5), "drop"),
        (lambda: dare_ties.merge([a], base=a, drop=0.5, density=0.5), "'drop' or its alias 'density'"),
        (lambda: regmean.merge([a], stats=[{}], alpha=2.0), "alpha"),
    ]
    for call, message in cases:
        with pytest.raises(SymmergeError, match=message):
            call()


def test_merge_state_dicts_runs_prepare_once_and_passes_its_context():
    calls = []

    def prepare(state_dicts, base, weights, params):
        calls.append(weights)
        return max(sd[k].abs().max().item() for sd in state_dicts for k in sd)  # a whole-model quantity

    def tensor(key, tensors, weights, stats, base, params, context):
        return weighted_sum_of(tensors, weights) / context * params["gain"]

    def weighted_sum_of(tensors, weights):
        return sum(w * t.double() for t, w in zip(tensors, weights))

    m = Method("scaled", tensor, params={"gain": 1.0}, prepare=prepare)
    sds = [{"x": torch.tensor([1.0, -4.0]), "y": torch.tensor([2.0])},
           {"x": torch.tensor([3.0, 0.0]), "y": torch.tensor([0.0])}]
    out = merge_state_dicts(m, sds, weights=[1.0, 3.0], gain=2.0)
    assert calls == [[0.25, 0.75]]  # weights normalised once, prepare called once
    assert torch.allclose(out["x"], torch.tensor([2.5, -1.0]) / 4.0 * 2.0)
    assert torch.allclose(out["y"], torch.tensor([0.5]) / 4.0 * 2.0)
    assert torch.equal(m.merge(sds, weights=[1.0, 3.0], gain=2.0)["x"], out["x"])


def test_registering_a_method_with_unknown_statistics_fails():
    assert STATISTICS == ("gram", "fisher", "activations")
    assert all(m.needs in (None, *STATISTICS) for m in METHODS.values())
    with pytest.raises(SymmergeError, match="unknown statistics 'hessian'"):
        register(Method("hessian_average", average.METHOD.tensor, needs="hessian"))
    assert "hessian_average" not in METHODS
    ok = register(Method("fisher_copy_for_test", fisher.METHOD.tensor, needs="fisher", params={"eps": 1e-8}))
    try:
        assert get_method("fisher_copy_for_test") is ok
    finally:
        del METHODS["fisher_copy_for_test"]


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
    merged, report = merge_models(models, "average", align="none", progress=False)
    emb = "bert.embeddings.word_embeddings.weight"
    expect = (models[0].state_dict()[emb] + models[1].state_dict()[emb]) / 2
    assert torch.allclose(merged.state_dict()[emb], expect)
    assert torch.equal(merged.cls.predictions.decoder.weight, merged.state_dict()[emb])
    assert "cls.predictions.decoder.weight" not in report["head"]["keys"]
