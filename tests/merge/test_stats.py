"""Statistics hooks (Gram matrices, diagonal Fishers) against independent computations, and the
basis they are gathered in: RegMean on an aligned pair uses statistics of the aligned models."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from symmerge.pipeline.align import align
from symmerge.io.data import Batch, Data, load_data
from symmerge.merge.fuse import merge_models
from symmerge.merge.heads import head_keys
from symmerge.merge import regmean
from symmerge.merge.statistics import fisher_stats, gram_stats


def st_vit(seed: int, dtype=torch.float32):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(seed)
    cfg = ViTConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24, image_size=8,
                    patch_size=4, num_channels=2, num_labels=3, initializer_range=0.4)
    return ViTForImageClassification(cfg).to(dtype).eval()


def st_bert(seed: int):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    cfg = BertConfig(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=24,
                     max_position_embeddings=32, num_labels=3, initializer_range=0.3)
    return BertForSequenceClassification(cfg).eval()


@pytest.fixture
def st_images(tmp_path):
    rng = np.random.default_rng(0)
    path = tmp_path / "images.npz"
    np.savez(path, pixel_values=rng.standard_normal((24, 2, 8, 8)).astype(np.float32), labels=rng.integers(0, 3, 24))
    return path


def st_text_data() -> Data:
    """Hand-built token batches with right padding (no tokenizer needed)."""
    g = torch.Generator().manual_seed(0)
    batches = []
    for lengths in ([5, 9, 3], [7, 2]):
        t = max(lengths)
        ids = torch.randint(1, 40, (len(lengths), t), generator=g)
        mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
        ids = ids.masked_fill(~mask, 0)
        batches.append(Batch({"input_ids": ids, "attention_mask": mask.long()},
                             torch.randint(0, 3, (len(lengths),), generator=g), mask))
    return Data("hand-made", "text", batches, 5)


def test_gram_matches_hidden_states_and_ignores_padding():
    model, data = st_bert(0), st_text_data()
    s = gram_stats(model, data, progress=False)
    expect = {0: 0.0, 1: 0.0}
    pooled = 0.0
    with torch.no_grad():
        for b in data:
            out = model.bert(**b.inputs, output_hidden_states=True)
            for layer in (0, 1):  # the input of layer i's query is hidden_states[i], real tokens only
                x = out.hidden_states[layer][b.mask].double()
                expect[layer] = expect[layer] + x.T @ x
            p = out.pooler_output.double()  # the classifier reads the pooled output, one row per example
            pooled = pooled + p.T @ p
    tokens = sum(int(b.mask.sum()) for b in data)
    for layer in (0, 1):
        key = f"bert.encoder.layer.{layer}.attention.self.query.weight"
        assert torch.allclose(s.tensors[key], expect[layer], rtol=1e-5, atol=1e-5)
        assert s.counts[key] == tokens
        # Q, K and V read the same tensor
        assert torch.equal(s.tensors[key], s.tensors[key.replace("query", "key")])
        assert torch.equal(s.tensors[key], s.tensors[key.replace("query", "value")])
    assert torch.allclose(s.tensors["classifier.weight"], pooled, rtol=1e-5, atol=1e-5)
    assert s.counts["classifier.weight"] == 5
    assert s.tensors["classifier.weight"].dtype == torch.float64
    means = s.means()
    key = "bert.encoder.layer.0.attention.output.dense.weight"
    assert torch.allclose(means[key], s.tensors[key] / tokens)


def _per_example_fisher(model, data: Data) -> dict:
    """Independent: the model's own loss (−log p(y|x)) per unpadded example, squared gradients."""
    params = dict(model.named_parameters())
    acc = {n: torch.zeros_like(p, dtype=torch.float64) for n, p in params.items()}
    count = 0
    for b in data:
        for i in range(len(b.labels)):
            n_tok = int(b.mask[i].sum())
            out = model(input_ids=b.inputs["input_ids"][i:i + 1, :n_tok], labels=b.labels[i:i + 1])
            grads = torch.autograd.grad(out.loss, list(params.values()), allow_unused=True)
            for (n, _), gr in zip(params.items(), grads):
                if gr is not None:
                    acc[n] += gr.double() ** 2
            count += 1
    return {n: a / count for n, a in acc.items()}


def test_empirical_fisher_matches_per_example_gradients():
    model, data = st_bert(1), st_text_data()
    s = fisher_stats(model, data, variant="empirical", progress=False)
    expect = _per_example_fisher(model, data)
    assert s.examples == 5
    for n, e in expect.items():
        assert torch.allclose(s.tensors[n], e, rtol=1e-4, atol=1e-9), n
    assert s.tensors["classifier.weight"].abs().sum() > 0
    norm = fisher_stats(model, data, variant="empirical", normalize=True, progress=False)
    total = sum(t.sum() for t in norm.tensors.values()) / sum(t.numel() for t in norm.tensors.values())
    assert abs(total.item() - 1.0) < 1e-9
    assert all(p.requires_grad for p in model.parameters())


