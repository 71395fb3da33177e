"""Real weights: all-MiniLM-L6-v2 disguised by a hidden group element + small noise, aligned back."""

from __future__ import annotations

import pytest
import torch

from conftest import add_noise, one_thread, output_rel_diff, sq_dist, with_weights
from symmerge.pipeline.align import align, instances_for
from symmerge.core.apply import apply, random_elements

pytestmark = pytest.mark.usefixtures("single_thread")

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A man is playing a guitar on a crowded street corner.",
    "Interest rates were left unchanged by the central bank on Thursday.",
    "She forgot her umbrella, so she got soaked walking home.",
    "Photosynthesis converts light energy into chemical energy.",
    "Is this the right train for the airport?",
]
NOISE = 0.01  # × each matched tensor's std


@pytest.fixture(scope="module")
def disguised(minilm):
    path, anchor, tokenizer = minilm
    _, instances = instances_for(anchor)
    instances = [i for i in instances if i.group.symmetry in ("attn", "ffn")]  # what align() does by default
    keys = [s.key for inst in instances for s in inst.slots]
    with one_thread():
        noisy, noise_norm = add_noise(anchor.state_dict(), NOISE, seed=123, keys=keys)
        hidden = random_elements(instances, torch.Generator().manual_seed(2024))
        model = with_weights(anchor, apply(noisy, instances, hidden))
    inputs = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
    return anchor, model, inputs, noise_norm, len(instances)


def mean_pooled(model, inputs):
    with torch.no_grad():
        h = model(**inputs).last_hidden_state
    mask = inputs["attention_mask"][..., None].to(h.dtype)
    e = (h * mask).sum(1) / mask.sum(1)
    return torch.nn.functional.normalize(e, dim=-1)


def test_real_model_setup(disguised, minilm):
    anchor, model, inputs, noise_norm, n_instances = disguised
    assert anchor.config.model_type == "bert" and anchor.config.num_hidden_layers == 6
    assert next(anchor.parameters()).dtype == torch.float32
    assert n_instances == 18  # 6 layers × (QK, VO, FFN)
    assert inputs["attention_mask"].sum(1).min() < inputs["attention_mask"].shape[1]  # padded rows present
    # the disguised model is the same function up to the small noise ...
    cos = (mean_pooled(anchor, inputs) * mean_pooled(model, inputs)).sum(-1)
    assert cos.min() > 0.99
    assert output_rel_diff(anchor, model, inputs) > 1e-4  # ... and the noise is real
    # ... while its weights are far away
    assert sq_dist(model.state_dict(), anchor.state_dict()) ** 0.5 > 50 * noise_norm


def test_align_real_minilm_back(disguised):
    anchor, model, inputs, noise_norm, _ = disguised
    aligned, report = align(model, anchor, inputs=inputs)
    # same function as the model it came from, on real tokenized English
    assert output_rel_diff(model, aligned, inputs) <= 1e-5
    assert report["verify_max_rel_diff"] <= 1e-5
    emb_m, emb_a = mean_pooled(model, inputs), mean_pooled(aligned, inputs)
    assert torch.allclose(emb_m @ emb_m.T, emb_a @ emb_a.T, atol=1e-5)
    # the distance drops from hundreds to the noise norm (the hidden inverse reaches ‖N‖ exactly)
    before, after = report["distance_before"], report["distance_after"]
    assert before > 50 * noise_norm
    assert after <= noise_norm * 1.001  # 0.1 % slack for fp32 rounding of the written weights
    assert after >= 0.95 * noise_norm
    keys = [n for n, _ in anchor.named_parameters()]
    assert sq_dist(aligned.state_dict(), anchor.state_dict(), keys) ** 0.5 == pytest.approx(after, rel=1e-6)
    # every module individually lands near the anchor
    for name, d in report["per_module"].items():
        assert d["after"] < 0.2 * d["before"], name
    # the paper's sequential rescale is close but never better than the joint optimum
    _, seq = align(model, anchor, rescale="sequential", inputs=inputs)
    assert after <= seq["distance_after"] * (1 + 1e-6)
    assert seq["distance_after"] <= 1.01 * noise_norm


def test_full_group_recovery_on_real_minilm_with_a_task_head(minilm):
    """The real all-MiniLM-L6-v2 with a classification head (post-LN: the residual stream's group is one
    permutation of the hidden dims through the embeddings, every LayerNorm, every layer, the pooler),
    disguised by a hidden residual permutation + head permutation + per-head rotations and scales + FFN
    permutation + noise, is brought back to the noise level by alignment in the full group."""
    from transformers import AutoModelForSequenceClassification

    from factories import disguised as hide

    path, _, tokenizer = minilm
    with one_thread():
        anchor = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2, local_files_only=True).eval()
        full = ("heads", "attn", "ffn", "rescale", "residual")
        model, noise_norm, canonical = hide(anchor, full, seed=7, noise=NOISE)
        inputs = dict(tokenizer(SENTENCES, padding=True, return_tensors="pt"))
        aligned, report = align(model, anchor, full, inputs=inputs)
    assert report["residual_variant"] == "permutation"
    assert report["distance_before"] > 50 * noise_norm
    assert report["distance_after"] <= 1.02 * noise_norm
    keys = [n for n, _ in anchor.named_parameters()]
    assert sq_dist(aligned.state_dict(), canonical, keys) ** 0.5 == pytest.approx(report["distance_after"], rel=1e-5)
    assert output_rel_diff(model, aligned, inputs) <= 1e-5
    # the paper's groups alone cannot undo the hidden stream permutation and head pairing
    _, paper = align(model, anchor, ("attn", "ffn", "rescale"), inputs=inputs)
    assert paper["distance_after"] > 10 * report["distance_after"]
