"""BERT-like encoders (post-LN): BERT, RoBERTa, XLM-R, CamemBERT, ELECTRA."""

from ..core.spec import Member
from .roles import MLP, Attention, Stream, build, mlm_transform

# ELECTRA with embedding_size != hidden_size: the stream starts at embeddings_project, not at the embeddings
NO_PROJECTION = "embeddings_project.weight"

SPEC = build(
    "bert", ("bert", "roberta", "xlm-roberta", "camembert", "electra"), "encoder.layer.{i}",
    Attention(q="attention.self.query", k="attention.self.key", v="attention.self.value", o="attention.output.dense"),
    MLP(inputs=("intermediate.dense",), output="output.dense"),
    Stream("layernorm", "post",
           embeddings=tuple(Member(f"embeddings.{n}.weight", 1, optional=True, unless=NO_PROJECTION)
                            for n in ("word_embeddings", "position_embeddings", "token_type_embeddings"))
           + (Member("embeddings_project.weight", 0, optional=True),
              Member("embeddings_project.bias", 0, optional=True)),
           norms=(("attention.output.LayerNorm", ""), ("output.LayerNorm", "")),
           others=(Member("embeddings.LayerNorm.weight", 0, 0, diag=True, unless=NO_PROJECTION),
                   Member("embeddings.LayerNorm.bias", 0, 0, unless=NO_PROJECTION)),
           heads=(Member("pooler.dense.weight", 1, 0, optional=True),  # BERT: the pooler reads the first token
                  Member("classifier.dense.weight", 1, 0, optional=True, root=True),  # RoBERTa / ELECTRA heads
                  Member("classifier.weight", 1, 0, optional=True, root=True, classes=("ForTokenClassification",)),
                  Member("qa_outputs.weight", 1, 0, optional=True, root=True),
                  Member("discriminator_predictions.dense.weight", 1, 0, optional=True, root=True),
                  Member("generator_predictions.dense.weight", 1, 0, optional=True, root=True))
           + mlm_transform("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                           "cls.predictions.decoder")
           + mlm_transform("lm_head.dense", "lm_head.layer_norm", "lm_head.decoder")
           + mlm_transform("generator_predictions.dense", "generator_predictions.LayerNorm", "generator_lm_head",
                           unless=NO_PROJECTION, reader=False)),
)
