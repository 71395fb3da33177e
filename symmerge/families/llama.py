"""Llama / Mistral / Qwen2 (RoPE, GQA, SwiGLU, pre-RMSNorm) and Qwen3 (the same plus per-head
q_norm/k_norm, which restrict the QK group)."""

from ..core.spec import Member
from .roles import DECODER_HEADS, MLP, Attention, Stream, build


def _llama(family: str, model_types: tuple[str, ...], pair_norms: tuple[str, ...] = ()):
    return build(
        family, model_types, "layers.{i}",
        Attention(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
                  rope=True, grouped=True, pair_norms=tuple("self_attn." + n for n in pair_norms)),
        MLP(inputs=("mlp.up_proj",), output="mlp.down_proj", gate="mlp.gate_proj"),
        Stream("rmsnorm", "pre", embeddings=(Member("embed_tokens.weight", 1),),
               norms=(("input_layernorm", "attn"), ("post_attention_layernorm", "mlp")), final="norm",
               heads=tuple(Member(h, 1, 0, optional=True, root=True) for h in DECODER_HEADS)),
    )


LLAMA = _llama("llama", ("llama", "mistral", "qwen2"))
QWEN3 = _llama("qwen3", ("qwen3",), pair_norms=("q_norm.weight", "k_norm.weight"))
