"""Phi(-1/2): partial RoPE (``partial_rotary_factor``), parallel attention + GELU MLP, LayerNorm."""

from .roles import MLP, Attention, build

SPEC = build(
    "phi", ("phi",), "layers.{i}",
    Attention(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.dense",
              rope=True, grouped=True),
    MLP(inputs=("mlp.fc1",), output="mlp.fc2"),
    partial_rotary=True,
    unsupported=(("self_attn.q_layernorm.weight", "qk_layernorm=True (a LayerNorm on each query/key head)"),),
)
