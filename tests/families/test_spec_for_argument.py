"""``spec_for`` takes a config's model_type; a model or a config given in its place was printed whole (its repr,
hundreds of lines) inside the 'unsupported model_type' error. Now one line naming the type and what to pass."""

from __future__ import annotations

import pytest
import torch

from factories import make_model


def test_a_model_or_a_config_is_one_short_error():
    from symmerge.errors import UsageError
    from symmerge.families import spec_for

    model = make_model("llama", dtype=torch.float32)
    for given, name in ((model, "LlamaModel"), (model.config, "LlamaConfig")):
        with pytest.raises(UsageError) as e:
            spec_for(given)
        text = str(e.value)
        assert "\n" not in text and len(text) < 200, text
        assert name in text and "pass its config's model_type" in text, text
    assert spec_for(model.config.model_type).family == "llama"
    with pytest.raises(UsageError, match="got int$"):
        spec_for(3)
