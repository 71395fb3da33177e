"""OT fusion (ot_wts, ot_acts, ot_acts_emd): plans against their definitions, the exact-plan special cases
against symmerge's own permutation alignment, activations gathered on the aligned models, bad input."""

from __future__ import annotations

import json

import numpy as np
import ot
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from conftest import make_inputs, output_rel_diff, with_weights
from factories import make_model
from symmerge.cli import main
from symmerge.core.apply import apply
from symmerge.core.solvers.transport import as_permutation, column_map, ground_cost, transport_plan
from symmerge.errors import SymmergeError
from symmerge.groups.head_orthogonal import HeadElement
from symmerge.groups.permutation import PermElement
from symmerge.groups.residual import StreamElement
from symmerge.io.data import Batch, Data, load_data
from symmerge.merge import METHODS, STATISTICS, Method, get_method, register
from symmerge.merge.fuse import merge_models
from symmerge.merge.ot_fusion import COMMON, transport_models
from symmerge.merge.statistics import activation_stats
from symmerge.pipeline.align import align, instances_for

pytestmark = pytest.mark.usefixtures("single_thread")


def random_cost(n, m, seed):
    return torch.rand(n, m, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def images(model, batches=3, per=4, seed=0) -> Data:
    cfg = model.config
    out = []
    for k in range(batches):
        g = torch.Generator().manual_seed(seed + k)
        x = torch.randn(per, cfg.num_channels, cfg.image_size, cfg.image_size, generator=g, dtype=torch.float64)
        out.append(Batch({"pixel_values": x}, torch.zeros(per, dtype=torch.long), None))
    return Data("hand-made", "image", out, batches * per)


def npz(path, model, n=24):
    cfg = model.config
    rng = np.random.default_rng(0)
    np.savez(path, pixel_values=rng.standard_normal((n, cfg.num_channels, cfg.image_size, cfg.image_size))
             .astype(np.float32), labels=rng.integers(0, cfg.num_labels, n).astype(np.int64))
    return str(path)


def permuted(model, seed: int = 5):
    """``model`` moved by a random permutation-type element of every group (a stream permutation, an FFN
    permutation, a permutation of the dims inside every head for QK and VO): the same function."""
    g = torch.Generator().manual_seed(seed)
    _, instances = instances_for(model)
    elements = {}
    for i in instances:
        if i.group.kind == "head_orthogonal":
            R = torch.stack([torch.eye(i.size, dtype=torch.float64)[torch.randperm(i.size, generator=g)]
                             for _ in range(i.blocks)])
            elements[i.name] = HeadElement(R, torch.ones(i.blocks, dtype=torch.float64))
        elif i.group.kind == "permutation":
            elements[i.name] = PermElement(torch.randperm(i.size, generator=g))
        elif i.group.kind == "residual":
            elements[i.name] = StreamElement(perm=torch.randperm(i.size, generator=g))
    chosen = [i for i in instances if i.name in elements]
    return with_weights(model, apply(model.state_dict(), chosen, elements))


def max_diff(sd_a, sd_b) -> float:
    return max((sd_a[k].double() - sd_b[k].double()).abs().max().item() for k in sd_b if sd_b[k].is_floating_point())


def params(**kw) -> dict:
    return {"reg": 0.0, **COMMON, **kw}


# ------------------------------------------------------------------ registry and statistics kind


def test_the_three_methods_are_registered_with_their_statistics_and_defaults():
    assert "activations" in STATISTICS
    wts, acts, emd = (get_method(n) for n in ("ot_wts", "ot_acts", "ot_acts_emd"))
    assert wts.needs is None and acts.needs == "activations" and emd.needs == "activations"
    assert all(m.needs_model and not m.needs_base for m in (wts, acts, emd))
    assert wts.params["reg"] == 0.06 and acts.params["reg"] == 0.08 and "reg" not in emd.params
    assert wts.params["units"] == "ffn,attn,residual" and wts.params["residual"] == "auto"
    assert {"ot_wts", "ot_acts", "ot_acts_emd"} <= set(METHODS)
    # a method consuming activations registers; the kind is known to the registration check
    m = register(Method("test_acts", lambda *a: a[1][0], needs="activations"))
    try:
        assert METHODS["test_acts"] is m
    finally:
        METHODS.pop("test_acts")


def test_a_method_that_needs_the_architecture_refuses_to_run_without_it():
    sd = make_model("vit", head=True).state_dict()
    with pytest.raises(SymmergeError, match="needs the architecture"):
        get_method("ot_wts").merge([sd, sd])


# ------------------------------------------------------------------ plans


@pytest.mark.parametrize("shape", [(7, 7), (5, 9), (12, 4)])
def test_entropic_plans_have_the_uniform_marginals(shape):
    n, m = shape
    cost = random_cost(n, m, 1)
    for reg in (1.0, 0.1, 0.02):
        T = transport_plan(cost, reg)
        assert T.shape == (n, m) and bool((T > 0).all())  # entropic: every pair carries mass
        assert torch.allclose(T.sum(1), torch.full((n,), 1 / n, dtype=torch.float64), atol=1e-8)
        assert torch.allclose(T.sum(0), torch.full((m,), 1 / m, dtype=torch.float64), atol=1e-8)
        M = column_map(T)
        assert torch.allclose(M.sum(0), torch.ones(m, dtype=torch.float64), atol=1e-12)
    T = transport_plan(cost, 0.0)  # exact: the marginals to rounding
    assert torch.allclose(T.sum(1), torch.full((n,), 1 / n, dtype=torch.float64), atol=1e-14)
    assert torch.allclose(T.sum(0), torch.full((m,), 1 / m, dtype=torch.float64), atol=1e-14)


def test_exact_plan_on_equal_uniform_marginals_is_the_linear_assignment():
    cost = random_cost(9, 9, 2)
    T = transport_plan(cost, 0.0)
    rows, cols = linear_sum_assignment(cost.numpy())  # scipy, independently
    expected = np.zeros((9, 9))
    expected[rows, cols] = 1.0 / 9
    assert np.allclose(T.numpy(), expected, atol=1e-15)
    perm = as_permutation(column_map(T))
    assert perm is not None and perm[cols].tolist() == rows.tolist()
    assert as_permutation(column_map(transport_plan(cost, 0.05))) is None


def test_entropic_plans_approach_the_exact_plan_as_the_regularisation_vanishes():
    g = torch.Generator().manual_seed(3)  # points and a noisy shuffled copy: a clear optimum
    xa = torch.randn(8, 4, generator=g, dtype=torch.float64)
    cost = ground_cost(xa, xa[torch.randperm(8, generator=g)] + 0.3 * torch.randn(8, 4, generator=g,
                                                                                   dtype=torch.float64))
    exact = transport_plan(cost, 0.0)
    regs = (1.0, 0.3, 0.1, 0.03, 0.01, 0.003)
    gaps = [(transport_plan(cost, reg) - exact).abs().sum().item() for reg in regs]
    assert all(later < earlier for earlier, later in zip(gaps, gaps[1:])), gaps
    assert gaps[0] > 1.0 and gaps[-1] < 1e-5, gaps
    # the entropic plans' transport cost decreases to the optimal one
    costs = [(transport_plan(cost, reg) * cost).sum().item() for reg in regs]
    best = (exact * cost).sum().item()
    assert all(later <= earlier + 1e-12 for earlier, later in zip(costs, costs[1:])), costs
    assert costs[0] - best > 0.1 and abs(costs[-1] - best) < 1e-6


def test_ground_cost_is_the_euclidean_distance_divided_by_its_maximum():
    g = torch.Generator().manual_seed(4)
    xa, xb = torch.randn(6, 5, generator=g, dtype=torch.float64), torch.randn(7, 5, generator=g, dtype=torch.float64)
    d = torch.cdist(xa, xb)
    assert torch.allclose(ground_cost(xa, xb, normalize=False), d, atol=1e-12)
    assert torch.allclose(ground_cost(xa, xb), d / d.max(), atol=1e-12)
    assert torch.allclose(ground_cost(xa, xb, "sqeuclidean", normalize=False), d.square(), atol=1e-12)
    with pytest.raises(SymmergeError, match="ground metric"):
        ground_cost(xa, xb, "manhattan")


# ------------------------------------------------------------------ exact plans = symmerge's permutation alignment


def test_exact_ffn_transport_on_the_weight_cost_is_permutation_alignment_then_average():
    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=1)
    same_cost = {"reg": 0, "units": "ffn", "cost": "sqeuclidean", "normalize": False}
    ot_merged, report = merge_models([a, b], "ot_wts", align="none", params=same_cost, progress=False)
    perm_merged, _ = merge_models([a, b], "average", align="ffn", progress=False)
    sd_ot, sd_perm = ot_merged.state_dict(), perm_merged.state_dict()
    assert all(torch.equal(sd_ot[k], sd_perm[k]) for k in sd_ot)
    assert report["method"] == "ot_wts" and report["statistics"] is None
    # the same by hand: align A's FFN units to B, then the plain average
    aligned = align(a, b, ("ffn",))[0].state_dict()
    sd_b = b.state_dict()
    for k, v in sd_ot.items():
        if k.startswith("vit."):
            assert torch.equal(v, (0.5 * aligned[k].double() + 0.5 * sd_b[k].double()).to(v.dtype)), k
    # the merge is not the plain average: the FFN units were matched
    plain = merge_models([a, b], "average", progress=False)[0].state_dict()
    assert not torch.equal(sd_ot["vit.layers.0.mlp.fc1.weight"], plain["vit.layers.0.mlp.fc1.weight"])


