"""BERT-like encoders (post-LN): BERT, RoBERTa, XLM-R, CamemBERT, ELECTRA."""

from .roles import MLP, Attention, build

SPEC = build(
    "bert", ("bert", "roberta", "xlm-roberta", "camembert", "electra"), "encoder.layer.{i}",
    Attention(q="attention.self.query", k="attention.self.key", v="attention.self.value", o="attention.output.dense"),
    MLP(inputs=("intermediate.dense",), output="output.dense"),
)
