"""symmerge.align recovers hidden group elements, never increases the distance, and honours
``layers`` and ``symmetries`` as documented."""

from __future__ import annotations

import itertools

import pytest
import torch

from conftest import add_noise, make_inputs, output_rel_diff, sq_dist, with_weights
from factories import make_model
from symmerge.core.apply import apply, random_elements
from symmerge.errors import SymmergeError
from symmerge.pipeline.align import align, instances_for
from symmerge.pipeline.bound import bind

pytestmark = pytest.mark.usefixtures("single_thread")

ALL = ("attn", "ffn", "rescale")
ARCHS = ("bert", "roberta", "distilbert", "deberta-v2", "deberta-v2-shared", "vit")


def disguised(anchor, seed=1, noise=0.0, head_model=False):
    """(model, ‖N‖): a hidden random element applied to anchor + N (N only on the matched tensors,
    Gaussian, ``noise`` × each tensor's std). With noise 0 it is the same function as the anchor."""
    _, instances = instances_for(anchor)
    instances = [i for i in instances if i.group.symmetry in ALL]  # the paper's groups (all kinds: test_groups)
    sd = anchor.state_dict()
    noise_norm = 0.0
    if noise:
        sd, noise_norm = add_noise(sd, noise, seed + 100, [s.key for i in instances for s in i.slots])
    elements = random_elements(instances, torch.Generator().manual_seed(seed))
    return with_weights(anchor, apply(sd, instances, elements)), noise_norm


def param_dist(a, b) -> float:
    return sq_dist(a.state_dict(), b.state_dict(), [n for n, _ in a.named_parameters()]) ** 0.5


@pytest.mark.parametrize("rescale", ["joint", "sequential"])
@pytest.mark.parametrize("arch", ARCHS)
def test_recovers_transformed_copy(arch, rescale):
    anchor = make_model(arch)
    model, _ = disguised(anchor)
    inputs = make_inputs(anchor)
    assert output_rel_diff(anchor, model, inputs) <= 1e-10
    aligned, report = align(model, anchor, rescale=rescale, inputs=inputs)
    assert report["distance_before"] > 10
    assert report["distance_before"] == pytest.approx(param_dist(model, anchor), rel=1e-12)
    assert report["distance_after"] <= 1e-9 * report["distance_before"]
    assert param_dist(aligned, anchor) <= 1e-9 * report["distance_before"]  # independent of the report
    assert output_rel_diff(model, aligned, inputs) <= 1e-10
    assert report["verify_max_rel_diff"] <= 1e-10
    for name, d in report["per_module"].items():
        assert d["after"] <= 1e-9 * max(d["before"], 1.0), name


@pytest.mark.parametrize("arch", ["bert", "distilbert", "deberta-v2", "vit"])
def test_recovers_transformed_copy_with_task_head_fp32(arch):
    anchor = make_model(arch, head=True, dtype=torch.float32)
    model, _ = disguised(anchor, seed=4)
    aligned, report = align(model, anchor, "paper")  # recommended (the default) adds the stream: the head's input moves
    assert report["distance_after"] <= 1e-5 * report["distance_before"]
    assert output_rel_diff(model, aligned, make_inputs(anchor)) <= 1e-5
    # the head is left exactly as the model had it
    sd_m, sd_a = model.state_dict(), aligned.state_dict()
    for k in sd_m:
        if "classifier" in k or "pooler" in k:
            assert torch.equal(sd_m[k], sd_a[k]), k


@pytest.mark.parametrize("arch", ARCHS)
def test_noisy_copy_aligns_to_noise_level(arch):
    anchor = make_model(arch)
    model, noise = disguised(anchor, seed=2, noise=0.02)
    inputs = make_inputs(anchor)
    _, joint = align(model, anchor, rescale="joint", inputs=inputs)
    aligned, seq = align(model, anchor, rescale="sequential", inputs=inputs)
    assert joint["distance_before"] > 20 * noise
    # the hidden element's inverse reaches exactly ‖N‖, so the optimum is at most that ...
    assert joint["distance_after"] <= noise * (1 + 1e-9)
    # ... and fitting a few rotation/scale parameters to the noise removes only a little of it
    assert joint["distance_after"] >= 0.9 * noise
    assert joint["distance_after"] <= seq["distance_after"] + 1e-12
    assert seq["distance_after"] <= 1.02 * noise
    assert output_rel_diff(model, aligned, inputs) <= 1e-10