@pytest.mark.parametrize("family", ["vit", "gpt2"])
@pytest.mark.parametrize("variant", [{}, {"qk": "joint"}, {"cross_heads": False}, {"residual": "single"},
                                     {"cost": "sqeuclidean", "normalize": False}])
def test_exact_transport_recovers_a_permuted_copy_from_weights(family, variant):
    b = make_model(family, head=True, seed=1)
    a = permuted(b)
    assert output_rel_diff(a, b, make_inputs(b)) < 1e-12 and max_diff(a.state_dict(), b.state_dict()) > 0.1
    moved = transport_models([a.state_dict(), b.state_dict()], a, params(**variant))[0]
    assert max_diff(moved, b.state_dict()) < 1e-12
    merged = get_method("ot_wts").merge([a.state_dict(), b.state_dict()], model=a, reg=0, **variant)
    assert max_diff(merged, b.state_dict()) < 1e-12


@pytest.mark.parametrize("variant", [{}, {"qk": "joint"}, {"cross_heads": False}, {"residual": "single"}])
def test_exact_transport_recovers_a_permuted_copy_from_activations(variant):
    b = make_model("vit", head=True, seed=1)
    a = permuted(b)
    data = images(b)
    stats = [activation_stats(m, data, progress=False).tensors for m in (a, b)]
    moved = transport_models([a.state_dict(), b.state_dict()], a, params(**variant), activations=True, stats=stats)[0]
    assert max_diff(moved, b.state_dict()) < 1e-12


