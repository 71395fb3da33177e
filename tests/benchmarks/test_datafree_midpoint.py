"""``benchmarks/datafree_midpoint.py`` (issue 42, item 1): J_mid's terms are the midpoint deviations of the
composite maps, formed here explicitly from the interpolated model and the endpoints (brute force, independent
code); J_mid is invariant under one orthogonal element applied to both A′ and B (stream rotation, head and FFN
permutations, per-head rotations), but not to one side; per-head scales and invertible maps keep its block terms
and move the stream terms through a head's Q, K, V or output; the stream scale scales what it should; the bound is a
bound; the descent lowers its objective and its elements preserve A's function (fp64 and fp32)."""

from __future__ import annotations

import argparse

import pytest
import torch

from benchmarks import datafree_midpoint as bench
from benchmarks.datafree_objectives import prepared
from factories import make_model
from symmerge.core.apply import apply, random_elements
from symmerge.groups.head_orthogonal import HeadGL
from symmerge.groups.residual import StreamElement
from symmerge.pipeline import engine
from symmerge.pipeline.verify import verify_elements, verify_forward, with_state_dict

pytestmark = pytest.mark.usefixtures("single_thread")  # no thread count checked here; 2-3x faster on 2 loaded cores

SIZES = dict(hidden_size=8, num_attention_heads=2, intermediate_size=6, num_hidden_layers=3, image_size=8,
             patch_size=4, num_channels=1)
L, H = SIZES["num_hidden_layers"], SIZES["num_attention_heads"]


def pair(dtype=torch.float64):
    return (make_model("vit", head=True, seed=7, dtype=dtype, **SIZES),
            make_model("vit", head=True, seed=3, dtype=dtype, **SIZES))


def canonical_pair(moved: bool = True):
    """Canonical A′ (A moved by a random element of every group) and B, and the instances."""
    a, b = pair()
    bound, setup, ca, cb = prepared(a, b)
    act = engine.active(setup["instances"], setup["opts"])
    if moved:
        ca = apply(ca, act, random_elements(act, torch.Generator().manual_seed(11)))
    return ca, cb, act


# ---------------------------------------------------------------- brute force, written apart from the module
def centring(n: int, extra: int = 0) -> torch.Tensor:
    """The centring of a stream of n dims, block-diagonal with ``extra`` untouched input coordinates (a bias's 1)."""
    P = torch.eye(n + extra, dtype=torch.float64)
    P[:n, :n] -= 1.0 / n
    return P


def composites(sd: dict) -> dict:
    """Every composite map of one model, by name: the score forms, the OV circuits, the linearised FFNs and every
    writer → later reader product, each an explicit matrix on white inputs (the readers through the centring)."""
    d = SIZES["hidden_size"]
    dh, P, P1 = d // H, centring(d), centring(d, 1)
    out, writers = {}, []
    patch = sd["vit.embeddings.patch_embeddings.projection.weight"]
    pos = sd["vit.embeddings.position_embeddings"][0]
    emb = torch.cat([patch.reshape(d, -1), sd["vit.embeddings.patch_embeddings.projection.bias"].reshape(d, 1),
                     pos.T, sd["vit.embeddings.cls_token"].reshape(d, 1)], 1)
    writers.append(("emb", P @ emb))
    for layer in range(L):
        g = lambda n: sd[f"vit.layers.{layer}.{n}"]  # noqa: E731
        readers = {"q": g("attention.q_proj.weight"), "k": g("attention.k_proj.weight"),
                   "v": g("attention.v_proj.weight")}
        for name, r in readers.items():
            for w_name, w in writers:
                out[f"{w_name}->{name}{layer}"] = r @ P @ w
        for h in range(H):
            rows = slice(h * dh, (h + 1) * dh)
            q = torch.cat([readers["q"][rows], g("attention.q_proj.bias")[rows, None]], 1) @ P1
            k = readers["k"][rows] @ P
            out[f"qk{layer}.{h}"] = q.T @ k
            v = torch.cat([readers["v"][rows], g("attention.v_proj.bias")[rows, None]], 1) @ P1
            out[f"ov{layer}.{h}"] = P @ g("attention.o_proj.weight")[:, rows] @ v
        o = torch.cat([g("attention.o_proj.weight"), g("attention.o_proj.bias")[:, None]], 1)
        writers.append((f"o{layer}", P @ o))
        fc1 = g("mlp.fc1.weight")
        for w_name, w in writers:
            out[f"{w_name}->fc1{layer}"] = fc1 @ P @ w
        fc1_aug = torch.cat([fc1, g("mlp.fc1.bias")[:, None]], 1) @ P1
        out[f"ffn{layer}"] = P @ g("mlp.fc2.weight") @ fc1_aug
        writers.append((f"fc2{layer}", P @ torch.cat([g("mlp.fc2.weight"), g("mlp.fc2.bias")[:, None]], 1)))
    for w_name, w in writers:
        out[f"{w_name}->classifier"] = sd["classifier.weight"] @ P @ w
    return out


