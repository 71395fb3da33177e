"""Phi(-1/2): partial RoPE (``partial_rotary_factor``), parallel attention + GELU MLP reading one
pre-LN LayerNorm, a final LayerNorm before an LM head with a bias."""

from ..core.spec import Member
from .roles import DECODER_HEADS, MLP, Attention, Stream, build

QK_LAYERNORM = "qk_layernorm=True (a LayerNorm on each query/key head)"
SPEC = build(
    "phi", ("phi",), "layers.{i}",
    Attention(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.dense",
              rope=True, grouped=True),
    MLP(inputs=("mlp.fc1",), output="mlp.fc2"),
    Stream("layernorm", "pre", embeddings=(Member("embed_tokens.weight", 1),),
           norms=(("input_layernorm", "both"),), final="final_layernorm",
           heads=tuple(Member(h, 1, 0, optional=True, root=True) for h in DECODER_HEADS)),
    partial_rotary=True,
    unsupported=(("self_attn.q_layernorm.weight", QK_LAYERNORM),),
    unsupported_settings=(("qk_layernorm", (False,), QK_LAYERNORM),),
)