@pytest.mark.parametrize("family", ["vit", "gpt2"])
def test_exact_transport_that_respects_every_symmetry_preserves_the_function(family):
    """One plan for the stream, joint Q/K plans inside each head, V/O inside each head, the FFN: with EMD
    every map is a permutation of a symmetry group, so the transported A computes A's function."""
    a, b = make_model(family, head=True, seed=0), make_model(family, head=True, seed=1)
    moved = transport_models([a.state_dict(), b.state_dict()], a,
                             params(qk="joint", cross_heads=False, residual="single"))[0]
    assert max_diff(moved, a.state_dict()) > 0.1
    assert output_rel_diff(a, with_weights(a, moved), make_inputs(a)) < 1e-12
    # Imfeld et al.'s defaults (separate Q/K plans across heads, mean of the stream maps) do not preserve it
    moved = transport_models([a.state_dict(), b.state_dict()], a, params())[0]
    assert output_rel_diff(a, with_weights(a, moved), make_inputs(a)) > 1e-3


# ------------------------------------------------------------------ soft transport


def test_entropic_ffn_transport_is_the_column_normalised_plan_on_producers_and_consumers():
    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=1)
    sa, sb = a.state_dict(), b.state_dict()
    moved = transport_models([sa, sb], a, params(reg=0.05, units="ffn", normalize=False))[0]
    p = "vit.layers.1.mlp."
    feats = [torch.cat([sd[p + "fc1.weight"], sd[p + "fc1.bias"][:, None], sd[p + "fc2.weight"].T], 1)
             for sd in (sa, sb)]
    C = torch.cdist(*feats)
    n = C.shape[0]
    T = ot.sinkhorn(np.full(n, 1 / n), np.full(n, 1 / n), (C / C.max()).numpy(), 0.05, method="sinkhorn_log",
                    numItermax=20000, stopThr=1e-9)
    M = torch.from_numpy(T / T.sum(0, keepdims=True))
    assert torch.allclose(moved[p + "fc1.weight"], M.T @ sa[p + "fc1.weight"], atol=1e-10)
    assert torch.allclose(moved[p + "fc1.bias"], M.T @ sa[p + "fc1.bias"], atol=1e-10)
    assert torch.allclose(moved[p + "fc2.weight"], sa[p + "fc2.weight"] @ M, atol=1e-10)
    assert torch.equal(moved["vit.layers.1.attention.q_proj.weight"], sa["vit.layers.1.attention.q_proj.weight"])
    # a soft map mixes units: the transported rows are not A's rows re-ordered
    assert as_permutation(M) is None