def brute_force(sd_a: dict, sd_b: dict) -> dict:
    """``{composite: ‖4 · (mean of the endpoints' composites − the midpoint's composite)‖²}``."""
    mid = {k: (sd_a[k] + sd_b[k]) / 2 for k in sd_a}
    ca, cb, cm = composites(sd_a), composites(sd_b), composites(mid)
    return {k: float((4 * ((ca[k] + cb[k]) / 2 - cm[k])).square().sum()) for k in cm}


def test_terms_are_the_midpoint_deviations_of_the_composites():
    ca, cb, _ = canonical_pair()
    want = brute_force(ca, cb)
    t = bench.terms(ca, cb, L, H)
    assert len(want) == t["qk"].numel() + t["ov"].numel() + L + int(bench.reads(L).sum())
    for layer in range(L):
        for h in range(H):
            assert float(t["qk"][layer, h]) == pytest.approx(want[f"qk{layer}.{h}"], rel=1e-10)
            assert float(t["ov"][layer, h]) == pytest.approx(want[f"ov{layer}.{h}"], rel=1e-10)
        assert float(t["ffn"][layer]) == pytest.approx(want[f"ffn{layer}"], rel=1e-10)
    writers = ["emb"] + [f"{n}{i}" for i in range(L) for n in ("o", "fc2")]
    readers = [f"{n}{i}" for i in range(L) for n in bench.READERS] + ["classifier"]
    mask = bench.reads(L)
    for w, wn in enumerate(writers):
        for r, rn in enumerate(readers):
            key = f"{wn}->{rn}"
            assert bool(mask[w, r]) == (key in want), key
            if key in want:
                assert float(t["pair"][w, r]) == pytest.approx(want[key], rel=1e-10), key
            else:
                assert float(t["pair"][w, r]) == 0.0
    total = bench.objective(t, "all", L)
    assert float(total) == pytest.approx(sum(want.values()), rel=1e-10)


def test_own_is_the_endpoints_composites_and_the_bound_bounds():
    ca, cb, _ = canonical_pair()
    own, dev, bound = (bench.terms(ca, cb, L, H, of=of) for of in ("own", "deviation", "bound"))
    one, two = composites(ca), composites(cb)
    assert float(own["ffn"][1]) == pytest.approx(float(one["ffn1"].square().sum() + two["ffn1"].square().sum()))
    for k in dev:
        assert bool((dev[k] <= bound[k] * (1 + 1e-12)).all())
        assert bool((bound[k][dev[k] > 0] > dev[k][dev[k] > 0]).any())


