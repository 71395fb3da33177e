"""OLMo 2: post-norm blocks — attention and MLP read the stream directly and RMSNorm their output
before the residual add (``writer_norms``: signed permutations of the stream unless those norms are
uniform); RoPE, GQA, SwiGLU; QK-norm over the whole query and key projections (one weight per dim of
every head: the QK group keeps no scale and locks a RoPE pair to sign flips where its weights differ
in any head, and the head permutation moves the norm weights with their heads)."""

from ..core.spec import Member
from .roles import DECODER_HEADS, MLP, Attention, Stream, build

SPEC = build(
    "olmo2", ("olmo2",), "layers.{i}",
    Attention(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
              rope=True, grouped=True, pair_norms=("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
              pair_norms_span_heads=True),
    MLP(inputs=("mlp.up_proj",), output="mlp.down_proj", gate="mlp.gate_proj"),
    Stream("rmsnorm", "pre", embeddings=(Member("embed_tokens.weight", 1),), norms=(), final="norm",
           heads=tuple(Member(h, 1, 0, optional=True, root=True) for h in DECODER_HEADS),
           writer_norms=("post_attention_layernorm", "post_feedforward_layernorm")),
)