@pytest.mark.parametrize("arch", ARCHS)
def test_independent_models_distance_never_increases(arch):
    anchor, model = make_model(arch, seed=0), make_model(arch, seed=7)
    inputs = make_inputs(anchor)
    after = {}
    for k in range(len(ALL) + 1):
        for subset in itertools.combinations(ALL, k):
            for mode in (("joint", "sequential") if "rescale" in subset else ("joint",)):
                aligned, r = align(model, anchor, symmetries=subset, rescale=mode, inputs=inputs)
                assert r["distance_after"] <= r["distance_before"] + 1e-12
                assert r["distance_after"] == pytest.approx(param_dist(aligned, anchor), rel=1e-12)
                for name, d in r["per_module"].items():
                    assert d["after"] <= d["before"] + 1e-12, name
                after[subset, mode] = r["distance_after"]
    eps = 1e-12
    none = after[(), "joint"]
    assert after[("attn",), "joint"] < none and after[("ffn",), "joint"] < none
    assert after[("rescale",), "joint"] < none
    # more symmetries never hurt (the groups act on disjoint tensors and each is solved exactly)
    assert after[("attn", "ffn"), "joint"] <= min(after[("attn",), "joint"], after[("ffn",), "joint"]) + eps
    assert after[ALL, "joint"] <= after[ALL, "sequential"] + eps
    assert after[ALL, "sequential"] <= after[("attn", "ffn"), "joint"] + eps
    assert after[("attn", "rescale"), "joint"] <= after[("attn", "rescale"), "sequential"] + eps
    assert after[("attn", "rescale"), "sequential"] <= after[("attn",), "joint"] + eps
    assert after[ALL, "joint"] < after[("attn", "ffn"), "joint"]  # rescale does something here
    assert after[ALL, "joint"] < after[ALL, "sequential"] - 1e-4  # and the joint optimum beats eq. 11-12


def test_empty_symmetries_change_nothing():
    anchor, model = make_model("bert", seed=0), make_model("bert", seed=7)
    for sym in ((), "none", ""):
        aligned, r = align(model, anchor, symmetries=sym)
        assert r["distance_after"] == r["distance_before"]
        for k, v in model.state_dict().items():
            assert torch.equal(v, aligned.state_dict()[k])


def test_rescale_none_equals_dropping_rescale():
    anchor, model = make_model("vit", seed=0), make_model("vit", seed=3)
    a1, r1 = align(model, anchor, symmetries=ALL, rescale="none")
    a2, r2 = align(model, anchor, symmetries=("attn", "ffn"))
    assert r1["rescale"] == "none"
    assert r1["distance_after"] == pytest.approx(r2["distance_after"], rel=1e-12)
    for k, v in a1.state_dict().items():
        assert torch.allclose(v, a2.state_dict()[k], rtol=0, atol=1e-12)


def test_model_and_anchor_are_not_modified():
    anchor, model = make_model("deberta-v2", seed=0), make_model("deberta-v2", seed=3)
    before = {k: v.clone() for k, v in itertools.chain(model.state_dict().items(),
                                                       (("anchor." + k, v) for k, v in anchor.state_dict().items()))}
    align(model, anchor)
    after = dict(itertools.chain(model.state_dict().items(), (("anchor." + k, v) for k, v in anchor.state_dict().items())))
    for k, v in before.items():
        assert torch.equal(v, after[k]), k


# ------------------------------------------------------------------ layers=[...]


