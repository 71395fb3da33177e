"""Activation matching (symmerge.pipeline.activations) and unlabeled data: recovery of hidden elements
from activations alone, the statistics and costs against independent computations, labels ignored."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from scipy.optimize import linear_sum_assignment

from conftest import make_inputs
from factories import disguised, make_model
from symmerge.core.apply import apply, canonicalize
from symmerge.errors import SymmergeError
from symmerge.io.data import Batch, Data, load_data, take
from symmerge.pipeline.activations import Joint, factor, match_activations
from symmerge.pipeline.align import align_pair, instances_for
from symmerge.pipeline.bound import bind
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.verify import with_state_dict

ALL = ("heads", "attn", "ffn", "rescale", "residual")


def unlabeled(model, batches: int = 4, seed: int = 0) -> Data:
    out = []
    for s in range(batches):
        inputs = make_inputs(model, seed=seed + s, batch=4, length=9)
        mask = inputs["attention_mask"].bool() if "attention_mask" in inputs else None
        out.append(Batch(inputs, None, mask))
    fmt = "image" if "pixel_values" in out[0].inputs else "text"
    return Data("memory", fmt, out, 4 * batches, labeled=False)


def canonical_pair(moved, anchor, symmetries):
    """Both models in the canonical form of ``symmetries`` (norms folded for the residual stream)."""
    opts = AlignOptions(symmetries=symmetries).solver_options()
    _, instances = instances_for(moved)
    wide = [i for i in instances if not i.kind.per_layer and i.kind.active(i, opts)]
    ca, cb = canonicalize(moved.state_dict(), wide), canonicalize(anchor.state_dict(), wide)
    return instances, opts, ca, cb, with_state_dict(moved, ca), with_state_dict(anchor, cb)


def max_error(instances, elements, ca, cb) -> float:
    out = apply(ca, [i for i in instances if i.name in elements], elements)
    return max((out[k].double() - cb[k].double()).abs().max().item() for k in cb if cb[k].is_floating_point())


# ------------------------------------------------------------------ recovery of a hidden element


@pytest.mark.parametrize("family", ["vit", "gpt2", "bert", "llama", "qwen3", "phi", "gemma", "gemma2", "gemma3", "gpt_neox",
                                    "phi3", "olmo2"])
@pytest.mark.parametrize("weights_for", [(), None], ids=["activations-only", "default"])
def test_activation_matching_recovers_a_hidden_element_exactly(family, weights_for):
    """A copy moved by a random element of every group (head permutation, rotations, scales, FFN
    permutation with SwiGLU unit scales, the residual stream in its largest group) is brought back to the
    anchor from activations alone (weights_for=()) and with the default split."""
    anchor = make_model(family, head=True)
    moved, _, _ = disguised(anchor, ALL, seed=3)
    instances, opts, ca, cb, ma, mb = canonical_pair(moved, anchor, ALL)
    elements = match_activations(instances, ma, mb, unlabeled(anchor), opts, weights_for=weights_for)
    assert max_error(instances, elements, ca, cb) < 1e-6


@pytest.mark.parametrize("family", ["vit", "llama"])
def test_without_the_residual_group_every_per_layer_group_comes_from_activations(family):
    """No residual group: the default fits everything to activations; still exact; and a different model
    as anchor is not 'recovered' (the check can fail)."""
    syms = ("heads", "attn", "ffn", "rescale")
    anchor = make_model(family, head=True)
    moved, _, _ = disguised(anchor, syms, seed=5)
    instances, opts, ca, cb, ma, mb = canonical_pair(moved, anchor, syms)
    elements = match_activations(instances, ma, mb, unlabeled(anchor), opts)
    assert max_error(instances, elements, ca, cb) < 1e-6
    other = make_model(family, head=True, seed=7)
    instances, opts, ca, cb, ma, mb = canonical_pair(moved, other, syms)
    elements = match_activations(instances, ma, mb, unlabeled(anchor), opts)
    assert max_error(instances, elements, ca, cb) > 1e-2


def test_align_pair_dispatches_to_activation_matching():
    anchor = make_model("vit", head=True)
    moved, _, canonical = disguised(anchor, ALL, seed=2)
    data = unlabeled(anchor, batches=3)
    res = align_pair(moved, anchor, AlignOptions(symmetries=ALL, match="activations", align_data=data, align_samples=10))
    assert res.report["match"] == "activations" and res.report["align_samples_used"] == 10
    sd = res.model.state_dict()
    assert max((sd[k] - canonical[k]).abs().max().item() for k in canonical) < 1e-6


# ------------------------------------------------------------------ statistics by hand


def test_joint_statistics_by_hand():
    """Correlations and the factor of the joint Gram against numpy on a tiny batch."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(7, 3, generator=g, dtype=torch.float64)
    b = torch.randn(7, 3, generator=g, dtype=torch.float64) + a[:, [2, 0, 1]]
    b[:, 1] = 5.0  # a constant column: correlation 0 with everything
    joint = Joint.empty(3)
    joint.add(a[:4], b[:4])
    joint.add(a[4:], b[4:])
    assert joint.count == 7
    with np.errstate(invalid="ignore", divide="ignore"):  # the constant column's correlations are 0/0
        expected = np.corrcoef(np.concatenate([a.numpy(), b.numpy()], 1), rowvar=False)
    expected[:, 4] = expected[4, :] = 0.0
    np.testing.assert_allclose(joint.correlation().numpy(), np.nan_to_num(expected), atol=1e-12)
    La, Lb = factor(joint.gram)
    torch.testing.assert_close(La @ Lb.T, a.T @ b, atol=1e-10, rtol=0)
    torch.testing.assert_close(La @ La.T, a.T @ a, atol=1e-10, rtol=0)
    torch.testing.assert_close(Lb @ Lb.T, b.T @ b, atol=1e-10, rtol=0)


