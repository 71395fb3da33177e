"""DistilBERT (post-LN)."""

from .roles import MLP, Attention, build

SPEC = build(
    "distilbert", ("distilbert",), "transformer.layer.{i}",
    Attention(q="attention.q_lin", k="attention.k_lin", v="attention.v_lin", o="attention.out_lin"),
    MLP(inputs=("ffn.lin1",), output="ffn.lin2"),
)