@pytest.mark.parametrize("layers", [[1], [0, 2]])
@pytest.mark.parametrize("arch", ["bert", "vit"])
def test_layers_only_changes_chosen_layers(arch, layers):
    anchor = make_model(arch, num_hidden_layers=3)
    model, _ = disguised(anchor, seed=6)
    aligned, report = align(model, anchor, layers=layers)
    assert report["layers"] == layers
    assert {int(n.split(".")[1]) for n in report["per_module"]} == set(layers)
    sd_m, sd_al, sd_an = model.state_dict(), aligned.state_dict(), anchor.state_dict()
    layer_of = bind(model).layer_of
    assert {layer_of(k) for k in sd_m} == {None, 0, 1, 2}
    moved = set()
    for k in sd_m:
        if layer_of(k) in layers:
            assert torch.allclose(sd_al[k], sd_an[k], rtol=0, atol=1e-10), k  # chosen layers recovered
            if not torch.equal(sd_al[k], sd_m[k]):
                moved.add(layer_of(k))
        else:
            assert torch.equal(sd_al[k], sd_m[k]), k  # everything else bit-identical
    assert moved == set(layers)
    assert output_rel_diff(model, aligned, make_inputs(anchor)) <= 1e-10
    # only the chosen layers' distance is removed
    rest = [k for k in sd_m if layer_of(k) not in layers and k in dict(anchor.named_parameters())]
    assert report["distance_after"] == pytest.approx(sq_dist(sd_m, sd_an, rest) ** 0.5, rel=1e-9)


def test_layers_out_of_range_is_an_error():
    anchor = make_model("bert")
    with pytest.raises(SymmergeError, match="out of range"):
        align(anchor, anchor, layers=[2])


# ------------------------------------------------------------------ symmetry subsets (bert names)

L = "encoder.layer.{i}."
Q, K, V, O = (L + "attention.self.query", L + "attention.self.key", L + "attention.self.value",
              L + "attention.output.dense")
FIN, FOUT = L + "intermediate.dense", L + "output.dense"
D_HEAD = 8  # conftest: hidden 24, 3 heads


def head_rows(t: torch.Tensor, h: int) -> torch.Tensor:
    return t[h * D_HEAD:(h + 1) * D_HEAD]


def attn_keys(i):
    return [n.format(i=i) + s for n in (Q, K, V) for s in (".weight", ".bias")] + [O.format(i=i) + ".weight"]


def ffn_keys(i):
    return [FIN.format(i=i) + ".weight", FIN.format(i=i) + ".bias", FOUT.format(i=i) + ".weight"]


def bilinear_invariants(sd, i, h):
    """Per-head products the attention computes with: W_Qᵀ W_K (+ bias terms) and W_O W_V."""
    q_w, k_w = head_rows(sd[Q.format(i=i) + ".weight"], h), head_rows(sd[K.format(i=i) + ".weight"], h)
    q_b, k_b = head_rows(sd[Q.format(i=i) + ".bias"], h), head_rows(sd[K.format(i=i) + ".bias"], h)
    v_w = head_rows(sd[V.format(i=i) + ".weight"], h)
    o_w = sd[O.format(i=i) + ".weight"][:, h * D_HEAD:(h + 1) * D_HEAD]
    return [q_w.T @ k_w, q_b @ k_w, q_w.T @ k_b, q_b @ k_b, o_w @ v_w]


@pytest.fixture(scope="module")
def pair():
    anchor = make_model("bert", seed=0)
    model, _ = disguised(anchor, seed=8)
    return model, anchor


def test_attn_only(pair):
    model, anchor = pair
    aligned, r = align(model, anchor, symmetries=("attn",))
    sm, sa, san = model.state_dict(), aligned.state_dict(), anchor.state_dict()
    for i in range(2):
        for k in ffn_keys(i):
            assert torch.equal(sm[k], sa[k]), k
        for k in attn_keys(i):
            assert not torch.equal(sm[k], sa[k]), k
        for h in range(3):
            # pure rotations: each member's per-head norm is unchanged (no rescale)
            for k in attn_keys(i)[:-1]:
                assert torch.linalg.norm(head_rows(sa[k], h)).item() == pytest.approx(torch.linalg.norm(head_rows(sm[k], h)).item(), rel=1e-12)
            ow = O.format(i=i) + ".weight"
            cols = slice(h * D_HEAD, (h + 1) * D_HEAD)
            assert torch.linalg.norm(sa[ow][:, cols]).item() == pytest.approx(torch.linalg.norm(sm[ow][:, cols]).item(), rel=1e-12)
            for x, y in zip(bilinear_invariants(sm, i, h), bilinear_invariants(sa, i, h)):
                assert torch.allclose(x, y, atol=1e-12)
    # the hidden element also scaled heads and permuted FFN units, so attn alone cannot reach 0
    assert 0.05 * r["distance_before"] < r["distance_after"] < r["distance_before"]
    _, r_full = align(model, anchor)
    assert r_full["distance_after"] < 1e-9 * r["distance_after"]