def test_sampled_fisher_estimates_the_model_expectation(st_images):
    model = st_vit(0, torch.float64)
    data = load_data(st_images, model, max_examples=2)
    s = fisher_stats(model, data, variant="sampled", samples=300, seed=0, progress=False)
    again = fisher_stats(model, data, variant="sampled", samples=300, seed=0, progress=False)
    assert all(torch.equal(s.tensors[k], again.tensors[k]) for k in s.tensors)
    # exact: E_x Σ_y p(y|x) (∂ log p(y|x))², by enumerating the 3 labels
    params = dict(model.named_parameters())
    exact = {n: torch.zeros_like(p) for n, p in params.items()}
    x = data.batches[0].inputs["pixel_values"]
    for i in range(2):
        logp = torch.log_softmax(model(pixel_values=x[i:i + 1]).logits[0], -1)
        for y in range(3):
            grads = torch.autograd.grad(logp[y], list(params.values()), retain_graph=True)
            for (n, _), gr in zip(params.items(), grads):
                exact[n] += logp[y].exp().detach() * gr ** 2 / 2
    num = sum(((s.tensors[n] - e) ** 2).sum() for n, e in exact.items()).sqrt()
    den = sum((e ** 2).sum() for e in exact.values()).sqrt()
    assert num / den < 0.15  # measured ~0.06; the empirical Fisher is ~1.4 away
    emp = fisher_stats(model, data, variant="empirical", progress=False)
    assert not torch.allclose(emp.tensors["classifier.weight"], s.tensors["classifier.weight"])


def _recover_perm(w_new, w_old):
    """Row i of w_new is row perm[i] of w_old."""
    d = torch.cdist(w_new.double(), w_old.double())
    return d.argmin(1)


def test_regmean_on_aligned_pair_uses_statistics_in_the_aligned_basis(st_images):
    a, b = st_vit(1), st_vit(2)
    merged, report = merge_models([a, b], "regmean", align="attn,ffn", data=str(st_images), params={"alpha": 0.95},
                                  progress=False, evaluate_result=False)
    assert report["alignment"]["anchor"]["index"] == 1
    # from scratch: align A to B, gather statistics on the aligned A and on B, solve
    a_al, _ = align(a, b, ("attn", "ffn"), rescale="joint")
    data = load_data(st_images, a)
    g_al, g_b = gram_stats(a_al, data, progress=False).means(), gram_stats(b, data, progress=False).means()
    heads = set(head_keys(a))
    body = [k for k in b.state_dict() if k not in heads]
    sds = [{k: m.state_dict()[k] for k in body} for m in (a_al, b)]
    manual = regmean.merge(sds, stats=[{k: g[k] for k in body if k in g} for g in (g_al, g_b)], alpha=0.95)
    out = merged.state_dict()
    for k in body:
        assert torch.allclose(out[k], manual[k], atol=1e-5), k
    assert all(torch.equal(out[k], a.state_dict()[k]) for k in heads)  # head of model 0 kept

    # the transformation law: the aligned model's Grams are the original Grams in the new basis
    g_a = gram_stats(a, data, progress=False).means()
    sa, sal = a.state_dict(), a_al.state_dict()
    fc2 = "vit.layers.0.mlp.fc2.weight"
    perm = _recover_perm(sal["vit.layers.0.mlp.fc1.weight"], sa["vit.layers.0.mlp.fc1.weight"])
    assert sorted(perm.tolist()) == list(range(24)) and perm.tolist() != list(range(24))
    assert torch.allclose(g_al[fc2], g_a[fc2][perm][:, perm], atol=1e-5)
    o = "vit.layers.0.attention.o_proj.weight"
    v_old, v_new = sa["vit.layers.0.attention.v_proj.weight"].double(), sal["vit.layers.0.attention.v_proj.weight"].double()
    blocks = []
    for h in range(2):  # V_h' = R_hᵀ V_h  ->  the o_proj input x_h becomes x_h R_h
        rt = torch.linalg.lstsq(v_old[8 * h:8 * h + 8].T, v_new[8 * h:8 * h + 8].T).solution.T
        blocks.append(rt.T)
    r = torch.block_diag(*blocks)
    assert torch.allclose(r.T @ r, torch.eye(16, dtype=torch.float64), atol=1e-4)
    assert torch.allclose(g_al[o], r.T @ g_a[o] @ r, atol=1e-4)
    # statistics taken before matching (the paper's code) give a different, wrong merge
    wrong = regmean.merge(sds, stats=[{k: g[k] for k in body if k in g} for g in (g_a, g_b)], alpha=0.95)
    assert (wrong[fc2] - manual[fc2]).abs().max() > 1e-3
    assert (wrong[o] - manual[o]).abs().max() > 1e-3