def _capture(model, modules, inputs, pre=False):
    """Independent capture of module outputs (or inputs) on one batch, as (tokens, features)."""
    got, hooks = {}, []
    for name in modules:
        mod = model.get_submodule(name)
        if pre:
            hooks.append(mod.register_forward_pre_hook(lambda m, args, n=name: got.__setitem__(n, args[0])))
        else:
            hooks.append(mod.register_forward_hook(lambda m, args, out, n=name: got.__setitem__(n, out)))
    with torch.no_grad():
        model(**inputs)
    for h in hooks:
        h.remove()
    return {k: v.reshape(-1, v.shape[-1]).double() for k, v in got.items()}


def _two_vits():
    a, b = make_model("vit", head=True, seed=0), make_model("vit", head=True, seed=11)
    data = unlabeled(a, batches=1)
    return a, b, data, data.batches[0].inputs


def test_head_rotations_equal_an_independent_procrustes_of_queries_and_keys():
    """attn only (no scales, no residual): each head's rotation is the Procrustes of Σ q_A q_Bᵀ + Σ k_A k_Bᵀ."""
    a, b, data, inputs = _two_vits()
    instances, opts, ca, cb, ma, mb = canonical_pair(a, b, ("attn",))
    elements = match_activations(instances, ma, mb, data, opts)
    att = "vit.layers.0.attention."
    qa, qb = (_capture(m, [att + "q_proj", att + "k_proj"], inputs) for m in (a, b))
    H, d = a.config.num_attention_heads, a.config.hidden_size // a.config.num_attention_heads
    for h in range(H):
        sl = slice(h * d, (h + 1) * d)
        M = sum(qa[n][:, sl].T @ qb[n][:, sl] for n in (att + "q_proj", att + "k_proj"))
        U, _, Vh = torch.linalg.svd(M)
        torch.testing.assert_close(elements["layer.0.attn.qk"].R[h], U @ Vh, atol=1e-8, rtol=0)


def test_ffn_permutation_is_the_assignment_on_unit_correlations():
    a, b, data, inputs = _two_vits()
    instances, opts, ca, cb, ma, mb = canonical_pair(a, b, ("ffn",))
    elements = match_activations(instances, ma, mb, data, opts)
    name = "vit.layers.1.mlp.fc2"
    ua, ub = (_capture(m, [name], inputs, pre=True)[name].numpy() for m in (a, b))
    n = ua.shape[1]
    corr = np.corrcoef(np.concatenate([ua, ub], 1), rowvar=False)[:n, n:]
    rows, cols = linear_sum_assignment(-corr)
    perm = np.empty(n, dtype=np.int64)
    perm[cols] = rows
    assert elements["layer.1.ffn"].perm.tolist() == perm.tolist()


def test_residual_rotation_is_the_procrustes_of_normalised_hidden_states():
    """Llama (RMSNorm, O(d)): Q = U Vᵀ of Σ ĥ_A ĥ_Bᵀ over every block boundary, ĥ = h / rms(h),
    hidden states captured independently."""
    a, b = make_model("llama", head=True, seed=0), make_model("llama", head=True, seed=11)
    data = unlabeled(a, batches=1)
    instances, opts, ca, cb, ma, mb = canonical_pair(a, b, ("residual",))
    elements = match_activations(instances, ma, mb, data, opts)
    inputs, mask = data.batches[0].inputs, data.batches[0].mask
    layers = [f"model.layers.{i}" for i in range(a.config.num_hidden_layers)]

    def states(m):
        outs = _capture(m, layers, inputs)
        ins = _capture(m, layers[:1], inputs, pre=True)
        h = torch.cat([ins[layers[0]][mask.reshape(-1)]] + [outs[n][mask.reshape(-1)] for n in layers])
        return h / h.square().mean(-1, keepdim=True).add(1e-12).sqrt()

    ha, hb = states(ma), states(mb)
    U, _, Vh = torch.linalg.svd(ha.T @ hb)
    torch.testing.assert_close(elements["residual"].Q, U @ Vh, atol=1e-8, rtol=0)