def test_ffn_only(pair):
    model, anchor = pair
    aligned, r = align(model, anchor, symmetries=("ffn",))
    sm, sa, san = model.state_dict(), aligned.state_dict(), anchor.state_dict()
    for i in range(2):
        for k in attn_keys(i):
            assert torch.equal(sm[k], sa[k]), k
        # the hidden permutation is undone exactly (index_select: bit-identical to the anchor)
        for k in ffn_keys(i):
            assert torch.equal(sa[k], san[k]), k
        assert not torch.equal(sm[FIN.format(i=i) + ".weight"], sa[FIN.format(i=i) + ".weight"])
    assert r["distance_after"] < r["distance_before"]


def test_rescale_only(pair):
    model, anchor = pair
    aligned, r = align(model, anchor, symmetries=("rescale",))
    sm, sa = model.state_dict(), aligned.state_dict()
    for i in range(2):
        for k in ffn_keys(i):
            assert torch.equal(sm[k], sa[k]), k
        for h in range(3):
            # no rotation: each head block is a scalar multiple of the original, a on Q/V, 1/a on K/O
            def ratio(key, cols=False):
                x = sm[key][:, h * D_HEAD:(h + 1) * D_HEAD] if cols else head_rows(sm[key], h)
                y = sa[key][:, h * D_HEAD:(h + 1) * D_HEAD] if cols else head_rows(sa[key], h)
                s = (x * y).sum() / (x * x).sum()
                assert torch.allclose(y, s * x, rtol=0, atol=1e-12), key
                return s.item()

            a_q = ratio(Q.format(i=i) + ".weight")
            assert ratio(Q.format(i=i) + ".bias") == pytest.approx(a_q, rel=1e-12)
            assert ratio(K.format(i=i) + ".weight") == pytest.approx(1 / a_q, rel=1e-12)
            assert ratio(K.format(i=i) + ".bias") == pytest.approx(1 / a_q, rel=1e-12)
            a_v = ratio(V.format(i=i) + ".weight")
            assert ratio(V.format(i=i) + ".bias") == pytest.approx(a_v, rel=1e-12)
            assert ratio(O.format(i=i) + ".weight", cols=True) == pytest.approx(1 / a_v, rel=1e-12)
            assert a_q > 0 and a_v > 0 and abs(a_q - 1) > 1e-3  # the hidden element scaled every head
    assert r["distance_after"] < r["distance_before"]
    assert output_rel_diff(model, aligned, make_inputs(model)) <= 1e-10


def test_rescale_only_scale_is_optimal_per_head(pair):
    """For R = I the scale minimises ‖a X1₊ − X2₊‖² + ‖X1₋/a − X2₋‖²: compare with a dense grid."""
    model, anchor = pair
    aligned, _ = align(model, anchor, symmetries=("rescale",))
    sm, sa, san = model.state_dict(), aligned.state_dict(), anchor.state_dict()
    grid = torch.exp(torch.linspace(-3, 3, 60001, dtype=torch.float64))
    i, h = 1, 2
    plus = [Q.format(i=i) + ".weight", Q.format(i=i) + ".bias"]
    minus = [K.format(i=i) + ".weight", K.format(i=i) + ".bias"]

    def cost(a, sd_x):
        return (sum((a * head_rows(sd_x[k], h) - head_rows(san[k], h)).square().sum() for k in plus)
                + sum((head_rows(sd_x[k], h) / a - head_rows(san[k], h)).square().sum() for k in minus))

    values = torch.stack([cost(a, sm) for a in grid[::100]])  # coarse, to locate the basin
    a0 = grid[::100][values.argmin()]
    fine = grid[(grid > a0 * 0.98) & (grid < a0 * 1.02)]
    best = min(cost(a, sm).item() for a in fine)
    assert cost(1.0, sa).item() <= best + 1e-12


