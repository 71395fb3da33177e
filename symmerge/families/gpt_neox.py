"""GPT-NeoX / Pythia: pre-LN LayerNorm; attention and MLP read the stream through their own norms
(in parallel with ``use_parallel_residual``, one after the other without); partial RoPE
(``partial_rotary_factor``, Pythia's ``rotary_pct``): RoPE pairs on the rotary dims and a free per-head
orthogonal map on the rest; the fused ``query_key_value`` holds ``[q_h, k_h, v_h]`` head after head."""

from ..core.spec import Member
from .roles import DECODER_HEADS, MLP, Attention, Stream, build

SPEC = build(
    "gpt_neox", ("gpt_neox",), "layers.{i}",
    Attention(fused="attention.query_key_value", fused_interleaved=True, o="attention.dense", rope=True),
    MLP(inputs=("mlp.dense_h_to_4h",), output="mlp.dense_4h_to_h"),
    Stream("layernorm", "pre", embeddings=(Member("embed_in.weight", 1),),
           norms=(("input_layernorm", "attn"), ("post_attention_layernorm", "mlp")), final="final_layer_norm",
           heads=tuple(Member(h, 1, 0, optional=True, root=True) for h in DECODER_HEADS)),
    partial_rotary=True,
)
