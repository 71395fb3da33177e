"""ViT (pre-LN LayerNorm), transformers 5 in-memory names."""

from ..core.spec import Member
from .roles import MLP, Attention, Stream, build

SPEC = build(
    "vit", ("vit",), "layers.{i}",
    Attention(q="attention.q_proj", k="attention.k_proj", v="attention.v_proj", o="attention.o_proj"),
    MLP(inputs=("mlp.fc1",), output="mlp.fc2"),
    Stream("layernorm", "pre",
           embeddings=(Member("embeddings.cls_token", 2), Member("embeddings.position_embeddings", 2),
                       Member("embeddings.patch_embeddings.projection.weight", 0),
                       Member("embeddings.patch_embeddings.projection.bias", 0, optional=True)),
           norms=(("layernorm_before", "attn"), ("layernorm_after", "mlp")), final="layernorm",
           heads=(Member("classifier.weight", 1, 0, optional=True, root=True),)),
    inputs="image",
)
