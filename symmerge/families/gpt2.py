"""GPT-2 (pre-LN LayerNorm): Conv1D layers (weight in × out); ``c_attn`` fuses Q, K, V."""

from ..core.spec import Member
from .roles import DECODER_HEADS, MLP, Attention, Stream, build

SPEC = build(
    "gpt2", ("gpt2",), "h.{i}",
    Attention(fused="attn.c_attn", o="attn.c_proj"),
    MLP(inputs=("mlp.c_fc",), output="mlp.c_proj"),
    Stream("layernorm", "pre", embeddings=(Member("wte.weight", 1), Member("wpe.weight", 1)),
           norms=(("ln_1", "attn"), ("ln_2", "mlp")), final="ln_f",
           heads=tuple(Member(h, 1, 0, optional=True, root=True) for h in DECODER_HEADS)),
    conv1d=True,
)