def test_soft_transport_of_a_model_onto_itself_stays_close_and_exact_transport_is_the_identity():
    a = make_model("vit", head=True, seed=0)
    sd = a.state_dict()
    assert max_diff(transport_models([sd, sd], a, params())[0], sd) == 0.0
    near = transport_models([sd, sd], a, params(reg=0.005))[0]
    far = transport_models([sd, sd], a, params(reg=0.5))[0]
    assert max_diff(near, sd) < max_diff(far, sd)


def test_three_models_are_each_transported_to_the_anchor_then_averaged():
    models = [make_model("vit", head=True, seed=s) for s in (0, 1, 2)]
    sds = [m.state_dict() for m in models]
    p = {"reg": 0.05}
    merged = get_method("ot_wts").merge(sds, model=models[0], **p)
    ta = transport_models([sds[0], sds[2]], models[0], {**get_method("ot_wts").params, **p})[0]
    tb = transport_models([sds[1], sds[2]], models[0], {**get_method("ot_wts").params, **p})[0]
    for k in sds[0]:
        assert torch.allclose(merged[k], (ta[k] + tb[k] + sds[2][k]) / 3, atol=1e-12), k
    # another anchor: the first model stays, the others move to it
    first = get_method("ot_wts").merge(sds, model=models[0], anchor=0, weights=[2, 1, 1], **p)
    tb0 = transport_models([sds[1], sds[0]], models[0], {**get_method("ot_wts").params, **p})[0]
    tc0 = transport_models([sds[2], sds[0]], models[0], {**get_method("ot_wts").params, **p})[0]
    k = "vit.layers.0.mlp.fc1.weight"
    assert torch.allclose(first[k], 0.5 * sds[0][k] + 0.25 * tb0[k] + 0.25 * tc0[k], atol=1e-12)


# ------------------------------------------------------------------ activations on the aligned models


def test_activation_statistics_are_token_rows_without_padding_and_capped():
    model = make_model("bert", head=True, seed=0)
    inputs = make_inputs(model)  # the last row is padded
    data = Data("hand-made", "text", [Batch(inputs, torch.zeros(3, dtype=torch.long), inputs["attention_mask"])], 3)
    seen = {}
    fc1 = model.bert.encoder.layer[0].intermediate.dense
    handle = fc1.register_forward_hook(lambda mod, args, out: seen.setdefault("fc1", out.detach()))
    with torch.no_grad():
        states = model(**inputs, output_hidden_states=True).hidden_states
    handle.remove()
    mask = inputs["attention_mask"].bool()
    stats = activation_stats(model, data, progress=False)
    key = "bert.encoder.layer.0.intermediate.dense.weight"
    assert stats.kind == "activations" and stats.counts[key] == int(mask.sum()) < mask.numel()
    assert torch.equal(stats.tensors[key], seen["fc1"][mask])
    assert torch.equal(stats.tensors["hidden_states.0"], states[0][mask])
    capped = activation_stats(model, data, max_rows=5, progress=False)
    assert torch.equal(capped.tensors[key], seen["fc1"][mask][:5])
    assert "classifier.weight" not in stats.tensors  # only the base model's layers