def test_invariant_under_one_orthogonal_element_on_both_sides():
    """The stream rotation, head and FFN permutations, per-head rotations: every term (a layer's per-head terms
    reordered by the head permutation)."""
    ca, cb, act = canonical_pair()
    g = random_elements(act, torch.Generator().manual_seed(5), scale=False)
    before = bench.terms(ca, cb, L, H)
    after = bench.terms(apply(ca, act, g), apply(cb, act, g), L, H)
    for k in before:
        sort = (lambda x: x.sort(-1).values) if k in ("qk", "ov") else (lambda x: x)
        torch.testing.assert_close(sort(after[k]), sort(before[k]), rtol=1e-9, atol=1e-10)
    one_side = bench.terms(apply(ca, act, g), cb, L, H)  # the control: moving A′ alone changes J_mid
    assert abs(float(bench.objective(one_side, "all", L)) / float(bench.objective(before, "all", L)) - 1) > 1e-3
    own, own_moved = bench.terms(ca, cb, L, H, of="own"), bench.terms(apply(ca, act, g), cb, L, H, of="own")
    for k in own:  # the endpoints' own composites: A′ alone moved keeps them (``rel-`` weights), a head's slot
        per = (lambda x: x.sum(-1)) if k in ("qk", "ov") else (lambda x: x)  # pairing A's head i with another of B
        torch.testing.assert_close(per(own_moved[k]), per(own[k]), rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("gl", [False, True])
def test_per_head_scales_and_maps_keep_the_block_terms_only(gl):
    """Per-head scales (and invertible maps) keep the block terms (functions of the composites QᵀK, OV), but move
    the stream terms whose reader is a head's Q, K or V or whose writer is an attention output (a map of that
    factor alone); the others stay."""
    ca, cb, act = canonical_pair()
    g = random_elements(act, torch.Generator().manual_seed(5), scale=True)
    if gl:
        gen = torch.Generator().manual_seed(6)
        g = {n: ((e, HeadGL(torch.eye(4, dtype=torch.float64) + 0.3 * torch.randn(H, 4, 4, generator=gen,
                                                                                  dtype=torch.float64)))
                 if ".attn." in n else e) for n, e in g.items()}
    before = bench.terms(ca, cb, L, H)
    after = bench.terms(apply(ca, act, g), apply(cb, act, g), L, H)
    for k in ("qk", "ov", "ffn"):
        torch.testing.assert_close(after[k].sort(-1).values if k != "ffn" else after[k],
                                   before[k].sort(-1).values if k != "ffn" else before[k], rtol=1e-9, atol=1e-10)
    reader = torch.tensor([n in ("q", "k", "v") for _ in range(L) for n in bench.READERS] + [False])
    writer = torch.tensor([False] + [n == "o" for _ in range(L) for n in ("o", "fc2")])
    heads = reader[None, :] | writer[:, None]
    torch.testing.assert_close(after["pair"][~heads], before["pair"][~heads], rtol=1e-9, atol=1e-10)
    assert not torch.allclose(after["pair"][heads], before["pair"][heads], rtol=1e-3)


def test_the_stream_scale_scales_what_it_should():
    """A stream scale c on both sides multiplies every writer: the OV, FFN and stream terms by c², not QK."""
    ca, cb, act = canonical_pair()
    stream = [i for i in act if i.name == "residual"]
    g = {"residual": StreamElement(Q=torch.eye(SIZES["hidden_size"], dtype=torch.float64), scale=1.7)}
    before = bench.terms(ca, cb, L, H)
    after = bench.terms(apply(ca, stream, g), apply(cb, stream, g), L, H)
    torch.testing.assert_close(after["qk"], before["qk"])
    for k in ("ov", "ffn", "pair"):
        torch.testing.assert_close(after[k], before[k] * 1.7 ** 2)


def test_objective_variants():
    ca, cb, _ = canonical_pair()
    t, own = bench.terms(ca, cb, L, H), bench.terms(ca, cb, L, H, of="own")
    parts = {k: float(v.sum()) for k, v in t.items()}
    assert float(bench.objective(t, "block", L)) == pytest.approx(parts["qk"] + parts["ov"] + parts["ffn"])
    assert float(bench.objective(t, "stream", L)) == pytest.approx(parts["pair"])
    w, ww = bench.depth(L, 10.0)
    assert float(w[-1]) == pytest.approx(0.1) and float(ww[0]) == 1.0 and float(ww[-1]) == pytest.approx(0.1)
    assert float(bench.objective(t, "ffn@10", L)) == pytest.approx(float((t["ffn"] * w).sum()))
    rel = float(bench.objective(t, "rel-qk", L, own))
    assert rel == pytest.approx(float((t["qk"] / own["qk"]).sum()))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_descent_lowers_its_objective_and_preserves_the_function(dtype):
    a, b = pair(dtype)
    bound, setup, ca, cb = prepared(a, b)
    ctx = {"a": a, "setup": setup, "ca": ca, "cb": cb}
    start, _ = engine.search(setup["instances"], ca, cb, setup["opts"], starts=engine.Restarts(None, None,
                                                                                               depth_decay=10.0))
    args = argparse.Namespace(lr=1e-2, steps=40, checkpoints={0, 40})
    run = bench.descend("all:0", ctx, start, args)
    assert run["history"][-1]["J"] < 0.9 * run["history"][0]["J"]
    assert run["history"][0]["J"] == pytest.approx(run["J_start"])
    for step, found in run["kept"].items():
        verify_elements(setup["instances"], found)
        check = verify_forward(a, with_state_dict(a, apply(ca, setup["instances"], found)), bound.spec)
        assert check["verify_max_rel_diff"] <= (1e-9 if dtype == torch.float64 else 1e-5)
    ends = {k: v.double() for k, v in apply(ca, setup["instances"], run["kept"][40]).items()}
    value = float(bench.objective(bench.terms(ends, {k: v.double() for k, v in cb.items()}, L, H), "all", L))
    assert value < 0.9 * run["J_start"]
