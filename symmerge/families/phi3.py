"""Phi-3: Llama-like (RoPE, possibly partial; GQA; pre-RMSNorm; SwiGLU) with fused projections:
``qkv_proj`` holds the H query heads, then the H_kv key and the H_kv value heads; ``gate_up_proj``
holds the gate, then the up projection."""

from ..core.spec import Member
from .roles import DECODER_HEADS, MLP, Attention, Stream, build

SPEC = build(
    "phi3", ("phi3",), "layers.{i}",
    Attention(fused="self_attn.qkv_proj", fused_parts=("query", "kv", "kv"), o="self_attn.o_proj", rope=True,
              grouped=True),
    MLP(inputs=(), output="mlp.down_proj", fused="mlp.gate_up_proj"),
    Stream("rmsnorm", "pre", embeddings=(Member("embed_tokens.weight", 1),),
           norms=(("input_layernorm", "attn"), ("post_attention_layernorm", "mlp")), final="norm",
           heads=tuple(Member(h, 1, 0, optional=True, root=True) for h in DECODER_HEADS)),
    partial_rotary=True,
)