def test_activations_are_gathered_on_the_aligned_models(tmp_path, monkeypatch):
    import symmerge.merge.fuse as fuse

    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=1)
    path = npz(tmp_path / "d.npz", a)
    recorded = []
    real = fuse.gather

    def spy(needs, model, data, **kw):
        s = real(needs, model, data, **kw)
        recorded.append(s.tensors)
        return s

    monkeypatch.setattr(fuse, "gather", spy)
    merged, report = merge_models([a, b], "ot_acts", align="attn,ffn", data=path, heads="merge", progress=False)
    assert report["statistics"]["kind"] == "activations" and len(recorded) == 2
    # by hand: the aligned A's FFN inputs' producer and embedding outputs on the same images
    aligned = align(a, b, ("attn", "ffn"))[0]
    data = load_data(path, a)
    key = "vit.layers.1.mlp.fc1.weight"

    def by_hand(model):
        outs, states = [], []
        handle = model.vit.layers[1].mlp.fc1.register_forward_hook(lambda m, i, o: outs.append(o.detach()))
        with torch.no_grad():
            for batch in data:
                states.append(model(**batch.inputs, output_hidden_states=True).hidden_states[2])
        handle.remove()
        return torch.cat([o.reshape(-1, o.shape[-1]) for o in outs]), torch.cat([s.reshape(-1, s.shape[-1])
                                                                                 for s in states])

    fc1, state = by_hand(aligned)
    assert torch.allclose(recorded[0][key].double(), fc1.double(), atol=1e-5)
    assert torch.allclose(recorded[0]["hidden_states.2"].double(), state.double(), atol=1e-5)
    unaligned, _ = by_hand(a)  # negative control: A before alignment has its FFN units in another order
    assert not torch.allclose(recorded[0][key].double(), unaligned.double(), atol=1e-3)
    assert torch.allclose(recorded[1][key].double(), by_hand(b)[0].double(), atol=1e-5)


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize("bad, message", [
    ({"reg": -1}, "reg must be finite and >= 0"), ({"reg": float("nan")}, "reg must be finite"),
    ({"reg": "x"}, "reg must be a number"), ({"units": "ffn,foo"}, "units must be"), ({"units": ""}, "units must be"),
    ({"units": 3}, "units must be"), ({"qk": "both"}, "qk must be separate or joint"),
    ({"cross_heads": "within"}, "cross_heads must be true or false"),
    ({"residual": "sum"}, "residual must be auto or mean or single"),
    ({"cost": "cosine"}, "cost must be euclidean or sqeuclidean"), ({"normalize": "yes"}, "normalize must be"),
])
def test_bad_parameters_are_refused(bad, message):
    a = make_model("vit", head=True, seed=0)
    with pytest.raises(SymmergeError, match=message):
        get_method("ot_wts").merge([a.state_dict(), a.state_dict()], model=a, **bad)


