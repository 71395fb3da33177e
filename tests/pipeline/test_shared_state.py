"""``with_state_dict(share=True)``: a model holding given tensors without copying them — the same values
and outputs as ``load_state_dict``'s copy, tied weights kept tied, the original untouched."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import make_inputs, output_rel_diff
from factories import make_model
from symmerge.pipeline.verify import owned_apart, with_state_dict

pytestmark = pytest.mark.usefixtures("single_thread")


def _noisy(model, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: v + torch.randn(v.shape, generator=g, dtype=v.dtype) * 0.01 if v.is_floating_point() else v.clone()
            for k, v in model.state_dict().items()}


@pytest.mark.parametrize("family", ["llama", "vit", "gpt2"])
def test_shared_clone_equals_the_loaded_copy_and_shares_storage(family):
    model = make_model(family, head=True, seed=0, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    sd = _noisy(model, 1)
    shared, loaded = with_state_dict(model, sd, share=True), with_state_dict(model, sd)
    for k, v in loaded.state_dict().items():
        assert torch.equal(shared.state_dict()[k], v), k
    named = dict(shared.named_parameters())
    assert any(p.data_ptr() == sd[k].data_ptr() for k, p in named.items())  # held, not copied
    inputs = make_inputs(model)
    assert output_rel_diff(loaded, shared, inputs) == 0.0
    for k, v in model.state_dict().items():  # the original untouched
        assert torch.equal(v, before[k]), k
    assert not shared.training


def test_shared_clone_keeps_tied_weights_tied_and_casts_to_the_model_dtype():
    model = make_model("llama", head=True, seed=0, dtype=torch.float32)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    sd = {k: v.double() for k, v in _noisy(model, 2).items()}
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    shared, loaded = with_state_dict(model, sd, share=True), with_state_dict(model, sd)
    assert shared.lm_head.weight is shared.model.embed_tokens.weight
    assert shared.lm_head.weight.dtype == torch.float32
    for k, v in loaded.state_dict().items():
        assert torch.equal(shared.state_dict()[k], v), k


def test_shared_clone_of_a_mismatched_state_dict_fails_like_load_state_dict():
    model = make_model("vit", head=True, seed=0, dtype=torch.float32)
    sd = dict(model.state_dict())
    sd.pop(next(iter(sd)))
    with pytest.raises(RuntimeError):
        with_state_dict(model, sd, share=True)


def test_owned_apart_copies_only_what_an_input_holds():
    model = make_model("vit", head=True, seed=0, dtype=torch.float32)
    own = model.state_dict()
    sd = dict(own)
    fresh = next(iter(sd))
    sd[fresh] = sd[fresh] + 1
    apart = owned_apart(sd, model)
    assert apart[fresh] is sd[fresh]
    for k in own:
        if k != fresh:
            assert apart[k].data_ptr() != own[k].data_ptr() and torch.equal(apart[k], own[k])
    clone = with_state_dict(model, apart, share=True)
    before = copy.deepcopy(own)
    with torch.no_grad():
        for p in clone.parameters():
            p.mul_(2)
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
