"""The equivalence check's default tolerance for float64 models. transformers' RMSNorm computes a float64 input in
float32 and casts the result back, so an unpatched float64 Llama moved by an exact residual-stream rotation (the
default `recommended` alignment) differs from itself at ~1e-7: the default must accept that (it refused it at 1e-9),
and still refuse a model that is not the same function."""

from __future__ import annotations

import pytest
import torch
import transformers

from symmerge.errors import SymmergeError
from symmerge.pipeline.align import align_pair
from symmerge.pipeline.options import AlignOptions
from symmerge.pipeline.verify import default_tolerance, verify_forward
from symmerge.families import spec_for


def llama64(seed: int):
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).double().eval()


def test_transformers_rmsnorm_rounds_float64_through_float32():
    """The premise: the stock module loses float64 precision (so 1e-9 cannot hold for an exact rotation)."""
    norm = llama64(0).model.norm
    h = torch.randn(2, 3, 32, dtype=torch.float64)
    exact = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon) * norm.weight
    err = float((norm(h) - exact).abs().max() / exact.abs().max())
    assert 1e-12 < err < 1e-6


def test_float64_llama_with_the_residual_stream_verifies_by_default():
    a, b = llama64(0), llama64(1)
    result = align_pair(a, b, AlignOptions(symmetries="recommended"))  # heads, attn, ffn, rescale, residual
    report = result.report
    assert report["verify_tolerance"] == default_tolerance(torch.float64) == 1e-6
    assert 1e-12 < report["verify_max_rel_diff"] <= 1e-6  # not zero: the stream was rotated, the norm rounded
    before = sum(float((x - y).pow(2).sum()) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    after = sum(float((x - y).pow(2).sum()) for x, y in zip(result.model.state_dict().values(),
                                                            b.state_dict().values()))
    assert after < before  # the alignment did move A


def test_float64_default_still_refuses_another_function():
    a = llama64(0)
    other = llama64(0)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.mul_(1 + 1e-3)  # a 0.1 % change of one tensor: not A
    with pytest.raises(SymmergeError, match="not equivalent"):
        verify_forward(a, other, spec_for("llama"))
    assert verify_forward(a, llama64(0), spec_for("llama"))["verify_max_rel_diff"] == 0.0
