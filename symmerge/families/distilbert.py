"""DistilBERT (post-LN)."""

from ..core.spec import Member
from .roles import MLP, Attention, Stream, build, mlm_transform

SPEC = build(
    "distilbert", ("distilbert",), "transformer.layer.{i}",
    Attention(q="attention.q_lin", k="attention.k_lin", v="attention.v_lin", o="attention.out_lin"),
    MLP(inputs=("ffn.lin1",), output="ffn.lin2"),
    Stream("layernorm", "post",
           embeddings=(Member("embeddings.word_embeddings.weight", 1),
                       Member("embeddings.position_embeddings.weight", 1)),
           norms=(("sa_layer_norm", ""), ("output_layer_norm", "")),
           others=(Member("embeddings.LayerNorm.weight", 0, 0, diag=True), Member("embeddings.LayerNorm.bias", 0, 0)),
           heads=(Member("pre_classifier.weight", 1, 0, optional=True, root=True),
                  Member("classifier.weight", 1, 0, optional=True, root=True, classes=("ForTokenClassification",)),
                  Member("qa_outputs.weight", 1, 0, optional=True, root=True))
           + mlm_transform("vocab_transform", "vocab_layer_norm", "vocab_projector")),
)
