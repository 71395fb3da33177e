"""DeBERTa v2/v3 (post-LN). With ``share_att_key=False`` the relative-position projections live in the
query/key head space too: c2p uses Q·pos_keyᵀ (pos_key is K-like), p2c uses K·pos_queryᵀ. The relative
position embeddings (and their LayerNorm) are read by those projections, so they move with the stream."""

from ..core.spec import Member
from .roles import MLP, Attention, Stream, build, mlm_transform

SPEC = build(
    "deberta-v2", ("deberta-v2",), "encoder.layer.{i}",
    Attention(q="attention.self.query_proj", k="attention.self.key_proj", v="attention.self.value_proj",
              o="attention.output.dense", extra_q=("attention.self.pos_query_proj",),
              extra_k=("attention.self.pos_key_proj",)),
    MLP(inputs=("intermediate.dense",), output="output.dense"),
    Stream("layernorm", "post",
           embeddings=tuple(Member(f"embeddings.{n}.weight", 1, optional=True, unless="embeddings.embed_proj.weight")
                            for n in ("word_embeddings", "position_embeddings", "token_type_embeddings"))
           + (Member("embeddings.embed_proj.weight", 0, optional=True),),
           norms=(("attention.output.LayerNorm", ""), ("output.LayerNorm", "")),
           extra_readers=("attention.self.pos_query_proj", "attention.self.pos_key_proj"),
           others=(Member("embeddings.LayerNorm.weight", 0, 0, diag=True), Member("embeddings.LayerNorm.bias", 0, 0),
                   Member("encoder.rel_embeddings.weight", 1, 0, optional=True),
                   Member("encoder.LayerNorm.weight", 0, 0, diag=True, optional=True),
                   Member("encoder.LayerNorm.bias", 0, 0, optional=True)),
           heads=(Member("pooler.dense.weight", 1, 0, optional=True, root=True),
                  Member("classifier.weight", 1, 0, optional=True, root=True, classes=("ForTokenClassification",)),
                  Member("qa_outputs.weight", 1, 0, optional=True, root=True))
           + mlm_transform("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                           "cls.predictions.decoder")),
)
