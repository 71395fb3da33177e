"""Which tensors outside the layers have a row per token (:func:`symmerge.config.vocab.is_vocabulary_tensor`): the
rows a ``tokenizer_source`` merge maps to the output vocabulary. By shape alone, a model whose hidden size equals
its vocabulary size (64 and 64) had its final norm ``model.norm.weight`` (64,) remapped as if its entries were
tokens (mergekit-compat probe: 2.3e-3 off mergekit's merge, and a union refused 'model.norm.weight has shape (64,)
… and (94,)'); the pooler of a BERT likewise."""

from __future__ import annotations

import pytest

from symmerge.config.vocab import is_vocabulary_tensor

TOKENS = ["model.embed_tokens.weight", "lm_head.weight", "lm_head.bias", "transformer.wte.weight",
          "gpt_neox.embed_in.weight", "embed_out.weight", "bert.embeddings.word_embeddings.weight",
          "cls.predictions.decoder.weight", "cls.predictions.bias", "final_logits_bias"]
NOT_TOKENS = ["model.norm.weight", "transformer.ln_f.weight", "transformer.ln_f.bias", "bert.pooler.dense.weight",
              "cls.predictions.transform.dense.weight", "model.embed_positions.weight"]


@pytest.mark.parametrize("name", TOKENS + NOT_TOKENS)
def test_a_hidden_size_equal_to_the_vocabulary_size_is_told_apart_by_name(name):
    config = {"vocab_size": 64, "hidden_size": 64}
    shape = (64,) if name.endswith(("bias", "norm.weight", "ln_f.weight")) else (64, 64)
    assert is_vocabulary_tensor(name, shape, config) == (name in TOKENS and "position" not in name)


@pytest.mark.parametrize("name", TOKENS + NOT_TOKENS)
def test_other_sizes_are_told_apart_by_shape(name):
    """Hidden 32, vocabulary 64: every tensor with 64 rows holds tokens, whatever its name (a model's own names)."""
    config = {"vocab_size": 64, "hidden_size": 32}
    assert is_vocabulary_tensor(name, (64, 32), config) == ("position" not in name)
    assert not is_vocabulary_tensor(name, (32,), config)
    nested = {"text_config": {"vocab_size": 64, "hidden_size": 64}}  # multimodal: the text model's sizes
    assert is_vocabulary_tensor(name, (64, 64), nested) == (name in TOKENS)
