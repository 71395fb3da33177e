"""DeBERTa v2/v3. With ``share_att_key=False`` the relative-position projections live in the
query/key head space too: c2p uses Q·pos_keyᵀ (pos_key is K-like), p2c uses K·pos_queryᵀ."""

from .roles import MLP, Attention, build

SPEC = build(
    "deberta-v2", ("deberta-v2",), "encoder.layer.{i}",
    Attention(q="attention.self.query_proj", k="attention.self.key_proj", v="attention.self.value_proj",
              o="attention.output.dense", extra_q=("attention.self.pos_query_proj",),
              extra_k=("attention.self.pos_key_proj",)),
    MLP(inputs=("intermediate.dense",), output="output.dense"),
)
