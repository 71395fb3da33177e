"""Gemma, Gemma 2 and Gemma 3 (text): Llama-like (RoPE, GQA, pre-RMSNorm) with

* RMSNorm multiplying by ``1 + w`` (folded as ``1 + w``, leaving ``w = 0``);
* the embeddings scaled by √d in the forward pass (a scalar: it commutes with every stream transform);
* GeGLU (``gelu(gate) * up``: the gate permuted with the units, ``up`` with a unit scale s ≠ 0);
* an LM head tied to the embeddings by default (the final norm then cannot fold: see ``--untie``);
* Gemma 2/3: sandwich norms — ``post_attention_layernorm`` / ``post_feedforward_layernorm`` on each
  block's output before the residual add (``writer_norms``: signed permutations of the stream unless
  they are uniform), ``pre_feedforward_layernorm`` before the MLP; attention and final-logit
  soft-capping are elementwise on scores and logits, which every group keeps exactly;
* Gemma 3: per-head ``q_norm``/``k_norm`` (like Qwen3: they restrict the QK group); sliding and global
  layers differ only in their RoPE base and mask.
"""

from ..core.spec import Member
from .roles import DECODER_HEADS, MLP, Attention, Stream, build


def _gemma(family: str, model_types: tuple[str, ...], sandwich: bool, pair_norms: tuple[str, ...] = ()):
    norms = (("input_layernorm", "attn"), ("pre_feedforward_layernorm" if sandwich else "post_attention_layernorm",
                                           "mlp"))
    return build(
        family, model_types, "layers.{i}",
        Attention(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
                  rope=True, grouped=True, pair_norms=tuple("self_attn." + n for n in pair_norms)),
        MLP(inputs=("mlp.up_proj",), output="mlp.down_proj", gate="mlp.gate_proj"),
        Stream("rmsnorm", "pre", embeddings=(Member("embed_tokens.weight", 1),), norms=norms, final="norm",
               heads=tuple(Member(h, 1, 0, optional=True, root=True) for h in DECODER_HEADS),
               writer_norms=("post_attention_layernorm", "post_feedforward_layernorm") if sandwich else (),
               offset=1.0),
    )


GEMMA = _gemma("gemma", ("gemma",), sandwich=False)
GEMMA2 = _gemma("gemma2", ("gemma2",), sandwich=True)
GEMMA3 = _gemma("gemma3_text", ("gemma3_text",), sandwich=True, pair_norms=("q_norm.weight", "k_norm.weight"))