def test_bad_input_is_refused_with_one_clear_error(tmp_path):
    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=1)
    sa, sb = a.state_dict(), b.state_dict()
    path = npz(tmp_path / "d.npz", a)
    with pytest.raises(SymmergeError, match="no parameter 'reg'"):
        merge_models([a, b], "ot_acts_emd", data=path, params={"reg": 0.1}, progress=False)
    with pytest.raises(SymmergeError, match="needs data for its activations"):
        merge_models([a, b], "ot_acts", progress=False)
    with pytest.raises(SymmergeError, match="same inputs: give one --data"):
        merge_models([a, b], "ot_acts", data=[path, path], progress=False)
    with pytest.raises(SymmergeError, match="task head reads the residual stream.*--heads merge"):
        merge_models([a, b], "ot_wts", progress=False)  # heads kept: the head would not follow the stream
    merge_models([a, b], "ot_wts", params={"units": "ffn,attn"}, progress=False)  # ... fine without the stream
    with pytest.raises(SymmergeError, match="anchor index 5 out of range"):
        get_method("ot_wts").merge([sa, sb], model=a, anchor=5)
    short = activation_stats(a, images(a, batches=1), progress=False).tensors
    full = activation_stats(b, images(b, batches=2), progress=False).tensors
    with pytest.raises(SymmergeError, match="must come from the same inputs"):
        get_method("ot_acts").merge([sa, sb], model=a, stats=[short, full])
    with pytest.raises(SymmergeError, match="activations lack"):
        get_method("ot_acts").merge([sa, sb], model=a, stats=[{}, {}])
    llama = make_model("llama", head=True, seed=0)
    sd = llama.state_dict()
    with pytest.raises(SymmergeError, match="RoPE"):
        get_method("ot_wts").merge([sd, sd], model=llama)
    out = get_method("ot_wts").merge([sd, sd], model=llama, units="ffn,residual")  # SwiGLU FFN and RMSNorm stream
    assert max_diff(out, sd) < 0.5


def test_cli_merges_with_ot_acts_after_the_paper_alignment(tmp_path):
    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=1)
    paths = []
    for name, m in (("a", a), ("b", b)):
        m.to(torch.float32).save_pretrained(tmp_path / name)
        paths.append(str(tmp_path / name))
    data = npz(tmp_path / "d.npz", a)
    out = tmp_path / "out"
    assert main(["merge", *paths, "--method", "ot_acts", "--align", "attn,ffn,rescale", "--data", data,
                 "--heads", "merge", "--param", "units=ffn,attn,residual", "-o", str(out)]) == 0
    report = json.loads((out / "symmerge_report.json").read_text())
    assert report["method"] == "ot_acts" and report["statistics"]["kind"] == "activations"
    assert report["alignment"]["symmetries"] == ["attn", "ffn", "rescale"]
    assert "fisher_variant" not in report["statistics"]
    assert 0 <= report["evaluation"]["merged"][0]["accuracy"] <= 1
    assert main(["merge", *paths, "--method", "ot_acts", "--data", data, "-o", str(tmp_path / "o2")]) == 2


@pytest.mark.parametrize("family", ["bert", "distilbert", "phi"])
def test_the_default_residual_policy_follows_the_family(family):
    """``auto``: Imfeld et al.'s mean policy needs sequential pre-norm blocks; post-LN encoders and Phi's
    parallel blocks get one plan for the whole stream instead of an error."""
    from symmerge.errors import SymmergeError
    from symmerge.merge.ot_fusion import COMMON, build_flow, settings

    model = make_model(family, head=True, dtype=torch.float32)
    params = {**COMMON, "reg": 0.05, "units": "ffn,residual"}
    flow = build_flow(model, settings(params, activations=False))
    assert "residual" in [getattr(u, "name", None) for u in flow]  # one plan for the whole stream
    with pytest.raises(SymmergeError, match="residual=single"):
        build_flow(model, settings({**params, "residual": "mean"}, activations=False))


def test_mixtures_of_experts_are_refused_with_what_to_do_instead():
    """It used to fail with a message about parallel attention: the experts' router was placed in the attention
    block."""
    a, b = make_model("mixtral", head=True, seed=0), make_model("mixtral", head=True, seed=1)
    for units in ("ffn,attn,residual", "ffn"):
        with pytest.raises(SymmergeError, match="mixtures of experts.*--method average") as err:
            merge_models([a, b], "ot_wts", align="none", params={"units": units})
        assert "parallel" not in str(err.value)
    merge_models([make_model("llama", head=True, seed=0), make_model("llama", head=True, seed=1)], "ot_wts",
                 align="none", params={"units": "ffn"})  # a dense decoder still transports


def test_families_with_several_stacks_are_refused():
    a, b = make_model("t5", head=True, seed=0), make_model("t5", head=True, seed=1)
    with pytest.raises(SymmergeError, match="one layer stack.*encoder, decoder"):
        merge_models([a, b], "ot_wts", align="none", params={"units": "ffn"})
