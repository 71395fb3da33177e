"""Mixtures of experts: Mixtral, Qwen2-MoE (with a shared expert and its gate), Qwen3-MoE and OLMoE.

Attention and the residual stream as in Llama (RoPE, GQA, pre-RMSNorm); Qwen2-MoE has Q/K/V biases,
Qwen3-MoE per-head q/k norms (as Qwen3), OLMoE q/k norms over the whole q and k (no QK group, see
:class:`~symmerge.families.roles.Attention`). Each layer's experts: one permutation of the experts
(router rows with the experts' fused tensors) and the FFN permutation inside each expert; a shared
expert (Qwen2-MoE) gets the plain FFN permutation, its scalar gate reads the stream.

transformers 5 fuses the experts in memory (``mlp.experts.gate_up_proj`` (E, 2I, d), ``down_proj``
(E, d, I)) but saves them one tensor per expert (Mixtral: ``block_sparse_moe.experts.{e}.w1/w2/w3``;
the others: ``mlp.experts.{e}.gate_proj/up_proj/down_proj``), as the released checkpoints store them.
The specs name the in-memory tensors; streamed alignment reads them as virtual tensors stacked from the
stored ones and writes them back split, in the checkpoint's own names (:mod:`symmerge.io.fused`).
"""

from ..core.spec import Member
from .roles import DECODER_HEADS, MLP, Attention, Experts, Stream, build

DENSE = "dense layers among the sparse ones (mlp_only_layers, decoder_sparse_step)"
DENSE_LAYERS = (("mlp.gate_proj.weight", DENSE),)
DENSE_SETTINGS = (("mlp_only_layers", ([], ()), DENSE), ("decoder_sparse_step", (1,), DENSE))
STREAM = Stream("rmsnorm", "pre", embeddings=(Member("embed_tokens.weight", 1),),
                norms=(("input_layernorm", "attn"), ("post_attention_layernorm", "mlp")), final="norm",
                heads=tuple(Member(h, 1, 0, optional=True, root=True) for h in DECODER_HEADS))
EXPERTS = Experts(router="mlp.gate", gate_up="mlp.experts.gate_up_proj", down="mlp.experts.down_proj")


def _attention(**kw) -> Attention:
    return Attention(q="self_attn.q_proj", k="self_attn.k_proj", v="self_attn.v_proj", o="self_attn.o_proj",
                     rope=True, grouped=True, **kw)


MIXTRAL = build("mixtral", ("mixtral",), "layers.{i}", _attention(), None, STREAM, moe=EXPERTS)
QWEN2_MOE = build(
    "qwen2_moe", ("qwen2_moe",), "layers.{i}", _attention(),
    MLP(inputs=("mlp.shared_expert.up_proj",), output="mlp.shared_expert.down_proj",
        gate="mlp.shared_expert.gate_proj"),
    STREAM, moe=Experts(EXPERTS.router, EXPERTS.gate_up, EXPERTS.down, readers=("mlp.shared_expert_gate",)),
    unsupported=DENSE_LAYERS, unsupported_settings=DENSE_SETTINGS)
QWEN3_MOE = build("qwen3_moe", ("qwen3_moe",), "layers.{i}",
                  _attention(pair_norms=("self_attn.q_norm.weight", "self_attn.k_norm.weight")), None, STREAM,
                  moe=EXPERTS, unsupported=DENSE_LAYERS, unsupported_settings=DENSE_SETTINGS)
OLMOE = build("olmoe", ("olmoe",), "layers.{i}", _attention(whole_norms=("self_attn.q_norm", "self_attn.k_norm")),
              None, STREAM, moe=EXPERTS)