def test_unknown_settings_are_refused():
    a, b, data, _ = _two_vits()
    instances, opts, ca, cb, ma, mb = canonical_pair(a, b, ALL)
    with pytest.raises(SymmergeError, match="residual fit"):
        match_activations(instances, ma, mb, data, opts, residual_fit="magic")


# ------------------------------------------------------------------ unlabeled data


def test_unlabeled_npz_and_jsonl_load_and_labels_are_ignored(tmp_path):
    from test_bad_input import write_tokenizer
    from transformers import BertConfig, BertModel

    vit = make_model("vit", head=True, dtype=torch.float32)
    x = np.random.default_rng(0).normal(size=(5, 3, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "plain.npz", pixel_values=x)
    np.savez(tmp_path / "bad_labels.npz", pixel_values=x, labels=np.full(5, 99, dtype=np.int64))
    with pytest.raises(SymmergeError, match="missing array 'labels'"):
        load_data(tmp_path / "plain.npz", vit)
    with pytest.raises(SymmergeError, match="out of range"):
        load_data(tmp_path / "bad_labels.npz", vit)
    for f in ("plain.npz", "bad_labels.npz"):
        d = load_data(tmp_path / f, vit, batch_size=2, labels=False)
        assert d.n == 5 and not d.labeled and all(b.labels is None for b in d)
        torch.testing.assert_close(torch.cat([b.inputs["pixel_values"] for b in d]), torch.from_numpy(x))
    assert take(d, 3).n == 3 and sum(b.size for b in take(d, 3)) == 3
    folder = tmp_path / "bert"
    folder.mkdir()
    write_tokenizer(folder)
    lines = [{"text": "the cat sat"}, {"text": "a dog ran fast", "label": "whatever"}]
    (tmp_path / "t.jsonl").write_text("\n".join(json.dumps(o) for o in lines) + "\n")
    base = BertModel(BertConfig(vocab_size=20, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                intermediate_size=8))  # no classification head: fine without labels
    d = load_data(tmp_path / "t.jsonl", base, tokenizer=folder, labels=False)
    assert d.n == 2 and d.batches[0].labels is None and d.batches[0].mask.shape[0] == 2
    with pytest.raises(SymmergeError, match="t.jsonl:1: no 'label'"):
        load_data(tmp_path / "t.jsonl", base, tokenizer=folder)


@pytest.mark.parametrize("sites_too", [False, True])
def test_the_statistics_pass_stops_after_the_last_block_boundary(sites_too):
    """From the second batch on, each forward stops after the last layer's output (the final norm and the
    LM head feed no statistic): the head runs on the first batch only, and every statistic equals the sum
    of one full pass per batch."""
    from symmerge.pipeline.activations import STREAM, _pseudo, gather

    a, b = (make_model("llama", head=True, seed=s) for s in (0, 3))
    data = unlabeled(a, batches=3)
    bound = bind(a)
    sites = []
    if sites_too:  # per-layer sites as well (every group from activations)
        for inst in bound.instances:
            if inst.kind.per_layer:
                sites += list({s.key: s for s in _pseudo(a, inst)[1]}.values())
    heads = []
    hooks = [m.get_output_embeddings().register_forward_hook(lambda *x: heads.append(1)) for m in (a, b)]
    try:
        stats = gather(a, b, data, sites, "orthogonal", progress=False, bound=bound)
    finally:
        for h in hooks:
            h.remove()
    assert len(heads) == 2  # the first batch's two forwards only
    parts = [gather(a, b, Data("one", data.format, [x], x.size, labeled=False), sites, "orthogonal",
                    progress=False, bound=bound) for x in data.batches]
    assert STREAM in stats and (len(stats) > 1) == sites_too
    for key, joint in stats.items():
        assert joint.count == sum(p[key].count for p in parts)
        torch.testing.assert_close(joint.gram, sum(p[key].gram for p in parts), rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(joint.sums, sum(p[key].sums for p in parts), rtol=1e-10, atol=1e-10)