def test_bad_arguments():
    m = make_model("bert")
    with pytest.raises(SymmergeError, match="unknown symmetry"):
        align(m, m, symmetries=("attn", "rows"))
    with pytest.raises(SymmergeError, match="rescale"):
        align(m, m, rescale="optimal")
    with pytest.raises(SymmergeError, match="architectures differ"):
        align(m, make_model("distilbert"))
    with pytest.raises(SymmergeError, match="shapes differ"):
        align(m, make_model("bert", intermediate_size=32))
    with pytest.raises(SymmergeError, match="heads"):
        align(m, make_model("bert", num_attention_heads=4))  # same shapes, other head split


# ------------------------------------------------------------------ brute force at model level


def test_ffn_alignment_is_brute_force_optimal():
    """6 FFN units: the ffn-only alignment reaches the minimum over all 720 permutations."""
    anchor, model = make_model("bert", seed=0, intermediate_size=6), make_model("bert", seed=4, intermediate_size=6)
    _, r = align(model, anchor, symmetries=("ffn",))
    sm, san = model.state_dict(), anchor.state_dict()
    for i in range(2):
        w_in, b_in, w_out = (sm[k] for k in ffn_keys(i))
        a_in, a_b, a_out = (san[k] for k in ffn_keys(i))
        best = min(((w_in[list(p)] - a_in).square().sum() + (b_in[list(p)] - a_b).square().sum()
                    + (w_out[:, list(p)] - a_out).square().sum()).item()
                   for p in itertools.permutations(range(6)))
        got = r["per_module"][f"layer.{i}.ffn"]["after"]
        assert got == pytest.approx(best ** 0.5, rel=1e-12)
        assert r["per_module"][f"layer.{i}.ffn"]["before"] > got


def test_attn_rotation_is_brute_force_optimal():
    """2-dim heads: the attn-only alignment reaches the minimum over a dense grid of O(2) per head."""
    import math

    kw = dict(hidden_size=4, num_attention_heads=2, intermediate_size=6)
    anchor, model = make_model("bert", seed=0, **kw), make_model("bert", seed=9, **kw)
    _, r = align(model, anchor, symmetries=("attn",))
    sm, san = model.state_dict(), anchor.state_dict()
    t = torch.linspace(0, 2 * math.pi, 40001, dtype=torch.float64)[:-1]
    c, s = torch.cos(t), torch.sin(t)
    Rs = torch.cat([torch.stack([torch.stack([c, -s], -1), torch.stack([s, c], -1)], -2),
                    torch.stack([torch.stack([c, s], -1), torch.stack([s, -c], -1)], -2)])  # O(2)
    for i in range(2):
        qk = [Q.format(i=i) + ".weight", Q.format(i=i) + ".bias", K.format(i=i) + ".weight", K.format(i=i) + ".bias"]
        vo = [V.format(i=i) + ".weight", V.format(i=i) + ".bias"]
        o = O.format(i=i) + ".weight"
        for group, keys, with_o in (("attn.qk", qk, False), ("attn.vo", vo, True)):
            total = 0.0
            for h in range(2):
                rows = slice(2 * h, 2 * h + 2)
                X1 = torch.cat([sm[k][rows].reshape(2, -1) for k in keys]
                               + ([sm[o][:, rows].T] if with_o else []), 1)
                X2 = torch.cat([san[k][rows].reshape(2, -1) for k in keys]
                               + ([san[o][:, rows].T] if with_o else []), 1)
                total += (Rs.mT @ X1 - X2).square().sum((1, 2)).min().item()
            got = r["per_module"][f"layer.{i}.{group}"]["after"] ** 2
            assert got <= total + 1e-12
            assert got >= total - 1e-6 * total
